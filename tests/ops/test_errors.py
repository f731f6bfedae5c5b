"""Malformed inputs raise a RuntimeError that says what is wrong, on every backend; never a crash."""
import pytest
import torch

from runner import ops

from .conftest import backend_params

BACKENDS = [pytest.param("python", "cpu", id="python"), *backend_params()]


def lin_ok():
    return (torch.zeros((4, 8), dtype=torch.int8), torch.zeros((3, 8), dtype=torch.int8),
            torch.zeros((256, 256), dtype=torch.int32))


def conv_ok():
    return (torch.zeros((2, 4, 8, 8), dtype=torch.uint8), torch.zeros((6, 2, 3, 3), dtype=torch.int8),
            torch.zeros((256, 256), dtype=torch.int32))


LINEAR_BAD = [  # (name, mutate(a, w, lut) -> args, kwargs, message fragment)
    ("a float", lambda a, w, l: ((a.float(), w, l), {}), "must be int8"),
    ("a int32", lambda a, w, l: ((a.int(), w, l), {}), "must be int8"),
    ("w uint8", lambda a, w, l: ((a, w.to(torch.uint8), l), {}), "weight codes `w` must be int8"),
    ("lut int64", lambda a, w, l: ((a, w, l.long()), {}), "int32 tensor of shape [256, 256]"),
    ("lut 255", lambda a, w, l: ((a, w, l[:255]), {}), "int32 tensor of shape [256, 256]"),
    ("lut 1-d", lambda a, w, l: ((a, w, l.reshape(-1)), {}), "int32 tensor of shape [256, 256]"),
    ("lut transposed", lambda a, w, l: ((a, w, l.t()), {}), "`lut` must be contiguous"),
    ("a strided", lambda a, w, l: ((torch.zeros((4, 16), dtype=torch.int8, device=a.device)[:, ::2], w, l), {}),
     "`a` must be contiguous"),
    ("w strided", lambda a, w, l: ((a, torch.zeros((3, 16), dtype=torch.int8, device=w.device)[:, ::2], l), {}),
     "`w` must be contiguous"),
    ("a 3-d", lambda a, w, l: ((a[None], w, l), {}), "expected a [M, K]"),
    ("K mismatch", lambda a, w, l: ((a, w[:, :5].contiguous(), l), {}), "K=8 columns but w has K=5"),
    ("algo", lambda a, w, l: ((a, w, l), {"algo": "fastest"}), "unknown algo 'fastest'"),
]

CONV_BAD = [
    ("a 3-d", lambda a, w, l: ((a[0], w, l), {}), "expected a [B, C, H, W]"),
    ("channels", lambda a, w, l: ((a, w, l), {"groups": 1}), "w expects 2 input channels"),
    ("groups", lambda a, w, l: ((a, w, l), {"groups": 3}), "groups=3 must divide"),
    ("stride 0", lambda a, w, l: ((a, w, l), {"groups": 2, "stride": 0}), "stride >= 1"),
    ("padding -1", lambda a, w, l: ((a, w, l), {"groups": 2, "padding": -1}), "padding >= 0"),
    ("too small", lambda a, w, l: ((a[:, :, :2, :2].contiguous(), w, l), {"groups": 2}), "empty"),
    ("channels_last", lambda a, w, l: ((a.to(memory_format=torch.channels_last), w, l), {"groups": 2}),
     "`a` must be contiguous"),
    ("lut", lambda a, w, l: ((a, w, l.short()), {"groups": 2}), "int32 tensor of shape [256, 256]"),
    ("algo", lambda a, w, l: ((a, w, l), {"groups": 2, "algo": ""}), "unknown algo ''"),
]


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("name,mutate,msg", LINEAR_BAD, ids=[c[0] for c in LINEAR_BAD])
def test_linear_bad_inputs(backend, device, name, mutate, msg):
    args, kw = mutate(*[t.to(device) for t in lin_ok()])
    with pytest.raises(RuntimeError, match=msg.replace("[", r"\[").replace("]", r"\]")):
        ops.lut_linear(*args, backend=backend, **kw)


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("name,mutate,msg", CONV_BAD, ids=[c[0] for c in CONV_BAD])
def test_conv_bad_inputs(backend, device, name, mutate, msg):
    args, kw = mutate(*[t.to(device) for t in conv_ok()])
    with pytest.raises(RuntimeError, match=msg.replace("[", r"\[").replace("]", r"\]")):
        ops.lut_conv2d(*args, backend=backend, **kw)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_good_inputs_pass(backend, device):
    """The baselines above are valid on every backend, so each failure is caused by its one change."""
    assert ops.lut_linear(*[t.to(device) for t in lin_ok()], backend=backend).shape == (4, 3)
    assert ops.lut_conv2d(*[t.to(device) for t in conv_ok()], groups=2, backend=backend).shape == (2, 6, 6, 6)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_lut_algos_reports_every_variant(backend, device):
    """approx::lut_algos lists each variant once; the unconditional ones apply to any shape, and
    one that does not apply says why."""
    rows = ops.algo_table(*[t.to(device) for t in lin_ok()], backend=backend)
    names = [r["algo"] for r in rows]
    assert names == list(ops.backend_algos(backend)) and len(set(names)) == len(names) and "direct" in names
    for r in rows:
        assert r["applies"] == (r["note"] == "") and (r["workspace_bytes"] is None) == (not r["applies"])
    conv = ops.algo_table(*[t.to(device) for t in conv_ok()], groups=2, backend=backend)
    assert {r["algo"] for r in conv if r["applies"]} >= {"direct"}
