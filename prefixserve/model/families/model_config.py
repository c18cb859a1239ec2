"""ModelConfig: the fields of a Hugging Face ``config.json`` that the Llama family needs.

Built once by ``ModelConfig.from_hf_dict``, validated, never mutated. Defaults for optional keys
follow the transformers config classes, so a checkpoint means the same thing to both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .family_fields import family_fields

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "SmolLM3ForCausalLM",
    "Phi3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
_REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
)


@dataclass(frozen=True)
class ModelConfig:
    architectures: tuple[str, ...]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None, or a dict with "rope_type" in SUPPORTED_ROPE_TYPES and that type's parameters.
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections
    o_proj_bias: bool = False  # Llama's attention_bias covers o_proj too; Qwen2's does not
    mlp_bias: bool = False
    sliding_window: int | None = None  # a row at position p attends to keys (p - window, p] on the window layers
    window_layers: tuple[bool, ...] = ()  # which layers slide (Gemma 3's local ones...); (): all, given a window
    qk_norm: bool = False  # Qwen3: RMSNorm over each q and k head before the rotation
    rope_layers: tuple[bool, ...] = ()  # SmolLM3: which layers rotate q and k (the others are NoPE); (): all
    partial_rotary_factor: float = 1.0  # Phi-4-mini: the rotation covers this share of each head's dims
    activation: str = "silu"  # of the gated MLP: "silu", or "gelu_tanh" (Gemma's GeGLU)
    attention_scale: float | None = None  # Gemma 3: query_pre_attn_scalar ** -0.5; None: head_dim ** -0.5
    local_rope_theta: float | None = None  # Gemma 3: the window layers' rope base
    attn_logit_softcapping: float | None = None  # Gemma 2: scores = cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def architecture(self) -> str:
        return self.architectures[0]

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each q and k head that rotate (the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def long_rope_after(self) -> int | None:
        """LongRoPE: the length past which a sequence rotates with the long factors; None without it."""
        scaling = self.rope_scaling
        return (
            None
            if scaling is None or scaling["rope_type"] != "longrope"
            else int(scaling["original_max_position_embeddings"])
        )

    @property
    def max_context_len(self) -> int:
        """Longest context this implementation computes exactly like the reference: the model's (the attention
        backends compute sliding windows, attention/backend.py)."""
        return self.max_position_embeddings

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> "ModelConfig":
        architectures = tuple(hf.get("architectures") or ())
        if not architectures:
            raise ValueError("config.json has no 'architectures'; add e.g. [\"LlamaForCausalLM\"]")
        if architectures[0] not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {architectures[0]!r} in config.json; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for key in _REQUIRED_KEYS:
            if hf.get(key) is None:
                raise ValueError(f"config.json is missing {key!r}, which a {architectures[0]} needs")
        heads = hf["num_attention_heads"]
        theta, rope_scaling = _rope_fields(hf)
        eos = hf.get("eos_token_id")
        family = family_fields(architectures[0], hf)
        return cls(
            architectures=architectures,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            max_position_embeddings=hf["max_position_embeddings"],
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            **family,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else ([] if eos is None else [eos])),
            torch_dtype=hf.get("torch_dtype") or hf.get("dtype"),
            extra=dict(hf),
        )

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"config {name}={value!r}; it must be a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"config num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}; fix one of them"
            )
        if self.head_dim % 2:
            raise ValueError(f"config head_dim={self.head_dim} must be even for rotary embeddings")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2 or self.rotary_dim == 0:
            raise ValueError(
                f"config partial_rotary_factor={self.partial_rotary_factor} gives {self.rotary_dim} "
                f"rotary dims of head_dim {self.head_dim}; it must be in (0, 1] and give an even number"
            )
        if not self.rms_norm_eps > 0:
            raise ValueError(f"config rms_norm_eps={self.rms_norm_eps}; it must be > 0")
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"config {name}={value!r}; it must be > 0, or null for none")
        if not self.rope_theta > 0:
            raise ValueError(f"config rope_theta={self.rope_theta}; it must be > 0")
        if self.rope_scaling is not None:
            _check_rope_scaling(self.rope_scaling, self.rotary_dim)
        for name, flags in (("no_rope_layers", self.rope_layers), ("layer_types", self.window_layers)):
            if flags and len(flags) != self.num_hidden_layers:
                raise ValueError(
                    f"config {name} has {len(flags)} entries for {self.num_hidden_layers} layers; give one per layer"
                )

    def uses_rope(self, layer_index: int) -> bool:
        return not self.rope_layers or self.rope_layers[layer_index]

    def window_of(self, layer_index: int) -> int | None:
        """The layer's sliding window in keys, None for full attention."""
        if self.sliding_window is None or (self.window_layers and not self.window_layers[layer_index]):
            return None
        return self.sliding_window


def _rope_fields(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either the transformers<5 keys or transformers 5's
    ``rope_parameters`` (which carries rope_theta inside)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if "full_attention" in params:  # Gemma 3: one set per kind of layer; the global layers' is the model's
        params = dict(params["full_attention"] or {})
    theta = float(params.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    params["rope_type"] = rope_type
    if rope_type == "llama3":
        # As transformers: the pre-training length defaults to max_position_embeddings.
        params.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
    if rope_type == "longrope":  # Phi-3 keeps the pre-training length beside rope_scaling (Phi3Config: 4096)
        original = hf.get("original_max_position_embeddings")
        if original is None and hf.get("architectures", [None])[0] == "Phi3ForCausalLM":
            original = 4096
        params["original_max_position_embeddings"] = (
            original or params.get("original_max_position_embeddings") or hf.get("max_position_embeddings")
        )
    params.pop("type", None)
    params.pop("partial_rotary_factor", None)  # a field of its own (partial_rotary_factor)
    return theta, params


def _check_rope_scaling(scaling: dict[str, Any], rotary_dim: int) -> None:
    rope_type = scaling.get("rope_type")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"config rope_scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    needed = {
        "linear": ("factor",),
        "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
        "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
    }[rope_type]
    for key in needed:
        if scaling.get(key) is None:
            raise ValueError(f"config rope_scaling of type {rope_type!r} is missing {key!r}")
    if rope_type == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ValueError("config rope_scaling needs high_freq_factor > low_freq_factor")
    if rope_type == "longrope":
        for key in ("short_factor", "long_factor"):
            factors = scaling[key]
            if (
                not isinstance(factors, list)
                or len(factors) != rotary_dim // 2
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in factors)
            ):
                raise ValueError(
                    f"config rope_scaling {key} must be {rotary_dim // 2} positive numbers (half the rotary dims)"
                )


def load_generation_eos(path: str | Path) -> list[int]:
    """End-of-sequence ids: generation_config.json's eos_token_id, else config.json's; [] if none.

    Lives here (no torch) so the tokenizer can use it; ``loader`` re-exports it.
    """
    for name in ("generation_config.json", "config.json"):
        file = Path(path) / name
        if file.is_file():
            eos = json.loads(file.read_text()).get("eos_token_id")
            if eos is not None:
                return [int(token) for token in eos] if isinstance(eos, list) else [int(eos)]
    return []
