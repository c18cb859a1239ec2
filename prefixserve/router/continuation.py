"""Picking up a stream where a dead replica left it.

While relaying a stream the router asks the replica for vLLM's `return_token_ids`
and keeps, per choice, the prompt ids, the output ids and the text already sent.
If the replica dies, another one is asked for a plain completion of

    prompt = original prompt ids + the k output ids already produced,  max_tokens - k

with the same sampling fields. Greedy and seeded sampling are keyed by absolute
token position, so its tokens are exactly those the original would have produced.

Its text, though, is the router's to make: the dead replica may have held back
characters (an unfinished UTF-8 sequence, the start of a possible stop string)
that the new replica cannot know were never sent. So the router decodes the whole
output again with the replicas' tokenizer, applies the stop strings itself, and
sends what lies past the text already sent, in the original endpoint's chunk shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..http import split_model
from ..model.tokenizers.tokenizer import IncrementalDecoder, Tokenizer
from .inbound import ClientRequest

# Fields of the original body that shape sampling; a continuation carries them unchanged.
CARRIED_FIELDS = (
    "model",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "cache_salt",
    "user",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_tokens",
    "bad_words",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
)


@dataclass
class ChoiceProgress:
    """One choice of a stream as relayed so far."""

    prompt_token_ids: Optional[list[int]] = None
    output_token_ids: list[int] = field(default_factory=list)
    text_sent: str = ""
    role_sent: bool = False  # chat: the assistant role chunk reached the client
    finish_reason: Optional[str] = None

    @property
    def can_continue(self) -> bool:
        """Continuable from token ids; a choice that never saw any (nothing sent yet) is replayed instead."""
        return self.prompt_token_ids is not None and self.finish_reason is None

    @property
    def nothing_sent(self) -> bool:
        return not self.output_token_ids and not self.text_sent


def stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if isinstance(stop, str):
        return [stop] if stop else []
    if isinstance(stop, list):
        return [s for s in stop if isinstance(s, str) and s]
    return []


def continuation_body(request: ClientRequest, progress: ChoiceProgress, include_usage: bool) -> Optional[dict]:
    """The /v1/completions body that produces the rest of the choice; None when nothing is left to produce."""
    body = request.body
    continued = {name: body[name] for name in CARRIED_FIELDS if name in body}
    continued.update(prompt=progress.prompt_token_ids + progress.output_token_ids, stream=True, return_token_ids=True)
    # the penalties, min_tokens and bad_words count the output so far as output, not as prompt
    prior = body.get("continued_output_tokens")
    continued["continued_output_tokens"] = len(progress.output_token_ids) + (prior if isinstance(prior, int) else 0)
    if request.max_tokens is not None:
        remaining = request.max_tokens - len(progress.output_token_ids)
        if remaining <= 0:
            return None
        continued["max_tokens"] = remaining
    if request.is_chat:
        if body.get("logprobs") is True:
            top = body.get("top_logprobs")
            continued["logprobs"] = top if isinstance(top, int) and not isinstance(top, bool) else 0
    elif "logprobs" in body:
        continued["logprobs"] = body["logprobs"]
    if include_usage:
        continued["stream_options"] = {"include_usage": True}
    return continued


def pinned_model(client_model: object, served_name: object, version: str) -> Optional[str]:
    """The `model` of a request that must run on `version` (the hex digits a stream's system_fingerprint gave):
    'name@fp_<digits>', the name the client asked for (else the name the stream's chunks carry), and the
    client's own pin instead when it names more digits (it is a prefix of the same fingerprint: the replica
    that began the stream checked it). A replica of any other version answers 404 model_not_found
    (server/routes.py check_version, inside its reload gate). None when no name is known."""
    name, digits = None, version
    if isinstance(client_model, str):
        try:
            name, client_version = split_model(client_model)
        except ValueError:  # the router refused such a body before it got here
            return None
        if client_version is not None and len(client_version) > len(digits):
            digits = client_version
    if name is None and isinstance(served_name, str):
        name = served_name
    return f"{name}@fp_{digits}" if name else None


class ContinuedText:
    """The text of a continued choice, decoded and cut by the router as the replica's engine would.

    The same rules as the engine's detokenizer: stop strings as vLLM matches them (the first to
    complete wins; of those completing together, the one starting earliest), and while the choice
    runs the last max_stop_len - 1 characters held back, since a stop string may still be forming.
    """

    def __init__(self, tokenizer: Tokenizer, progress: ChoiceProgress, body: dict) -> None:
        self.stop = stop_strings(body)
        self.max_stop_len = max(map(len, self.stop), default=0)
        stop_token_ids = body.get("stop_token_ids") if isinstance(body.get("stop_token_ids"), list) else []
        self.stop_token_ids = {t for t in stop_token_ids if isinstance(t, int)}
        if body.get("ignore_eos") is not True:
            self.stop_token_ids.update(tokenizer.eos_token_ids)
        self.decoder = IncrementalDecoder(tokenizer, progress.prompt_token_ids)
        self.text = self.decoder.push(progress.output_token_ids)
        # What the client has is the replica's text; the router's own decoding continues after it.
        self.num_emitted_chars = len(progress.text_sent)

    def push(self, new_ids: list[int], finish_reason: Optional[str]) -> tuple[str, bool]:
        """(text to send now, whether a stop string ended the choice here)."""
        if finish_reason == "stop" and new_ids and new_ids[-1] in self.stop_token_ids:
            new_ids = new_ids[:-1]  # an EOS or stop token is not part of the text
        self.text += self.decoder.push(new_ids)
        if finish_reason is not None:
            self.text += self.decoder.flush()
        stopped = self._cut_at_stop()
        visible = len(self.text)
        if self.stop and finish_reason is None and not stopped:
            visible = max(self.num_emitted_chars, visible - self.max_stop_len + 1)
        delta = self.text[self.num_emitted_chars : visible]
        self.num_emitted_chars = max(self.num_emitted_chars, visible)
        return delta, stopped

    def _cut_at_stop(self) -> bool:
        search_from = max(0, self.num_emitted_chars - self.max_stop_len + 1)
        hits = []  # (where it completes, where it starts)
        for stop in self.stop:
            start = self.text.find(stop, search_from)
            if start >= 0:
                hits.append((start + len(stop), start))
        if not hits:
            return False
        self.text = self.text[: min(hits)[1]]
        return True


def chat_logprobs(logprobs) -> Optional[dict]:
    """A completions-style logprobs block as chat's `{"content": [...]}` (best effort; None passes through)."""
    if not isinstance(logprobs, dict) or not isinstance(logprobs.get("tokens"), list):
        return None
    tokens, values = logprobs["tokens"], logprobs.get("token_logprobs") or []
    tops = logprobs.get("top_logprobs") or []
    content = []
    for i, token in enumerate(tokens):
        top = tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}
        content.append(
            {
                "token": token,
                "logprob": values[i] if i < len(values) else None,
                "bytes": list(str(token).encode()),
                "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(str(t).encode())} for t, lp in top.items()],
            }
        )
    return {"content": content, "refusal": None}


