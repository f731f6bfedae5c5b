"""Where do backend=cuda and backend=cpp first differ in the converted ViT? (docs/models.md, "cuda and cpp")

    PYTHONPATH=. python benchmarks/vit_bits.py [--checkpoint CKPT.pt] [--fmnist DIR] [--images 512] [--fix on,off]

Builds model=vit (seeded random weights, or a checkpoint's: approx-run train's file, or a plain state dict),
converts it with model.approx_matmuls=true for mul8s_1L2N (every layer), for mul8u_2V0 on the products with the
exact signed table on the other layers, and for mul8u_2V0 on the products alone (the other layers fp32, as
benchmarks/vit_gpu.sh step 2 had it: their float32 GEMMs cannot agree bit for bit), with the float64 steps of
runner.float64_steps (fix on) and with torch's float32 LayerNorm, softmax and GELU as before them (fix off:
conversion without float64_steps; only this script does that), and runs the same images through the cpp model on the
CPU and the cuda model on the GPU, with a forward hook on every module. For each table and variant it prints the
first module, in the order the forwards finish, whose output differs (max |diff|, how many values), the first
quantized layer whose input codes differ, and whether the logits are equal. Then every float step alone, on the CPU
model's own input, on both devices: how many float32 outputs differ, how many of the float64 values before the
rounding, by how many float64 ulps of the tensor's largest value, and the codes those differences are expected to
change at the next quantized layer's scale, sum of min(1, |diff| / s) (what docs/models.md's probability rests on).
Without a GPU both sides run on the CPU (a dry run: nothing differs), so the script can be checked anywhere. Images:
Fashion-MNIST's test set with --fmnist (calibration on its training images), else seeded uniform noise."""
from __future__ import annotations

import argparse
import copy
import time
from collections import defaultdict

import torch
from torch import nn

import runner.layers as layers_mod
from runner.attention.quantized import QuantizedMatMul, _codes
from runner.config import compose
from runner.float64_steps import float64_steps
from runner.layers import convert_model, quantized_layers, quantized_models
from runner.models import build_model, fold_input_normalization
from runner.multipliers import resolve
from runner.quant import QuantConfig, quant_layers as quantized_layers_of, quantize_act

# (label, the products' table, the other layers' table or None to leave them fp32, as vit_gpu.sh step 2 did for
# mul8u_2V0: then the Linears and the patch conv sum in float32 in each device's order, and cannot agree)
TABLES = (("mul8s_1L2N", "mul8s_1L2N", "mul8s_1L2N"), ("mul8u_2V0 products, exact rest", "mul8u_2V0", "exact"),
          ("mul8u_2V0 products, fp32 rest", "mul8u_2V0", None))
FLOAT_STEPS = (nn.LayerNorm, nn.Softmax, nn.GELU, nn.AdaptiveAvgPool2d)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", help="trained weights of model=vit (default: seeded random weights)")
    p.add_argument("--fmnist", help="folder of the Fashion-MNIST IDX files (default: uniform noise images)")
    p.add_argument("--images", type=int, default=512)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--fix", default="on,off", help="on, off or on,off: with and/or without the float64 steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="the second side's device (cuda: backend=cuda; cpu: backend=cpp, a dry run)")
    return p.parse_args(argv)


def build(args):
    cfg = compose("train", ["model=vit", "model.approx_matmuls=true"])
    torch.manual_seed(args.seed)
    model = build_model(cfg.model, 0.286, 0.353)  # Fashion-MNIST's normalisation; a checkpoint brings its own
    if args.checkpoint:
        state = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
        model.load_state_dict(state.get("state_dict", state))
    gen = torch.Generator().manual_seed(args.seed + 1)
    if args.fmnist:
        from runner.data import load_dataset

        data = load_dataset(compose("train", ["model=vit", "data=fashion_mnist", f"data.root={args.fmnist}"]).data)
        calib, x = data.train_x, data.test_x[:args.images]
    else:
        calib, x = torch.rand(2048, 1, 28, 28, generator=gen), torch.rand(args.images, 1, 28, 28, generator=gen)
    return model.eval(), calib, x


def convert(model, calib, x, products, rest, fix: bool, backend: str, device):
    """(cpp model on the CPU, the other backend's model on device) from one calibration, as vit_gpu.sh step 2."""
    names = list(quantized_layers_of(model))
    tables = {n: resolve(products if n.endswith((".qk", ".av")) else rest or products) for n in names}
    layers = None if rest else [n for n in names if n.endswith((".qk", ".av"))]
    steps = layers_mod.float64_steps
    layers_mod.float64_steps = steps if fix else (lambda m: m)  # fix off: torch's float32 modules stay
    try:
        _, cpp, stats = quantized_models(model, tables, QuantConfig(), calib, backend="cpp", layers=layers)
        other = convert_model(fold_input_normalization(model, x[:1]), tables, QuantConfig(), stats, backend=backend,
                              layers=layers).to(device)
    finally:
        layers_mod.float64_steps = steps
    assert fix == any(type(s) is not t and isinstance(s, t) for s in cpp.modules() for t in FLOAT_STEPS[:3])
    return cpp.eval(), other.eval()


