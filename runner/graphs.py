"""A model's forward replayed from CUDA graphs, one per input shape: what the timed passes of an evaluation run on
a GPU (eval.cuda_graph). At compare's batch of 1,000 a LeNet-5 forward is about 20 small kernels; launched one by
one from Python, the host's dispatch and the launch gaps take longer than the kernels themselves, and a graph
replays them in one launch. The predictions never come from a replay: the evaluation's first pass runs eagerly
(it also makes every first-call choice, auto's timed kernel picks among them, outside any capture)."""
from __future__ import annotations

import torch
from torch import nn

from runner.linking import in_forward


class GraphedForward:
    """model(x) from a CUDA graph captured for x's shape and dtype, after an eager warm-up on a side stream; any
    shape on the CPU, or after a capture failed (an op that synchronises with the host, data-dependent shapes),
    runs eagerly. The model must not change between calls (its layers, tables, scales): the graph holds the
    kernels and arguments of the capture. Forward hooks are left out of the capture: they are Python that a
    replay does not run (the non-finite input check reads the first, eager pass's flags)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.graphs: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.cuda.CUDAGraph]] = {}
        self.failure = ""  # why the forward runs eagerly, once a capture failed

    def prepare(self, x: torch.Tensor) -> None:
        """Capture for x's shape now (an untimed moment) rather than on its first call."""
        if self._wants_graph(x) and self._key(x) not in self.graphs:
            self._capture(x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self._wants_graph(x):
            return self.model(x)
        entry = self.graphs.get(self._key(x)) or self._capture(x)
        if entry is None:
            return self.model(x)
        static_x, static_out, graph = entry
        static_x.copy_(x)
        graph.replay()
        return static_out.clone()  # the next replay overwrites static_out

    def _wants_graph(self, x) -> bool:
        return isinstance(x, torch.Tensor) and x.is_cuda and not self.failure

    @staticmethod
    def _key(x: torch.Tensor) -> tuple:
        return tuple(x.shape), x.dtype, x.device

    def _capture(self, x: torch.Tensor):
        hooks = self.model._forward_hooks, self.model._forward_pre_hooks
        try:
            static_x = x.clone()
            side = torch.cuda.Stream(x.device)
            side.wait_stream(torch.cuda.current_stream(x.device))
            with torch.cuda.stream(side), torch.no_grad():  # warm-up off the capturing stream, as torch asks
                for _ in range(2):
                    self.model(static_x)
            torch.cuda.current_stream(x.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            self.model._forward_hooks, self.model._forward_pre_hooks = type(hooks[0])(), type(hooks[1])()
            with torch.no_grad(), torch.cuda.graph(graph), in_forward(self.model):  # hooks off, hand-offs on
                static_out = self.model(static_x)
        except RuntimeError as exc:  # what cannot be captured runs eagerly, as before
            self.failure = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            torch.cuda.synchronize(x.device)
            return None
        finally:
            self.model._forward_hooks, self.model._forward_pre_hooks = hooks
        self.graphs[self._key(x)] = entry = (static_x, static_out, graph)
        return entry
