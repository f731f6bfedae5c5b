"""One LeNet-5 training step, TorchApprox's and ours, in one process: the comparison of the retraining speed.

TorchApprox (etrommer/torch-approx, its own CUDA backend, JIT-built by torch at import): LeNet-5 wrapped with
`wrap_quantizable`, `prepare_qat`, calibrated on 512 random images with its observers on, observers off,
then trained in its approximate mode (a [256, 256] int32 table already on the GPU, set on every layer) and
in its quantized mode (its fake-quant). Ours: benchmarks/train_step.py's paths (fp32, fake-quant, approx
with grad=ste and grad=lut) in its modes (plain: the loop anyone writes; eager / graph: runner.train_step,
what `approx-run finetune` runs). Every step: forward, cross-entropy, backward, optimizer step (SGD momentum
0.9 or Adam, lr 1e-4), timed alone with CUDA events after --warmup steps, median and min of --repeats;
per_step_ms: the mean of --repeats back-to-back steps. Batches 32 and 256. x_fp32: over our fp32 step in
plain mode at the same batch and optimizer; x_torchapprox: over TorchApprox's step of the same kind (approx
for our approx paths, fake-quant for our fake-quant) at the same batch and optimizer.

    TORCH_CUDA_ARCH_LIST=9.0 python benchmarks/torchapprox_step.py --torchapprox .data/torch-approx/src \\
        --csv benchmarks/torchapprox_step_h100.csv

Without the package installed (a plain source tree on PYTHONPATH), its `__init__` cannot read its version
from the installed metadata; the harness then reports "source" as its version. Timing only: untrained
weights, a fixed random batch."""
from __future__ import annotations

import argparse
import importlib.metadata as metadata
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers import import_torchapprox  # noqa: E402
from runner.models import LeNet5  # noqa: E402
from train_step import MODES, PATHS, measure, report, time_step  # noqa: E402


def torchapprox_lenet(ta, mode: str, device: torch.device, seed: int = 0) -> torch.nn.Module:
    """LeNet-5 (ours, same initial weights as our paths) converted the way TorchApprox's own benchmarks do:
    wrap_quantizable, prepare_qat, calibrated (observers on), observers off; mode "approx" multiplies through
    the exact table (on the GPU), "fakequant" runs its quantized (fake-quant) forward."""
    from torch.ao.quantization import disable_observer, prepare_qat

    torch.manual_seed(seed)
    net = ta.wrap_quantizable(LeNet5(mean=0.1307, std=0.3081)).train()
    with warnings.catch_warnings():  # torch.ao.quantization's deprecation notice, once per model
        warnings.simplefilter("ignore", DeprecationWarning)
        prepare_qat(net, ta.tal.layer_mapping_dict(), inplace=True)
    net.to(device)
    layers = [m for _, m in ta.get_approx_modules(net)]
    for m in layers:
        m.inference_mode = ta.tal.InferenceMode.QUANTIZED
    calib = torch.rand(512, 1, 28, 28, generator=torch.Generator().manual_seed(seed)).to(device)
    with torch.no_grad():
        for part in calib.split(128):
            net(part)
    net.apply(disable_observer)
    lut = torch.from_numpy(ta.tal.ApproxLayer.accurate_lut()).int().contiguous().to(device)
    for m in layers:
        m.inference_mode = ta.tal.InferenceMode.APPROXIMATE if mode == "approx" else ta.tal.InferenceMode.QUANTIZED
        m.lut = lut
    return net.train()


def torchapprox_row(ta, mode, optimizer, x, y, device, args) -> dict:
    net = torchapprox_lenet(ta, mode, device)
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=1e-4, momentum=0.9) if optimizer == "sgd" else torch.optim.Adam(params, lr=1e-4)

    def step(xb, yb):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(net(xb), yb).backward()
        opt.step()

    res = time_step(step, x, y, device, args.warmup, args.repeats)
    return {"impl": "torchapprox", "path": "approx" if mode == "approx" else "fakequant", "backend": "torchapprox",
            "device": str(device), "batch": len(x), "optimizer": optimizer, "mode": "plain", "step_mode": "eager",
            "threads": torch.get_num_threads(), "repeats": args.repeats, **res}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--torchapprox", default=".data/torch-approx/src", help="TorchApprox's src/ directory")
    ap.add_argument("--batches", default="32,256")
    ap.add_argument("--optimizers", default="sgd,adam")
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--multiplier", default="mul8u_T83", help="our approx paths' table")
    ap.add_argument("--learn-scales", default="true", choices=("true", "false"))
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--profile", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--csv", default=None)
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    ta = import_torchapprox(args.torchapprox)
    print(f"GPU {torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
          f"torchapprox {metadata.version('torchapprox')} from {args.torchapprox}")
    gen = torch.Generator().manual_seed(1)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        x = torch.rand(batch, 1, 28, 28, generator=gen).to(device)
        y = torch.randint(0, 10, (batch,), generator=gen).to(device)
        for optimizer in args.optimizers.split(","):
            for mode in ("approx", "fakequant"):
                rows.append(torchapprox_row(ta, mode, optimizer, x, y, device, args))
            for path in args.paths.split(","):
                for mode in args.modes.split(","):
                    rows.append(measure(path, mode, optimizer, x, y, device, "cuda", args))
    key = {(r["batch"], r["optimizer"]): r["step_ms_median"] for r in rows
           if r["impl"] == "approx-run" and r["path"] == "fp32" and r["mode"] == "plain"}
    ta_ms = {(r["batch"], r["optimizer"], r["path"]): r["step_ms_median"] for r in rows if r["impl"] == "torchapprox"}
    for r in rows:
        ref = key.get((r["batch"], r["optimizer"]))
        r["x_fp32"] = r["step_ms_median"] / ref if ref else float("nan")
        kind = "fakequant" if r["path"] == "fakequant" else "approx" if r["path"].startswith("approx") else None
        ta_ref = ta_ms.get((r["batch"], r["optimizer"], kind))
        r["x_torchapprox"] = r["step_ms_median"] / ta_ref if ta_ref else float("nan")
    report(rows, args.csv)


if __name__ == "__main__":
    main()
