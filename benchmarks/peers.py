"""Other projects' approximate-multiplier kernels, loaded from their source trees for same-process benchmarks
(benchmarks/torchapprox_step.py, benchmarks/peers_conv.py). Nothing of theirs is vendored here: each loader takes
the directory of a checkout (or `git archive` export) and builds the peer's extension with torch's JIT
(torch.utils.cpp_extension.load, cached under TORCH_EXTENSIONS_DIR; TORCH_CUDA_ARCH_LIST picks the GPU arch).

TorchApprox (etrommer/torch-approx): `src/`; its own `torchapprox.operators.backend` JIT-builds its backend at
import (CPU GEMM always, CUDA GEMM and depthwise conv when a GPU is visible).
ApproxTorch (woshimark666/ApproxTorch): the repository root; its setup.py builds all of approxtorch/backend/csrc
with nvcc -arch=native -O3 --split-compile=0. Here only the two files its maintained conv path calls are JIT-built
(same nvcc flags but the arch; the LUT BGEMM, csrc/claude/bgemm_float_claude.cu, and the u8 im2col,
csrc/claude/bgemm_lre_backward_claude.cu), and its op wrappers (approxtorch/backend/ops.py, which imports nothing
but torch) are loaded from the file, without importing the approxtorch package (whose __init__ needs the full
setup.py build)."""
from __future__ import annotations

import glob
import importlib.metadata as metadata
import importlib.util
import os
import sys
import types
from pathlib import Path


def _torchapprox_on_path(src: str) -> None:
    """Puts TorchApprox's src/ first on sys.path. Without the package installed its `__init__` cannot read its
    version from the installed metadata; "source" is reported instead."""
    path = str(Path(src).resolve())
    if path not in sys.path:
        sys.path.insert(0, path)
    try:
        metadata.version("torchapprox")
    except metadata.PackageNotFoundError:  # not installed: its __init__ asks the metadata for its version
        real = metadata.version
        if not getattr(real, "_torchapprox_source", False):
            def version(name, _real=real):
                return "source" if name == "torchapprox" else _real(name)
            version._torchapprox_source = True
            metadata.version = version


def import_torchapprox(src: str) -> types.SimpleNamespace:
    """TorchApprox's layer modules from a source tree (its backend compiles on first import: a minute or two)."""
    _torchapprox_on_path(src)
    import torchapprox.layers as tal
    from torchapprox.utils.conversion import get_approx_modules, wrap_quantizable

    return types.SimpleNamespace(tal=tal, get_approx_modules=get_approx_modules, wrap_quantizable=wrap_quantizable)


def import_torchapprox_conv(src: str) -> types.ModuleType:
    """TorchApprox's conv operator module (torchapprox.operators.conv2d: Conv2dArgs, _im2col_conv2d, the
    approx GEMM it calls through `backend.approx`); importing it builds the backend."""
    _torchapprox_on_path(src)
    import torchapprox.operators.conv2d as conv2d

    return conv2d


def _cuda_include_fallback() -> list[str]:
    """Header folders for a CUDA toolkit without the math libraries' headers (ATen/cuda/CUDAContext.h includes
    cusparse.h and cublas_v2.h): those of the pip wheels torch depends on (site-packages/nvidia/*/include), only
    when CUDA_HOME's include/ lacks cusparse.h."""
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME and os.path.exists(os.path.join(CUDA_HOME, "include", "cusparse.h")):
        return []
    import torch

    site = Path(torch.__file__).resolve().parent.parent
    return sorted({str(Path(p).parent) for p in glob.glob(str(site / "nvidia" / "*" / "include" / "cusparse.h"))})


def load_approxtorch(src: str, verbose: bool = False) -> types.ModuleType:
    """ApproxTorch's op wrappers (approxtorch/backend/ops.py as a standalone module) with the CUDA ops its conv
    layers call JIT-built and registered under torch.ops.approxtorch: im2col_u8, bgemm_fake_int8_claude(_save),
    bgemm_fake_uint8_claude. Needs nvcc and a CUDA build of torch (it compiles whether or not a GPU is visible)."""
    from torch.utils.cpp_extension import load

    root = Path(src).resolve()
    csrc = root / "approxtorch" / "backend" / "csrc" / "claude"
    sources = [csrc / "bgemm_float_claude.cu", csrc / "bgemm_lre_backward_claude.cu"]
    for s in sources:
        if not s.exists():
            raise FileNotFoundError(f"ApproxTorch source {s} is missing (expects the repository root)")
    load(name="approxtorch_conv_peer", sources=[str(s) for s in sources],
         extra_include_paths=[str(csrc), *_cuda_include_fallback()],
         extra_cuda_cflags=["-O3", "--split-compile=0"], is_python_module=False, verbose=verbose)
    spec = importlib.util.spec_from_file_location("approxtorch_peer_ops", root / "approxtorch" / "backend" / "ops.py")
    ops = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ops)
    return ops
