"""Builds runner._C ahead of time: CPU kernels always, CUDA kernels when torch has CUDA and nvcc exists.

Environment:
  APPROX_RUN_NO_CUDA=1     skip the CUDA kernels even where they could be built (faster dev builds)
  CUDA_HOME                the CUDA toolkit to use; otherwise found from the real nvcc (see _find_cuda_home)
  TORCH_CUDA_ARCH_LIST     GPU architectures (default "8.0;9.0")
"""
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent.resolve()
CSRC = Path("extensions") / "csrc"


def _log(msg):
    print(f"[approx-run setup] {msg}", file=sys.stderr)


def _find_cuda_home():
    """The real toolkit root. `nvcc` on PATH may be a wrapper script, so torch's guess
    (dirname of `which nvcc`) can point at a directory without lib64/libcudart; ask nvcc
    itself, whose --dryrun prints the toolkit's TOP."""
    env = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if env and Path(env, "bin", "nvcc").exists():
        return env
    nvcc = shutil.which("nvcc")
    candidates = []
    if nvcc:
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "x.cu"
            src.write_text("__global__ void k() {}\n")
            try:
                out = subprocess.run(
                    [nvcc, "--dryrun", "-c", str(src), "-o", str(Path(tmp) / "x.o")],
                    capture_output=True, text=True, timeout=60,
                )
                m = re.search(r"^#\$ TOP=(.+)$", out.stdout + out.stderr, re.M)
                if m:
                    candidates.append(m.group(1).strip().strip('"'))
            except (OSError, subprocess.SubprocessError):
                pass
        candidates.append(str(Path(os.path.realpath(nvcc)).parent.parent))
    candidates += ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    for c in candidates:
        c = os.path.realpath(c)
        if Path(c, "bin", "nvcc").exists() and (
            glob.glob(f"{c}/lib64/libcudart*") or glob.glob(f"{c}/lib/libcudart*")
            or glob.glob(f"{c}/targets/*/lib/libcudart*")
        ):
            return c
    return None


def _extensions():
    import torch
    from torch.utils import cpp_extension

    # -ffp-contract=off: fp32 a*b+c rounds twice, as in eager PyTorch (approx::dequantize matches it)
    cxx_flags = ["-O3", "-std=c++20", "-fopenmp", "-DNDEBUG", "-ffp-contract=off"]
    sources = [str(CSRC / "ops.cpp")] + sorted(str(p) for p in (CSRC / "cpu").glob("*.cpp"))
    # cuda/: kernels (.cu, nvcc) and their host-only parts (.cpp), built only with CUDA
    cuda_sources = sorted(str(p) for p in (CSRC / "cuda").glob("*.cu"))
    cuda_sources += sorted(str(p) for p in (CSRC / "cuda").glob("*.cpp")) if cuda_sources else []

    use_cuda = False
    if os.environ.get("APPROX_RUN_NO_CUDA", "0") == "1":
        _log("APPROX_RUN_NO_CUDA=1: building the CPU kernels only")
    elif not torch.version.cuda:
        _log("this torch has no CUDA: building the CPU kernels only")
    elif not cuda_sources:
        _log("no CUDA sources: building the CPU kernels only")
    else:
        home = _find_cuda_home()
        if home is None:
            _log("nvcc / CUDA toolkit not found: building the CPU kernels only")
        else:
            os.environ["CUDA_HOME"] = home
            cpp_extension.CUDA_HOME = home  # torch caches its own (possibly wrong) guess at import
            use_cuda = True
            _log(f"building CUDA kernels with the toolkit at {home}")
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")

    if use_cuda:
        ext = cpp_extension.CUDAExtension(
            "runner._C",
            sources + cuda_sources,
            extra_compile_args={
                "cxx": cxx_flags + ["-DAPPROX_WITH_CUDA"],
                "nvcc": ["-O3", "-std=c++20", "--use_fast_math", "-lineinfo", "-DAPPROX_WITH_CUDA"],
            },
            extra_link_args=["-fopenmp"],
            py_limited_api=False,
        )
    else:
        ext = cpp_extension.CppExtension(
            "runner._C", sources, extra_compile_args={"cxx": cxx_flags}, extra_link_args=["-fopenmp"],
        )
    return [ext], cpp_extension.BuildExtension


exts, build_ext = _extensions()
os.environ.setdefault("MAX_JOBS", "2")
setup(ext_modules=exts, cmdclass={"build_ext": build_ext.with_options(use_ninja=True)})
