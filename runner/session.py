"""What the evaluations of one command share, so a sweep, a sensitivity table or a search does not
redo work that is unchanged between its jobs.

One process-wide `Session` (the basic launcher runs every job of a command in this process; a joblib
worker gets its own) keeps: data sets, baselines, calibration per (baseline, quant scheme, seed),
fake-quant models, converted approx models (each evaluation loads its own tables into the one for its
model and quant scheme), the predictions of each reference row (by row key), and the activations that reach
the first approximated layer when the layers before it are the same in many evaluations (sensitivity:
all fake-quant but one layer). Every cache key holds everything that determines the cached value, so a
hit is the value a fresh computation would give."""
from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from runner import distributed
from runner.data.dataset import loaded
from runner.layer_checks import check_non_finite_inputs
from runner.attention import matmul_layers, use_matmuls
from runner.models import chain_matches, fold_input_normalization, run_from, run_until, stage_position


def cache_key(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Prefix:
    """What the layers before an evaluation's first approximated layer compute: `base` names the model, data
    split and quantization, `before` those layers in forward order with what each computes. A prefix whose
    `before` begins another's, under the same base, computes the same activations up to the other's stage."""
    base: str
    before: tuple = ()


class Session:
    # activations kept for starting mid-model: 1,000 mnist images at conv2 take 3.5 MB, at full MNIST 35 MB
    MAX_PREFIXES = 8

    def __init__(self):
        self._data: dict = {}
        self._baselines: dict = {}
        self._calibrations: dict = {}
        self._memo: dict = {}
        self._predictions: dict = {}
        self._prefixes: OrderedDict = OrderedDict()

    def dataset(self, data_cfg: DictConfig):
        from runner.data import load_dataset

        key = cache_key(OmegaConf.to_container(data_cfg, resolve=True))
        if key not in self._data:
            from runner.train import held_apart, left_out

            cfg = OmegaConf.create({"data": data_cfg})
            self._data[key] = left_out(held_apart(load_dataset(data_cfg), cfg), cfg)
        return self._data[key]

    def baseline(self, cfg: DictConfig):
        """(model, meta, checkpoint path, data) as runner.train.load_or_train returns them; a checkpoint file
        rewritten since (another process retrained it) is read again."""
        from runner.train import baseline_path, load_or_train

        path = baseline_path(cfg)
        hit = self._baselines.get(str(path))
        if hit is not None and path.exists() and hit[0] == path.stat().st_mtime_ns \
                and hit[1][3] is self.dataset(cfg.data):  # given weights serve every data set of their classes
            return self._matmuls(hit[1], cfg)
        result = load_or_train(cfg, data=self.dataset(cfg.data))
        self._baselines[str(path)] = (path.stat().st_mtime_ns if path.exists() else None, result)
        return self._matmuls(result, cfg)

    @staticmethod
    def _matmuls(result, cfg):
        """The baseline with its attention products layers or not, as this config says (a sweep's jobs may differ
        in model.approx_matmuls and share the checkpoint and its model)."""
        use_matmuls(result[0], bool(cfg.model.get("approx_matmuls", False)))
        return result

    def calibration(self, model: nn.Module, ckpt: Path, calib_x: torch.Tensor, qcfg, seed: int):
        """(model with BatchNorm and the input normalisation folded into the convs (fold_input_normalization), on
        CPU; calibration statistics of every layer)."""
        from runner.quant import calibrate

        key = (str(ckpt), cache_key(qcfg.as_dict()), seed, id(model), id(calib_x))
        if key not in self._calibrations:
            folded = fold_input_normalization(model, calib_x[:1])
            # Under several ranks rank 0 alone calibrates, with every core, and the others take its statistics:
            # four ranks calibrating on the CPU at once made a 4-GPU ResNet-18 retraining's set-up about three
            # times the one-GPU command's (their threads on the same cores), and every rank needs the same scales
            stats = distributed.broadcast_object(calibrate(folded, calib_x, qcfg, seed=seed)
                                                 if distributed.is_main() else None)
            # the inputs stay referenced with their result, so their ids cannot be reused by other objects
            self._calibrations[key] = (folded.cpu(), stats, model, calib_x)
        folded, stats = self._calibrations[key][:2]
        # the products are layers as the model's are now (calibration observed them either way)
        use_matmuls(folded, any(m.approx for m in matmul_layers(model).values()))
        return folded, stats

    def memo(self, key, build):
        """build() once per key (fake-quant models, operand histograms)."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def predictions(self, key: str):
        return self._predictions.get(key)

    def keep_predictions(self, key: str, predictions: torch.Tensor) -> None:
        self._predictions[key] = predictions

    @torch.no_grad()
    def logits_from(self, model: nn.Module, x: torch.Tensor, batch_size: int, device: torch.device,
                    start: str | None, prefix: Prefix | None) -> torch.Tensor:
        """The model's logits over x (on CPU), computed from the stage holding `start` onwards with the kept
        input of that stage when `prefix` names what the layers before it compute; the first evaluation under a
        prefix keeps it, within a memory budget (prefix_budget: what does not fit is recomputed, never evicted
        half-way). A kept input of an earlier stage whose layers compute the same (its Prefix.before begins
        ours) is carried forward through the stages between instead of running the model from its input: a
        one-layer sensitivity or search walks the layers in order, so the part of the model before the layer it
        approximates runs about once over the images in all, not once per layer.
        A model whose forward is not the chain of its stages (runner.models.chain_matches) runs whole."""
        model = model.eval().to(device)
        batches = [x[i:i + batch_size] for i in range(0, len(x), batch_size)]
        if start is None or prefix is None or not batches or not self._chain_ok(model, batches[0], start, device):
            logits = torch.cat([model(b).float().cpu() for b in loaded(batches, device)])
            check_non_finite_inputs(model)
            return logits
        key = (prefix, start, device.type, batch_size, len(x))
        kept = self._prefixes.get(key)
        if kept is not None:
            self._prefixes.move_to_end(key)
            logits = torch.cat([run_from(model, a, start).float().cpu() for a in kept])
            check_non_finite_inputs(model)
            return logits
        after, earlier = self._earlier_prefix(model, key)
        budget, used, out = prefix_budget(device), 0, []
        kept = []
        inputs = earlier if earlier else loaded(batches, device)
        for a in inputs:  # one batch at a time: this evaluation's logits and, while they fit, its prefix
            a = run_until(model, a, start, after=after)
            out.append(run_from(model, a, start).float().cpu())
            used += a.numel() * a.element_size()
            kept = kept + [a] if kept is not None and used <= budget else None
        check_non_finite_inputs(model)
        if kept is not None:
            self._prefixes[key] = kept
            while len(self._prefixes) > self.MAX_PREFIXES or (
                    len(self._prefixes) > 1 and sum(_bytes(v) for v in self._prefixes.values()) > budget):
                self._prefixes.popitem(last=False)
        return torch.cat(out)

    def _earlier_prefix(self, model: nn.Module, key) -> tuple[str | None, list | None]:
        """(layer, kept stage inputs) of the latest kept prefix this one continues: the same images, batches,
        device and reference, layers before it that are the first of ours, in a stage at or before ours;
        (None, None) when there is none."""
        prefix, start = key[0], key[1]
        best, best_pos = None, -1
        pos = stage_position(model, start)
        for kept_key in self._prefixes:
            p, s = kept_key[0], kept_key[1]
            if kept_key[2:] != key[2:] or p.base != prefix.base or p.before != prefix.before[:len(p.before)]:
                continue
            at = stage_position(model, s)
            if best_pos < at <= pos:
                best, best_pos = kept_key, at
        if best is None:
            return None, None
        self._prefixes.move_to_end(best)
        return best[1], self._prefixes[best]

    def _chain_ok(self, model: nn.Module, first: torch.Tensor, start: str, device: torch.device) -> bool:
        """Whether the model's forward is the chain of its stages, checked once per model (two passes over one
        batch): split anywhere, the stages run in the same order, so the answer holds for every stage that holds a
        layer; a layer in no stage runs the model whole."""
        key = ("chain", id(model))
        if key not in self._memo:  # the model stays referenced, so its id is not reused
            self._memo[key] = (chain_matches(model, first.to(device), start), model)
        if not self._memo[key][0]:
            return False
        try:
            stage_position(model, start)
        except ValueError:
            return False
        return True


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def prefix_budget(device: torch.device) -> int:
    """Bytes of kept activations: a quarter of a GPU's memory, 2 GiB of host memory on the CPU
    (APPROX_RUN_PREFIX_CACHE_MB overrides both). ResNet-50's input of layer2 at 224x224 is 3.2 MB an image, so
    5,000 images' prefix at its deepest-but-one stage fit an H100's quarter; what does not fit is recomputed."""
    import os

    if os.environ.get("APPROX_RUN_PREFIX_CACHE_MB"):
        return int(float(os.environ["APPROX_RUN_PREFIX_CACHE_MB"]) * 2**20)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory // 4
    return 2 * 2**30


_SESSION: Session | None = None


def get() -> Session:
    global _SESSION
    if _SESSION is None:
        _SESSION = Session()
    return _SESSION


def reset() -> None:
    """Forget everything (tests; a command that changed checkpoints on disk)."""
    global _SESSION
    _SESSION = None
