"""Where a sweep's wall time goes: the command run in this process with its main steps timed.

    python benchmarks/sweep_phases.py sweep 'sweep.multipliers=mul8s_*' backend=cpp paths.checkpoints=DIR \
        paths.results=FRESH_DIR
    python benchmarks/sweep_phases.py --passes paths.checkpoints=DIR   # one pass of each path's model

The first form prints the time to import torch, all imports, the command, and the summed wall time (and
call count) of each step below; steps nest (a job contains its evaluations), so the rows do not add up.
The evaluation passes (run_timed) inside prepare and inside the jobs are also summed apart, and each of
those two steps printed without them: the fixed costs a change to set-up or per-job work moves. Steps a
version of the code lacks are left out, so the same script times an older tree (PYTHONPATH=OLD_TREE).
The second times one forward of the fp32, fake-quant and approx (backend=cpp) LeNet-5 over the 1,000
mnist5k test images (median of 9 after one warm-up), the unit the sweep repeats 4 times per path."""
from __future__ import annotations

import collections
import functools
import sys
import time

T0 = time.perf_counter()
import torch  # noqa: E402

T_TORCH = time.perf_counter() - T0

from runner import cli, compare, data, evaluate, operand, provenance, session, sweep, train  # noqa: E402
from runner.jobs import hydra_app, run as jobs_run  # noqa: E402

T_IMPORTS = time.perf_counter() - T0
STEPS = {  # module -> the functions timed (looked up where the sweep calls them; names a version lacks are skipped)
    sweep: ["sweep_jobs", "compose_jobs", "plan_all", "prepare", "run_jobs", "summarize"],
    jobs_run: ["run_job"],
    compare: ["build_models", "run_timed", "layer_macs", "auto_picks", "plan_run", "model_layers", "append_rows",
              "write_csv", "atomic_write_json"],
    provenance: ["write_config_yaml"],
    operand: ["operand_histograms", "metrics"],
    data: ["load_dataset"],
    train: ["load_or_train"],
    session.Session: ["calibration", "baseline"],
}
PHASES = ("runner.sweep.prepare", "runner.sweep.run_jobs")  # the evaluation passes inside each are summed apart


def timed_steps() -> tuple[dict, collections.Counter]:
    spent, calls = collections.defaultdict(float), collections.Counter()
    active = []
    for owner, names in STEPS.items():
        for name in names:
            if not hasattr(owner, name):
                continue
            fn, label = getattr(owner, name), f"{getattr(owner, '__name__', owner)}.{name}"

            @functools.wraps(fn)
            def wrapper(*args, _fn=fn, _label=label, **kw):
                t = time.perf_counter()
                active.append(_label)
                try:
                    return _fn(*args, **kw)
                finally:
                    active.pop()
                    took = time.perf_counter() - t
                    spent[_label] += took
                    calls[_label] += 1
                    if _label == "runner.compare.run_timed":
                        for phase in PHASES:
                            if phase in active:
                                spent[f"{phase}: its evaluation passes (run_timed)"] += took
            setattr(owner, name, wrapper)
    return spent, calls


def passes(overrides: list[str]) -> None:
    from hydra import compose, initialize_config_dir

    from runner.config import CONFIG_DIR

    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        cfg = compose("compare", overrides=["backend=cpp", "multiplier=mul8s_1L2J", *overrides])
    plan = compare.plan_run(cfg)
    model, _, ckpt, ds = session.get().baseline(cfg)
    fq, approx, _ = compare.build_models(cfg, model, ckpt, ds.train_x, plan.multipliers, plan.approx_layers,
                                         plan.row_keys)
    print(f"threads {torch.get_num_threads()}, {len(ds.test_x)} images, one batch")
    for name, m in (("pytorch", model), ("fakequant", fq), ("approx", approx)):
        m.eval()
        with torch.no_grad():
            m(ds.test_x)
            ms = []
            for _ in range(9):
                t = time.perf_counter()
                m(ds.test_x)
                ms.append((time.perf_counter() - t) * 1e3)
        print(f"  {name:<10} {sorted(ms)[4]:8.1f} ms (min {min(ms):.1f})")


def main() -> int:
    if sys.argv[1:2] == ["--passes"]:
        passes(sys.argv[2:])
        return 0
    spent, calls = timed_steps()
    t = time.perf_counter()
    rc = cli.main(sys.argv[1:])
    took = time.perf_counter() - t
    print(f"\nimport torch {T_TORCH:.2f} s, all imports {T_IMPORTS:.2f} s, command {took:.2f} s, "
          f"total {time.perf_counter() - T0:.2f} s", file=sys.stderr)
    for label, s in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"  {s:8.2f} s {calls[label] or '':>4}{'x' if calls[label] else ' '}  {label}", file=sys.stderr)
    for phase in PHASES:
        in_passes = spent[f"{phase}: its evaluation passes (run_timed)"]
        print(f"  {spent[phase] - in_passes:8.2f} s        {phase} without its evaluation passes", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
