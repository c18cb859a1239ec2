"""SGLang's `python -m sglang.bench_serving`, unmodified, from SGLang's own CPU venv. Not part of the package:
nothing imports this file, not the package and not the tests.

Why a wrapper: the client module (sglang/benchmark/serving.py) pulls in `sglang.srt.configs` at import time for
one PD-disaggregation constant, and that package imports torchvision at module level. PyPI's Linux torchvision
wheels are CUDA builds that cannot load against the CPU torch, so this registers an inert stand-in for
`torchvision` (the generated-shared-prefix / random / sharegpt text datasets never touch it) and then runs the
module as `__main__` with runpy, exactly as `python -m` would. No SGLang file is edited. The stand-in hides from
`importlib.util.find_spec`, so transformers still sees torchvision as absent. The Hugging Face hub is set offline
(HF_HUB_OFFLINE=1), since the client otherwise looks `--model` up on the hub; pass the model directory as --model and
the served name as --served-model-name so its chat-template check reads the local tokenizer.

Set up once (CPU only; torch==2.13.0 resolves to the local CPU wheel):

    python -m venv /tmp/sglang-peer
    /tmp/sglang-peer/bin/pip install --no-deps sglang
    /tmp/sglang-peer/bin/pip install aiohttp msgspec numpy orjson requests tqdm pybase64 pillow psutil \
        transformers==5.19.0 torch==2.13.0 triton==3.9.0 starlette pyzmq IPython datasets \
        apache-tvm-ffi==0.1.11 sentencepiece==0.2.1 compressed-tensors gguf

Run against a prefixserve server (tokenizer = the built-in model's directory,
`python -c "from prefixserve.model.default import ensure_default_model as d; print(d())"`):

    /tmp/sglang-peer/bin/python benchmarks/sglang_bench_client.py --backend vllm \
        --base-url http://127.0.0.1:8000 --model DIR --served-model-name prefixserve-tiny --tokenizer DIR \
        --dataset-name generated-shared-prefix --gsp-num-groups 2 --gsp-prompts-per-group 8 \
        --gsp-system-prompt-len 512 --gsp-question-len 64 --gsp-output-len 16 \
        --num-prompts 16 --max-concurrency 4
"""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import runpy
import sys
import types

_STUBBED = {"torchvision"}


class _Inert:
    """Any attribute, any call: enough for module-level `T.Compose`, `InterpolationMode.BICUBIC` and the like."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert()

    def __call__(self, *args, **kwargs):
        return _Inert()


class _InertModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert()


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] not in _STUBBED:
            return None
        frame = sys._getframe(1)
        for _ in range(3):  # an availability probe (importlib.util.find_spec) must see it absent
            if frame is None:
                break
            if frame.f_code.co_name == "find_spec" and frame.f_globals.get("__name__") == "importlib.util":
                return None
            frame = frame.f_back
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        return _InertModule(spec.name)

    def exec_module(self, module):
        module.__path__ = []


if __name__ == "__main__":
    # The client loads `--model` with AutoTokenizer.from_pretrained to look for a chat template; a bare served
    # name would send that to the Hugging Face hub. Only loopback traffic here: keep the hub offline.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if importlib.util.find_spec("torchvision") is None:  # a working torchvision, if any, is used as is
        sys.meta_path.insert(0, _StubFinder())
    sys.argv[0] = "sglang.bench_serving"
    runpy.run_module("sglang.bench_serving", run_name="__main__", alter_sys=True)
