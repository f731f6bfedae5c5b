"""The search's descent on a synthetic accuracy model (no network): its evaluations grow linearly with the
number of layers, and search.max_distinct=k bounds the different tables in the result."""
import dataclasses

import pytest
import torch

from runner.errors import UserError
from runner.multipliers import resolve
from runner.search import check, cheapest_within, distinct, evaluate_uniform, greedy
from tests.conftest import compose

CANDIDATES = ["mul8s_1KV8", "mul8s_1L2J", "mul8s_1KX5", "mul8s_1L2N"]


class FakeEvaluator:
    """Accuracy = fake-quant - the sum of per-(layer, table) losses (seeded), counting evaluations."""

    def __init__(self, layers, candidates, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.layers, self.exact = layers, resolve("exact")
        self.fakequant_accuracy, self.evals = 0.9, 0
        self.cost = {(n, m.name): float(torch.rand(1, generator=gen)) * 0.004 * (i + 1)
                     for n in layers for i, m in enumerate(candidates)}

    def accuracy(self, assign):
        self.evals += 1
        return self.fakequant_accuracy - sum(self.cost.get((n, m.name), 0.0) for n, m in assign.items())


def _run(n_layers, max_distinct=None, max_loss=0.5):
    layers = [f"layer{i}.conv" for i in range(n_layers)]
    candidates = [resolve(c) for c in CANDIDATES]
    ev = FakeEvaluator(layers, candidates)
    macs = {n: 1000 * (1 + i % 3) for i, n in enumerate(layers)}
    log = []
    evaluate_uniform(ev, candidates, layers, macs, log)
    chosen = greedy(ev, candidates, layers, macs, max_loss, 10_000, log, max_distinct)
    return ev, chosen, candidates, layers, macs, log


def test_evaluations_grow_linearly_with_layers():
    counts = {n: _run(n)[0].evals for n in (4, 8, 16, 32)}
    for n, evals in counts.items():
        assert evals <= 3 * n * len(CANDIDATES) + len(CANDIDATES)
    assert counts[32] / counts[4] < 8 * 1.5  # 8x the layers: about 8x the evaluations, not more


@pytest.mark.parametrize("k", [1, 2, 3])
def test_max_distinct_bounds_the_tables_used(k):
    ev, chosen, candidates, layers, macs, log = _run(12, max_distinct=k, max_loss=2.0)
    free = _run(12, max_loss=2.0)[1]
    assert distinct(free) > 3  # the limit binds: unconstrained, the descent uses more tables
    chosen = cheapest_within(chosen, candidates, layers, macs, log, ev.fakequant_accuracy, 2.0)
    everywhere = {n: ev.exact for n in layers}
    assert distinct({**everywhere, **chosen}) <= k
    assert 100 * (ev.fakequant_accuracy - ev.accuracy(chosen)) <= 2.0
    if k == 1:  # the descent cannot move from exact; a uniform table within budget is cheaper
        assert len({m.name for m in chosen.values()}) == 1 and next(iter(chosen.values())).name != "exact"


def test_distinct_counts_tables_by_content():
    a = resolve("exact")
    b = dataclasses.replace(a, name="exact_copy")
    assert distinct({"x": a, "y": b}) == 1


@pytest.mark.parametrize("bad", ["0", "-1", "1.5", "true"])
def test_max_distinct_must_be_a_positive_integer(bad):
    with pytest.raises(UserError, match="max_distinct"):
        check(compose("search", [f"search.max_distinct={bad}"]))


def test_max_evals_bounds_the_descent_not_the_one_layer_table():
    """A budget smaller than the one-layer table (layers x candidates) still leaves the descent its
    evaluations: the search moves off exact and spends at most max_evals beyond the table."""
    layers = [f"layer{i}.conv" for i in range(8)]
    candidates = [resolve(c) for c in CANDIDATES]
    ev = FakeEvaluator(layers, candidates)
    macs = {n: 1000 for n in layers}
    table_evals = len(layers) * len(candidates)
    chosen = greedy(ev, candidates, layers, macs, 0.5, 5, [])
    assert any(m.name != "exact" for m in chosen.values())
    assert ev.evals <= table_evals + 5


class _StepEvaluator:
    """Each approximated layer costs exactly 2**-7 of accuracy (0.78125 points): sums stay exact in binary."""

    def __init__(self, layers):
        self.layers, self.exact, self.fakequant_accuracy, self.evals = layers, resolve("exact"), 0.75, 0

    def accuracy(self, assign):
        self.evals += 1
        return self.fakequant_accuracy - 2 ** -7 * sum(m.name != self.exact.name for m in assign.values())


@pytest.mark.parametrize("max_loss, approximated", [(0.78125, 1), (0.78, 0), (2 * 0.78125, 2), (1.5, 1)])
def test_a_move_exactly_on_the_budget_is_accepted(max_loss, approximated):
    """The budget is `within max_loss points`: a loss equal to it is within (docs/exploration.md)."""
    layers = ["a", "b"]
    ev, m = _StepEvaluator(layers), resolve("mul8s_1L2N")
    chosen = greedy(ev, [m], layers, {"a": 1000, "b": 2000}, max_loss, 100, [])
    assert sum(c.name == m.name for c in chosen.values()) == approximated
    log = [{"kind": "uniform", "assignment": m.name, "val_accuracy": ev.accuracy({n: m for n in layers}),
            "mult_energy_rel": 0.1}]
    uniform = cheapest_within({n: ev.exact for n in layers}, [m], layers, {"a": 1000, "b": 2000}, log,
                              ev.fakequant_accuracy, max_loss)
    assert all(c.name == m.name for c in uniform.values()) == (max_loss >= 2 * 0.78125)
