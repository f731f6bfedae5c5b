"""Approximation-aware retraining: train the converted model through its LUT layers.

`approx-run finetune` is `approx-run compare` plus one more path, `approx_finetuned`: the approx model
(the baseline's weights in LUT layers) trained `finetune.epochs` with the approximate forward, its static
activation scales recalibrated, then evaluated like the others. Its row sits beside the `approx` row of
the same configuration in results.csv. compare and sweep take the same `finetune` group; there
finetune.epochs=0 (their default) means no retraining.

The retrained weights are a checkpoint of their own, named from everything that determines them
(baseline, each layer's LUT, quant scheme, approximated layers, finetune settings), written atomically
and reused by the next run with the same configuration (finetune.force=true retrains)."""
from __future__ import annotations

import copy
import hashlib
import io
import json
import math
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
import torch.nn.functional as F
from torch import nn

from runner.code_map import fit_code_maps
from runner.console import console, progress_bar
from runner.errors import UserError, config_number
from runner.layer_checks import check_non_finite_inputs
from runner.layers import _Approx, _FakeQuant, learn_act_scales, quantized_layers, set_grad_mode
from runner.ops_autograd import GRADS
from runner.provenance import atomic_write_bytes
from runner.quant import QuantConfig, calibrate
from runner.store import write_csv
from runner.train_step import TrainStep, read_input_flags

OPTIMIZERS = ("adam", "sgd")
SCHEDULES = ("constant", "cosine")
# When the static activation scales are recalibrated from the retrained model's own activations:
#   epoch  before every epoch after the first, so the last epoch trains with the final scales
#   end    once after training (the weights never see the new scales: measured worse, see docs)
#   none   keep the baseline's calibration
RECALIBRATE = ("none", "epoch", "end")
# When each LUT layer's mean output error (against the exact product of the same codes) is folded into its bias:
#   before  on the converted weights, so training starts from an unbiased model
#   after   on the retrained weights (training already absorbs some of the mean error into the bias)
#   both    before and after;  none: never
BIAS_CORRECTION = ("none", "before", "after", "both")
# images (a seeded subset of the training set) the mean output errors are measured on
BIAS_CORRECTION_IMAGES = 2000
# the nested `finetune.distill` node, as flat fields (flat so the row's finetune_* columns stay scalars)
DISTILL_KEYS = {"alpha": "distill_alpha", "temperature": "distill_temperature"}
# finetune keys that say how to run, not what to train: outside FinetuneConfig, so they name no checkpoint
# and no finetune setting column. force: retrain although a checkpoint exists; cuda_graph: the step as one CUDA
# graph on a GPU (runner.train_step; ignored on the CPU); devices: the ranks of a distributed retraining
# (runner.distributed); resume: continue from the last finished epoch's resume state; lr_scaling: the
# learning rate's rule over the ranks (it names the checkpoint only where it changes the learning rate).
RUN_KEYS = ("force", "cuda_graph", "devices", "resume", "lr_scaling")
# On a GPU the step's loss and accuracy stay on the device; the host reads them (and whether a loss was
# non-finite) every this many steps and at the end of each epoch, not every step.
READ_EVERY = 50


