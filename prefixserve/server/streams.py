"""Server-sent events and the merging of several request streams into one response."""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, Sequence


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


async def merge_streams(streams: Sequence[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """Items of all streams as (stream index, item), as they come. Cancelling the merge closes every stream."""
    if len(streams) == 1:  # the common case needs no tasks
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncIterator) -> None:
        try:
            async for item in stream:
                await queue.put((index, item))
        except Exception as error:  # handed to the consumer, which re-raises it
            await queue.put((index, error))
        else:
            await queue.put((index, done))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is done:
                remaining -= 1
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
