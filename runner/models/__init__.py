"""The model zoo, one module per family, and building a model from its config (`model=` group).

A model config names the class or factory in `_target_` (Hydra's convention); its other keys, less the ones
that choose what to convert later (approx_layers, other_layers) and the name, are the constructor's keyword
arguments. The zoo's configs take in_channels, image_size and num_classes from the data config, and the data
set's normalisation (mean, std) is passed to zoo models, which apply it as their first step so it can fold
into the first conv. A user's model (`model=custom model._target_=pkg.module.Class`) gets only the keys its
config has; see docs/models.md for the Python API that converts any nn.Module."""
from __future__ import annotations

import inspect

from torch import nn

from runner.errors import UserError
from runner.models.common import (chain_matches, fold_batchnorm, fold_input_normalization, Normalize, PadWith,
                                  run_from, run_until, set_module, stage_position, stages_of)
from runner.models.lenet import LeNet5

# model name -> its class or factory (what configs/model/<name>.yaml names in _target_)
ZOO = {
    "lenet5": "runner.models.lenet.LeNet5",
    "resnet8": "runner.models.resnet.resnet8",
    "resnet20": "runner.models.resnet.resnet20",
    "vgg": "runner.models.vgg.VGG",
    "mobilenetv2": "runner.models.mobilenetv2.MobileNetV2",
    "vit": "runner.models.vit.ViT",
}

# model.* keys that are not constructor arguments
NOT_KWARGS = ("name", "_target_", "approx_layers", "other_layers", "approx_matmuls")

__all__ = ["ZOO", "LeNet5", "Normalize", "PadWith", "build_model", "chain_matches", "fold_batchnorm",
           "fold_input_normalization", "run_from", "run_until", "stage_position", "stages_of"]


def _target(cfg) -> str:
    target = cfg.get("_target_") if "_target_" in cfg else None  # `in` is False for a missing (???) value
    if target is None and cfg.get("name") in ZOO:  # a config written before models had _target_
        target = ZOO[cfg.name]
    if not target:
        raise UserError(f"model={cfg.get('name')} names no class: pass model._target_=pkg.module.Class "
                        f"(an nn.Module), or choose a zoo model: {', '.join(ZOO)}.")
    return str(target)


def build_model(cfg, mean=0.0, std=1.0) -> nn.Module:
    """cfg: the `model` config node; mean, std: the data set's normalisation, for the zoo's models (and for a
    user's class whose constructor takes `mean` and `std`)."""
    from hydra.utils import get_object
    from omegaconf import OmegaConf

    target = _target(cfg)
    try:
        factory = get_object(target)
    except Exception as exc:  # noqa: BLE001  (hydra wraps import errors in its own types)
        raise UserError(f"model._target_={target} cannot be imported ({str(exc).splitlines()[0]}). Give the "
                        "full dotted path of an nn.Module class or factory importable from PYTHONPATH.") from None
    kwargs = {k: v for k, v in OmegaConf.to_container(cfg, resolve=True).items() if k not in NOT_KWARGS}
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for key, value in (("mean", mean), ("std", std)):
        if key in params or (takes_any and target in ZOO.values()):
            kwargs.setdefault(key, value)
    try:
        model = factory(**kwargs)
    except TypeError as exc:
        raise UserError(f"model._target_={target} does not take the arguments {sorted(kwargs)}: {exc}. Drop or add "
                        "model.<key>=... overrides to match its constructor.") from None
    if not isinstance(model, nn.Module):
        raise UserError(f"model._target_={target} built a {type(model).__name__}, not a torch nn.Module.")
    # attention made explicit (its projections and products layers of their own): a rewrite that computes the
    # same, and leaves the parameters' names of models without attention as they were
    from runner.attention import explicit_attention, use_matmuls

    return use_matmuls(explicit_attention(model), bool(cfg.get("approx_matmuls", False)))
