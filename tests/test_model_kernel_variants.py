"""Which compiled kernel variant runs: the CPU's features, PREFIXSERVE_CPU_ISA's cap, what was built,
and that a build never needs AVX-512 (or any instruction set) to succeed.

The variants' kernels themselves are tested in test_model_kernels.py and test_model_rowwise.py
(once per variant this CPU runs); here is how one is chosen and built.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from prefixserve.model import kernel_variants, kernels

ROOT = Path(__file__).resolve().parents[1]
# A build does not depend on the caps: CI's capped runs (as an AVX2 machine, ...) leave it to the uncapped one.
builds = pytest.mark.skipif(
    bool(os.environ.get("PREFIXSERVE_CPU_ISA")), reason="the build is the same under any cap; the uncapped run tests it"
)


@pytest.fixture
def clean_features():
    kernels.cpu_features.cache_clear()
    yield
    kernels.cpu_features.cache_clear()


def test_every_variant_names_its_instructions_and_none_asks_for_the_build_machines_own():
    for machine in ("x86_64", "aarch64", "riscv64"):
        variants = kernel_variants.variants_for(machine)
        assert variants[0].name == "portable" and variants[0].backend == "PORTABLE"
        for variant in variants:
            assert not any("native" in flag for flag in variant.flags), variant
    x86 = {variant.name: variant for variant in kernel_variants.variants_for("x86_64")}
    assert list(x86) == ["portable", "avx2", "avx512", "avx512_bf16", "amx"]
    assert x86["portable"].flags == ("-march=x86-64", "-mtune=generic")  # baseline x86-64: no AVX at all
    assert "-mavx2" in x86["avx2"].flags and not any("avx512" in flag for flag in x86["avx2"].flags)
    assert x86["avx512_bf16"].needs[-1] == "avx512_bf16"
    assert {"amx_tile", "amx_bf16"} <= set(x86["amx"].needs) and "-mamx-bf16" in x86["amx"].flags
    assert kernel_variants.machine("AMD64") == "x86_64" and kernel_variants.machine("arm64") == "aarch64"
    assert kernel_variants.variants_for("riscv64") == kernel_variants.GENERIC


def test_the_cpu_features_come_from_cpuinfo_when_torch_does_not_report_them(monkeypatch, tmp_path, clean_features):
    monkeypatch.delattr(kernels.torch._C._cpu, "_get_cpu_capability")
    fake = tmp_path / "cpuinfo"
    real_open = open
    monkeypatch.setattr(
        "builtins.open", lambda path, *a, **k: real_open(fake if path == "/proc/cpuinfo" else path, *a, **k)
    )
    fake.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 fma f16c avx512f avx512bw avx512dq avx512vl amx_bf16\n")
    expected = {"avx2", "fma3", "f16c", "avx512_f", "avx512_bw", "avx512_dq", "avx512_vl", "amx_bf16"}
    assert expected <= kernels.cpu_features()
    kernels.cpu_features.cache_clear()
    fake.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 fma f16c\n")
    monkeypatch.setattr(kernels, "variants_for", lambda: kernel_variants.variants_for("x86_64"))
    assert kernels.cpu_features() == {"avx2", "fma3", "f16c"}
    assert [variant.name for variant in kernels.executable()] == ["portable", "avx2"]


def test_the_cap_keeps_the_choice_at_or_below_it_and_an_unknown_cap_names_the_choices(monkeypatch):
    monkeypatch.setattr(
        kernels,
        "cpu_features",
        lambda: frozenset({"avx2", "fma3", "f16c", "avx512_f", "avx512_bw", "avx512_dq", "avx512_vl", "avx512_bf16"}),
    )
    monkeypatch.setattr(kernels, "variants_for", lambda: kernel_variants.variants_for("x86_64"))
    monkeypatch.delenv(kernels.CAP_VARIABLE, raising=False)
    assert [variant.name for variant in kernels.allowed()] == ["portable", "avx2", "avx512", "avx512_bf16"]
    monkeypatch.setattr(kernels, "amx_permitted", lambda: True)  # the OS grants the tile state
    monkeypatch.setattr(
        kernels,
        "cpu_features",
        lambda: frozenset(
            {
                "avx2",
                "fma3",
                "f16c",
                "avx512_f",
                "avx512_bw",
                "avx512_dq",
                "avx512_vl",
                "avx512_bf16",
                "amx_tile",
                "amx_bf16",
            }
        ),
    )
    assert kernels.allowed()[-1].name == "amx"
    monkeypatch.setattr(kernels, "amx_permitted", lambda: False)  # it refuses: never loaded (SIGILL)
    assert kernels.allowed()[-1].name == "avx512_bf16"
    monkeypatch.setenv(kernels.CAP_VARIABLE, "AVX2")
    assert [variant.name for variant in kernels.allowed()] == ["portable", "avx2"]
    monkeypatch.setenv(kernels.CAP_VARIABLE, "portable")
    assert [variant.name for variant in kernels.allowed()] == ["portable"]
    monkeypatch.setattr(kernels, "cpu_features", lambda: frozenset({"avx2", "fma3", "f16c"}))
    monkeypatch.setenv(kernels.CAP_VARIABLE, "avx512_bf16")  # a cap is a ceiling: the CPU still decides
    assert [variant.name for variant in kernels.allowed()] == ["portable", "avx2"]
    monkeypatch.setenv(kernels.CAP_VARIABLE, "sse9")
    with pytest.raises(ValueError, match="portable, avx2, avx512, avx512_bf16, amx"):
        kernels.allowed()


def test_a_variant_the_cpu_cannot_run_is_never_loaded(monkeypatch):
    """Its module initialiser is compiled with those instructions: loading it would be SIGILL."""
    monkeypatch.setattr(kernels, "cpu_features", lambda: frozenset())
    monkeypatch.setattr(kernels, "variants_for", lambda: kernel_variants.variants_for("x86_64"))
    with pytest.raises(ValueError, match="cannot run the 'avx2' kernels"):
        kernels.load("avx2")


def test_variant_names_what_runs():
    if kernels.compiled is None:
        assert kernels.variant() == "pytorch"
    else:
        assert kernels.variant() == kernels.compiled.variant
        assert kernels.variant() in {variant.name for variant in kernels.allowed()}
    assert kernels.variant() in kernels.describe()


def _python(code: str, **environment) -> subprocess.CompletedProcess:
    env = {**os.environ, **environment}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.skipif(not kernels.available(), reason="no compiled variant is built")
def test_the_best_variant_runs_unless_capped_and_zero_turns_them_off():
    best = kernels.available()[-1]
    show = "from prefixserve.model import kernels; print(kernels.variant())"
    assert _python(show, PREFIXSERVE_CPU_ISA="").stdout.strip() == best
    assert _python(show, PREFIXSERVE_CPU_ISA="portable").stdout.strip() == "portable"
    assert _python(show, PREFIXSERVE_KERNELS="0").stdout.strip() == "pytorch"
    refused = _python(show, PREFIXSERVE_CPU_ISA="avx9000")
    assert refused.returncode != 0 and "PREFIXSERVE_CPU_ISA='avx9000' names no kernel variant" in refused.stderr


def _copy_build_tree(destination: Path) -> Path:
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, destination / name)
    shutil.copytree(ROOT / "prefixserve" / "csrc", destination / "prefixserve" / "csrc")
    (destination / "prefixserve" / "model").mkdir()
    shutil.copy(ROOT / "prefixserve" / "model" / "kernel_variants.py", destination / "prefixserve" / "model")
    return destination


@builds
def test_a_build_without_a_working_compiler_succeeds_without_kernels(tmp_path):
    """`pip install -e .` must never fail because of the kernels: no compiler is a warning."""
    tree = _copy_build_tree(tmp_path)
    result = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace"],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "CXX": "false", "CC": "false"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "compiled kernels were not built" in result.stderr
    assert not list((tree / "prefixserve").glob("*.so"))


@builds
@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
def test_a_variant_the_compiler_cannot_build_is_left_out_and_the_rest_are_built(tmp_path):
    """An older compiler without -mavx512bf16, say: that variant is a warning, the others install."""
    tree = _copy_build_tree(tmp_path)
    compiler = tree / "fussy-c++"
    compiler.write_text(
        '#!/bin/sh\nfor a in "$@"; do [ "$a" = "-mavx512bf16" ] && '
        '{ echo "unrecognized option $a" >&2; exit 1; }; done\nexec c++ "$@"\n'
    )
    compiler.chmod(0o755)
    machine_variants = [variant.name for variant in kernel_variants.variants_for()]
    wanted = ",".join(name for name in ("portable", "avx512_bf16") if name in machine_variants)
    result = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace"],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "CXX": str(compiler), "CC": str(compiler), "PREFIXSERVE_KERNEL_VARIANTS": wanted},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    built = sorted(path.name.split(".")[0] for path in (tree / "prefixserve").glob("*.so"))
    expected = ["_C", "_kernels_portable"]
    assert built == expected, result.stderr[-2000:]
    if "avx512_bf16" in wanted:
        assert "_kernels_avx512_bf16 was not built" in result.stderr


def _objdump(path: Path) -> str:
    return subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", str(path)], capture_output=True, text=True, timeout=120
    ).stdout


@pytest.mark.skipif(
    shutil.which("objdump") is None or kernel_variants.machine() != "x86_64",
    reason="objdump on x86-64 reads the built instructions",
)
@pytest.mark.parametrize("name, forbidden", [("portable", ("%ymm", "%zmm")), ("avx2", ("%zmm",))])
def test_a_built_variant_uses_no_instruction_set_above_its_own(name, forbidden):
    """The portable build is baseline x86-64 (no AVX), the avx2 build has no AVX-512: they run on any
    CPU of their class, whatever machine built them."""
    import importlib.util

    spec = importlib.util.find_spec(kernel_variants.module_name(name))
    if spec is None:
        pytest.skip(f"the {name} variant is not built")
    code = _objdump(Path(spec.origin))
    assert code, "objdump read nothing"
    for register in forbidden:
        assert register not in code, f"{name} uses {register}"


CROSS_COMPILER = "aarch64-linux-gnu-g++"
QEMU_CHECKED_SOURCES = [
    "paged_causal.cpp",
    "rowwise.cpp",
    "quantized_matmul.cpp",
    "lora.cpp",
]  # built and run under qemu below


@builds
@pytest.mark.skipif(
    shutil.which(CROSS_COMPILER) is None,
    reason=f"no {CROSS_COMPILER} (Debian's g++-aarch64-linux-gnu; .ci/run installs it)",
)
@pytest.mark.parametrize("backend", ["PORTABLE", "NEON"])
def test_the_kernels_compile_for_aarch64(backend, tmp_path):
    """Compile only (no aarch64 machine here): the kernel sources against torch's headers, C++17. Where qemu can
    run them, the test below builds the computing sources for aarch64 (and runs them), so this one compiles only
    the rest (the variant table and the peak loop)."""
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    flags = [
        "-std=c++17",
        "-O2",
        "-march=armv8-a",
        "-ffp-contract=off",
        "-fopenmp",
        "-fPIC",
        "-Werror=return-type",
        f"-DPREFIXSERVE_SIMD_{backend}",
        "-DPREFIXSERVE_VARIANT=cross",
        "-DTORCH_EXTENSION_NAME=_kernels_cross",
        f"-I{sysconfig.get_paths()['include']}",
    ] + [f"-I{path}" for path in include_paths()]
    sources = ["variant.cpp", "peak.cpp"] + ([] if shutil.which("qemu-aarch64") else QEMU_CHECKED_SOURCES)
    for source in sources:
        result = subprocess.run(
            [
                CROSS_COMPILER,
                *flags,
                "-c",
                str(ROOT / "prefixserve" / "csrc" / source),
                "-o",
                str(tmp_path / f"{source}.o"),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert (tmp_path / f"{source}.o").stat().st_size > 0


@builds
@pytest.mark.skipif(
    shutil.which(CROSS_COMPILER) is None or shutil.which("qemu-aarch64") is None,
    reason=f"needs {CROSS_COMPILER} and qemu-aarch64 (Debian's qemu-user; .ci/run installs both)",
)
@pytest.mark.parametrize("backend", ["NEON", "PORTABLE"])
def test_the_aarch64_kernels_compute_attention_under_qemu(backend, tmp_path):
    """The kernels built for aarch64, run: tests/aarch64/check_kernels.cpp links them statically with a
    serial stand-in for ATen's parallel_for and checks every row against double precision (float32 and
    bf16 K/V), each sequence alone bit for bit as in the batch, the row-wise kernels, and the quantized matmul."""
    from torch.utils.cpp_extension import include_paths

    program = tmp_path / f"check_{backend.lower()}"
    here = ROOT / "tests" / "aarch64"
    build = [
        CROSS_COMPILER,
        "-std=c++17",
        "-O2",
        "-march=armv8-a",
        "-ffp-contract=off",
        "-static",
        f"-DPREFIXSERVE_SIMD_{backend}",
        f"-I{here}",
        f"-I{ROOT / 'prefixserve' / 'csrc'}",
        *[f"-I{path}" for path in include_paths()],
        *[str(ROOT / "prefixserve" / "csrc" / source) for source in QEMU_CHECKED_SOURCES],
        str(here / "check_kernels.cpp"),
        "-o",
        str(program),
    ]
    built = subprocess.run(build, capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    ran = subprocess.run(["qemu-aarch64", str(program)], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert f"{backend.lower()} float32" in ran.stdout and "alone as in the batch: yes" in ran.stdout
    assert all(f"quantized int{bits}: worst" in ran.stdout for bits in (8, 5, 4))
    assert all(
        f"quantized {kind}: decoded as its layout says and rows alone as in the batch: yes" in ran.stdout
        for kind in ("Q6_K", "Q3_K", "Q2_K", "IQ4_NL")
    )
