"""A fixed set of KV blocks with reference counts and an O(1) free list.

Block ids index the engine's KV tensors, so a block never moves; only its
bookkeeping changes. A block is in exactly one of three states:

    free      key is None, ref_count == 0, linked into the free list
    private   key is None, ref_count >= 1 (a request's tail, not yet full or not cacheable)
    cached    key is set, registered in the radix index, ref_count >= 0
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional, Union


class Block:
    """One KV block. `__slots__` keeps a cached block's Python footprint small."""

    __slots__ = (
        "block_id",
        "ref_count",
        "key",
        "token_bytes",
        "parent",
        "scope",
        "owner",
        "device_only",
        "num_children",
        "pin_count",
        "last_access",
        "ttl",
        "expire_at",
        "prev_free",
        "next_free",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.key: Optional[bytes] = None
        # Packed token ids of this block, compared on every hit (collision guard).
        self.token_bytes: Optional[bytes] = None
        # The cached parent block, or the scope digest (bytes) for block 0 of a prefix.
        self.parent: Union["Block", bytes, None] = None
        # The scope digest its tenant's chain hangs from (a private scope past a shared prefix): what a
        # tier's encryption key for this block commits to.
        self.scope: Optional[bytes] = None
        # The tenant whose share it counts against (tenant_shares.py): the tenant of its private scope; None for
        # a public prefix's block or an untenanted request's.
        self.owner: Optional[str] = None
        # Its KV never leaves the device pool (cache_retention "device"): never spilled, never written down.
        self.device_only = False
        self.num_children = 0  # cached children
        self.pin_count = 0
        self.last_access = 0  # logical tick: orders LRU eviction
        self.ttl: Optional[float] = None
        self.expire_at: Optional[float] = None
        self.prev_free: Optional[Block] = None
        self.next_free: Optional[Block] = None

    def __repr__(self) -> str:
        state = "cached" if self.key is not None else ("private" if self.ref_count else "free")
        return f"Block({self.block_id}, {state}, ref={self.ref_count})"


class FreeBlockList:
    """Intrusive doubly linked list: append, pop and remove are all O(1)."""

    def __init__(self, blocks: Iterable[Block] = ()) -> None:
        self._head: Optional[Block] = None
        self._tail: Optional[Block] = None
        self.num_blocks = 0
        for block in blocks:
            self.append(block)

    def append(self, block: Block) -> None:
        block.prev_free, block.next_free = self._tail, None
        if self._tail is None:
            self._head = block
        else:
            self._tail.next_free = block
        self._tail = block
        self.num_blocks += 1

    def pop_front(self) -> Block:
        block = self._head
        if block is None:
            raise IndexError("pop from an empty free list")
        self.remove(block)
        return block

    def remove(self, block: Block) -> None:
        if block.prev_free is None:
            self._head = block.next_free
        else:
            block.prev_free.next_free = block.next_free
        if block.next_free is None:
            self._tail = block.prev_free
        else:
            block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_blocks -= 1

    def __iter__(self):
        block = self._head
        while block is not None:
            yield block
            block = block.next_free

    def __len__(self) -> int:
        return self.num_blocks


class BlockPool:
    """All blocks of one KV pool; hands out free blocks and takes them back."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least 1 block, got {num_blocks}; raise the KV memory budget")
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        self.free_list = FreeBlockList(self.blocks)
        # Called with each block freed: the window layers' slots (window_slots.py) follow the block.
        self.on_free: Optional[Callable[[Block], None]] = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.free_list.num_blocks

    def allocate(self) -> Block:
        """A free block with ref_count 1, owned privately by the caller."""
        block = self.free_list.pop_front()
        assert block.ref_count == 0 and block.key is None, block
        block.ref_count = 1
        return block

    def free(self, block: Block) -> None:
        """Return an uncached, unreferenced block to the free list."""
        assert block.ref_count == 0 and block.key is None, f"cannot free {block}"
        block.parent = block.scope = block.owner = None
        block.device_only = False
        block.token_bytes = None
        block.ttl = block.expire_at = None
        if self.on_free is not None:
            self.on_free(block)
        self.free_list.append(block)
