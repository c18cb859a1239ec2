"""Records the tier tests store: chains keyed exactly as the engine keys them."""

from __future__ import annotations

import threading
from typing import Callable, Iterable, Optional

from prefixserve.cache import BlockKeyer
from prefixserve.tiers import BlockRecord, RecordExpectation, encode_record

SCOPE = b"\x5a" * 32
OTHER_SCOPE = b"\xa5" * 32
BLOCK_SIZE = 4


def make_chain(token_ids: list[int], payload_bytes: int = 64, scope: bytes = SCOPE) -> list[BlockRecord]:
    """Records for every full block of `token_ids`, keyed exactly as the engine keys them."""
    keys = BlockKeyer(BLOCK_SIZE).keys(scope, token_ids)
    records, parent = [], None
    for index, key in enumerate(keys):
        tokens = token_ids[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE]
        payload = key[:4] * (payload_bytes // 4)  # distinct per block, so a mix-up shows
        records.append(BlockRecord(key, parent, scope, tokens, "float32", (payload_bytes // 4,), payload))
        parent = key
    return records


def expect(record: BlockRecord) -> RecordExpectation:
    return RecordExpectation(record.key, record.scope_digest, record.token_ids, record.dtype, record.shape)


def size(record: BlockRecord) -> int:
    return len(encode_record(record))


def run_in_threads(work: Callable, arguments: Iterable, timeout: Optional[float] = None) -> list[BaseException]:
    """work(argument) in a thread of its own for each argument, all joined; returns what they raised
    (an assertion in a thread would vanish otherwise)."""
    failures: list[BaseException] = []

    def guarded(argument) -> None:
        try:
            work(argument)
        except BaseException as error:
            failures.append(error)

    threads = [threading.Thread(target=guarded, args=(argument,)) for argument in arguments]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    return failures
