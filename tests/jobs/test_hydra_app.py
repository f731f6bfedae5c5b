"""compose_jobs: every job's config equals what composing that job alone gives, with one composition per
distinct set of overrides other than the multiplier, and resolved (no interpolation parsed again per read)."""
import hydra
import pytest
from omegaconf import OmegaConf

from runner.jobs.argv import expand_jobs
from runner.jobs.hydra_app import compose_jobs
from runner.jobs.plan import with_multiplier
from tests.conftest import compose


@pytest.fixture
def compositions(monkeypatch):
    """How many times Hydra composes (compose_jobs imports hydra.compose when it runs)."""
    calls = []
    real = hydra.compose

    def counted(*args, **kwargs):
        calls.append(kwargs.get("overrides"))
        return real(*args, **kwargs)

    monkeypatch.setattr(hydra, "compose", counted)
    return calls


def _strings(node):
    if isinstance(node, str):
        yield node
    elif isinstance(node, (dict, list)):
        for value in (node.values() if isinstance(node, dict) else node):
            yield from _strings(value)


def _alone(job, tmp_path):
    """A job's config composed by itself, as a launcher's process composes it (run_job adds the multiplier)."""
    return OmegaConf.to_container(with_multiplier(compose("sweep", job)), resolve=True)


def test_a_multiplier_only_sweep_composes_once(tmp_path, compositions):
    overrides = ["sweep.multiplier=mul8s_1KV8,mul8u_2V0,exact", "backend=python", f"paths.results={tmp_path}",
                 "+multiplier.layers={fc3: exact}"]
    jobs = expand_jobs(overrides)
    cfgs = compose_jobs("sweep", jobs, overrides)
    assert len(compositions) == 1
    assert [c.multiplier.name for c in cfgs] == ["mul8s_1KV8", "mul8u_2V0", "exact"]
    for job, cfg in zip(jobs, cfgs):
        composed = OmegaConf.to_container(cfg, resolve=False)
        assert composed == _alone(job, tmp_path)
        assert not [s for s in _strings(composed) if "${" in s]  # resolved: read as plain values
    cfgs[0].eval.limit = 7  # each job's config is its own
    assert cfgs[1].eval.limit != 7


def test_a_sweep_over_other_axes_composes_per_job(tmp_path, compositions):
    overrides = ["sweep.multiplier=mul8s_1KV8,mul8s_1L2N", "quant=per_channel_minmax,per_tensor_minmax",
                 "eval.limit=100,200", f"paths.results={tmp_path}"]
    jobs = expand_jobs(overrides)
    cfgs = compose_jobs("sweep", jobs, overrides)
    assert len(cfgs) == 8 and len(compositions) == 4  # one per (quant, eval.limit)
    assert {(c.quant.name, c.eval.limit, c.multiplier.name) for c in cfgs} == {
        (q, n, m) for q in ("per_channel_minmax", "per_tensor_minmax") for n in (100, 200)
        for m in ("mul8s_1KV8", "mul8s_1L2N")}
    for job, cfg in zip(jobs, cfgs):
        assert OmegaConf.to_container(cfg, resolve=False) == _alone(job, tmp_path)


def test_an_interpolation_of_the_multiplier_follows_each_job(tmp_path, compositions):
    """A config that interpolates the multiplier (set per job) is resolved per job, after the multiplier."""
    overrides = ["sweep.multiplier=mul8s_1KV8,mul8u_2V0", "+sweep.label=${multiplier.name}",
                 f"paths.results={tmp_path}"]
    jobs = expand_jobs(overrides)
    cfgs = compose_jobs("sweep", jobs, overrides)
    assert len(compositions) == 1
    assert [c.sweep.label for c in cfgs] == ["mul8s_1KV8", "mul8u_2V0"]
    for job, cfg in zip(jobs, cfgs):
        assert OmegaConf.to_container(cfg, resolve=False) == _alone(job, tmp_path)


def test_an_interpolation_that_cannot_be_resolved_is_left_to_the_job(tmp_path):
    """As before: composing succeeds, and the job that reads the value reports it."""
    overrides = ["sweep.multiplier=mul8s_1KV8,mul8s_1L2N", "+sweep.note=${nothing.here}", f"paths.results={tmp_path}"]
    cfgs = compose_jobs("sweep", expand_jobs(overrides), overrides)
    assert [c.multiplier.name for c in cfgs] == ["mul8s_1KV8", "mul8s_1L2N"]
    assert cfgs[0].eval.limit == compose("sweep", [f"paths.results={tmp_path}"]).eval.limit
    with pytest.raises(Exception, match="nothing"):
        _ = cfgs[0].sweep.note
