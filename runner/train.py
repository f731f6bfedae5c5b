"""Baseline training and the checkpoint store.

A checkpoint's file name is derived from exactly the config that determines its weights (data set
and split, model, training hyper-parameters, seed), so every later command finds and reuses it."""
from __future__ import annotations

import hashlib
import io
import json
import math
import pickle
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from runner.console import console, progress_bar
from runner.data import Dataset, data_digest, load_dataset
from runner.errors import UserError, config_number
from runner.models import ZOO, build_model
from runner.provenance import atomic_write_bytes, git_info, resolve_device
from runner.store import locked, write_csv

# train.* keys that do not change the weights
_NON_WEIGHT_KEYS = ("force", "eval_batch_size")
# data.* keys that only say where files are, not what they contain
_NON_DATA_KEYS = ("root", "download", "in_channels", "image_size", "num_classes", "zoo_train_epochs",
                  "finetune_batch_size", "finetune_epochs", "finetune_warmup_epochs")
# model.* keys that choose what to convert later, not what to train
_NON_MODEL_KEYS = ("approx_layers", "other_layers", "approx_matmuls")
# model.* keys that the data set determines (its name is in the key)
_DATA_SHAPE_KEYS = ("in_channels", "image_size")


def weight_config(cfg: DictConfig) -> dict:
    """Everything that determines the baseline's weights: the data's content (not where it lies), the model,
    the training recipe and the seed. Row keys and retrained checkpoints build on it."""
    data = {k: v for k, v in OmegaConf.to_container(cfg.data, resolve=True).items() if k not in _NON_DATA_KEYS}
    data["sha256"] = data_digest(cfg.data)
    train = {k: v for k, v in OmegaConf.to_container(cfg.train, resolve=True).items() if k not in _NON_WEIGHT_KEYS}
    model = {k: v for k, v in OmegaConf.to_container(cfg.model, resolve=True).items()
             if k not in _NON_MODEL_KEYS + _DATA_SHAPE_KEYS}
    if model.get("_target_") == ZOO.get(model.get("name")):  # the zoo's own class: the name says it
        model.pop("_target_")
    return {"data": data, "model": model, "train": train,
            "seed": int(cfg.seed)}


def checkpoint_path(cfg: DictConfig) -> Path:
    """<model>_<data>-<data digest>_<digest of the whole weight config>.pt: a changed file under data.root
    names another checkpoint, as a changed recipe does."""
    key = weight_config(cfg)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    return Path(cfg.paths.checkpoints) / f"{cfg.model.name}_{cfg.data.name}-{key['data']['sha256'][:8]}_{digest}.pt"


@torch.no_grad()
def evaluate_accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int, device) -> float:
    model.eval()
    correct = 0
    for i in range(0, len(x), batch_size):
        logits = model(x[i:i + batch_size].to(device))
        correct += (logits.argmax(1).cpu() == y[i:i + batch_size]).sum().item()
    return correct / len(x)


def check_train_config(cfg: DictConfig) -> None:
    t = cfg.train
    if t.get("schedule", "constant") not in ("constant", "cosine"):
        raise UserError(f"train.schedule={t.schedule}: choose constant or cosine.")
    if t.get("optimizer", "adam") not in ("adam", "adamw", "sgd"):
        raise UserError(f"train.optimizer={t.optimizer}: choose adam, adamw or sgd.")
    config_number(t.get("warmup_epochs", 0.0), "train.warmup_epochs", minimum=0, kind=float)
    smoothing = config_number(t.get("label_smoothing", 0.0), "train.label_smoothing", minimum=0, kind=float)
    if smoothing >= 1:
        raise UserError(f"train.label_smoothing={smoothing} must be < 1.")
    if t.get("optimizer", "adam") == "sgd":
        config_number(t.get("momentum", 0.9), "train.momentum", minimum=0, kind=float)
    for key in ("epochs", "batch_size", "eval_batch_size"):
        config_number(t[key], f"train.{key}", minimum=1)
    config_number(t.get("weight_decay", 0.0), "train.weight_decay", minimum=0, kind=float)
    if not config_number(t.lr, "train.lr", kind=float) > 0:
        raise UserError(f"train.lr={t.lr} must be > 0.")


def make_optimizer(model: nn.Module, t: DictConfig) -> torch.optim.Optimizer:
    """train.optimizer: adam (the default, also for configs that predate the key), adamw (decoupled weight decay,
    the transformers' optimizer) or sgd (momentum, nesterov)."""
    if t.get("optimizer", "adam") == "sgd":
        return torch.optim.SGD(model.parameters(), lr=float(t.lr), momentum=float(t.get("momentum", 0.9)),
                               nesterov=bool(t.get("nesterov", False)), weight_decay=float(t.weight_decay))
    if t.get("optimizer", "adam") == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=float(t.lr), weight_decay=float(t.weight_decay))
    return torch.optim.Adam(model.parameters(), lr=float(t.lr), weight_decay=float(t.weight_decay))


