"""Baseline training and the checkpoint store.

A checkpoint's file name is derived from exactly the config that determines its weights (data set
and split, model, training hyper-parameters, seed), so every later command finds and reuses it."""
from __future__ import annotations

import dataclasses
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
_NON_WEIGHT_KEYS = ("force", "eval_batch_size", "devices")
# data.* keys that only say where files are, not what they contain
_NON_DATA_KEYS = ("root", "download", "cache_dir", "workers", "in_channels", "image_size", "num_classes",
                  "zoo_train_epochs", "vit_train_epochs", "vit_train_shift", "finetune_batch_size",
                  "finetune_epochs", "finetune_warmup_epochs",
                  # which images these take is in the data's digest (sha256), by content rather than by path
                  "train_limit", "exclude_images")
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
    if pretrained(cfg.model):  # the weights are given, not trained: their identity replaces the recipe
        from runner.models.torchvision_models import weights_identity

        model.update(weights_identity(cfg.model.weights))
        return {"data": data, "model": model}
    return {"data": data, "model": model, "train": train,
            "seed": int(cfg.seed)}


def pretrained(model_cfg) -> bool:
    """A model whose weights are given (model=torchvision model.weights=...): it is its own baseline."""
    from runner.models.torchvision_models import weights_kind

    return model_cfg.get("name") == "torchvision" and weights_kind(model_cfg.get("weights")) != "none"


def model_label(model_cfg) -> str:
    """The model's name in checkpoint names and the results' `model` column (torchvision's with its arch)."""
    arch = model_cfg.get("arch") if model_cfg.get("name") == "torchvision" else None
    return f"{model_cfg.name}.{arch}" if arch else str(model_cfg.name)


def model_classes(model_cfg) -> int | None:
    """The outputs a torchvision model config builds (None for the zoo's, which take data.num_classes)."""
    if model_cfg.get("name") != "torchvision":
        return None
    if model_cfg.get("num_classes") is not None:
        return int(model_cfg.num_classes)
    from runner.models.torchvision_models import check_arch, weights_enum, weights_kind

    if weights_kind(model_cfg.get("weights")) == "enum":
        return len(weights_enum(check_arch(model_cfg.arch), model_cfg.weights).meta["categories"])
    return 1000  # torchvision's default


def check_classes(cfg: DictConfig, data: Dataset) -> None:
    """The model's outputs must be the data's classes, or every accuracy is of mislabelled images."""
    n = model_classes(cfg.model)
    if n is None:
        return
    shape = getattr(data, "input_shape", None) or tuple(data.test_x.shape[1:])
    if shape and shape[0] != 3:
        raise UserError(f"model=torchvision takes RGB images (3 channels); data={cfg.data.name} has {shape[0]}. "
                        "Use 3-channel data (data=cifar10, data=imagefolder) or a zoo model (model=lenet5, resnet20, ...).")
    if n == data.num_classes:
        return
    fix = (f"pass +model.num_classes={data.num_classes} (random weights, or a state dict trained for "
           f"{data.num_classes} classes)" if weights_kind_of(cfg.model) != "enum" else
           f"use data with its {n} classes (ImageNet's 1000 synset folders under data.root)")
    raise UserError(f"model.arch={cfg.model.arch} has {n} outputs but data={cfg.data.name} has {data.num_classes} "
                    f"classes: {fix}, or model.weights=null +model.num_classes={data.num_classes}.")


def weights_kind_of(model_cfg) -> str:
    from runner.models.torchvision_models import weights_kind

    return weights_kind(model_cfg.get("weights"))


def checkpoint_path(cfg: DictConfig) -> Path:
    """<model>_<data>-<data digest>_<digest of the whole weight config>.pt: a changed file under data.root
    names another checkpoint, as a changed recipe does."""
    key = weight_config(cfg)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    return Path(cfg.paths.checkpoints) / f"{model_label(cfg.model)}_{cfg.data.name}-{key['data']['sha256'][:8]}_{digest}.pt"


@torch.no_grad()
def evaluate_accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int, device) -> float:
    model.eval()
    correct = 0
    for i in range(0, len(x), batch_size):
        logits = model(x[i:i + batch_size].to(device))
        correct += (logits.argmax(1).cpu() == y[i:i + batch_size]).sum().item()
    return correct / len(x)


