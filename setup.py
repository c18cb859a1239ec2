"""Builds prefixserve's compiled CPU kernels (prefixserve/csrc/) at install time; metadata lives in pyproject.toml.

Two kinds of extension module:
  prefixserve._C                 the binding (tensor checks, dispatch), built once for the
                                 architecture's baseline
  prefixserve._kernels_<variant> the kernel sources built once per instruction set (portable, avx2,
                                 avx512, avx512_bf16 on x86-64; portable and neon on aarch64), each
                                 with its own flags from prefixserve/model/kernel_variants.py
No -march=native anywhere: a wheel built on one machine runs on every CPU of its architecture, and
prefixserve.model.kernels picks the best variant the CPU runs at import.

Every kernel module is optional: a compiler that is missing, too old or fails on one variant logs a
warning and the install goes on without it (without _C, the pure-PyTorch reference paths run).
PREFIXSERVE_KERNEL_VARIANTS=portable,avx2 builds only those (a faster build for development).

-ffp-contract=off: no multiply-add is fused behind the code's back. A row's bits must not depend on
where its sums were inlined (csrc/paged_causal.cpp computes a row alone or in a block of rows); gcc
fusing a scalar multiply-add in one place and not another broke that once (1-ulp differences).
"""

import os
import runpy
import warnings

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = "prefixserve/csrc"
HEADERS = [
    f"{CSRC}/{name}"
    for name in (
        "attention_tiles.h",
        "binding.h",
        "kernels.h",
        "lora.h",
        "lora_slots.h",
        "peak.h",
        "quantized.h",
        "quantized_codes.h",
        "quantized_scales.h",
        "rowwise.h",
        "simd.h",
    )
]
COMMON_FLAGS = [
    "-O3",
    "-g0",
    "-ffp-contract=off",
    "-fopenmp",
    "-fvisibility=hidden",
    "-Wno-maybe-uninitialized",
]  # gcc 12 warns inside its own intrinsics headers

catalogue = runpy.run_path(os.path.join(ROOT, "prefixserve/model/kernel_variants.py"))


def chosen_variants():
    variants = catalogue["variants_for"]()
    wanted = os.environ.get("PREFIXSERVE_KERNEL_VARIANTS")
    if not wanted:
        return variants
    names = {name.strip() for name in wanted.split(",") if name.strip()}
    unknown = names - {variant.name for variant in variants}
    if unknown:
        raise SystemExit(
            f"PREFIXSERVE_KERNEL_VARIANTS names {sorted(unknown)}, not variants of this machine "
            f"({', '.join(variant.name for variant in variants)})"
        )
    return tuple(variant for variant in variants if variant.name in names)


def extensions():
    try:
        from torch.utils.cpp_extension import CppExtension
    except ImportError as error:  # pragma: no cover - torch is a build requirement
        warnings.warn(f"prefixserve's kernels are not built: {error}", stacklevel=2)
        return []
    binding_flags = list(catalogue["BINDING_FLAGS"].get(catalogue["machine"](), ()))
    modules = [
        CppExtension(
            "prefixserve._C",
            [f"{CSRC}/module.cpp", f"{CSRC}/decoder_stack.cpp", f"{CSRC}/lora_slots.cpp"],
            depends=HEADERS,
            extra_compile_args=["-O2", "-g0"] + binding_flags,
        )
    ]
    for variant in chosen_variants():
        modules.append(
            CppExtension(
                catalogue["module_name"](variant.name),
                [
                    f"{CSRC}/variant.cpp",
                    f"{CSRC}/paged_causal.cpp",
                    f"{CSRC}/rowwise.cpp",
                    f"{CSRC}/peak.cpp",
                    f"{CSRC}/quantized_matmul.cpp",
                    f"{CSRC}/lora.cpp",
                ],
                depends=HEADERS,
                # C++17: the kernel sources need nothing newer (the binding follows torch's headers).
                extra_compile_args=COMMON_FLAGS
                + ["-std=c++17", f"-DPREFIXSERVE_SIMD_{variant.backend}", f"-DPREFIXSERVE_VARIANT={variant.name}"]
                + list(variant.flags),
                extra_link_args=["-fopenmp"],
            )
        )
    return modules


def build_command():
    from torch.utils.cpp_extension import BuildExtension

    class OptionalKernels(BuildExtension):
        """Builds each kernel module in its own temporary directory (the variants compile the same
        sources with other flags) and turns a failed one into a warning instead of a failed install."""

        failed = ()

        def build_extensions(self):
            try:
                super().build_extensions()
            except Exception as error:  # a compiler torch refuses, or none at all
                warnings.warn(
                    f"prefixserve's compiled kernels were not built ({type(error).__name__}: {error}); "
                    "the pure-PyTorch paths run instead",
                    stacklevel=2,
                )
                self.failed = tuple(ext.name for ext in self.extensions)
            # What was not built is no output: the in-place copy (pip install -e .) and the wheel skip it.
            self.extensions = [ext for ext in self.extensions if ext.name not in self.failed]

        def build_extension(self, ext):
            shared_temp = self.build_temp
            self.build_temp = os.path.join(shared_temp, ext.name.rsplit(".", 1)[-1])
            try:
                super().build_extension(ext)
            except Exception as error:
                warnings.warn(
                    f"prefixserve: {ext.name} was not built ({type(error).__name__}: {error}); "
                    "prefixserve runs without it (a slower variant, or the pure-PyTorch path)",
                    stacklevel=2,
                )
                self.failed += (ext.name,)
            finally:
                self.build_temp = shared_temp

    return OptionalKernels


modules = extensions()
setup(ext_modules=modules, cmdclass={"build_ext": build_command()} if modules else {})