def _tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return next((t for t in out if isinstance(t, torch.Tensor)), None)
    return None


def _codes_of(module, args) -> list[torch.Tensor]:
    """The integer codes a quantized layer reads (computed on the CPU, the same way for both sides)."""
    args = [a.detach().cpu() for a in args if isinstance(a, torch.Tensor)]
    with torch.no_grad():
        if isinstance(module, QuantizedMatMul):
            (sa, sb), (xr, yr) = module.scales(*args), module._qranges()
            return [_codes(args[0], sa.cpu(), xr), _codes(args[1], sb.cpu(), yr)]
        return [quantize_act(args[0], module.input_scale(args[0]).detach().cpu(), module.signed)]


class Recorder:
    """Every module's output (forward hooks, in the order the forwards finish), the quantized layers' input codes,
    and the float steps' inputs."""

    def __init__(self, model: nn.Module):
        self.outputs, self.codes, self.step_inputs, self.hooks = [], [], [], []
        self.next_layer, self._waiting = {}, []  # float step -> the quantized layer that runs next (its scale)
        quantized = {id(m) for m in quantized_layers(model).values()}
        for name, m in model.named_modules():
            self.hooks.append(m.register_forward_hook(self._out(name or "(logits)")))
            if id(m) in quantized:
                self.hooks.append(m.register_forward_pre_hook(self._codes(name)))
            if isinstance(m, FLOAT_STEPS):
                self.hooks.append(m.register_forward_pre_hook(self._step(name)))

    def _out(self, name):
        def hook(m, args, out):
            t = _tensor(out)
            if t is not None:
                self.outputs.append((name, t.detach().cpu()))
        return hook

    def _codes(self, name):
        def hook(m, args):
            self.codes.append((name, _codes_of(m, args)))
            for step in self._waiting:
                self.next_layer.setdefault(step, float(m.input_scale(args[0])))
            self._waiting = []
        return hook

    def _step(self, name):
        def hook(m, args):
            self.step_inputs.append((name, args[0].detach().cpu()))
            self._waiting.append(name)
        return hook

    def clear(self):
        self.outputs, self.codes, self.step_inputs, self._waiting = [], [], [], []

    def remove(self):
        for h in self.hooks:
            h.remove()


def compare(cpp, other, x, batch, device):
    """Per module: [order, values differing, max |diff|, values]; per quantized layer: [order, codes differing];
    the logits of both; the float steps' CPU inputs (first batch) and the scale of the layer after each."""
    rec_a, rec_b = Recorder(cpp), Recorder(other)
    outs, codes, logits, step_inputs = {}, {}, ([], []), None
    try:
        for i in range(0, len(x), batch):
            xb = x[i:i + batch]
            with torch.no_grad():
                logits[0].append(cpp(xb))
                logits[1].append(other(xb.to(device)).cpu())
            names_a = [n for n, _ in rec_a.outputs]
            if names_a != [n for n, _ in rec_b.outputs]:
                raise SystemExit("the two models' modules ran in different orders: " + str(names_a[:5]))
            for order, ((name, a), (_, b)) in enumerate(zip(rec_a.outputs, rec_b.outputs)):
                s = outs.setdefault(name, [order, 0, 0.0, 0])
                differ = a != b if a.is_floating_point() else a.ne(b)
                n = int(differ.sum())
                s[1] += n
                s[3] += a.numel()
                if n:
                    s[2] = max(s[2], float((a.double() - b.double()).abs().max()))
            for order, ((name, ca), (_, cb)) in enumerate(zip(rec_a.codes, rec_b.codes)):
                s = codes.setdefault(name, [order, 0])
                s[1] += sum(int((p.int() != q.int()).sum()) for p, q in zip(ca, cb))
            if step_inputs is None:
                step_inputs = [(n, t, rec_a.next_layer.get(n)) for n, t in rec_a.step_inputs]
            rec_a.clear(), rec_b.clear()
    finally:
        rec_a.remove(), rec_b.remove()
    return outs, codes, (torch.cat(logits[0]), torch.cat(logits[1])), step_inputs


def _float64_ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in float64 ulps of a's largest |value| (a result much smaller than its terms, as GELU's far
    negative tail, is many ulps of itself off: far from any code boundary but 0's, and harmless)."""
    top = a.abs().max()
    return float((a - b).abs().max() / (torch.nextafter(top, torch.tensor(float("inf"), dtype=a.dtype)) - top))