@dataclass(frozen=True)
class FinetuneConfig:
    epochs: int = 3
    lr: float = 5e-3
    optimizer: str = "adam"        # adam | sgd (momentum 0.9)
    grad: str = "ste"              # ste | lut (see runner.ops)
    slope_window: int = 48         # lut: slopes over +-slope_window codes (validated; 1 = central difference)
    batch_size: int = 16
    schedule: str = "cosine"       # cosine | constant, after warmup_epochs of linear warm-up
    warmup_epochs: float = 0.0
    weight_decay: float = 0.0
    learn_scales: bool = True      # static activation scales trained with the weights (LSQ gradient, log scale)
    recalibrate: str = "none"      # none | epoch | end (RECALIBRATE; measured: recalibrating hurts)
    distill_alpha: float = 0.0     # loss = (1 - alpha) CE(labels) + alpha T^2 KL(teacher_T || student_T)
    distill_temperature: float = 4.0
    bias_correction: str = "none"  # none | before | after | both (BIAS_CORRECTION)
    act_scale_factor: float = 0.25  # static activation scales times this before training (< 1: codes pushed up)
    weight_scale_factor: float = 0.85  # weight scales factor * max|w| / 127 while training (< 1: codes pushed up)
    code_map: bool = True          # each layer stores the codes nearest its table's exact products (runner.code_map)

    def __post_init__(self):
        for key, low, kind in (("epochs", 0, int), ("slope_window", 1, int), ("batch_size", 1, int),
                               ("lr", 0, float), ("weight_decay", 0, float), ("warmup_epochs", 0, float),
                               ("distill_alpha", 0, float), ("distill_temperature", 0, float),
                               ("act_scale_factor", 0, float), ("weight_scale_factor", 0, float)):
            config_number(getattr(self, key), f"finetune.{_key_name(key)}", minimum=low, kind=kind)
        if self.optimizer not in OPTIMIZERS:
            raise UserError(f"finetune.optimizer={self.optimizer!r}: choose {' or '.join(OPTIMIZERS)}.")
        if self.grad not in GRADS:
            raise UserError(f"finetune.grad={self.grad!r}: choose {' or '.join(GRADS)}.")
        if self.recalibrate not in RECALIBRATE:
            raise UserError(f"finetune.recalibrate={self.recalibrate!r}: choose one of {', '.join(RECALIBRATE)}.")
        if not 1 <= int(self.slope_window) <= 127:
            raise UserError(f"finetune.slope_window={self.slope_window}: must be in 1..127.")
        if self.learn_scales and self.recalibrate != "none":
            raise UserError(f"finetune.recalibrate={self.recalibrate} would overwrite the learned activation scales; "
                            "set finetune.learn_scales=false to recalibrate instead.")
        for key in ("act_scale_factor", "weight_scale_factor"):
            if not 0 < float(getattr(self, key)) <= 1:
                raise UserError(f"finetune.{key}={getattr(self, key)}: must be in (0, 1].")
        if self.bias_correction not in BIAS_CORRECTION:
            raise UserError(f"finetune.bias_correction={self.bias_correction!r}: choose one of "
                            f"{', '.join(BIAS_CORRECTION)}.")
        if not isinstance(self.code_map, bool):
            raise UserError(f"finetune.code_map={self.code_map!r}: choose true or false.")
        if self.schedule not in SCHEDULES:
            raise UserError(f"finetune.schedule={self.schedule!r}: choose {' or '.join(SCHEDULES)}.")
        if not float(self.lr) > 0 or int(self.batch_size) < 1 or float(self.weight_decay) < 0:
            raise UserError(f"finetune.lr must be > 0, finetune.batch_size >= 1 and finetune.weight_decay >= 0; got "
                            f"lr={self.lr}, batch_size={self.batch_size}, weight_decay={self.weight_decay}.")
        if not 0 <= float(self.distill_alpha) <= 1 or not float(self.distill_temperature) > 0:
            raise UserError(f"finetune.distill.alpha must be in [0, 1] and finetune.distill.temperature > 0; got "
                            f"alpha={self.distill_alpha}, temperature={self.distill_temperature}.")

    @classmethod
    def from_cfg(cls, node) -> "FinetuneConfig":
        data = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node or {})
        distill = data.pop("distill", None) or {}
        if not isinstance(distill, dict) or set(distill) - set(DISTILL_KEYS):
            raise UserError(f"finetune.distill={distill!r}: known keys are {sorted(DISTILL_KEYS)}.")
        data.update({DISTILL_KEYS[k]: v for k, v in distill.items()})
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known - set(RUN_KEYS)
        if unknown:
            names = sorted({_key_name(k) for k in known} | set(RUN_KEYS))
            raise UserError(f"unknown finetune setting(s) {sorted(unknown)}; known: {names}.")
        _check_cuda_graph(data.get("cuda_graph", True))
        return cls(**{k: v for k, v in data.items() if k in known})

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def distills(self) -> bool:
        return float(self.distill_alpha) > 0


def _key_name(field: str) -> str:
    """The config key of a field (distill_alpha -> distill.alpha)."""
    flat = {v: k for k, v in DISTILL_KEYS.items()}
    return f"distill.{flat[field]}" if field in flat else field


def cuda_graph_setting(cfg: DictConfig) -> bool:
    """finetune.cuda_graph, checked: true (the default) captures the training step as a CUDA graph on a GPU."""
    return _check_cuda_graph((cfg.get("finetune") or {}).get("cuda_graph", True))


