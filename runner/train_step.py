"""One training step (forward, loss, backward, optimizer step, the quantized layers' weight requantization)
on buffers of fixed address, replayed as one CUDA graph on a GPU.

At LeNet-5's sizes a GPU step is a few hundred kernels of microseconds each: the host's Python, dispatcher
and launches, not the GPU, set the step's time. A CUDA graph launches the whole step at once, so a step
costs one copy of the batch's indices, one learning-rate write and one replay.

What capture needs, and where it is met:
- the step reads and writes the same tensors every time: the batch arrives by copy into static buffers
  (its indices into training data that already sit on the GPU, or the batch itself); parameters, gradients
  (None before capture, so the graph allocates them once), optimizer states and the layers' weight codes
  and scales keep their addresses;
- no host wait and no host decision on device values inside the step: the optimizer is fused (one kernel
  per group, its step counter on the device) and reads its learning rate from a device tensor, which the
  caller's schedule refills between replays; loss, accuracy and a non-finite-loss flag accumulate on the
  device; the layers' input checks set device flags (runner.layers);
- the quantized layers requantize their weights after the optimizer step inside the graph
  (refresh_weight_quant: pure tensor ops), so every replay's forward sees the codes of the current weights;
- the CUDA kernels' own state is settled before capture: `auto`'s timed choice per shape (autotune.cpp)
  is made in the eager warm-up steps, and the prepared-table cache (table_cache.cpp) builds the tables
  inside the graph, not from its cache, because the weight codes' version counter moved since the last
  call (bumped here before capture, so that holds whatever happened before);
- replays change tensors without bumping their version counters, so after each replay the counters of
  the model's tensors are bumped here: the next eager use (a partial batch, evaluation, recalibration)
  requantizes, and the kernels' table cache does not serve a table of older weights.

A step whose batch shape differs from the captured one (the last partial batch of an epoch) runs eagerly on
the same tensors. A model whose step cannot be captured (an op that reads device values on the host, such
as torch's per-channel fake-quantize in a fake-quant layer's training forward) runs eagerly with the reason
in `reason`; on the CPU every step is eager and the optimizer is torch's default, as before graphs."""
from __future__ import annotations

import contextlib
import warnings
from typing import Callable

import torch
from torch import nn

# eager steps before capture: the first call of a layer caches its tables and times auto's choice for them,
# the second times it for the uncached tables training uses; one more for allocator and library warm-up
GRAPH_WARMUP = 3
# the buffers a step writes besides the parameters: runner.layers' requantization
TRACKED_BUFFERS = ("weight_codes", "weight_scale")


def step_optimizer(params, name: str, lr: float, weight_decay: float, device: torch.device):
    """(optimizer, lr tensor or None). On the CPU torch's default implementation and a float learning rate; on
    a GPU the fused one (no host wait, capturable) reading its learning rate from a device tensor, whether
    the step then runs as a graph or not, so both runs do the same arithmetic."""
    if device.type != "cuda":
        if name == "sgd":
            return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay), None
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay), None
    lr_t = torch.tensor(float(lr), dtype=torch.float32, device=device)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr_t, momentum=0.9, weight_decay=weight_decay, fused=True), lr_t
    return torch.optim.Adam(params, lr=lr_t, weight_decay=weight_decay, fused=True, capturable=True), lr_t


