"""Builds prefixserve's compiled CPU kernels (prefixserve/csrc/) at install time; metadata lives in pyproject.toml.

The extension is optional: where it cannot be built (no compiler), the install still succeeds
and prefixserve.model.kernels logs a warning and runs the pure-PyTorch reference paths.
-march=native: the kernels are built for the machine that installs them (pip install -e . here).
-ffp-contract=off: no multiply-add is fused behind the code's back; where two paths must give a
row the same bits (csrc/paged_attention.cpp's decode and transposed paths) fusing one and not the
other broke that (measured: 1-ulp differences until this flag).
"""

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

setup(
    ext_modules=[
        CppExtension(
            "prefixserve._C",
            ["prefixserve/csrc/paged_attention.cpp"],
            extra_compile_args=["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"],
            extra_link_args=["-fopenmp"],
            optional=True,
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