def _check_cuda_graph(value) -> bool:
    if not isinstance(value, bool):
        raise UserError(f"finetune.cuda_graph={value!r}: choose true or false.")
    return value


def enabled(cfg: DictConfig) -> bool:
    node = cfg.get("finetune")
    return node is not None and config_number(node.get("epochs", 0) or 0, "finetune.epochs", minimum=0) > 0


def finetuned_checkpoint_path(cfg: DictConfig, identity: dict) -> Path:
    """Where a retrained model is kept (runner.train.checkpoint_path names the baseline's)."""
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:10]
    return Path(cfg.paths.checkpoints) / f"{cfg.model.name}_{cfg.data.name}_finetuned_{digest}.pt"


def identity(weight_config: dict, multipliers: dict, layers: list[str], qcfg: QuantConfig,
             fcfg: FinetuneConfig, lr_scale: float = 1.0) -> dict:
    """What determines the retrained weights (the backend does not, beyond fp32 rounding; nor does the number
    of ranks at one global batch, which sums the same gradients in another order). With distillation the
    teacher is the baseline itself, which weight_config names. lr_scale: the learning rate's factor from
    finetune.lr_scaling, named only when it is not 1, so the names of checkpoints from before it stay."""
    ident = {"baseline": weight_config, "layers": layers, "luts": {n: multipliers[n].sha256 for n in layers},
             "signed": {n: multipliers[n].signed for n in layers}, "quant": qcfg.as_dict(),
             "finetune": fcfg.as_dict()}
    if lr_scale != 1.0:
        ident["lr_scale"] = lr_scale
    return ident


def run_settings(cfg: DictConfig) -> dict:
    """The run keys of a distributed retraining, checked: {devices, resume, lr_scaling}."""
    from runner import distributed

    node = cfg.get("finetune") or {}
    resume = node.get("resume", False)
    if not isinstance(resume, bool):
        raise UserError(f"finetune.resume={resume!r}: choose true or false.")
    rule = str(node.get("lr_scaling", "none"))
    distributed.lr_scale(rule, 1)
    return {"devices": node.get("devices", 1), "resume": resume, "lr_scaling": rule}


@dataclass
class Resume:
    """Per-epoch resume state of one retraining: `path` (beside its checkpoint, named from the same identity,
    so another configuration never resumes it), written atomically by rank 0 after every epoch and removed
    once the checkpoint is saved; `load`: continue from it (finetune.resume=true) when it exists."""
    path: Path
    ident: str
    load: bool = False

    def read(self) -> dict | None:
        if not self.load or not self.path.exists():
            return None
        try:
            state = torch.load(self.path, map_location="cpu", weights_only=True)
        except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
            raise UserError(f"resume state {self.path} is unreadable ({exc}); delete it to retrain from the "
                            "start.") from exc
        if state.get("identity") != self.ident:
            return None
        return state

    def write(self, epoch: int, model: nn.Module, opt, gen: torch.Generator, history: list[dict]) -> None:
        buf = io.BytesIO()
        torch.save({"identity": self.ident, "epoch": epoch, "history": history, "generator": gen.get_state(),
                    "rng": torch.get_rng_state(),
                    "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
                    "optimizer": opt.state_dict()}, buf)
        atomic_write_bytes(self.path, buf.getvalue())

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def lr_factor(step: int, total: int, warmup: int, schedule: str) -> float:
    """The learning rate of optimizer step `step` (0-based) over fcfg.lr: linear warm-up over `warmup` steps,
    then constant or a cosine decay that reaches 0 after the last step."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


@torch.no_grad()
def teacher_log_probs(teacher: nn.Module, x: torch.Tensor, temperature: float, device: torch.device,
                      batch_size: int = 1000) -> torch.Tensor:
    """log softmax(teacher(x) / T) for every training image, computed once (no augmentation: each image's
    target is the same every epoch), on `device`. The teacher is copied: the caller's model is not moved."""
    model = copy.deepcopy(teacher).eval().to(device)
    logits = torch.cat([model(x[i:i + batch_size].to(device)) for i in range(0, len(x), batch_size)])
    return F.log_softmax(logits.float() / float(temperature), dim=1).to(device)


