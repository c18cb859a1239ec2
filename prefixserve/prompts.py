"""What a prompt may be, said once: the offline API, the server and the router split prompts here.

A single prompt is text, a list of token ids, or (offline) a vLLM-style dict
{"prompt" | "prompt_token_ids", "cache_salt"}; a batch is a list of those.
"""

from __future__ import annotations

from typing import Any


def is_token_ids(value: Any) -> bool:
    """A non-empty list or tuple of ints (booleans are not token ids)."""
    return (
        isinstance(value, (list, tuple))
        and bool(value)
        and all(isinstance(item, int) and not isinstance(item, bool) for item in value)
    )


def split_prompts(prompts: Any) -> list:
    """One prompt or a batch of them, as a list of single prompts; raises ValueError / TypeError naming the fix."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if is_token_ids(prompts):
        return [list(prompts)]  # one prompt given as token ids
    if isinstance(prompts, (list, tuple)):
        if not prompts:
            raise ValueError("no prompt given; send at least one prompt: a string, a list of strings or token ids")
        return list(prompts)
    raise TypeError(f"a prompt must be a string, token ids, a dict or a list of those, got {type(prompts).__name__}")
