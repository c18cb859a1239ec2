"""GGUF LoRA files as llama.cpp's convert_lora_to_gguf.py writes them and `llama-server --lora` reads them
(prefixserve/lora/gguf_adapter.py): the converter's own file for a PEFT adapter (tests/lora_files/) is that adapter,
bit for bit, and serves transformers + peft's tokens; GGUFs that are not a LoRA of this base are refused, naming
why."""

from pathlib import Path

import numpy as np
import pytest
from lora_helpers import peft_greedy

from prefixserve import LLM, LoRARequest, SamplingParams
from prefixserve.lora.adapter import AdapterError, load_adapter

pytest.importorskip("peft")
FILES = Path(__file__).parent / "lora_files"
PROMPT = "The lighthouse keeper counted the ships that passed the rocks each night, and wrote their names in"
NUM_TOKENS = 12


@pytest.fixture(scope="module")
def llm():
    return LLM(enable_lora=True, dtype="float32", kv_cache_memory_bytes=16 << 20, log_stats=False)


def greedy():
    return SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)


def test_the_converters_file_is_the_peft_adapter_and_serves_its_tokens(llm):
    config = llm.engine.version.config
    from_directory = load_adapter("qk", str(FILES / "qk"), config, 16)
    from_gguf = load_adapter("qk", str(FILES / "qk.gguf"), config, 16)
    assert from_gguf.fingerprint == from_directory.fingerprint  # q and k rows back in order: the same weights
    (served,) = llm.generate(
        [PROMPT], greedy(), use_tqdm=False, lora_request=LoRARequest("qk", 1, str(FILES / "qk.gguf"))
    )
    (expected,) = peft_greedy(FILES / "qk", [served.prompt_token_ids], NUM_TOKENS)
    assert served.token_ids == expected
    (base,) = llm.generate([PROMPT], greedy(), use_tqdm=False)
    assert base.token_ids != served.token_ids and base.num_cached_tokens == 0
    (again,) = llm.generate(
        [PROMPT], greedy(), use_tqdm=False, lora_request=LoRARequest("qk-dir", 2, str(FILES / "qk"))
    )
    assert again.token_ids == served.token_ids and again.num_cached_tokens > 0  # one adapter, two files: one cache


def write_gguf(path: Path, architecture="llama", kind="adapter", tensors=None) -> str:
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), architecture)
    writer.add_type(kind)
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", 4.0)
    for name, values in (tensors or {"blk.0.attn_q.weight.lora_a": np.zeros((2, 512), np.float32)}).items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_gguf_files_that_are_not_a_lora_of_this_base_are_refused(llm, tmp_path):
    (tmp_path / "noise.gguf").write_bytes(b"not a gguf at all" * 10)
    cases = {
        str(tmp_path / "noise.gguf"): "not a readable GGUF file",
        write_gguf(tmp_path / "model.gguf", kind="model"): "not a LoRA adapter",
        write_gguf(tmp_path / "qwen.gguf", architecture="qwen2"): "adapts a 'qwen2' model",
        write_gguf(
            tmp_path / "norm.gguf", tensors={"blk.0.attn_norm.weight": np.ones(512, np.float32)}
        ): "not a LoRA pair of a projection",
        write_gguf(tmp_path / "lone.gguf"): "lora_A alone",
        write_gguf(
            tmp_path / "wide.gguf",
            tensors={
                "blk.0.attn_q.weight.lora_a": np.zeros((2, 640), np.float32),
                "blk.0.attn_q.weight.lora_b": np.zeros((512, 2), np.float32),
            },
        ): "another base model",
    }
    for path, message in cases.items():
        with pytest.raises(AdapterError, match=message):
            llm.generate(["hello"], greedy(), use_tqdm=False, lora_request=LoRARequest("bad", 5, path))
    (still,) = llm.generate(["hello"], greedy(), use_tqdm=False)
    assert len(still.token_ids) == NUM_TOKENS
