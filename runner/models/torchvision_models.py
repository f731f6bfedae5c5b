"""Any classification model of torchvision.models by name (`model=torchvision model.arch=NAME`), with its
pretrained weights (`model.weights=`), and the input normalisation in front as an explicit Normalize so that
fold_input_normalization folds it into the first conv as for the zoo.

The model keeps torchvision's own layer names (conv1, layer1.0.conv1, fc; features.0.0, classifier.3), so
model.approx_layers and a torchvision state dict use the names users know: the Normalize is added as one more
child (`input_norm`) of torchvision's module, whose class becomes a subclass that applies it first.

model.weights:
    null                 random initialisation (torchvision's), model.num_classes outputs (default 1000)
    DEFAULT | NAME       a member of the arch's weights enum (get_model_weights): torchvision's weights API
                         loads it from torch's hub cache ($TORCH_HOME/hub/checkpoints) and downloads it only
                         where a network exists; offline, a missing file is a UserError naming the path
    /path/to/file.pt     a state dict (torchvision's keys), read with torch.load(weights_only=True) only
"""
from __future__ import annotations

import difflib
import os
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn

from runner.errors import UserError
from runner.provenance import file_sha256
from runner.models.common import Normalize

# torchvision's ImageNet normalisation (the `transforms` of every ImageNet weights enum member)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def classification_models() -> list[str]:
    import torchvision.models as tvm

    return list(tvm.list_models(module=tvm))


def check_arch(arch) -> str:
    names = classification_models()
    if arch in names:
        return str(arch)
    close = difflib.get_close_matches(str(arch), names, n=4, cutoff=0.5)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    raise UserError(f"model.arch={arch} is not a torchvision classification model.{hint} The {len(names)} names: "
                    "python -c 'import torchvision.models as m; print(m.list_models(module=m))'.")


def weights_kind(weights) -> str:
    """'none', 'enum' or 'file' for a model.weights value."""
    if weights is None or str(weights).lower() in ("", "null", "none"):
        return "none"
    text = str(weights)
    return "file" if ("/" in text or text.endswith((".pt", ".pth"))) else "enum"


def weights_enum(arch: str, name: str):
    """The member `name` (DEFAULT, IMAGENET1K_V2, or the full ResNet50_Weights.IMAGENET1K_V2) of arch's enum."""
    import torchvision.models as tvm

    enum = tvm.get_model_weights(arch)
    member = str(name).rsplit(".", 1)[-1]
    if member not in enum.__members__:
        raise UserError(f"model.weights={name}: {arch}'s weights are {', '.join(enum.__members__)} (or null for random "
                        "weights, or the path of a state dict file).")
    return enum[member]


def hub_file(weights) -> Path:
    """Where torchvision's weights API looks for a weights enum member's file (torch.hub's cache)."""
    return Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(weights.url)


class _Normalized:
    """Mixed into a torchvision model's class: forward normalises its [0, 1] input first."""

    def forward(self, x):
        return super().forward(self.input_norm(x))


@lru_cache(maxsize=None)
def _normalized_class(base: type) -> type:
    cls = type(base.__name__, (_Normalized, base), {"__module__": __name__, "__qualname__": f"Normalized{base.__name__}"})
    globals()[cls.__qualname__] = cls  # found by name, as pickle looks classes up
    return cls


def _add_normalize(model: nn.Module, mean, std) -> nn.Module:
    model.__class__ = _normalized_class(type(model))
    model.input_norm = Normalize(list(mean), list(std))
    return model


def normalization_of(weights) -> tuple[tuple, tuple]:
    """The mean and std of the weights' preprocessing (ImageNet's when they have none, or no weights)."""
    if weights is None:
        return IMAGENET_MEAN, IMAGENET_STD
    try:
        t = weights.transforms()
        return tuple(float(v) for v in t.mean), tuple(float(v) for v in t.std)
    except (AttributeError, TypeError):
        return IMAGENET_MEAN, IMAGENET_STD


def weights_identity(weights) -> dict:
    """What names the weights in checkpoint and row identities: an enum member by its name (its file name carries
    torchvision's hash of the content), a state dict file by its content's sha256."""
    kind = weights_kind(weights)
    if kind != "file":
        return {"weights": None if kind == "none" else str(weights)}
    path = Path(str(weights)).expanduser()
    if not path.is_file():
        raise UserError(f"model.weights={weights}: no such file. Pass the path of a state dict saved with "
                        "torch.save(model.state_dict(), path), a weights enum name (DEFAULT, IMAGENET1K_V1, ...) or null.")
    return {"weights_sha256": file_sha256(path)}