def distill_loss(logits: torch.Tensor, labels: torch.Tensor, teacher_logp: torch.Tensor | None,
                 fcfg: FinetuneConfig) -> torch.Tensor:
    """Cross-entropy to the labels, mixed with the KL divergence to the teacher's softened distribution
    (Hinton et al. 2015; times T^2 so its gradient keeps its size as T changes). alpha = 0: plain CE."""
    ce = F.cross_entropy(logits, labels)
    if teacher_logp is None or not fcfg.distills:
        return ce
    t, alpha = float(fcfg.distill_temperature), float(fcfg.distill_alpha)
    kl = F.kl_div(F.log_softmax(logits / t, dim=1), teacher_logp, reduction="batchmean", log_target=True)
    return (1.0 - alpha) * ce + alpha * (t * t) * kl


class _Captured(Exception):
    """Raised by correct_bias's hook to stop a forward once the layer's input is in hand."""


@torch.no_grad()
def correct_bias(model: nn.Module, x: torch.Tensor, device: torch.device, batch_size: int = 500) -> dict:
    """Fold each LUT layer's mean output error into its bias (error compensation as in ALWANN / TFApprox):
    per output channel, the mean over x's images (and positions) of the layer's output minus the output of
    the exact product of the same codes (the fake-quant computation), subtracted from the bias. Layer by
    layer in forward order, so each layer is measured on inputs the corrected layers before it produce.
    The measuring forwards run requant=float (the error is the same; integer mode would clamp it into the
    next layer's codes). Returns {layer: the subtracted shift (float64, per channel)}."""
    layers = {n: m for n, m in model.named_modules() if isinstance(m, _Approx)}
    training = model.training
    model.eval().to(device)
    modes = {n: m.requant for n, m in layers.items()}
    shifts = {}
    try:
        for m in layers.values():
            m.requant = "float"
        for name, layer in layers.items():
            total, count = None, 0
            for i in range(0, len(x), batch_size):
                inputs = []

                def capture(_module, args, inputs=inputs):
                    inputs.append(args[0])
                    raise _Captured
                hook = layer.register_forward_pre_hook(capture)
                try:
                    model(x[i:i + batch_size].to(device))
                except _Captured:
                    pass
                finally:
                    hook.remove()
                diff = (layer(inputs[0]) - _FakeQuant.forward(layer, inputs[0])).double()
                diff = diff.reshape(-1, diff.shape[-1]) if diff.dim() == 2 else diff.transpose(0, 1).flatten(1).t()
                total = diff.sum(0) if total is None else total + diff.sum(0)
                count += diff.shape[0]
            shifts[name] = total / count
            layer.bias.sub_(shifts[name].to(layer.bias.dtype))
    finally:
        for n, m in layers.items():
            m.requant = modes[n]
        model.train(training)
    return shifts


@torch.no_grad()
def scale_act_scales(model: nn.Module, factor: float) -> None:
    """Every static activation scale times `factor` before retraining. A table whose products are coarse for
    small and mid-size operands (mul8u_T83: 0 or 4,608 for codes 8-63) computes better on larger codes: a
    factor below 1 moves the activations' codes up, clipping the largest values, and training (with
    learn_scales, which goes on from there) adapts the weights to the clipping."""
    if factor == 1.0:
        return
    for layer in quantized_layers(model, weights_only=True).values():
        if not layer.dynamic:
            layer.act_scale.mul_(factor)


@torch.no_grad()
def set_weight_scale_factor(model: nn.Module, factor: float) -> None:
    """Every quantized layer's weight scale factor * max|w| / 127 from now on (the weight codes grow 1/factor and
    the largest weights clip, as act_scale_factor does for the activations); factor 1 clamps the weights to the
    clipped range first, so that the plain max|w| / 127 rule of a saved and reloaded model gives the same codes."""
    for layer in quantized_layers(model).values():
        layer.set_weight_scale_factor(factor)


def _bias_correction_images(x: torch.Tensor, seed: int) -> torch.Tensor:
    keep = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))[:BIAS_CORRECTION_IMAGES]
    return x[keep]