def check_model_fits(cfg: DictConfig, data: Dataset) -> None:
    """A freshly built model on two training images, before any training or evaluation: a model that does not
    fit the data (its channels, image size or classes) stops with one message naming both shapes and the
    model's own error, instead of a traceback after the data loads (or an evaluation of the wrong outputs)."""
    x = data.train_x[:2]
    if not isinstance(x, torch.Tensor):  # a lazy view of a large set (data=imagefolder): its two images
        x = x.to()
    shape = "x".join(str(d) for d in x.shape[1:])
    # a set that names its classes (an ImageFolder's folders) has that many, whatever data.num_classes says
    classes = data.num_classes if getattr(data, "classes", ()) else cfg.data.get("num_classes")
    classes = int(classes) if classes is not None else int(data.train_y.max()) + 1
    target = str(cfg.model.get("_target_") or "") if "_target_" in cfg.model else ""
    label = cfg.model.name if not target or target == ZOO.get(cfg.model.name) else f"{cfg.model.name} ({target})"
    what = f"model={label} does not fit data={cfg.data.name} (images {shape}, {classes} classes)"
    fix = (f"Choose a model that takes {shape} images and gives {classes} outputs (a zoo model takes both from the "
           "data set; a class of yours gets its constructor's keys as +model.<key>=value, docs/models.md), or "
           "data it was made for.")
    model = build_model(cfg.model, data.mean, data.std).eval()
    try:
        with torch.no_grad():
            out = model(x)
    except Exception as exc:  # noqa: BLE001  (whatever the model raises on the batch is the reason)
        lines = [line for line in str(exc).splitlines() if line.strip()]
        raise UserError(f"{what}: its first batch fails with {type(exc).__name__}: "
                        f"{lines[-1] if lines else ''}. {fix}") from None
    got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
    if got != [len(x), classes]:
        raise UserError(f"{what}: it gives outputs of shape {got} for {len(x)} images, not [{len(x)}, {classes}] "
                        f"(one score per class). {fix}")


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
    config_number(t.get("shift", 0), "train.shift", minimum=0)
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
    """The baseline trained from scratch. In a process group (runner.distributed) every rank trains a replica
    wrapped in DistributedDataParallel on its DistributedSampler shard of each epoch's seeded permutation;
    train.batch_size is the global batch. BatchNorm statistics stay per rank (rank 0's are saved), as in
    torchvision's reference recipes without --sync-bn."""
    from runner import distributed

    check_train_config(cfg)
    rank, world = distributed.rank_world()
    shift = int(cfg.train.get("shift", 0))
    if shift and not isinstance(data.train_x, torch.Tensor):
        raise UserError(f"train.shift={shift}: data={data.name} is read a batch at a time with its own augmentation "
                        "(data.augment); pass train.shift=0.")
    if shift and data.augment:
        raise UserError(f"train.shift={shift}: data={data.name} has its own training augmentation (data.augment); "
                        "pass train.shift=0, or data.augment=false to shift its images instead.")
    check_model_fits(cfg, data)
    torch.manual_seed(int(cfg.seed))
    model = build_model(cfg.model, data.mean, data.std).to(device)
    opt = make_optimizer(model, cfg.train)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=float(cfg.train.get("label_smoothing", 0.0)))
    sampler = None
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel
        from torch.utils.data import DataLoader, TensorDataset
        from torch.utils.data.distributed import DistributedSampler

        from runner.data import CropFlip

        per_rank = distributed.check_batch(int(cfg.train.batch_size), world, "train.batch_size")
        net = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
        dataset = TensorDataset(data.train_x, data.train_y)
        sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=int(cfg.seed))
        loader = DataLoader(dataset, batch_size=per_rank, sampler=sampler,
                            collate_fn=CropFlip(int(cfg.seed) + rank) if data.augment else
                            CropFlip(int(cfg.seed) + rank, pad=shift, flip=False) if shift else None)
    else:
        net = model
        loader = data.loader("train", int(cfg.train.batch_size), shuffle=True, seed=int(cfg.seed), shift=shift)
    epochs = int(cfg.train.epochs)
    sched = make_schedule(opt, cfg.train, len(loader))
    history = []
    with progress_bar(f"train {cfg.model.name} on {data.name}", total=epochs * len(loader)) as advance:
        for epoch in range(1, epochs + 1):
            model.train()
            if sampler is not None:
                sampler.set_epoch(epoch)
            t0, total_loss, seen = time.perf_counter(), 0.0, 0
            for xb, yb in loader:
                xb, yb = xb.to(device), yb.to(device)
                opt.zero_grad(set_to_none=True)
                loss = loss_fn(net(xb), yb)
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


def read_checkpoint(path: Path, meta_keys=()) -> tuple[dict, dict]:
    """(state dict, meta) of a checkpoint file as save_checkpoint writes it. A truncated, foreign or damaged
    file (a bare state dict, a list, meta without meta_keys) raises ValueError saying what is wrong, for the
    caller's message naming the file."""
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError, ValueError, TypeError) as exc:
        raise ValueError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from exc
    if not isinstance(blob, dict) or not isinstance(blob.get("state_dict"), dict):
        raise ValueError(f"holds a {type(blob).__name__}{' without state_dict' if isinstance(blob, dict) else ''}, "
                         "not approx-run's {state_dict, meta}")
    meta = blob.get("meta")
    if not isinstance(meta, dict) or any(k not in meta for k in meta_keys):
        raise ValueError("its meta (what trained it) is missing or incomplete")
    return blob["state_dict"], meta


