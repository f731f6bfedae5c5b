"""Shared helpers for the op tests: random LUTs and codes, the backends this build can run."""
import pytest
import torch

from runner import _ext
from runner.reference import as_pair
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


def taps_of(a, kernel, stride, padding, dilation):
    """im2col: [B, C kh kw, Ho, Wo], tap (c, ky, kx) of each output pixel, code 0 in the padding."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = kernel, *(as_pair(v, '') for v in (stride, padding, dilation))
    b, c, h, w = a.shape
    hp, wp = h + 2 * ph, w + 2 * pw
    ho, wo = (hp - dh * (kh - 1) - 1) // sh + 1, (wp - dw * (kw - 1) - 1) // sw + 1
    padded = torch.nn.functional.pad(a, (pw, pw, ph, ph)).contiguous()
    view = padded.as_strided((b, c, kh, kw, ho, wo), (c * hp * wp, hp * wp, dh * wp, dw, sh * wp, sw))
    return view.reshape(b, c * kh * kw, ho, wo).contiguous()