def reshape_chunk(
    envelope: dict, is_chat: bool, text: str, finish_reason: Optional[str], logprobs, token_ids: Optional[list[int]]
) -> dict:
    """A continuation's completion chunk as a chunk of the original stream (same id, created, model)."""
    if is_chat:
        choice = {
            "index": 0,
            "delta": {"content": text} if text else {},
            "logprobs": chat_logprobs(logprobs),
            "finish_reason": finish_reason,
        }
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {**envelope, "choices": [choice]}


def usage_of(choices: list[ChoiceProgress], n: int, reported: Optional[dict]) -> dict:
    """Usage as the router saw it: each prompt once (the n samples of a prompt share it), every output token."""
    prompt_tokens = sum(len(p.prompt_token_ids or ()) for p in choices[:: max(n, 1)])
    completion_tokens = sum(len(p.output_token_ids) for p in choices)
    cached, details = 0, {}
    reported_details = reported.get("prompt_tokens_details") if isinstance(reported, dict) else None
    if isinstance(reported_details, dict):
        value = reported_details.get("cached_tokens")
        cached = min(value, prompt_tokens) if isinstance(value, int) else 0
        by_tier = reported_details.get("cached_tokens_by_tier")
        if isinstance(by_tier, dict):  # the continuing replica's split, cut to the client's prompt, nearest first
            remaining, split = cached, {}
            for tier, count in by_tier.items():
                if isinstance(tier, str) and isinstance(count, int) and not isinstance(count, bool) and count >= 0:
                    split[tier] = min(count, remaining)
                    remaining -= split[tier]
            details["cached_tokens_by_tier"] = split
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached, **details},
    }
