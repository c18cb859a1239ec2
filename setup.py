"""Builds prefixserve's compiled CPU kernels (prefixserve/csrc/) at install time; metadata lives in pyproject.toml.

The extension is optional: where it cannot be built (no compiler), the install still succeeds
and prefixserve.model.kernels logs a warning and runs the pure-PyTorch reference paths.
-march=native: the kernels are built for the machine that installs them (pip install -e . here).
"""

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

setup(
    ext_modules=[
        CppExtension(
            "prefixserve._C",
            ["prefixserve/csrc/paged_decode.cpp"],
            extra_compile_args=["-O3", "-march=native", "-fopenmp"],
            extra_link_args=["-fopenmp"],
            optional=True,
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