def train_epochs(model: nn.Module, data, fcfg: FinetuneConfig, qcfg: QuantConfig, device: torch.device, seed: int,
                 label: str, teacher: nn.Module | None = None, cuda_graph: bool = True, resume: Resume | None = None,
                 lr_scale: float = 1.0) -> list[dict]:
    """Train `model` in place through its (LUT) layers, recalibrating as fcfg.recalibrate says; one log row
    per epoch. teacher: the fp32 model to distil from (needed when fcfg.distill_alpha > 0). resume: where the
    per-epoch resume state goes (and whether to start from it); lr_scale: the learning rate's factor.

    The training images, labels and teacher targets sit on `device` and batches are index slices of them
    (no DataLoader, no per-batch copies). The step has no host wait on a GPU: loss and accuracy accumulate
    on the device, and a non-finite loss sets a device flag, read every READ_EVERY steps and after each
    epoch (every step on the CPU, where reading costs nothing). The layers' own NaN/Inf checks stay.

    In a process group (runner.distributed) every rank runs this on the same data: the set-up below is
    broadcast from rank 0, the model is wrapped in DistributedDataParallel, and each global batch of
    fcfg.batch_size images (the one-process run's batch, from the same seeded permutation) is split
    over the ranks, so the averaged gradients are the one-process run's up to summation order."""
    from runner import distributed

    if fcfg.distills and teacher is None:
        raise ValueError("finetune.distill.alpha > 0 needs the fp32 teacher model")
    rank, world = distributed.rank_world()
    bs = int(fcfg.batch_size)
    distributed.check_batch(bs, world, "finetune.batch_size")
    torch.manual_seed(seed)
    scale_act_scales(model, float(fcfg.act_scale_factor))
    set_weight_scale_factor(model, float(fcfg.weight_scale_factor))
    if fcfg.bias_correction in ("before", "both"):
        correct_bias(model, _bias_correction_images(data.train_x, seed), device)
    model.to(device)
    if fcfg.code_map:  # at the scales training starts from, before its first step
        fit_code_maps(model, data.train_x, qcfg, seed)
    model.train()
    set_grad_mode(model, fcfg.grad, fcfg.slope_window)
    learn_act_scales(model, fcfg.learn_scales)
    net = model
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        distributed.broadcast_module(model)
        if device.type == "cuda" and cuda_graph:
            # DDP's gradient all-reduce runs from autograd hooks between the backward's kernels: a graph of the
            # whole step would have to hold NCCL calls, which the step's capture does not support
            console.print("[yellow]training step runs eagerly[/]: a CUDA graph does not hold DDP's gradient "
                          "all-reduce (finetune.cuda_graph applies to one-process retraining)")
        cuda_graph = False
        # buffers (tables, codes, scales) follow the parameters on every rank alike: no per-step broadcast
        net = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None,
                                      broadcast_buffers=False)
    xs, ys = data.train_x.to(device), data.train_y.to(device)
    soft = (teacher_log_probs(teacher, data.train_x, fcfg.distill_temperature, device) if fcfg.distills else None)

    def loss_of(idx):  # the batch is its indices: the gather from the on-device set is part of the step (graph)
        xb, yb = xs[idx], ys[idx]
        logits = net(xb)
        return distill_loss(logits, yb, None if soft is None else soft[idx], fcfg), logits, yb

    lr0 = float(fcfg.lr) * float(lr_scale)
    step = TrainStep(model, loss_of, fcfg.optimizer, lr0, fcfg.weight_decay, device, cuda_graph=cuda_graph)
    n, epochs = len(xs), int(fcfg.epochs)
    per_epoch = (n + bs - 1) // bs
    total, warmup = epochs * per_epoch, round(float(fcfg.warmup_epochs) * per_epoch)
    read_every = READ_EVERY if device.type == "cuda" else 1
    gen = torch.Generator().manual_seed(seed)
    history, first = [], 1
    state = resume.read() if resume is not None else None
    if state is not None:  # every rank reads the same file (paths.checkpoints is shared between nodes)
        model.load_state_dict(state["model"])
        lrs = [g["lr"] for g in step.opt.param_groups]  # on a GPU the device tensor the fused step reads
        step.opt.load_state_dict(state["optimizer"])
        for group, lr in zip(step.opt.param_groups, lrs):
            group["lr"] = lr
        gen.set_state(state["generator"])
        torch.set_rng_state(state["rng"])
        history, first = list(state["history"]), int(state["epoch"]) + 1
        console.print(f"[green]resuming[/] {label} after epoch {state['epoch']} of {epochs} ({resume.path})")
    with progress_bar(f"finetune {label} ({fcfg.grad} gradients)", total=total) as advance:
        if first > 1:
            advance((first - 1) * per_epoch)
        for epoch in range(first, epochs + 1):
            t0 = time.perf_counter()
            if fcfg.recalibrate == "epoch" and epoch > 1:
                recalibrate(model.eval(), data.train_x, qcfg, seed=seed, device=device)
                model.train()
            order = torch.randperm(n, generator=gen)
            if world > 1:
                order = distributed.shard(order, world)
            order = order.to(device)
            step.reset_stats()
            for i in range(per_epoch):
                done = (epoch - 1) * per_epoch + i
                lr = lr0 * lr_factor(done, total, warmup, fcfg.schedule)
                batch = order[i * bs:(i + 1) * bs]
                loss = step(distributed.my_part(batch, rank, world) if world > 1 else batch, lr=lr)
                if (i + 1) % read_every == 0 or i + 1 == per_epoch:
                    if world > 1:  # every rank stops together: a rank alone raising would leave the others waiting
                        distributed.all_reduce_(step.bad)
                    _check_loss(step.bad, epoch, fcfg)
                    advance(min(read_every, i % read_every + 1), epoch=f"{epoch}/{epochs}", loss=f"{float(loss):.3f}")
            if step.replays:
                read_input_flags(model)
            check_non_finite_inputs(model)
            seen = len(order)
            if world > 1:
                distributed.all_reduce_(step.loss_sum, step.correct)
            history.append({"epoch": epoch, "train_loss": float(step.loss_sum) / seen,
                            "train_accuracy": int(step.correct) / seen, "epoch_s": time.perf_counter() - t0,
                            "lr_end": lr0 * lr_factor(epoch * per_epoch, total, warmup, fcfg.schedule)})
            if resume is not None and rank == 0:
                resume.write(epoch, model, step.opt, gen, history)
                console.print(f"epoch {epoch}/{epochs} finished (loss {history[-1]['train_loss']:.4f}); "
                              f"resume state saved", highlight=False)
    step.close()
    if world > 1:
        distributed.check_same(model)
    learn_act_scales(model, False)  # the trained scales become the static ones
    set_weight_scale_factor(model, 1.0)  # the clipped weights clamped: the plain rule now gives the trained codes
    if fcfg.recalibrate == "end":
        recalibrate(model.eval(), data.train_x, qcfg, seed=seed, device=device)
    if fcfg.bias_correction in ("after", "both"):
        correct_bias(model, _bias_correction_images(data.train_x, seed), device)
    if world > 1 and (fcfg.recalibrate == "end" or fcfg.bias_correction in ("after", "both")):
        distributed.broadcast_module(model)  # rank 0's result on every rank: the evaluation is sharded over them
    return history


