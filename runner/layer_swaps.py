"""One converted model for the evaluations that each approximate other layers of it (sensitivity, search)."""
from __future__ import annotations

import copy

import torch
from torch import nn

from runner.layers import check_signedness, consumer_links, converted_layer, link_consumers
from runner.models import set_module
from runner.quant import ActStats, QuantConfig


class LayerSwaps:
    """One converted model for the evaluations that each approximate other layers of it, every other layer
    fake-quant (model.other_layers=fakequant: sensitivity, search). Converting the whole model per evaluation
    copies every layer, quantizes every weight and traces the forward (half a second for a ResNet-50 on a CPU,
    more than its evaluation from the kept prefix on a GPU); here the layers under test are swapped in as LUT
    layers and the previous evaluation's put back as the fake-quant layers they were. The model's structure,
    and so its consumer links, do not depend on which layers are swapped: traced once.
    `fake_model`: convert_model(..., fake=True, others="fakequant") of `folded`, the model every layer of which
    is fake-quant under the evaluations' signedness (copied: the reference model itself stays as it is)."""

    def __init__(self, fake_model: nn.Module, folded: nn.Module, qcfg: QuantConfig, stats: dict[str, ActStats],
                 backend: str, algo: str):
        self.model = copy.deepcopy(fake_model)
        self.folded, self.qcfg, self.stats, self.backend, self.algo = folded, qcfg, stats, backend, algo
        self._fake: dict[str, nn.Module] = {}  # a swapped-in layer's name: the fake-quant layer it replaced
        self._links = consumer_links(self.model)

    def install(self, multipliers: dict, layers: list[str]) -> nn.Module:
        """The model with `layers` (names) as LUT layers of their multipliers, every other layer fake-quant; a
        layer that stays swapped keeps its LUT layer (set_multiplier loads another table into it)."""
        check_signedness({n: multipliers[n] for n in layers}, self.stats)
        for name in [n for n in self._fake if n not in layers]:
            set_module(self.model, name, self._fake.pop(name))
        for name in layers:
            current = self.model.get_submodule(name)
            if current.signed != multipliers[name].signed:
                raise ValueError(f"LayerSwaps: {name} has signed={current.signed}, its multiplier "
                                 f"{multipliers[name].name} does not: the swaps serve one signedness per layer")
            if name in self._fake:  # swapped in by an earlier evaluation: set_multiplier loads this one's table
                continue
            new = converted_layer(self.folded.get_submodule(name), name, multipliers[name], self.qcfg, self.stats,
                                  self.backend, self.algo, fake=False)
            self._fake[name] = current
            set_module(self.model, name, new.to(_device_of(current)))
        link_consumers(self.model, self._links)
        return self.model.eval()


def _device_of(module: nn.Module) -> torch.device:
    return next((t.device for t in module.parameters()), None) or \
        next((t.device for t in module.buffers()), torch.device("cpu"))
