"""Run a model over a test set: predictions plus latency (warm-up, then median of timed repeats;
CUDA work is timed with events after synchronising)."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn

from runner.data.dataset import loaded
from runner.errors import UserError, config_number
from runner.graphs import GraphedForward
from runner.layer_checks import check_non_finite_inputs


@dataclass
class Timed:
    predictions: torch.Tensor     # int64 [N] on CPU
    logits: torch.Tensor          # float32 [N, classes] on CPU (from the first pass)
    batch_ms: list[float]         # every timed batch of every repeat
    pass_ms: list[float]          # each timed pass over the whole set
    timed_as: str = "eager"       # "cuda_graph": the timed passes replayed CUDA graphs (runner.graphs)

    @property
    def latency_ms_median(self) -> float:
        return statistics.median(self.batch_ms) if self.batch_ms else float("nan")

    @property
    def total_ms_median(self) -> float:
        return statistics.median(self.pass_ms) if self.pass_ms else float("nan")


class Clock:
    """Wall time on CPU; CUDA events on GPU (they measure the device, not the launch queue)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def start(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def ms_since(self, t0) -> float:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            return t0.elapsed_time(end)
        return (time.perf_counter() - t0) * 1e3


def device_timer(device, queued=True):
    """fn -> microseconds of one call, by Clock (CUDA events on the GPU).
    queued: a sleep kernel keeps the GPU busy while the host dispatches fn, so that the events
    time the device's work, as in a pipeline where the host runs ahead (an idle GPU would also
    wait for Python and the dispatcher)."""
    clock = Clock(device)

    def run(fn):
        if clock.cuda:
            torch.cuda.synchronize(device)
            if queued:
                torch.cuda._sleep(400_000)
        t0 = clock.start()
        fn()
        return clock.ms_since(t0) * 1e3
    return run


def check_eval_config(e) -> None:
    """The eval block: a bad value stops the run before any work (eval.limit=-5 would otherwise slice
    the test set from the end, eval.batch_size=0 fail deep inside)."""
    config_number(e.batch_size, "eval.batch_size", minimum=1)
    config_number(e.warmup, "eval.warmup", minimum=0)
    # 0: no timed pass, the latency columns empty (a study that wants accuracies only: a sensitivity map started
    # from kept prefixes would otherwise still run every model whole once to time it)
    config_number(e.repeats, "eval.repeats", minimum=0)
    config_number(e.get("limit"), "eval.limit", minimum=1, optional=True)
    if not isinstance(e.get("cuda_graph", True), bool):
        raise UserError(f"eval.cuda_graph={e.get('cuda_graph')!r}: choose true or false.")


@torch.no_grad()
def run_timed(model: nn.Module, x: torch.Tensor, batch_size: int, device: torch.device,
              warmup: int = 1, repeats: int = 3, logits: torch.Tensor | None = None, cuda_graph: bool = True) -> Timed:
    """logits: the model's outputs over x when the caller has them (computed from kept activations);
    the timed passes still run the whole model. cuda_graph: on a GPU the warm-up and timed passes replay a CUDA
    graph per batch shape (runner.graphs; the predictions come from the eager first pass either way), or run
    eagerly where the model cannot be captured."""
    model = model.eval().to(device)
    # a tensor's batches move to the device once; a lazily read set (runner.data.Images) is read a batch at a
    # time in every pass, so memory holds one batch (its per-batch times exclude the read, its passes do not)
    lazy = not isinstance(x, torch.Tensor)
    batches = [x[i:i + batch_size] if lazy else x[i:i + batch_size].to(device) for i in range(0, len(x), batch_size)]
    clock = Clock(device)
    if logits is None:  # the first pass yields the predictions and is the first warm-up pass
        logits = torch.cat([model(b).float().cpu() for b in loaded(batches, device)])
        check_non_finite_inputs(model)
        warmup -= 1
    if not repeats:
        warmup = 0
    forward = model
    if repeats and cuda_graph and device.type == "cuda":
        forward = GraphedForward(model)
        first = next(iter(loaded(batches[:1], device)))
        for n in dict.fromkeys(len(b) for b in batches):  # the full batch's size, and the last one's
            forward.prepare(first[:n])  # captured before the timing, from the first batch's images
        del first
    for _ in range(max(0, warmup)):
        for b in loaded(batches, device):
            forward(b)
    batch_ms, pass_ms = [], []
    for _ in range(repeats):
        t_pass = clock.start()
        for b in loaded(batches, device):
            t0 = clock.start()
            forward(b)
            batch_ms.append(clock.ms_since(t0))
        pass_ms.append(clock.ms_since(t_pass))
    check_non_finite_inputs(model)
    timed_as = "cuda_graph" if forward is not model and forward.graphs and not forward.failure else "eager"
    return Timed(logits.argmax(1), logits, batch_ms, pass_ms, timed_as)


def run_timed_sharded(model: nn.Module, x: torch.Tensor, batch_size: int, device: torch.device,
                      warmup: int = 1, repeats: int = 3, cuda_graph: bool = True) -> Timed:
    """run_timed over the ranks of a process group (runner.distributed): rank r runs the batches r, r + W, ...
    of the one-process run's batches, so every image is computed in the batch it would be in on one device
    (dynamic scales, which depend on the batch, give the same codes), and every rank gets every image's
    prediction back in order: the counts, and so the row, are the one-device run's. Timings: each batch's
    latency from every rank; a pass's time is the slowest rank's pass. The logits stay each rank's own
    (only the predictions travel)."""
    import torch.distributed as dist

    from runner.distributed import rank_world

    rank, world = rank_world()
    starts = list(range(0, len(x), batch_size))
    mine = starts[rank::world]
    if isinstance(x, torch.Tensor):
        part = torch.cat([x[i:i + batch_size] for i in mine]) if mine else x[:0]
    else:  # a lazily read set (runner.data.Images): a view of this rank's images, still read a batch at a time
        part = x.take(torch.cat([torch.arange(i, min(i + batch_size, len(x))) for i in mine]) if mine
                      else torch.zeros(0, dtype=torch.int64))
    timed = run_timed(model, part, batch_size, device, warmup=warmup, repeats=repeats, cuda_graph=cuda_graph) \
        if mine else \
        Timed(torch.zeros(0, dtype=torch.int64), torch.zeros(0), [], [0.0] * repeats)
    gathered = [None] * world
    dist.all_gather_object(gathered, (timed.predictions, timed.batch_ms, timed.pass_ms, timed.timed_as))
    chunks = {}
    for r, (preds, *_) in enumerate(gathered):
        for j, i in enumerate(starts[r::world]):
            size = min(batch_size, len(x) - i)
            offset = j * batch_size  # every batch of a rank but its last is full
            chunks[i] = preds[offset:offset + size]
    predictions = torch.cat([chunks[i] for i in starts]) if starts else timed.predictions
    batch_ms = [ms for _, b, _, _ in gathered for ms in b]
    pass_ms = [max(p[k] for _, _, p, _ in gathered) for k in range(len(timed.pass_ms))]
    kinds = {how for _, b, _, how in gathered if b}  # the ranks that timed batches
    return Timed(predictions, timed.logits, batch_ms, pass_ms, kinds.pop() if len(kinds) == 1 else "eager")