def _read_state_dict(path: Path) -> dict:
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001  (torch raises many types for a damaged or pickled-code file)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"model.weights={path} is not a readable state dict ({first}). approx-run reads weights "
                        "with torch.load(weights_only=True) only; save them with torch.save(model.state_dict(), "
                        "path).") from None
    if isinstance(blob, dict) and isinstance(blob.get("state_dict"), dict):  # approx-run's and many trainers' form
        blob = blob["state_dict"]
    if not isinstance(blob, dict) or not all(isinstance(v, torch.Tensor) for v in blob.values()):
        raise UserError(f"model.weights={path} holds a {type(blob).__name__}, not a state dict (names -> tensors).")
    # DataParallel's prefix off; our Normalize's buffers (a state dict of this module's model) come from the weights
    return {k.removeprefix("module."): v for k, v in blob.items() if not k.startswith("input_norm.")}


def _load_state_dict(model: nn.Module, state: dict, source: str, arch: str) -> None:
    result_error = None
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # shapes that differ
        result_error = str(exc).replace("\n", " ")
        missing, unexpected = [], []
    if result_error or missing or unexpected:
        detail = result_error or (f"missing {len(missing)} keys (e.g. {', '.join(missing[:3])}), unexpected "
                                  f"{len(unexpected)} (e.g. {', '.join(unexpected[:3])})")
        raise UserError(f"model.weights={source} does not fit torchvision's {arch}: {detail[:600]}. Give a state dict "
                        f"of {arch} (torchvision's key names), or the matching model.arch; a model with another "
                        "class count needs +model.num_classes=N.")


def build(arch: str, weights=None, num_classes: int | None = None, **kwargs) -> nn.Module:
    """torchvision's `arch` with `weights` (see the module docstring), Normalize(mean, std) of the weights'
    preprocessing in front. num_classes: the outputs of a randomly initialised model, or the class count the
    state dict file was trained for (a pretrained enum member fixes its own)."""
    import torchvision.models as tvm

    arch = check_arch(arch)
    kind = weights_kind(weights)
    enum = weights_enum(arch, weights) if kind == "enum" else None
    if enum is not None and num_classes is not None and int(num_classes) != len(enum.meta["categories"]):
        raise UserError(f"model.weights={weights} has {len(enum.meta['categories'])} classes, model.num_classes="
                        f"{num_classes}: drop model.num_classes, or use model.weights=null for random weights.")
    if num_classes is not None:
        kwargs["num_classes"] = int(num_classes)
    on_meta = torch.empty(0).device.type == "meta"  # a build for the layer names only: no weights to read
    if enum is not None and not on_meta:
        path = hub_file(enum)
        if not path.is_file():
            raise UserError(
                f"model.weights={weights} ({enum}) is not in torch's hub cache: looked for {path}. This machine has "
                f"no network to download it; on one that has, run python -c \"import torchvision; "
                f"torchvision.models.get_model('{arch}', weights='{enum}')\" (or download {enum.url}) and copy "
                f"the file to {path} (set TORCH_HOME to use another cache), or pass model.weights=/path/to/"
                "state_dict.pt.")
        try:
            model = tvm.get_model(arch, weights=enum, progress=False, **kwargs)
        except Exception as exc:  # noqa: BLE001  (torch.hub raises for a damaged or mismatched file)
            raise UserError(f"model.weights={weights}: {path} does not load ({str(exc).splitlines()[0][:400]}). "
                            "Delete it and place an intact copy there.") from None
    else:
        model = tvm.get_model(arch, weights=None, **kwargs)
        if kind == "file" and not on_meta:
            path = Path(str(weights)).expanduser()
            if not path.is_file():
                weights_identity(weights)  # its message
            _load_state_dict(model, _read_state_dict(path), str(weights), arch)
    mean, std = normalization_of(enum)
    return _add_normalize(model, mean, std).eval()


def model_classes(model: nn.Module) -> int | None:
    """The number of outputs of a torchvision model's classifier (its last Linear or 1x1 Conv2d)."""
    last = None
    for m in model.modules():
        if isinstance(m, nn.Linear):
            last = m.out_features
        elif isinstance(m, nn.Conv2d) and m.kernel_size == (1, 1):
            last = m.out_channels
    return last
