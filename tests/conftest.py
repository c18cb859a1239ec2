"""Suite-wide fixtures: one private model cache directory and small engines shared per module."""

from __future__ import annotations

import os

import pytest
from redis_helpers import redis_server, shared_redis  # noqa: F401 (fixtures: each test its own redis-server or cluster)


@pytest.fixture(scope="session", autouse=True)
def private_model_cache(tmp_path_factory):
    """Generate the built-in default model once per session into a temporary cache directory."""
    cache_dir = tmp_path_factory.mktemp("prefixserve-home")
    previous = os.environ.get("PREFIXSERVE_CACHE_DIR")
    os.environ["PREFIXSERVE_CACHE_DIR"] = str(cache_dir)
    yield cache_dir
    if previous is None:
        os.environ.pop("PREFIXSERVE_CACHE_DIR", None)
    else:
        os.environ["PREFIXSERVE_CACHE_DIR"] = previous


@pytest.fixture(scope="session")
def default_model_dir(private_model_cache):
    """The built-in model's directory, generated once per session."""
    from prefixserve.model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def default_model(default_model_dir):
    """The built-in model loaded in float32 on the CPU."""
    import torch

    from prefixserve.model import load_model

    return load_model(default_model_dir, torch.float32, torch.device("cpu"))


TIER_SECRET = "prefixserve-tests-fleet-secret-0123456789abcdef"  # the tests' fleet secret (tiers/seal.py)


@pytest.fixture(scope="session")
def tier_secret_file(tmp_path_factory):
    """A kv_tier_secret_file holding TIER_SECRET (mode 600), as every replica of a test fleet gets it."""
    path = tmp_path_factory.mktemp("secret") / "kv-tier.secret"
    path.write_text(TIER_SECRET + "\n")
    path.chmod(0o600)
    return str(path)


SMALL_KV = 32 << 20  # 2,048 tokens of the default model in fp32: fast to allocate, plenty for tests


def make_llm(**options):
    from prefixserve import LLM

    options.setdefault("dtype", "float32")
    options.setdefault("kv_cache_memory_bytes", SMALL_KV)
    options.setdefault("log_stats", False)
    return LLM(**options)


def _variant_names() -> list[str]:
    from prefixserve.model.kernel_variants import variants_for

    return [variant.name for variant in variants_for()]


@pytest.fixture(params=_variant_names())
def kernel_variant(request, monkeypatch):
    """Each compiled variant this CPU runs (up to PREFIXSERVE_CPU_ISA's cap), loaded in this process and
    made the one the model calls; its CompiledKernels. Skips the variants the CPU cannot run."""
    from prefixserve.model import kernels

    name = request.param
    if name not in {variant.name for variant in kernels.allowed()}:
        pytest.skip(f"this CPU does not run the {name} kernels (or {kernels.CAP_VARIABLE} caps them)")
    if not kernels.is_built(name):
        pytest.skip(f"the {name} kernels are not built ({kernels.describe_build()})")
    loaded = kernels.load(name)
    monkeypatch.setattr(kernels, "compiled", loaded)
    return loaded


@pytest.fixture(params=["compiled", "reference"])
def attention_path(request, monkeypatch):
    """Run a test with attention on the compiled kernels and on the pure-PyTorch reference paths."""
    from prefixserve.model import kernels
    from prefixserve.model.attention import paged as attention

    if request.param == "compiled":
        if kernels.compiled is None:
            pytest.skip("prefixserve's compiled kernels are not built")
    else:
        monkeypatch.setattr(attention, "causal_kernel_for", lambda k_cache: None)
    return request.param
