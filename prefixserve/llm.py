"""The offline API: `LLM(model=None, **options).generate(prompts, params)`, as vLLM users know it."""

from __future__ import annotations

import sys
import weakref
from typing import Any, Optional, Sequence, Union

from tqdm import tqdm

from .chat_tools import render_chat, template_reads_tools
from .config import EngineConfig
from .engine.assembly import build_engine
from .engine.engine import PromptType
from .engine.operations.reload import purge_previous_remote
from .engine.outputs import RequestOutput
from .engine.sampling_params import SamplingParams
from .lora.lora_request import LoRARequest
from .prompts import split_prompts

PROGRESS_THRESHOLD = 4  # more prompts than this get a progress bar (on a terminal only)


class LLM:
    def __init__(self, model: Optional[str] = None, **options: Any) -> None:
        self.engine = build_engine(EngineConfig.from_kwargs(model=model, **options))
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0
        # Flush the KV tiers' pending disk writes when this LLM goes away, or at exit at the latest.
        self._finalizer = weakref.finalize(self, self.engine.close)

    def reload(self, model: Optional[str] = None, purge_remote: bool = False):
        """Serve another checkpoint with the same KV layout (None: the same path again, e.g. rewritten
        weights) without rebuilding the KV pool; the old version's cached blocks are freed at once and
        its records leave the host and disk tiers (and the remote tier with `purge_remote`, once no
        other replica serves the old version). Returns the ReloadReport."""
        tiers = self.engine.tiers
        if purge_remote and tiers.shared is None:
            raise ValueError("purge_remote needs a remote tier (kv_remote_url); leave it out")
        report = self.engine.reload(model)
        self.tokenizer = self.engine.tokenizer
        if purge_remote:
            purge_previous_remote(self.engine, report)
        return report

    def pin(self, prompt: PromptType, ttl: Optional[float] = None, cache_salt: Optional[str] = None) -> dict:
        """Keep this prompt's full blocks resident (computed now if they are not cached) until `unpin`,
        or for `ttl` seconds; with a disk tier the pin survives a restart. Returns the pin (its id,
        blocks, expiry); raises ValueError naming the fix (e.g. past max_pinned_blocks)."""
        request = self.engine.add_request(prompt, SamplingParams(max_tokens=1), cache_salt=cache_salt)
        self.engine.run_until_finished([request.request_id])
        return self.engine.pin_prefix(request.prompt_token_ids, None, cache_salt, ttl).public()

    def unpin(self, pin_id: str) -> bool:
        """Remove a pin made by `pin`; False when there is none of that id."""
        return self.engine.unpin_prefix(pin_id) is not None

    def pins(self) -> list[dict]:
        return self.engine.pins.listing()

    def close(self) -> None:
        """Flush what the KV tiers still have to write; the LLM stays usable until it is dropped."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._finalizer()

    def generate(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = True,
        lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None,
    ) -> list[RequestOutput]:
        """Outputs in prompt order; a prompt with n > 1 gives n outputs in a row. `lora_request` (vLLM's): one
        adapter for every prompt, or one (or None: the base) per prompt; needs LLM(..., enable_lora=True)."""
        prompt_list = split_prompts(prompts)
        lora_list = one_each(lora_request, len(prompt_list), "lora_requests")
        param_list = one_each(SamplingParams() if params is None else params, len(prompt_list), "SamplingParams")
        order: list[str] = []
        for prompt, param, lora in zip(prompt_list, param_list, lora_list):
            for sample in range(param.n):
                request = self.engine.add_request(
                    prompt, param.for_sample(sample), request_id=str(self._next_id), lora_request=lora
                )
                order.append(request.request_id)
                self._next_id += 1
        return self._run(order, use_tqdm and len(order) > PROGRESS_THRESHOLD)

    def chat(
        self,
        messages: Union[list[dict], list[list[dict]]],
        params: Optional[SamplingParams] = None,
        use_tqdm: bool = True,
        tools: Optional[list[dict]] = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}, OpenAI's tool calls and tool results too) or a list of
        them, rendered with the chat template; `tools` in OpenAI's form, as vLLM's LLM.chat takes them (a template
        that knows no tools is taught them: chat_tools.py). Read the calls with server/tool_calls.py's parse."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        reads_tools = template_reads_tools(self.tokenizer.chat_template)
        rendered = [render_chat(conversation, tools, reads_tools) for conversation in conversations]
        prompts = [self.tokenizer.encode_chat(chat, True, chat_tools) for chat, chat_tools in rendered]
        return self.generate(prompts, params, use_tqdm)

    def _run(self, order: list[str], show_progress: bool) -> list[RequestOutput]:
        with tqdm(total=len(order), desc="generating", disable=not (show_progress and sys.stderr.isatty())) as bar:
            return self.engine.run_until_finished(order, on_finish=lambda _output: bar.update(1))


def one_each(given, num_prompts: int, what: str) -> list:
    """`given` for every prompt, or a list or tuple of one per prompt (ValueError naming `what` otherwise)."""
    if not isinstance(given, (list, tuple)):
        return [given] * num_prompts
    if len(given) != num_prompts:
        raise ValueError(f"got {len(given)} {what} for {num_prompts} prompts; give one or one each")
    return list(given)