def _check_loss(bad: torch.Tensor, epoch: int, fcfg: FinetuneConfig) -> None:
    if bool(bad):
        raise UserError(f"finetune diverged (non-finite loss) in epoch {epoch}; lower finetune.lr (now {fcfg.lr}).")


def _save(path: Path, model: nn.Module, meta: dict) -> None:
    buf = io.BytesIO()
    torch.save({"state_dict": {k: v.cpu() for k, v in model.state_dict().items()}, "meta": meta}, buf)
    atomic_write_bytes(path, buf.getvalue())


def _load(path: Path, model: nn.Module) -> dict:
    from runner.train import read_checkpoint

    try:
        state, meta = read_checkpoint(path)
        model.load_state_dict(state)
        return meta
    except (ValueError, RuntimeError, KeyError, TypeError) as exc:
        raise UserError(f"Retrained checkpoint {path} is unreadable or does not fit this model ({exc}). "
                        "Delete it or pass finetune.force=true to retrain.") from exc


def obtain(cfg: DictConfig, approx: nn.Module, data, ident: dict, qcfg: QuantConfig, device: torch.device,
           out_dir: Path, label: str, teacher: nn.Module | None = None) -> tuple[nn.Module, dict, Path]:
    """The retrained copy of `approx` (on CPU, eval mode): loaded from its checkpoint when one exists for
    this configuration, else trained (distilling from `teacher`, the fp32 baseline, when
    finetune.distill.alpha > 0), recalibrated and saved. Returns (model, meta, checkpoint path).
    In a process group every rank trains; rank 0 alone writes the checkpoint and the epoch log."""
    from runner import distributed

    fcfg = FinetuneConfig.from_cfg(cfg.finetune)
    run = run_settings(cfg)
    rank, world = distributed.rank_world()
    path = finetuned_checkpoint_path(cfg, ident)
    model = copy.deepcopy(approx)
    # rank 0 decides for every rank: a checkpoint written between two ranks' looks must not split them
    if distributed.broadcast_object(path.exists() and not cfg.finetune.get("force", False)):
        meta = _load(path, model)
        if meta.get("history") and rank == 0:  # the run dir holds the epochs that made these weights, reused or not
            write_csv(Path(out_dir) / "finetune_log.csv", list(meta["history"]))
        console.print(f"[green]reusing retrained checkpoint[/] {path}")
        return model.eval(), meta, path
    seed = int(cfg.seed)
    scale = distributed.lr_scale(run["lr_scaling"], world)
    resume = Resume(path.with_suffix(".resume"), cache_key_of(ident), load=run["resume"])
    try:
        history = train_epochs(model, data, fcfg, qcfg, device, seed, label, teacher=teacher,
                               cuda_graph=cuda_graph_setting(cfg), resume=resume, lr_scale=scale)
    except KeyboardInterrupt:
        if rank == 0 and resume.path.exists():
            console.print("[yellow]retraining stopped[/]: the same command with finetune.resume=true continues it "
                          f"from its last finished epoch ({resume.path})", highlight=False)
        raise
    model.eval().cpu()
    meta = {"identity": ident, "history": history, "torch": str(torch.__version__),
            "device": str(device), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "epoch_s": sum(h["epoch_s"] for h in history) / len(history),
            "world_size": world, "devices": distributed.rank_devices(device), "batch_per_device": int(fcfg.batch_size) // world,
            "lr_scaling": run["lr_scaling"], "lr_effective": float(fcfg.lr) * scale}
    if rank == 0:
        _save(path, model, meta)
        resume.remove()
        write_csv(Path(out_dir) / "finetune_log.csv", history)
        console.print(f"[green]saved retrained checkpoint[/] {path}")
    distributed.barrier()  # the checkpoint exists for every rank once this returns
    return model, meta, path


