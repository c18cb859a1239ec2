"""When a request's latest token ends it: EOS, a stop token id, a complete grammar, or a length limit.

Decided here only; the scheduler applies it (Scheduler.finish_request is the one place a
request finishes). Stop *strings* need text, so the output processor finds them and
hands them to the same finish_request.
"""

from __future__ import annotations

from typing import Optional

from .request import Request


def check_stop(request: Request) -> Optional[tuple[str, Optional[int]]]:
    """(finish_reason, stop_reason) when the token just appended ends the request, else None."""
    params = request.sampling_params
    token_id = request.token_ids[-1]
    if not params.ignore_eos and token_id in request.eos_token_ids:
        return "stop", token_id
    if token_id in params.stop_token_ids:
        return "stop", token_id
    if request.grammar is not None and request.grammar.done:  # the output is whole: nothing more may follow
        return "stop", None
    if request.num_output_tokens >= params.max_tokens or request.num_tokens >= request.max_model_len:
        return "length", None
    return None
