"""Build: the C++ CPU reference always; the CUDA kernels only where they can run (never required).

CUDA kernels (``sage_compile._sm90``: Hopper wgmma; ``sage_compile._sm89``: INT4 QK on mma.sync, for Ampere and
Ada — also built for Hopper, where it runs emulated, for its tests) are built when nvcc is found and an arch they target is
named or present:
  SAGE_CUDA_ARCHS="90a"   build for these archs (";"- or ","-separated; "" or "none": build no CUDA);
  unset                   the archs of the GPUs nvidia-smi lists.
With no nvcc, no GPU and no SAGE_CUDA_ARCHS — a CPU machine — only the CPU reference is built, and a
CUDA build that fails is reported and skipped, so `pip install` never fails for CUDA.
"""
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor

from pybind11 import get_include as pybind11_include
from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import Extension, setup

cpu_flags = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-fast-math"]

SM90_SOURCES = ["csrc/sm90/binding.cpp", "csrc/sm90/attention.cu"]
# The kernel instantiations and their table: generated into the build directory at build time (one .cu per group,
# compiled in parallel with the rest) by this script's generate(out_dir).
SM90_GENERATOR = "csrc/sm90/instantiations.py"
COMMON = "csrc/common"  # headers every CUDA extension may include (binding_args.h)
SM89_SOURCES = ["csrc/sm89/binding.cpp", "csrc/sm89/attention.cu"]
KERNEL_ARCHS = {"_sm90": {"90a"}, "_sm89": {"80", "86", "89", "90a"}}  # extension → archs it has code for


def _nvcc():
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
        return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


def _requested_archs():
    """Archs named by SAGE_CUDA_ARCHS, else those of the visible GPUs (9.0 → 90a: wgmma needs sm_90a)."""
    named = os.environ.get("SAGE_CUDA_ARCHS")
    if named is not None:
        return {a.strip() for a in named.replace(",", ";").split(";") if a.strip() and a.strip() != "none"}
    try:
        caps = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return set()
    archs = set()
    for cap in caps:
        major, _, minor = cap.strip().partition(".")
        if major.isdigit() and minor.isdigit():
            archs.add(f"{major}{minor}" + ("a" if (major, minor) == ("9", "0") else ""))
    return archs


class NvccExtension(Extension):
    """A pybind11 module whose sources nvcc compiles and links (CUDA runtime linked statically). ``generator``: a
    script whose ``generate(out_dir)`` writes more sources into the build directory and returns their paths."""

    def __init__(self, name, sources, archs, generator=None):
        super().__init__(name, sources)
        self.archs = sorted(archs)
        self.generator = generator


def _generated_sources(generator, out_dir):
    spec = importlib.util.spec_from_file_location("_sage_generator", generator)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.generate(out_dir)


def _run(cmd):
    print(" ".join(cmd))
    subprocess.run(cmd, check=True)


class BuildExt(build_ext):
    def build_extension(self, ext):
        if not isinstance(ext, NvccExtension):
            return super().build_extension(ext)
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        objects_dir = os.path.join(self.build_temp, ext.name)
        os.makedirs(objects_dir, exist_ok=True)
        gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in ext.archs]
        include_dirs = sorted({os.path.abspath(os.path.dirname(src)) for src in ext.sources} | {os.path.abspath(COMMON)})
        flags = ["-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-I", pybind11_include(),
                 "-I", sysconfig.get_paths()["include"], *(f"-I{d}" for d in include_dirs), *gencode]
        # One nvcc per source, in parallel (MAX_JOBS, default every core): the kernel files take the time.
        jobs = int(os.environ.get("MAX_JOBS", "0")) or os.cpu_count() or 1
        try:  # never fail the install for CUDA: a failed generator or nvcc leaves the Triton/CPU kernels
            sources = list(ext.sources)
            if ext.generator is not None:
                sources += _generated_sources(ext.generator, os.path.join(objects_dir, "generated"))
            objects = [os.path.join(objects_dir, os.path.basename(src) + ".o") for src in sources]
            with ThreadPoolExecutor(max_workers=jobs) as pool:
                list(pool.map(_run, [[_nvcc(), "-c", src, "-o", obj, *flags] for src, obj in zip(sources, objects)]))
            _run([_nvcc(), *objects, "-o", target, "-shared", "--cudart", "static", *gencode])
        except Exception as err:  # noqa: BLE001 (nvcc, the generator, the file system: all optional for CUDA)
            print(f"WARNING: building {ext.name} failed ({err}); the Triton/CPU kernels remain", file=sys.stderr)


ext_modules = [
    Pybind11Extension(
        "sage_compile._C",
        ["csrc/cpu/reference.cpp", "csrc/cpu/backward.cpp"],
        cxx_std=17,
        extra_compile_args=cpu_flags,
        extra_link_args=["-fopenmp"],
    )
]
if _nvcc():
    archs = _requested_archs()
    if archs & KERNEL_ARCHS["_sm90"]:
        ext_modules.append(NvccExtension("sage_compile._sm90", SM90_SOURCES, archs & KERNEL_ARCHS["_sm90"],
                                          generator=SM90_GENERATOR))
    if archs & KERNEL_ARCHS["_sm89"]:
        ext_modules.append(NvccExtension("sage_compile._sm89", SM89_SOURCES, archs & KERNEL_ARCHS["_sm89"]))

setup(
    packages=["sage_compile", "sage_compile.numerics", "sage_compile.kernels", "sage_compile.kernels.backward",
              "sage_compile.policy", "sage_compile.ops", "sage_compile.integrations", "sage_compile.passes",
              "sage_compile.bench"],
    package_dir={"sage_compile": "sage_compile", "sage_compile.passes": "passes", "sage_compile.bench": "bench"},
    ext_modules=ext_modules,
    cmdclass={"build_ext": BuildExt},
)
