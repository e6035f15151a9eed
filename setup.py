"""Build: the C++ CPU reference always; CUDA kernels only for archs present or named (never required).

SAGE_CUDA_ARCHS="90a;89" names CUDA archs to build; unset, archs of visible GPUs are used; with neither
(or no nvcc) only the CPU reference is built.
"""
import os

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup

cpu_flags = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-fast-math"]

ext_modules = [
    Pybind11Extension(
        "sage_compile._C",
        ["csrc/cpu/reference.cpp"],
        cxx_std=17,
        extra_compile_args=cpu_flags,
        extra_link_args=["-fopenmp"],
    )
]

setup(
    packages=["sage_compile", "sage_compile.kernels", "sage_compile.integrations", "sage_compile.passes"],
    package_dir={"sage_compile": "sage_compile", "sage_compile.passes": "passes"},
    ext_modules=ext_modules,
)
