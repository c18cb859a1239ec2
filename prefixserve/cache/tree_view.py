"""A bounded picture of the radix index for the dashboard: chains merged, small subtrees folded.

The index may hold 100,000 blocks; a page can draw a few hundred nodes and stay responsive. So:

1. A chain of single-child blocks becomes one node (a *segment*): a 64-block shared system
   prompt is one bar of 1,024 tokens, not 64 nodes.

       scope ─ b0 ─ b1 ─ b2 ─┬─ b3 ─ b4             scope ─ [b0 b1 b2] ─┬─ [b3 b4]
                             └─ b5           =>                         └─ [b5]

2. Nodes are expanded largest subtree first. When a node's children do not all fit in
   `max_nodes`, its largest children are drawn (using at most half of the room left, so one
   wide node cannot starve others still waiting) and the rest fold into one "N more" node under it.

Nothing here carries token ids or text: a segment is named by its first block's key prefix.
Recency is the blocks' logical LRU clock (`Block.last_access`), not wall time.
Standard library only (cache/ never imports torch).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional

from .block_pool import Block

DEFAULT_MAX_NODES = 300
KEY_PREFIX_HEX = 12  # hex digits of a block key shown for a segment


@dataclass(frozen=True)
class TreeNode:
    id: str  # "root", "s<n>" (a scope), "b<first block id>" (a segment), "m<parent id>" (folded children)
    parent: Optional[str]
    kind: str  # "root" | "scope" | "prefix" | "more"
    label: str  # a scope's name, "N more", or a segment's key prefix: never token text
    num_blocks: int  # blocks of this node itself (a "more" node: every folded block)
    num_tokens: int  # num_blocks x block size
    subtree_blocks: int  # this node and everything below it
    ticks_since_use: int  # LRU clock ticks since the newest use of a block in this node (or below it)
    recency: float  # 1.0: used most recently of all cached blocks; 0.0: least recently
    ref_count: int  # running requests holding it (the largest count among its blocks)
    pinned: bool
    expiring: bool  # some block has a TTL deadline
    expires_in: Optional[float]  # seconds to the earliest deadline (None: no deadline, or no clock given)
    tier: str  # where its KV lives: "device" for the pool
    copies: tuple[str, ...]  # lower tiers that also hold every block of a segment (spilled or written through)
    num_folded: int  # a "more" node: subtrees folded into it; 0 otherwise


@dataclass(frozen=True)
class TierCount:
    tier: str
    num_blocks: int
    num_only_here: int  # blocks this tier holds that the device pool does not


@dataclass(frozen=True)
class TreeView:
    nodes: list[TreeNode]  # parents before children
    block_size: int
    num_blocks: int  # cached blocks in the pool
    num_segments: int  # chains after merging, before folding
    num_folded_blocks: int  # blocks drawn only as part of a "more" node
    tiers: list[TierCount]  # device first, then each lower tier given
    blocks_by_scope: dict[str, int]  # scope name -> cached blocks rooted in it (folded or not)


class _Group:
    """A segment (or the root, or a scope) with what its subtree aggregates."""

    __slots__ = (
        "id",
        "kind",
        "label",
        "blocks",
        "children",
        "subtree_blocks",
        "last_access",
        "ref_count",
        "pinned",
        "expire_at",
        "order",
    )

    def __init__(self, id_: str, kind: str, label: str, blocks: list[Block], order: int) -> None:
        self.id, self.kind, self.label, self.blocks, self.order = id_, kind, label, blocks, order
        self.children: list[_Group] = []
        self.subtree_blocks = len(blocks)
        self.last_access = max((b.last_access for b in blocks), default=0)
        self.ref_count = max((b.ref_count for b in blocks), default=0)
        self.pinned = any(b.pin_count for b in blocks)
        deadlines = [b.expire_at for b in blocks if b.expire_at is not None]
        self.expire_at: Optional[float] = min(deadlines) if deadlines else None

    def absorb(self, child: "_Group") -> None:
        """Fold a child's subtree aggregates into this node's (bottom-up)."""
        self.subtree_blocks += child.subtree_blocks
        self.last_access = max(self.last_access, child.last_access)
        self.ref_count = max(self.ref_count, child.ref_count)
        self.pinned = self.pinned or child.pinned
        if child.expire_at is not None and (self.expire_at is None or child.expire_at < self.expire_at):
            self.expire_at = child.expire_at


def build_tree_view(
    cached_blocks: Iterable[Block],
    block_size: int,
    *,
    max_nodes: int = DEFAULT_MAX_NODES,
    scope_names: Optional[Mapping[bytes, str]] = None,
    tier_keys: Optional[Mapping[str, Iterable[bytes]]] = None,
    now: Optional[float] = None,
) -> TreeView:
    """At most `max_nodes` nodes picturing `cached_blocks` (a RadixCache's: `map(cache.get, cache.keys())`).

    `scope_names` names scope digests (a tenant id, "(shared)"); `tier_keys` gives each lower
    tier's keys (counted per tier, and named in a segment's `copies`); `now` (the cache's clock)
    turns TTL deadlines into seconds.
    """
    if max_nodes < 2:
        raise ValueError(f"max_nodes must be at least 2 (a root and one more), got {max_nodes}")
    blocks = list(cached_blocks)
    lower = {tier: set(keys) for tier, keys in (tier_keys or {}).items()}
    counter = itertools.count()
    root, segments = _merge_chains(blocks, scope_names or {}, counter)
    ticks = [b.last_access for b in blocks]
    oldest, newest = (min(ticks), max(ticks)) if ticks else (0, 0)

    def node(group: _Group, parent: Optional[str], kind: str, label: str, num_blocks: int, num_folded: int = 0):
        span = newest - oldest
        return TreeNode(
            id=group.id if kind != "more" else f"m{parent}",
            parent=parent,
            kind=kind,
            label=label,
            num_blocks=num_blocks,
            num_tokens=num_blocks * block_size,
            subtree_blocks=group.subtree_blocks if kind != "more" else num_blocks,
            ticks_since_use=newest - group.last_access if group.subtree_blocks else 0,
            recency=(group.last_access - oldest) / span if span and group.subtree_blocks else 1.0,
            ref_count=group.ref_count,
            pinned=group.pinned,
            expiring=group.expire_at is not None,
            expires_in=None if group.expire_at is None or now is None else group.expire_at - now,
            tier="device",
            num_folded=num_folded,
            copies=tuple(
                tier for tier, keys in lower.items() if group.blocks and all(b.key in keys for b in group.blocks)
            ),
        )

    nodes, num_folded_blocks = _expand(root, max_nodes, counter, node)
    by_scope: dict[str, int] = {}
    for scope in root.children:
        by_scope[scope.label] = by_scope.get(scope.label, 0) + scope.subtree_blocks
    return TreeView(
        nodes=nodes,
        block_size=block_size,
        num_blocks=len(blocks),
        num_segments=segments,
        num_folded_blocks=num_folded_blocks,
        tiers=_tier_counts(blocks, lower),
        blocks_by_scope=by_scope,
    )


def _expand(root: _Group, max_nodes: int, counter, node) -> tuple[list[TreeNode], int]:
    """(nodes, parents before children, of at most `max_nodes`; blocks folded into "more" nodes), expanding the
    largest subtree first; `node` makes a TreeNode of a group."""
    nodes: list[TreeNode] = []
    parents: dict[str, Optional[str]] = {root.id: None}
    num_folded_blocks = 0
    # Budget used = nodes emitted + groups waiting in the heap + one reserved slot for a possible
    # "more" node per waiting group that has children; so folding always fits.
    used = 1 + (1 if root.children else 0)
    heap = [(-root.subtree_blocks, root.order, root)]
    while heap:
        _, _, group = heapq.heappop(heap)
        nodes.append(node(group, parents[group.id], group.kind, group.label, len(group.blocks)))
        if not group.children:
            continue
        used -= 1  # this group's reserved slot is spent now, on its children or its fold
        free = max_nodes - used
        children = sorted(group.children, key=lambda c: (-c.subtree_blocks, c.order))
        cost = [1 + (1 if child.children else 0) for child in children]
        if sum(cost) <= free:
            shown, folded = children, []
        else:
            allowance, spent, count = (max(1, free // 2) if heap else free), 0, 0
            while count < len(children) and spent + cost[count] + 1 <= allowance:
                spent += cost[count]
                count += 1
            shown, folded = children[:count], children[count:]
        for child in shown:
            parents[child.id] = group.id
            heapq.heappush(heap, (-child.subtree_blocks, child.order, child))
        used += sum(cost[: len(shown)])
        if folded:
            used += 1
            fold = _Group("", "more", "", [], next(counter))
            for child in folded:
                fold.absorb(child)
            num_folded_blocks += fold.subtree_blocks
            nodes.append(node(fold, group.id, "more", f"{len(folded)} more", fold.subtree_blocks, len(folded)))
    assert len(nodes) <= max_nodes, (len(nodes), max_nodes)
    return nodes, num_folded_blocks


def _merge_chains(blocks: list[Block], scope_names: Mapping[bytes, str], counter) -> tuple[_Group, int]:
    """(root group over scopes over merged segments, number of segments), subtree aggregates filled in."""
    children: dict[int, list[Block]] = {}
    scopes: dict[bytes, list[Block]] = {}
    for block in blocks:
        parent = block.parent
        if isinstance(parent, Block):
            children.setdefault(parent.block_id, []).append(block)
        else:
            scopes.setdefault(parent, []).append(block)
    root = _Group("root", "root", "KV pool", [], next(counter))
    created: list[tuple[_Group, _Group]] = []  # (group, its parent) in creation order: parents first
    stack: list[tuple[Block, _Group]] = []
    for index, (digest, firsts) in enumerate(scopes.items()):
        scope = _Group(f"s{index}", "scope", scope_names.get(digest, f"scope {digest.hex()[:8]}"), [], next(counter))
        created.append((scope, root))
        stack.extend((first, scope) for first in reversed(firsts))
    num_segments = 0
    while stack:
        first, parent = stack.pop()
        run, block = [first], first
        while len(kids := children.get(block.block_id, ())) == 1:
            block = kids[0]
            run.append(block)
        segment = _Group(f"b{first.block_id}", "prefix", first.key.hex()[:KEY_PREFIX_HEX], run, next(counter))
        num_segments += 1
        created.append((segment, parent))
        stack.extend((kid, segment) for kid in reversed(kids))
    for group, parent in created:
        parent.children.append(group)
    for group, parent in reversed(created):  # children were created after their parents
        parent.absorb(group)
    return root, num_segments


def _tier_counts(blocks: list[Block], lower: Mapping[str, set[bytes]]) -> list[TierCount]:
    device = {block.key for block in blocks}
    below = set().union(*lower.values())
    counts = [TierCount("device", len(device), len(device - below))]
    counts += [TierCount(tier, len(keys), len(keys - device)) for tier, keys in lower.items()]
    return counts
