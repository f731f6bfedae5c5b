"""Loads the compiled extension (runner._C) if it was built, and reports which backends exist.

Importing runner never fails because a compiled part is missing: the python backend always
works, and `approx-run info` says what is missing and how to build it."""
from __future__ import annotations

import functools

import torch

BUILD_HINT = (
    "Build it with `pip install --no-build-isolation -e .` from the repository root "
    "(needs a C++20 compiler; the CUDA kernels also need nvcc and a CUDA build of torch)."
)


@functools.lru_cache(maxsize=None)
def extension_error() -> str | None:
    """None when runner._C loaded (its TORCH_LIBRARY registrations are then live), else why not."""
    try:
        from runner import _C  # noqa: F401  (import registers the approx:: ops)
    except ImportError as exc:
        return f"the compiled extension runner._C is not importable ({exc})"
    return None


def has_kernel(op: str, dispatch_key: str) -> bool:
    if extension_error() is not None:
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"approx::{op}", dispatch_key)


def backend_status() -> dict[str, str]:
    """Backend name -> 'available' or the reason it is not."""
    return dict(_backend_status())


# Cached: asking the driver for its devices costs milliseconds, and every job of a sweep asks.
@functools.cache
def _backend_status() -> dict[str, str]:
    status = {"python": "available"}
    err = extension_error()
    if err:
        status["cpp"] = f"missing: {err}. {BUILD_HINT}"
        status["cuda"] = status["cpp"]
        return status
    status["cpp"] = "available" if has_kernel("lut_linear", "CPU") else "missing: no CPU kernels registered"
    if not has_kernel("lut_linear", "CUDA"):
        status["cuda"] = ("missing: runner._C was built without CUDA kernels "
                          "(torch without CUDA, nvcc not found, or APPROX_RUN_NO_CUDA=1 at build time)")
    elif not torch.cuda.is_available():
        status["cuda"] = "built, but no CUDA device is visible"
    else:
        status["cuda"] = "available"
    return status
