"""Shared helpers for the op tests: random LUTs and codes, the backends this build can run."""
import pytest
import torch

from runner import _ext
from runner.multipliers.core import exact_lut  # noqa: F401  (re-exported for the op tests)


def compiled_backends():
    """(backend, device) pairs whose kernels exist here; CUDA joins when built and visible."""
    out = []
    status = _ext.backend_status()
    if status["cpp"] == "available":
        out.append(("cpp", "cpu"))
    if status["cuda"] == "available":
        out.append(("cuda", "cuda"))
    return out


BACKENDS = compiled_backends()
needs_compiled = pytest.mark.skipif(not BACKENDS, reason="runner._C not built")


def backend_params():
    """pytest params over the compiled backends (the CUDA one carries the `cuda` marker)."""
    return [pytest.param(b, d, id=b, marks=[pytest.mark.cuda] if b == "cuda" else [])
            for b, d in BACKENDS] or [pytest.param("cpp", "cpu", id="cpp", marks=needs_compiled)]


def cpp_only(backend, *algos):
    """The CPU-only variants among algos where the backend is cpp, else none."""
    return algos if backend == "cpp" else ()


def random_lut(gen, lo=-(2**15), hi=2**15):
    """A random (non-exact) multiplier table; lut[0][0], lut[128][128] and lut[a][0] are non-zero,
    so padding and zero weights are checked too."""
    lut = torch.randint(lo, hi, (256, 256), generator=gen, dtype=torch.int32)
    lut[lut == 0] = 1
    return lut


def codes(gen, shape, signed):
    if signed:
        return torch.randint(-128, 128, shape, generator=gen, dtype=torch.int8)
    return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)


def weights(gen, shape):
    return torch.randint(-128, 128, shape, generator=gen, dtype=torch.int8)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)
