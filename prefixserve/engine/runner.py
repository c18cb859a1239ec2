"""Tensor side of a step: lays out the batch, runs the model over the paged KV pool, samples.

A step's batch is flat: the new tokens of every scheduled request one after the
other, each request's rows being the last `num_new` positions of its context.

    request A (prefill chunk, 5 new)   request B (decode)   request C (decode)
    rows 0..4, positions 32..36        row 5, position 70   row 6, position 9
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

from ..cache.window_slots import WindowSlots
from ..lora.step import LoRAStep
from ..lora.step import attach as attach_lora
from ..model import AttentionMetadata, LlamaForCausalLM, ModelConfig
from ..model.attention.paged import choose_backend
from ..model.kernels import lora_slots_for
from .kv_memory import zeroed_pool
from .logits_processors import process_logits
from .model_version import CurrentVersion
from .outputs import TokenLogprob
from .sampling import Sampler, compute_logprobs, row_probs
from .scheduler import ScheduledRequest
from .speculation import accept, verify_sampled


class StepResult(NamedTuple):
    """Per scheduled request: the sampled token (None for a mid-prompt chunk) and its logprob (None unless the
    request asked for logprobs); for a drafted request, lists: one per row (engine/speculation.py)."""

    token_ids: list[Optional[int]]
    logprobs: list[Optional[TokenLogprob]]


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * element_size


class ModelRunner:
    def __init__(
        self,
        current: CurrentVersion,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        seed: int = 0,
        batch_invariant: bool = True,
        window_slots: Optional[WindowSlots] = None,
        enable_lora: bool = False,
        max_loras: int = 1,
    ) -> None:
        self.batch_invariant = batch_invariant
        # Each step's rows by LoRA adapter, read by every adapted layer (lora/step.py); None: no adapters served.
        self.lora_step = LoRAStep(max_loras, lora_slots_for(device)) if enable_lora else None
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.current = current
        self.prepare(current.version.model)
        config = current.version.config
        self.block_size = block_size
        self.device = device
        # With window slots, the sliding-window layers keep their K/V in a pool of window_slots.num_slots
        # blocks, reached through window_slots.slot_of (cache/window_slots.py); the others hold every block.
        self.window_slots = window_slots
        self.window_layers = (
            [config.window_of(i) is not None for i in range(config.num_hidden_layers)]
            if window_slots is not None
            else [False] * config.num_hidden_layers
        )
        # Zeroed, not empty, as a defence only: the attention plan never reads an unwritten slot (decode
        # padding reads the sequence's own newest slot; tests fill unwritten slots with NaN to prove it).
        # On Linux CPUs in huge pages (kv_memory.py): decodes read blocks scattered over the pool.
        self.kv_caches = []
        for windowed in self.window_layers:
            shape = (
                window_slots.num_slots if windowed else num_blocks,
                block_size,
                config.num_key_value_heads,
                config.head_dim,
            )
            self.kv_caches.append((zeroed_pool(shape, dtype, device), zeroed_pool(shape, dtype, device)))
        # Attention reads the pool one way for this engine's life: compiled, invariant or cascade (model/attention/)
        self.attention = choose_backend(self.kv_caches[0][0], batch_invariant)
        self.sampler = Sampler(seed)

    def prepare(self, model: LlamaForCausalLM) -> None:
        """Ready `model` to run here (at start-up, and a hot reload's before the swap), with this engine's
        batch-invariance choice: each linear layer's row calls are measured for the step sizes it makes."""
        model.plan_rows(self.batch_invariant, self.max_num_batched_tokens, self.max_num_seqs)
        if self.lora_step is not None:
            attach_lora(model, self.lora_step)

    @property
    def model(self) -> LlamaForCausalLM:
        return self.current.version.model

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Layout of one block's KV as the tiers store it: (layers, K/V, block_size, kv_heads, head_dim)."""
        _, block_size, num_kv_heads, head_dim = self.kv_caches[0][0].shape
        return (len(self.kv_caches), 2, block_size, num_kv_heads, head_dim)

    def holds_every_layer(self, block_id: int) -> bool:
        """Whether the pool holds this block's K/V in every layer (a window layer's slot may be gone)."""
        return self.window_slots is None or self.window_slots.slot_of[block_id] >= 0

    def _rows_of(self, block_ids: Sequence[int]) -> list[torch.Tensor]:
        """Per layer, the rows of its cache holding these blocks (a window layer's: their slots)."""
        ids = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        if self.window_slots is None:
            return [ids] * len(self.kv_caches)
        slots = torch.tensor([self.window_slots.slot_of[b] for b in block_ids], dtype=torch.int64, device=self.device)
        if bool((slots < 0).any()):
            raise ValueError("a block's window-layer K/V is gone; check holds_every_layer first")
        return [slots if windowed else ids for windowed in self.window_layers]

    @property
    def dtype_name(self) -> str:
        return str(self.kv_caches[0][0].dtype).removeprefix("torch.")

    @torch.inference_mode()
    def read_blocks(self, block_ids: Sequence[int]) -> list[bytes]:
        """The KV of these pool blocks as bytes, one payload per block (see block_shape); every layer's must
        be held (holds_every_layer)."""
        rows = self._rows_of(block_ids)
        stacked = torch.stack(
            [torch.stack([k.index_select(0, ids), v.index_select(0, ids)]) for (k, v), ids in zip(self.kv_caches, rows)]
        )
        per_block = stacked.permute(2, 0, 1, 3, 4, 5).contiguous().cpu()  # [blocks, layers, 2, size, heads, d]
        raw = per_block.view(-1).view(torch.uint8).view(len(block_ids), -1)
        return [raw[i].numpy().tobytes() for i in range(len(block_ids))]

    @torch.inference_mode()
    def write_blocks(self, block_ids: Sequence[int], payloads: Sequence[bytes]) -> None:
        """Copy payloads (from read_blocks, possibly another process's) into these pool blocks. The window
        layers' part goes to slots given as idle (window_slots.py); a block none can be had for keeps only its
        full layers' K/V, and a match cut before it recomputes it."""
        dtype = self.kv_caches[0][0].dtype
        flat = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8).view(dtype)
        values = flat.view(len(block_ids), *self.block_shape).to(self.device)
        kept = list(range(len(block_ids)))
        if self.window_slots is not None:
            kept = [i for i, given in enumerate(self.window_slots.give_idle(block_ids)) if given]
        ids = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        picked = torch.tensor(kept, dtype=torch.int64, device=self.device)
        rows = self._rows_of([block_ids[i] for i in kept])
        for layer, (k_cache, v_cache) in enumerate(self.kv_caches):
            if self.window_layers[layer]:
                k_cache.index_copy_(0, rows[layer], values[picked, layer, 0])
                v_cache.index_copy_(0, rows[layer], values[picked, layer, 1])
            else:
                k_cache.index_copy_(0, ids, values[:, layer, 0])
                v_cache.index_copy_(0, ids, values[:, layer, 1])

    def _rotary_positions(self, meta: AttentionMetadata, scheduled: Sequence[ScheduledRequest]) -> torch.Tensor:
        """The rows of the rotary table each row reads: its position, past `long_offset` for a sequence that
        rotates with LongRoPE's long factors (model/families/rope.py)."""
        offset = self.model.rotary.long_offset
        if offset is None or not any(request.long_rope for request, _ in scheduled):
            return meta.positions
        shifts = torch.tensor([offset if request.long_rope else 0 for request, _ in scheduled], dtype=torch.int64)
        rows = torch.tensor([num_new for _, num_new in scheduled], dtype=torch.int64)
        return meta.positions + torch.repeat_interleave(shifts, rows).to(meta.positions.device)

    @torch.inference_mode()
    def execute(self, scheduled: Sequence[ScheduledRequest]) -> StepResult:
        """Run one step; a sampled token (and logprob) per request, None for mid-prompt chunks."""
        input_ids: list[int] = []
        query_lens, seq_lens, block_tables = [], [], []
        sample_rows, sampled_requests, positions = [], [], []  # positions: where each sampled token lands
        rows_of = []  # per scheduled request, its sampled rows' indexes among sample_rows
        segments = []  # (adapter, first row, end row) per request: which rows an adapter updates
        for request, num_new in scheduled:
            start = request.num_computed_tokens
            end = start + num_new
            segments.append((request.lora, len(input_ids), len(input_ids) + num_new))
            # a drafted request (engine/speculation.py): its last token, then its drafts, every row sampled
            input_ids += request.token_ids[start:end] + request.draft
            query_lens.append(num_new)
            seq_lens.append(end)
            block_tables.append([block.block_id for block in request.blocks])
            # Logits only where the last known token was just computed: that row predicts the next.
            num_sampled = len(request.draft) + 1 if end == request.num_tokens + len(request.draft) else 0
            rows_of.append(range(len(sample_rows), len(sample_rows) + num_sampled))
            for row in range(num_sampled):
                sample_rows.append(len(input_ids) - num_sampled + row)
                sampled_requests.append(request)
                positions.append(request.num_tokens + row)
        meta = AttentionMetadata.build(query_lens, seq_lens, block_tables, self.block_size, self.device)
        window_meta = None
        if self.window_slots is not None:  # the same step over the window layers' slots (-1: released below a window)
            slot_of = self.window_slots.slot_of
            window_meta = AttentionMetadata.build(
                query_lens,
                seq_lens,
                [[slot_of[b] for b in table] for table in block_tables],
                self.block_size,
                self.device,
            )
        # Only the sampled rows' outputs are used: the last layer computes those alone (every row's
        # K/V is still written). A step of decodes samples every row.
        every_row = len(sample_rows) == len(input_ids)
        if self.lora_step is not None:
            self.lora_step.begin(segments, len(input_ids), None if every_row else sample_rows, self.device)
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            self._rotary_positions(meta, scheduled),
            self.kv_caches,
            meta,
            output_rows=None if every_row else sample_rows,
            window_meta=window_meta,
            attention=self.attention,
        )
        if not sample_rows:
            return StepResult([None] * len(scheduled), [None] * len(scheduled))
        logits = self.model.compute_logits(hidden)
        processed = process_logits(logits, sampled_requests)
        params = [request.sampling_params for request in sampled_requests]
        # logprobs from the model's own logits, as vLLM and OpenAI give them
        sampled = self.sampler.sample(processed, params, positions, raw_logits=logits)
        tokens, logprobs = [], []
        for (request, _), rows in zip(scheduled, rows_of):
            if not rows:
                tokens.append(None)
                logprobs.append(None)
            elif not request.draft:
                tokens.append(sampled.token_ids[rows[0]])
                logprobs.append(sampled.logprobs[rows[0]])
            else:
                kept = self._verify(request, rows, sampled.token_ids, processed, positions)
                tokens.append(kept)
                logprobs.append(self._kept_logprobs(request, rows, kept, sampled.logprobs, logits))
        return StepResult(tokens, logprobs)

    def _verify(self, request, rows: range, row_tokens: list[int], processed: torch.Tensor, positions) -> list[int]:
        """The tokens a drafted request's step keeps (engine/speculation.py): greedy, its rows' argmax while the
        drafts agree; sampled, by speculative sampling over its rows' distributions."""
        params = request.sampling_params
        if params.is_greedy:
            return accept(request.draft, [row_tokens[row] for row in rows])
        own = processed[rows.start : rows.stop].float().cpu()
        return verify_sampled(
            [row_probs(row, params) for row in own],
            own.argmax(dim=-1).tolist(),
            request.draft,
            lambda j: self.sampler.generator_for(params, positions[rows.start + j]),
        )

    @staticmethod
    def _kept_logprobs(request, rows: range, kept: list[int], row_logprobs: list, logits: torch.Tensor):
        """Each kept token's logprob from its row (a sampled request's kept tokens may not be its rows' draws)."""
        if request.sampling_params.logprobs is None:
            return None
        if request.sampling_params.is_greedy:
            return [row_logprobs[row] for row in rows[: len(kept)]]
        own = logits[rows.start : rows.start + len(kept)]
        return compute_logprobs(own, [request.sampling_params] * len(kept), kept)