class TrainStep:
    """step(*batch, lr=None) -> the step's loss (a device tensor; in graph mode the graph's static output,
    valid until the next step). `loss_of(*batch)` computes (loss, logits, labels) from the batch's tensors;
    `lr`, when given, is this step's learning rate. Sums over the steps since reset_stats(): loss_sum
    (loss x batch size), correct (top-1 hits), bad (a non-finite loss), all on the device.

    mode: "graph" (captured or to be captured after GRAPH_WARMUP eager steps) or "eager"; reason: why eager."""

    def __init__(self, model: nn.Module, loss_of: Callable, optimizer: str, lr: float, weight_decay: float,
                 device: torch.device, cuda_graph: bool = True, warmup: int = GRAPH_WARMUP):
        self.model, self.loss_of, self.device = model, loss_of, device
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt, self.lr_tensor = step_optimizer(self.params, optimizer, float(lr), float(weight_decay), device)
        if self.lr_tensor is not None:  # the tensor the optimizer reads (its group's own, should it copy ours)
            self.lr_tensor = self.opt.param_groups[0]["lr"]
        self._lr = float(lr)
        self.loss_sum = torch.zeros((), device=device)
        self.correct = torch.zeros((), dtype=torch.int64, device=device)
        self.bad = torch.zeros((), dtype=torch.bool, device=device)
        if device.type != "cuda":
            self.mode, self.reason = "eager", "not a CUDA device"
        elif not cuda_graph:
            self.mode, self.reason = "eager", "finetune.cuda_graph=false"
        else:
            self.mode, self.reason = "graph", ""
        self.warmup, self.steps = int(warmup), 0
        self.graph = None
        self._shapes = None  # the first batch's: the one shape a graph is captured for
        self._static_in = self._static_loss = None
        # this device's streams for warm-up and capture (torch's default capture stream is one per process,
        # made on whichever GPU was current first: a worker training on another GPU must not use it)
        self._side = torch.cuda.Stream(device) if self.mode == "graph" else None
        self._capture_stream = torch.cuda.Stream(device) if self.mode == "graph" else None
        # what replays change without bumping version counters (see the module docstring); not the tables,
        # which training never changes (their version keys the layers' slope cache and the kernels' table cache)
        self._tracked = [t for name, t in (*model.named_parameters(), *model.named_buffers())
                         if name.rpartition(".")[2] in TRACKED_BUFFERS or t.requires_grad]
        self._tracked = [t for t in self._tracked if not t.is_inference()]
        self.replays = self.eager_steps = 0

    # -------------------------------------------------------------------------------------------------
    def set_lr(self, lr: float) -> None:
        if lr == self._lr:
            return
        self._lr = lr
        if self.lr_tensor is not None:
            self.lr_tensor.fill_(lr)  # one small kernel between replays, no host wait
        else:
            for group in self.opt.param_groups:
                group["lr"] = lr

    @property
    def lr(self) -> float:
        return self._lr

    def reset_stats(self) -> None:
        self.loss_sum.zero_()
        self.correct.zero_()

    def __call__(self, *batch: torch.Tensor, lr: float | None = None) -> torch.Tensor:
        if lr is not None:
            self.set_lr(float(lr))
        self.steps += 1
        if self._shapes is None:
            self._shapes = [(a.shape, a.dtype) for a in batch]
        if self.mode == "graph" and self.graph is None and self.steps > self.warmup and self._fits(batch):
            self._capture(batch)  # on failure: mode eager, with the reason
        if self.graph is not None and self._fits(batch):
            return self._replay(batch)
        if self.mode == "graph" and self.graph is None:  # warm-up: eager on a side stream, as capture will be
            current = torch.cuda.current_stream(self.device)
            self._side.wait_stream(current)
            with torch.cuda.stream(self._side):
                loss = self._eager(batch)
            current.wait_stream(self._side)
            return loss
        return self._eager(batch)  # the CPU, graphs off or impossible, or a batch of another shape

    # -------------------------------------------------------------------------------------------------
    def _body(self, batch) -> torch.Tensor:
        """The step itself: what an eager step runs and what the graph records."""
        loss, logits, labels = self.loss_of(*batch)
        loss.backward()
        self.opt.step()
        refresh_quantized(self.model, force=True)
        with torch.no_grad():
            self.bad.logical_or_(~torch.isfinite(loss))
            self.loss_sum.add_(loss.detach(), alpha=len(labels))
            self.correct.add_((logits.argmax(1) == labels).sum())
        return loss.detach()

    def _eager(self, batch) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=True)
        self.eager_steps += 1
        with _quiet_capturable(self.opt):
            return self._body(batch)

    def _fits(self, batch) -> bool:
        return len(batch) == len(self._shapes) and all(
            (a.shape, a.dtype) == shape for a, shape in zip(batch, self._shapes))

    def _replay(self, batch) -> torch.Tensor:
        for a, s in zip(batch, self._static_in):
            s.copy_(a, non_blocking=True)
        with torch.cuda.device(self.device):  # a replay runs on the current device's current stream
            self.graph.replay()
        torch.autograd.graph.increment_version(self._tracked)
        self.replays += 1
        return self._static_loss

    def _capture(self, batch) -> bool:
        """Record the step as a CUDA graph (nothing runs); False (and eager from now on) if it cannot be."""
        from runner.layer_checks import check_non_finite_inputs

        torch.cuda.synchronize(self.device)
        check_non_finite_inputs(self.model)      # an eager step's pending flag read waits on an event: not now
        # codes of the current weights before the graph's forward, with moved version counters, so that its
        # forward requantizes nothing and the kernels' table cache treats the codes as changing (no cached table)
        torch.autograd.graph.increment_version(self._tracked)
        refresh_quantized(self.model)
        self._static_in = [a.detach().clone() for a in batch]
        self.opt.zero_grad(set_to_none=True)     # the graph allocates the gradients, once
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.device(self.device), _input_hooks_off(self.model), \
                    torch.cuda.graph(graph, stream=self._capture_stream):
                self._static_loss = self._body(self._static_in)
        except Exception as exc:  # noqa: BLE001 - any failure: the eager step is always possible
            self._give_up(f"the step could not be captured as a CUDA graph ({type(exc).__name__}: "
                          f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''})")
            return False
        self.graph = graph
        return True

    def _give_up(self, reason: str) -> None:
        from runner.console import console

        self.mode, self.reason, self.graph = "eager", reason, None
        self._static_in = self._static_loss = None
        self.opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize(self.device)
        torch.autograd.graph.increment_version(self._tracked)
        console.print(f"[yellow]training step runs eagerly[/]: {reason}")

    def close(self) -> None:
        """After the last step: free the graph. Version counters move once more, so the next forward (eval:
        with the weights' NaN/Inf check) requantizes from the trained weights, as after an eager step."""
        self.graph = None
        self._static_in = self._static_loss = None
        torch.autograd.graph.increment_version(self._tracked)


