"""One request's output text: incremental decoding, stop strings, and what may be streamed yet."""

from __future__ import annotations

from typing import Optional, Sequence

from ..model import IncrementalDecoder, Tokenizer
from .stop_strings import StopMatcher


class RequestDetokenizer:
    """Text of one request, fed its output ids step by step.

        text:  [ emitted (streamed) ...... | held back: a stop string may be forming | ]
               0                  num_emitted_chars                         len(text)

    While the request runs, the last max_stop_len - 1 characters are held back, so text a
    stop string later cuts off is never streamed.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt: Optional[str], prompt_token_ids: Sequence[int], stop: Sequence[str]
    ) -> None:
        self.prompt = prompt
        self.num_prompt_tokens = len(prompt_token_ids)
        self.decoder = IncrementalDecoder(tokenizer, prompt_token_ids)
        self.matcher = StopMatcher(stop) if stop else None
        self.text = ""
        self.num_decoded_tokens = 0  # output ids pushed into the decoder
        self.num_emitted_chars = 0  # characters handed out in outputs so far
        self.num_reported_tokens = 0  # output ids handed out in outputs so far

    def update(self, token_ids: Sequence[int], finished: bool, drop_last: bool) -> Optional[str]:
        """Decode the output ids new since the last call (`token_ids`: prompt and output;
        `drop_last`: the last is an EOS / stop token, not text); returns the stop string that
        completed, the text then cut where it starts."""
        new_ids = list(token_ids[self.num_prompt_tokens + self.num_decoded_tokens :])
        self.num_decoded_tokens += len(new_ids)
        if drop_last and new_ids:
            new_ids.pop()
        delta = self.decoder.push(new_ids)
        if finished:
            delta += self.decoder.flush()
        self.text += delta
        if self.matcher is not None and delta:
            match = self.matcher.feed(delta)
            if match is not None:
                self.text = self.text[: match.start]
                return match.stop
        return None

    def take_delta_text(self, finished: bool) -> str:
        """The text that may be streamed now and was not before."""
        visible = len(self.text)
        if self.matcher is not None and not finished:
            visible = max(self.num_emitted_chars, visible - self.matcher.max_stop_len + 1)
        delta = self.text[self.num_emitted_chars : visible]
        self.num_emitted_chars = max(self.num_emitted_chars, visible)
        return delta

    @property
    def emitted_text(self) -> str:
        return self.text[: self.num_emitted_chars]

    def take_delta_range(self, num_output_tokens: int) -> tuple[int, int]:
        """[start, end) of the output ids new since the previous output."""
        start, self.num_reported_tokens = self.num_reported_tokens, num_output_tokens
        return start, num_output_tokens