def probe_steps(cpp, other, step_inputs, device):
    """Each float step alone on the CPU model's input, on the CPU and on the device: values differing in float32
    (the module as converted) and in float64 (the float64 twin before its rounding), max float64 ulps apart."""
    mods_a, mods_b = dict(cpp.named_modules()), dict(other.named_modules())
    # values, float32 differing, float64 differing, max ulps, float64->32 differing, expected changed codes
    per_kind = defaultdict(lambda: [0, 0, 0, 0.0, 0, 0.0])
    for name, inp, scale in step_inputs:
        ma, mb = mods_a[name], mods_b[name]
        kind = type(ma).__name__
        twin = float64_steps(nn.Sequential(copy.deepcopy(ma)))[0]  # float64 in, float64 out: before any rounding
        twin_b = copy.deepcopy(twin).to(device)
        with torch.no_grad():
            a32, b32 = ma(inp), mb(inp.to(device)).cpu()
            a64, b64 = twin(inp.double()), twin_b(inp.double().to(device)).cpu()
        s = per_kind[kind]
        s[0] += inp.numel() if kind != "Float64GlobalAvgPool" else a32.numel()
        s[1] += int((a32 != b32).sum())
        s[2] += int((a64 != b64).sum())
        s[3] = max(s[3], _float64_ulps(a64, b64) if a64.numel() else 0.0)
        s[4] += int((a64.float() != b64.float()).sum())
        if scale:
            s[5] += float(((a64 - b64).abs() / scale).clamp(max=1).sum())
    return per_kind


def forward_seconds(model, x, batch, device, repeats=5) -> float:
    """Median time of a whole pass over x (no hooks), for the cost of the float64 steps on the device."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    with torch.no_grad():
        for _ in range(repeats + 1):
            sync()
            t0 = time.perf_counter()
            for i in range(0, len(x), batch):
                model(x[i:i + batch].to(device))
            sync()
            times.append(time.perf_counter() - t0)
    return sorted(times[1:])[repeats // 2]


def report(table, fix, outs, codes, logits, per_kind):
    a, b = logits
    print(f"\n== {table}, fix {'on' if fix else 'off'}: logits equal: {torch.equal(a, b)} "
          f"(max |diff| {(a - b).abs().max().item():.3g}, {int((a != b).any(dim=1).sum())} of {len(a)} images differ, "
          f"predictions differ on {int((a.argmax(1) != b.argmax(1)).sum())})")
    differ = sorted((s[0], name, s) for name, s in outs.items() if s[1])
    if differ:
        order, name, s = differ[0]
        print(f"first module whose output differs: {name} (#{order} in finishing order): {s[1]} of {s[3]} values, "
              f"max |diff| {s[2]:.3g}; {len(differ)} of {len(outs)} modules differ")
        for _, n, t in differ[1:6]:
            print(f"   then {n}: {t[1]} of {t[3]} values, max |diff| {t[2]:.3g}")
    else:
        print(f"no module's output differs ({len(outs)} modules)")
    flipped = sorted((s[0], name, s[1]) for name, s in codes.items() if s[1])
    print(f"first quantized layer whose input codes differ: {flipped[0][1]} ({flipped[0][2]} codes; "
          f"{len(flipped)} layers)" if flipped else f"no quantized layer's input codes differ ({len(codes)} layers)")
    print("each float step alone on the same (CPU) input, first batch: values | float32 outputs differing | "
          "float64 differing | max float64 ulps (of the largest value) apart | float64->32 differing | "
          "expected changed codes at the next layer")
    for kind, (n, d32, d64, ulps, r32, flips) in sorted(per_kind.items()):
        print(f"   {kind:22s} {n:10d} | {d32:8d} | {d64:8d} | {ulps:6.1f} | {r32:6d} | {flips:.2g}")


def main(argv=None):
    args = parse(argv)
    device = torch.device(args.device)
    backend = "cuda" if device.type == "cuda" else "cpp"
    print(f"torch {torch.__version__}; cpp on the CPU vs {backend} on {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else " (a dry run)"))
    model, calib, x = build(args)
    print(f"model=vit {'from ' + args.checkpoint if args.checkpoint else f'random weights (seed {args.seed})'}; "
          f"{len(x)} {'Fashion-MNIST test' if args.fmnist else 'noise'} images")
    for table, products, rest in TABLES:
        for fix in [v.strip() == "on" for v in args.fix.split(",")]:
            t0 = time.perf_counter()
            cpp, other = convert(model, calib, x, products, rest, fix, backend, device)
            outs, codes, logits, steps = compare(cpp, other, x, args.batch, device)
            report(table, fix, outs, codes, logits, probe_steps(cpp, other, steps, device))
            ms = 1e3 * forward_seconds(other, x, args.batch, device)
            print(f"{backend} model's pass over the {len(x)} images on {device.type}: {ms:.1f} ms "
                  f"({time.perf_counter() - t0:.1f} s in all)")


if __name__ == "__main__":
    main()
