"""Builds prefixserve's compiled CPU kernels (prefixserve/csrc/) at install time; metadata lives in pyproject.toml.

The extension is optional: where it cannot be built (no compiler), the install still succeeds
and prefixserve.model.kernels logs a warning and runs the pure-PyTorch reference paths.
-march=native: the kernels are built for the machine that installs them (pip install -e . here).
-ffp-contract=off: no multiply-add is fused behind the code's back. A row's bits must not depend on
where its sums were inlined (csrc/paged_causal.cpp computes a row alone or in a block of rows); gcc
fusing a scalar multiply-add in one place and not another broke that once (1-ulp differences).
"""

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

setup(
    ext_modules=[
        CppExtension(
            "prefixserve._C",
            ["prefixserve/csrc/module.cpp", "prefixserve/csrc/paged_causal.cpp", "prefixserve/csrc/rowwise.cpp"],
            depends=["prefixserve/csrc/attention_tiles.h", "prefixserve/csrc/kernels.h", "prefixserve/csrc/rowwise.h"],
            extra_compile_args=["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"],
            extra_link_args=["-fopenmp"],
            optional=True,
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