def make_schedule(opt: torch.optim.Optimizer, t: DictConfig, steps_per_epoch: int):
    """The learning rate over the run: cosine decay to 0 (the last epochs settle instead of bouncing around the
    optimum, so the saved last weights are reliably among the best) or constant, after train.warmup_epochs of
    linear warm-up (transformers diverge early at full rate); None for a constant rate without warm-up."""
    total = int(t.epochs) * steps_per_epoch
    warmup = min(int(round(float(t.get("warmup_epochs", 0.0)) * steps_per_epoch)), total - 1)
    cosine = t.get("schedule", "constant") == "cosine"
    if warmup <= 0:
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total) if cosine else None

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup))) if cosine else 1.0
    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def train_model(cfg: DictConfig, data: Dataset, device: torch.device) -> tuple[nn.Module, list[dict]]:
    check_train_config(cfg)
    torch.manual_seed(int(cfg.seed))
    model = build_model(cfg.model, data.mean, data.std).to(device)
    opt = make_optimizer(model, cfg.train)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=float(cfg.train.get("label_smoothing", 0.0)))
    loader = data.loader("train", int(cfg.train.batch_size), shuffle=True, seed=int(cfg.seed))
    epochs = int(cfg.train.epochs)
    sched = make_schedule(opt, cfg.train, len(loader))
    history = []
    with progress_bar(f"train {cfg.model.name} on {data.name}", total=epochs * len(loader)) as advance:
        for epoch in range(1, epochs + 1):
            model.train()
            t0, total_loss, seen = time.perf_counter(), 0.0, 0
            for xb, yb in loader:
                xb, yb = xb.to(device), yb.to(device)
                opt.zero_grad(set_to_none=True)
                loss = loss_fn(model(xb), yb)
                loss.backward()
                opt.step()
                if sched is not None:
                    sched.step()
                total_loss += loss.item() * len(xb)
                seen += len(xb)
                advance(1, epoch=epoch, loss=f"{loss.item():.3f}")
            acc = evaluate_accuracy(model, data.test_x, data.test_y, int(cfg.train.eval_batch_size), device)
            history.append({"epoch": epoch, "train_loss": total_loss / seen, "test_accuracy": acc,
                            "seconds": time.perf_counter() - t0})
    return model.cpu().eval(), history


def save_checkpoint(path: Path, model: nn.Module, meta: dict) -> None:
    buf = io.BytesIO()
    torch.save({"state_dict": model.state_dict(), "meta": meta}, buf)
    atomic_write_bytes(path, buf.getvalue())


def load_checkpoint(path: Path, cfg: DictConfig, data: Dataset) -> tuple[nn.Module, dict]:
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
        model = build_model(cfg.model, data.mean, data.std)
        model.load_state_dict(blob["state_dict"])
    except (OSError, RuntimeError, KeyError, EOFError, pickle.UnpicklingError) as exc:
        raise UserError(f"Checkpoint {path} is unreadable or does not fit model={cfg.model.name} ({exc}). "
                        "Delete it or pass train.force=true to retrain.") from exc
    return model.eval(), blob["meta"]


def load_or_train(cfg: DictConfig, data: Dataset | None = None, out_dir: Path | None = None):
    """The baseline for this config: reused from checkpoints/ when present (unless train.force), else trained.
    Returns (model on CPU in eval mode, meta dict, checkpoint path, data set)."""
    check_train_config(cfg)
    data = data or load_dataset(cfg.data)
    path = checkpoint_path(cfg)
    # Two runs needing the same baseline (parallel sweeps, a train beside a compare) train it once:
    # the second waits for the first's checkpoint instead of training its own copy.
    with locked(path, timeout=None, waiting=f"another approx-run is training {path.name}"):
        return _load_or_train_locked(cfg, data, path, out_dir)


def why_new(cfg: DictConfig, path: Path) -> str:
    """Why no checkpoint fits: the data digest and recipe, and the nearest checkpoints' differences."""
    key = weight_config(cfg)
    recipe = hashlib.sha256(json.dumps(key["train"], sort_keys=True).encode()).hexdigest()[:10]
    others = sorted(path.parent.glob(f"{cfg.model.name}_{cfg.data.name}-*.pt"))
    same_data = [p for p in others if p.name.startswith(path.name.rsplit("_", 1)[0] + "_")]
    note = ""
    if same_data:
        note = f"; {len(same_data)} checkpoint(s) of this data have other settings"
    elif others:
        note = f"; {len(others)} {cfg.data.name} checkpoint(s) are of other data (another data.root or changed files)"
    return f"data digest {key['data']['sha256'][:12]}.., recipe {recipe}{note}"


def _load_or_train_locked(cfg: DictConfig, data: Dataset, path: Path, out_dir: Path | None):
    if path.exists() and not cfg.train.get("force", False):
        model, meta = load_checkpoint(path, cfg, data)
        console.print(f"[green]reusing checkpoint[/] {path} (test accuracy {meta['test_accuracy']:.4f})")
        return model, meta, path, data
    device = resolve_device(cfg.device)
    if not path.exists():
        console.print(f"no checkpoint for this data and recipe ({why_new(cfg, path)}): training", highlight=False)
    console.print(f"training {cfg.model.name} on {data.name} ({len(data.train_x)} train / {len(data.test_x)} test "
                  f"images, {cfg.train.epochs} epochs, device {device})")
    model, history = train_model(cfg, data, device)
    meta = {
        "data": data.name,
        "data_source": data.source,
        "data_sha256": weight_config(cfg)["data"]["sha256"],
        "config": weight_config(cfg),
        "test_accuracy": history[-1]["test_accuracy"],
        "epochs": len(history),
        "git_sha": git_info()["git_sha"],
        "torch": str(torch.__version__),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    save_checkpoint(path, model, meta)
    if out_dir is not None:
        write_csv(Path(out_dir) / "train_log.csv", history)
    console.print(f"[green]saved checkpoint[/] {path} (test accuracy {meta['test_accuracy']:.4f})")
    return model, meta, path, data


def run(cfg: DictConfig, out_dir: Path) -> dict:
    """`approx-run train`."""
    model, meta, path, _ = load_or_train(cfg, out_dir=out_dir)
    return {"checkpoint": str(path), "test_accuracy": meta["test_accuracy"]}
