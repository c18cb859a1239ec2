"""What a request's sampling fields do to its next-token logits, before greedy or sampled choice.

    logit_bias           + bias on the named token ids (OpenAI: -100 bans, +100 forces in practice)
    repetition_penalty   every token seen (prompt and output): a positive logit / p, a negative one x p (vLLM)
    frequency_penalty    - f x (times the token was generated so far)     } OpenAI's, over output tokens
    presence_penalty     - p if the token was generated at all             }
    min_tokens           end-of-sequence and stop token ids banned until that many tokens were generated
    bad_words            a word's last token banned where the output ends with the rest of it (vLLM)
    structured_outputs   every token the request's grammar forbids next banned (structured_output.py), last

"Output" includes the prompt's last `continued_output_tokens` (a stream continued elsewhere), so a
continuation chooses exactly what the uninterrupted generation would have. Only the logits of the rows
asking for any of these are copied and changed; logprobs are still
taken from the raw logits (OpenAI's and vLLM's default). Nothing here touches the KV: a cache hit
changes no output with these fields either.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .request import Request

BANNED = float("-inf")


def output_so_far(request: Request) -> list[int]:
    """The tokens this generation produced: its own, after those a continued stream's prompt carries."""
    return request.token_ids[request.num_prompt_tokens - request.sampling_params.continued_output_tokens :]


def num_generated(request: Request) -> int:
    """len(output_so_far(request)), without the slice: read for every sampled row of every step."""
    return request.num_output_tokens + request.sampling_params.continued_output_tokens


def wants_processing(request: Request) -> bool:
    params = request.sampling_params
    return bool(
        request.grammar is not None
        or params.logit_bias
        or params.presence_penalty
        or params.frequency_penalty
        or params.repetition_penalty != 1.0
        or request.bad_words_token_ids
        or num_generated(request) < params.min_tokens
    )


def process_logits(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """`logits[row]` is `requests[row]`'s next-token row; returns them processed (a copy when any changed)."""
    rows = [row for row, request in enumerate(requests) if wants_processing(request)]
    if not rows:
        return logits
    logits = logits.float().clone()
    for row in rows:
        logits[row] = _process_row(logits[row], requests[row])
    return logits


def _process_row(row: torch.Tensor, request: Request) -> torch.Tensor:
    params = request.sampling_params
    vocab_size = row.numel()
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.int64)
        row.index_add_(0, ids, torch.tensor(list(params.logit_bias.values()), dtype=row.dtype))
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(request.token_ids)), dtype=torch.int64)
        values = row.index_select(0, seen)
        penalized = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
        row.index_copy_(0, seen, penalized)
    output = output_so_far(request)
    if output and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=vocab_size)[:vocab_size]
        row -= params.frequency_penalty * counts.to(row.dtype) + params.presence_penalty * (counts > 0).to(row.dtype)
    if num_generated(request) < params.min_tokens:
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(request.eos_token_ids))
        banned = [token for token in stops if token < vocab_size]
        if banned:
            row[torch.tensor(banned, dtype=torch.int64)] = BANNED
    for word in request.bad_words_token_ids:  # the output so far must end with all but the word's last token
        head = len(word) - 1
        if head == 0 or (len(output) >= head and tuple(output[len(output) - head :]) == word[:-1]):
            row[word[-1]] = BANNED
    if request.grammar is not None:
        request.grammar.mask_row(row)
    return row