def load_checkpoint(path: Path, cfg: DictConfig, data: Dataset) -> tuple[nn.Module, dict]:
    try:
        state, meta = read_checkpoint(path, meta_keys=("test_accuracy",))
        model = build_model(cfg.model, data.mean, data.std)
        model.load_state_dict(state)
    except (ValueError, RuntimeError, KeyError, TypeError) as exc:
        raise UserError(f"Checkpoint {path} is unreadable or does not fit model={cfg.model.name} ({exc}). "
                        "Delete it or pass train.force=true to retrain.") from exc
    return model.eval(), meta


def load_or_train(cfg: DictConfig, data: Dataset | None = None, out_dir: Path | None = None):
    """The baseline for this config: reused from checkpoints/ when present (unless train.force), else trained.
    Returns (model on CPU in eval mode, meta dict, checkpoint path, data set)."""
    from runner import distributed

    check_train_config(cfg)
    data = data or left_out(held_apart(load_dataset(cfg.data), cfg), cfg)
    check_classes(cfg, data)
    if pretrained(cfg.model):
        return load_pretrained(cfg, data)
    path = checkpoint_path(cfg)
    if cfg.train.get("force", False) or not path.exists():
        check_model_fits(cfg, data)  # before the checkpoint's lock file: a model that cannot train leaves nothing
    if distributed.rank_world()[1] > 1:
        return _load_or_train_ranks(cfg, data, path, out_dir)
    # Two runs needing the same baseline (parallel sweeps, a train beside a compare) train it once:
    # the second waits for the first's checkpoint instead of training its own copy.
    with locked(path, timeout=None, waiting=f"another approx-run is training {path.name}"):
        return _load_or_train_locked(cfg, data, path, out_dir)