def cache_key_of(ident: dict) -> str:
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()


def row_columns(fcfg: FinetuneConfig, meta: dict, path: Path) -> dict:
    """The approx_finetuned row's extra columns (empty in every other row). How the weights were trained
    (ranks, devices, the batch per device, the learning-rate rule) comes from the checkpoint's meta: a
    reused checkpoint says how it was made. finetune_batch_size is the global batch."""
    return {**{f"finetune_{k}": v for k, v in fcfg.as_dict().items()},
            "finetune_epoch_s": meta.get("epoch_s"), "finetune_checkpoint": str(path),
            "finetune_world_size": meta.get("world_size", 1), "finetune_devices": meta.get("devices", meta.get("device")),
            "finetune_batch_per_device": meta.get("batch_per_device", int(fcfg.batch_size)),
            "finetune_lr_scaling": meta.get("lr_scaling", "none"),
            "finetune_lr_effective": meta.get("lr_effective", float(fcfg.lr))}


@torch.no_grad()
def recalibrate(model: nn.Module, calib_x: torch.Tensor, qcfg: QuantConfig, seed: int = 0, device="cpu") -> dict:
    """New static activation scales for a converted model after its weights changed (retraining), layer by
    layer in forward order, so each layer is observed with the new scales of the layers before it. The
    observing forwards run requant=float: in integer mode a layer's input arrives already clamped to its old
    range, so a range could never grow."""
    stats = {}
    if qcfg.activation == "dynamic":
        return stats
    layers = quantized_layers(model)
    modes = {name: layer.requant for name, layer in layers.items()}
    try:
        for layer in layers.values():
            layer.requant = "float"
        for name, layer in layers.items():
            stats.update(calibrate(model, calib_x, qcfg, device=device, seed=seed, layers={name: layer}))
            layer.set_act_amax(stats[name])
    finally:
        for name, layer in layers.items():
            layer.requant = modes[name]
    return stats
