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
import pickle
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from runner.console import console, progress_bar
from runner.errors import UserError, config_number
from runner.layers import learn_act_scales, recalibrate, set_grad_mode
from runner.ops import GRADS
from runner.provenance import atomic_write_bytes
from runner.quant import QuantConfig
from runner.store import write_csv

OPTIMIZERS = ("adam", "sgd")
SCHEDULES = ("constant", "cosine")
# When the static activation scales are recalibrated from the retrained model's own activations:
#   epoch  before every epoch after the first, so the last epoch trains with the final scales
#   end    once after training (the weights never see the new scales: measured worse, see docs)
#   none   keep the baseline's calibration
RECALIBRATE = ("none", "epoch", "end")


@dataclass(frozen=True)
class FinetuneConfig:
    epochs: int = 3
    lr: float = 5e-3
    optimizer: str = "adam"        # adam | sgd (momentum 0.9)
    grad: str = "ste"              # ste | lut (see runner.ops)
    slope_window: int = 48         # lut: slopes over +-slope_window codes (validated; 1 = central difference)
    batch_size: int = 16
    schedule: str = "cosine"       # cosine | constant
    weight_decay: float = 0.0
    learn_scales: bool = True      # static activation scales trained with the weights (LSQ gradient, log scale)
    recalibrate: str = "none"      # none | epoch | end (RECALIBRATE; measured: recalibrating hurts)

    def __post_init__(self):
        for key, low, kind in (("epochs", 0, int), ("slope_window", 1, int), ("batch_size", 1, int),
                               ("lr", 0, float), ("weight_decay", 0, float)):
            config_number(getattr(self, key), f"finetune.{key}", minimum=low, kind=kind)
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
        if self.schedule not in SCHEDULES:
            raise UserError(f"finetune.schedule={self.schedule!r}: choose {' or '.join(SCHEDULES)}.")
        if not float(self.lr) > 0 or int(self.batch_size) < 1 or float(self.weight_decay) < 0:
            raise UserError(f"finetune.lr must be > 0, finetune.batch_size >= 1 and finetune.weight_decay >= 0; got "
                            f"lr={self.lr}, batch_size={self.batch_size}, weight_decay={self.weight_decay}.")

    @classmethod
    def from_cfg(cls, node) -> "FinetuneConfig":
        data = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node or {})
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known - {"force"}
        if unknown:
            raise UserError(f"unknown finetune setting(s) {sorted(unknown)}; known: {sorted(known | {'force'})}.")
        return cls(**{k: v for k, v in data.items() if k in known})

    def as_dict(self) -> dict:
        return asdict(self)


def enabled(cfg: DictConfig) -> bool:
    node = cfg.get("finetune")
    return node is not None and config_number(node.get("epochs", 0) or 0, "finetune.epochs", minimum=0) > 0


def checkpoint_path(cfg: DictConfig, identity: dict) -> Path:
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:10]
    return Path(cfg.paths.checkpoints) / f"{cfg.model.name}_{cfg.data.name}_finetuned_{digest}.pt"


def identity(weight_config: dict, multipliers: dict, layers: list[str], qcfg: QuantConfig,
             fcfg: FinetuneConfig) -> dict:
    """What determines the retrained weights (the backend does not, beyond fp32 rounding)."""
    return {"baseline": weight_config, "layers": layers, "luts": {n: multipliers[n].sha256 for n in layers},
            "signed": {n: multipliers[n].signed for n in layers}, "quant": qcfg.as_dict(),
            "finetune": fcfg.as_dict()}


def _optimizer(params, fcfg: FinetuneConfig):
    if fcfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=float(fcfg.lr), momentum=0.9, weight_decay=float(fcfg.weight_decay))
    return torch.optim.Adam(params, lr=float(fcfg.lr), weight_decay=float(fcfg.weight_decay))