def refresh_quantized(model: nn.Module, force: bool = False) -> None:
    """Every quantized layer's weight scale and codes from its current weights: those whose weights changed
    since (their version counter says), or all (force: inside a capture the counters of tensors an optimizer
    kernel wrote are not what decides; the graph must hold the requantization)."""
    from runner.layers import quantized_layers

    layers = list(quantized_layers(model, weights_only=True).values())
    if force:
        torch.autograd.graph.increment_version([m.weight for m in layers])
    for layer in layers:
        layer.refresh_weight_quant()


@contextlib.contextmanager
def _input_hooks_off(model: nn.Module):
    """Without the converted model's NonFiniteInputCheck forward hook while capturing: it copies the layers'
    flags to the host and waits on an event, which a graph cannot hold. The flags themselves are still set
    by the captured kernels; the next eager forward's hook, or read_input_flags, reads them."""
    from runner.layers import NonFiniteInputCheck

    saved = {k: h for k, h in model._forward_hooks.items() if isinstance(h, NonFiniteInputCheck)}
    for k in saved:
        del model._forward_hooks[k]
    try:
        yield
    finally:
        model._forward_hooks.update(saved)


def read_input_flags(model: nn.Module) -> None:
    """Raise (a UserError naming the layer) if some quantized layer's input held NaN or Inf since the flags
    were last cleared: what the forward hook reports for eager steps, for replayed ones. Waits for the device."""
    from runner.layers import NonFiniteInputCheck, quantized_layers

    layers = [(n, m) for n, m in quantized_layers(model).items() if m.nonfinite_input.is_cuda]
    if layers:
        NonFiniteInputCheck._raise(layers, torch.cat([m.nonfinite_input for _, m in layers]).cpu())


@contextlib.contextmanager
def _quiet_capturable(opt):
    """torch warns once when a capturable optimizer steps outside a capture; here eager steps are meant."""
    if not any(g.get("capturable") for g in opt.param_groups):
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*capturable=True.*")
        yield