def _load_or_train_ranks(cfg: DictConfig, data: Dataset, path: Path, out_dir: Path | None):
    """load_or_train for the ranks of a process group: rank 0 decides whether to train (a lock held while the
    ranks train together would keep the others out of the training), every rank trains its shard, and rank 0
    saves the checkpoint (atomically, under the checkpoint's lock) before any rank goes on."""
    from runner import distributed

    if not distributed.broadcast_object(not path.exists() or bool(cfg.train.get("force", False))):
        model, meta = load_checkpoint(path, cfg, data)
        console.print(f"[green]reusing checkpoint[/] {path} (test accuracy {meta['test_accuracy']:.4f})")
        return model, meta, path, data
    device = resolve_device(cfg.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    rank, world = distributed.rank_world()
    console.print(f"training {cfg.model.name} on {data.name} ({len(data.train_x)} train / {len(data.test_x)} test "
                  f"images, {cfg.train.epochs} epochs, {world} ranks, global batch {cfg.train.batch_size})")
    model, history = train_model(cfg, data, device)
    meta = _meta(cfg, data, history)
    meta.update({"world_size": world, "batch_per_device": int(cfg.train.batch_size) // world})
    if rank == 0:
        with locked(path, timeout=None, waiting=f"another approx-run is training {path.name}"):
            save_checkpoint(path, model, meta)
        if out_dir is not None:
            write_csv(Path(out_dir) / "train_log.csv", history)
        console.print(f"[green]saved checkpoint[/] {path} (test accuracy {meta['test_accuracy']:.4f})")
    distributed.barrier()
    return model, meta, path, data


def _meta(cfg: DictConfig, data: Dataset, history: list[dict]) -> dict:
    return {
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


def baseline_path(cfg: DictConfig) -> Path:
    """The file the baseline's weights come from: its checkpoint, or the given weights' file."""
    if not pretrained(cfg.model):
        return checkpoint_path(cfg)
    from runner.models.torchvision_models import hub_file, weights_enum, weights_kind

    weights = cfg.model.weights
    if weights_kind(weights) == "file":
        return Path(str(weights)).expanduser()
    return hub_file(weights_enum(cfg.model.arch, weights))


def load_pretrained(cfg: DictConfig, data: Dataset):
    """A model with given weights as the baseline: nothing trained, no checkpoint written. Its 'checkpoint' is
    the weights file (a state dict, or the hub cache's file of an enum member), which keys the session's caches."""
    model = build_model(cfg.model, data.mean, data.std).eval()
    weights, path = cfg.model.weights, baseline_path(cfg)
    meta = {"data": data.name, "data_source": data.source, "data_sha256": weight_config(cfg)["data"]["sha256"],
            "config": weight_config(cfg), "pretrained": str(weights),
            "test_accuracy": None,  # not measured here: compare's pytorch row is its accuracy
            "git_sha": git_info()["git_sha"], "torch": str(torch.__version__)}
    console.print(f"[green]pretrained[/] {model_label(cfg.model)} weights {weights} ({path}): its own baseline, "
                  "nothing to train", highlight=False)
    return model, meta, path, data


def held_apart(data: Dataset, cfg: DictConfig) -> Dataset:
    """A set with no training split (an ImageFolder of val/ only): a seeded, class-stratified part of its images
    (data.calib_images of them; at most a fifth of a small set) becomes the training split, which calibration
    reads, and every accuracy is measured on the rest, so no image calibrates the model it measures."""
    if getattr(data, "has_train", True) or not len(data.test_y):
        return data
    want = config_number(cfg.data.get("calib_images", 1000), "data.calib_images", minimum=1)
    fraction = min(want / len(data.test_y), 0.2)
    carved = data.carve("test", fraction, int(cfg.data.get("calib_seed", 0)))
    out = dataclasses.replace(carved, name=data.name, train_x=carved.test_x, train_y=carved.test_y,
                              test_x=carved.train_x, test_y=carved.train_y, has_train=False,
                              info={**data.info, "calibration_held_apart": len(carved.test_y)})
    console.print(f"{data.name} has no training split: {len(out.train_y)} of its images (seeded, every class) "
                  f"held apart for calibration, accuracy on the other {len(out.test_y)}", highlight=False)
    return out


def left_out(data: Dataset, cfg: DictConfig) -> Dataset:
    """The measured images less those data.exclude_images lists (an ImageFolder's files): search's confirmation
    on the whole val split leaves out the images its choice was made on. After held_apart, so the calibration
    part is the one the search calibrated on whenever both read the same images."""
    if not cfg.data.get("exclude_images"):
        return data
    from runner.data.imagefolder import excluded_names

    names = data.test_x.names() if hasattr(data.test_x, "names") else None
    if names is None:
        raise UserError(f"data.exclude_images needs data=imagefolder (its images have file names); "
                        f"data={cfg.data.name} has none.")
    drop = excluded_names(cfg.data)
    keep = torch.tensor([n not in drop for n in names], dtype=torch.bool)
    out = dataclasses.replace(data, test_x=data.test_x.take(keep), test_y=data.test_y[keep],
                              info={**data.info, "excluded": int((~keep).sum())})
    console.print(f"{int((~keep).sum())} of the measured images left out (data.exclude_images="
                  f"{cfg.data.exclude_images}): accuracy on the other {len(out.test_y)}",
                  highlight=False, soft_wrap=True)
    return out


def why_new(cfg: DictConfig, path: Path) -> str:
    """Why no checkpoint fits: the data digest and recipe, and the nearest checkpoints' differences."""
    key = weight_config(cfg)
    recipe = hashlib.sha256(json.dumps(key["train"], sort_keys=True).encode()).hexdigest()[:10]
    others = sorted(path.parent.glob(f"{model_label(cfg.model)}_{cfg.data.name}-*.pt"))
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
    meta = _meta(cfg, data, history)
    save_checkpoint(path, model, meta)
    if out_dir is not None:
        write_csv(Path(out_dir) / "train_log.csv", history)
    console.print(f"[green]saved checkpoint[/] {path} (test accuracy {meta['test_accuracy']:.4f})")
    return model, meta, path, data


def run(cfg: DictConfig, out_dir: Path) -> dict:
    """`approx-run train`: in this process, or over the ranks of train.devices or torchrun (runner.distributed)."""
    from runner import distributed

    check_train_config(cfg)
    if pretrained(cfg.model):
        # given weights are the baseline every command uses; training would replace them (a retrained copy
        # through the approximate layers is `approx-run finetune`; from scratch: model.weights=null)
        model, meta, path, _ = load_or_train(cfg, out_dir=out_dir)
        console.print(f"nothing to train: model.weights={cfg.model.weights} is the baseline every command uses "
                      f"as it is. Retrain through the approximate layers with `approx-run finetune`, or train "
                      f"from random weights with model.weights=null.", highlight=False)
        return {"checkpoint": str(path), "test_accuracy": None, "pretrained": str(cfg.model.weights)}
    devices = distributed.resolve(cfg.train.get("devices", 1), resolve_device(cfg.device).type == "cuda",
                                  "train.devices")
    distributed.check_batch(int(cfg.train.batch_size), len(devices), "train.batch_size")
    return distributed.run(cfg, out_dir, train_here, devices)


def train_here(cfg: DictConfig, out_dir: Path) -> dict:
    model, meta, path, _ = load_or_train(cfg, out_dir=out_dir)
    return {"checkpoint": str(path), "test_accuracy": meta["test_accuracy"]}