def train_epochs(model: nn.Module, data, fcfg: FinetuneConfig, qcfg: QuantConfig, device: torch.device, seed: int,
                 label: str) -> list[dict]:
    """Train `model` in place through its (LUT) layers, recalibrating as fcfg.recalibrate says; one log row
    per epoch."""
    torch.manual_seed(seed)
    model.to(device).train()
    set_grad_mode(model, fcfg.grad, fcfg.slope_window)
    learn_act_scales(model, fcfg.learn_scales)
    opt = _optimizer([p for p in model.parameters() if p.requires_grad], fcfg)
    loader = data.loader("train", int(fcfg.batch_size), shuffle=True, seed=seed)
    epochs = int(fcfg.epochs)
    sched = (torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs * len(loader))
             if fcfg.schedule == "cosine" else None)
    loss_fn = nn.CrossEntropyLoss()
    history = []
    with progress_bar(f"finetune {label} ({fcfg.grad} gradients)", total=epochs * len(loader)) as advance:
        for epoch in range(1, epochs + 1):
            t0, total_loss, correct, seen = time.perf_counter(), 0.0, 0, 0
            if fcfg.recalibrate == "epoch" and epoch > 1:
                recalibrate(model.eval(), data.train_x, qcfg, seed=seed, device=device)
                model.train()
            for xb, yb in loader:
                xb, yb = xb.to(device), yb.to(device)
                opt.zero_grad(set_to_none=True)
                logits = model(xb)
                loss = loss_fn(logits, yb)
                if not torch.isfinite(loss):
                    raise UserError(f"finetune diverged (loss {loss.item()}) in epoch {epoch}; "
                                    f"lower finetune.lr (now {fcfg.lr}).")
                loss.backward()
                opt.step()
                if sched is not None:
                    sched.step()
                total_loss += loss.item() * len(xb)
                correct += int((logits.argmax(1) == yb).sum())
                seen += len(xb)
                advance(1, epoch=f"{epoch}/{epochs}", loss=f"{loss.item():.3f}")
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            history.append({"epoch": epoch, "train_loss": total_loss / seen, "train_accuracy": correct / seen,
                            "epoch_s": time.perf_counter() - t0, "lr_end": opt.param_groups[0]["lr"]})
    learn_act_scales(model, False)  # the trained scales become the static ones
    if fcfg.recalibrate == "end":
        recalibrate(model.eval(), data.train_x, qcfg, seed=seed, device=device)
    return history


def _save(path: Path, model: nn.Module, meta: dict) -> None:
    buf = io.BytesIO()
    torch.save({"state_dict": {k: v.cpu() for k, v in model.state_dict().items()}, "meta": meta}, buf)
    atomic_write_bytes(path, buf.getvalue())


def _load(path: Path, model: nn.Module) -> dict:
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
        model.load_state_dict(blob["state_dict"])
        return blob["meta"]
    except (OSError, RuntimeError, KeyError, EOFError, pickle.UnpicklingError) as exc:
        raise UserError(f"Retrained checkpoint {path} is unreadable or does not fit this model ({exc}). "
                        "Delete it or pass finetune.force=true to retrain.") from exc


def obtain(cfg: DictConfig, approx: nn.Module, data, ident: dict, qcfg: QuantConfig, device: torch.device,
           out_dir: Path, label: str) -> tuple[nn.Module, dict, Path]:
    """The retrained copy of `approx` (on CPU, eval mode): loaded from its checkpoint when one exists for
    this configuration, else trained, recalibrated and saved. Returns (model, meta, checkpoint path)."""
    fcfg = FinetuneConfig.from_cfg(cfg.finetune)
    path = checkpoint_path(cfg, ident)
    model = copy.deepcopy(approx)
    if path.exists() and not cfg.finetune.get("force", False):
        meta = _load(path, model)
        if meta.get("history"):  # the run dir holds the epochs that made these weights, reused or not
            write_csv(Path(out_dir) / "finetune_log.csv", list(meta["history"]))
        console.print(f"[green]reusing retrained checkpoint[/] {path}")
        return model.eval(), meta, path
    seed = int(cfg.seed)
    history = train_epochs(model, data, fcfg, qcfg, device, seed, label)
    model.eval().cpu()
    meta = {"identity": ident, "history": history, "torch": str(torch.__version__),
            "device": str(device), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "epoch_s": sum(h["epoch_s"] for h in history) / len(history)}
    _save(path, model, meta)
    write_csv(Path(out_dir) / "finetune_log.csv", history)
    console.print(f"[green]saved retrained checkpoint[/] {path}")
    return model, meta, path


def row_columns(fcfg: FinetuneConfig, meta: dict, path: Path) -> dict:
    """The approx_finetuned row's extra columns (empty in every other row)."""
    return {**{f"finetune_{k}": v for k, v in fcfg.as_dict().items()},
            "finetune_epoch_s": meta.get("epoch_s"), "finetune_checkpoint": str(path)}


def run(cfg: DictConfig, out_dir: Path) -> dict:
    """`approx-run finetune`: compare with retraining on (finetune.epochs >= 1)."""
    from runner import compare

    if config_number(cfg.finetune.epochs, "finetune.epochs") < 1:
        raise UserError(f"finetune.epochs={cfg.finetune.epochs}: `approx-run finetune` needs at least one epoch.")
    FinetuneConfig.from_cfg(cfg.finetune)
    return compare.run(cfg, out_dir)
