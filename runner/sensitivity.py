"""`approx-run sensitivity`: which layer tolerates which multiplier.

    approx-run sensitivity sensitivity.multipliers='mul8*'
    approx-run sensitivity sensitivity.multipliers=[mul8u_T83,mul8s_1L2N] sensitivity.layers=[conv1,fc1]

For every (layer, multiplier) pair, a compare run with only that layer approximated and the others
fake-quant int8 under the same scheme (model.other_layers=fakequant, the signedness of the multiplier
under test): one ordinary results row per pair (path approx, multiplier_per_layer names the layer),
beside the fake-quant reference row. The evaluations share one session (runner.session), and each starts
at its layer from the kept fake-quant activations. Resumable like sweep (rows recorded ok are skipped);
a failing pair is recorded failed and the table goes on. The run dir holds sensitivity.csv (tidy: one
line per pair) and sensitivity.png (accuracy loss, layers x multipliers)."""
from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

import pandas as pd
from omegaconf import DictConfig, OmegaConf, open_dict

from runner.errors import UserError

KEY = "sensitivity.multipliers"


def multiplier_node(spec: str, layers: dict | None = None) -> dict:
    """The multiplier config node of a name or a table file."""
    from runner.sweep import _is_path

    node = {"name": "file", "path": spec, "signed": None} if _is_path(spec) else {"name": spec}
    if layers:
        node["layers"] = layers
    return node


def compose_command(command: str, argv: list[str] | None, key: str, doc: str, keys_help: str):
    """(config, expanded multiplier names) of `approx-run <command> argv`, key naming the multiplier set;
    None when argv asks for the help, which is then printed (doc's first paragraph and keys_help)."""
    from runner.cli import asked_for_help
    from runner.config import compose
    from runner.sweep import expand_multipliers, split_argv

    argv = list(sys.argv[1:] if argv is None else argv)
    if asked_for_help(argv, command, doc, keys_help):
        return None
    flags, overrides, value = split_argv(argv, key)
    if flags:
        raise UserError(f"`approx-run {command}` takes key=value overrides only, not {' '.join(flags)}.")
    if value is None:
        raise UserError(f"`approx-run {command}` needs a multiplier set: {key}='mul8*' (names, globs or files).")
    names = expand_multipliers(value, key)
    return compose(command, overrides), names


def make_run_dir(cfg: DictConfig) -> Path:
    """results/<command>/<date>_<time>/ with the composed config in it."""
    from runner.provenance import write_config_yaml

    run_dir = Path(cfg.paths.results) / str(cfg.command) / time.strftime("%Y-%m-%d_%H-%M-%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    write_config_yaml(run_dir / "config.yaml", cfg)
    return run_dir


def layer_names(cfg: DictConfig, wanted) -> list[str]:
    from runner.layers import select_layers
    from runner.models import build_model

    model = build_model(cfg.model, 0.0, 1.0)
    if wanted is not None and not isinstance(wanted, (list, tuple)) and not OmegaConf.is_list(wanted):
        wanted = [wanted]
    return select_layers(model, list(wanted) if wanted else None)


def pair_config(cfg: DictConfig, layer: str, spec: str) -> DictConfig:
    """The compare config that approximates `layer` alone with `spec`."""
    job = copy.deepcopy(cfg)
    with open_dict(job):
        job.multiplier = OmegaConf.create(multiplier_node(spec))
        job.model.approx_layers = [layer]
        job.model.other_layers = "fakequant"
    return job


def run_pairs(cfg: DictConfig, pairs: list[tuple[str, str]], run_dir: Path) -> pd.DataFrame:
    """Evaluate each (layer, multiplier) pair as a compare run; one tidy line per pair from the results file."""
    from runner import compare
    from runner.console import progress_bar
    from runner.store import read_csv
    from runner.workers import Task, devices_of, run_tasks

    jobs = [pair_config(cfg, layer, spec) for layer, spec in pairs]
    plans = []  # (compare.plan's answer, "") or (None, the reason the pair cannot run)
    for job in jobs:
        try:
            plans.append((compare.plan(job), ""))
        except UserError as exc:
            plans.append((None, str(exc)))
    devices = devices_of([cfg], "sensitivity")
    tasks = []
    with progress_bar(f"{cfg.command}: {len(jobs)} evaluations", total=len(jobs)) as advance:
        for i, (job, (layer, spec)) in enumerate(zip(jobs, pairs)):
            out = run_dir / f"{i}_{layer}"
            out.mkdir(parents=True, exist_ok=True)
            if len(devices) > 1:  # spread over a worker per device (runner.workers), this process serving one
                tasks.append(Task(i, (job, out, True, plans[i][0])))
                continue
            compare.run(job, out, quiet=True, planned=plans[i][0])
            advance(1, layer=layer, multiplier=Path(spec).name)
        if tasks:
            run_tasks(compare.run, tasks, devices, advance)
    rows = read_csv(Path(cfg.results_file))
    ok = rows[rows["status"] == "ok"].drop_duplicates("row_key", keep="last").set_index("row_key") \
        if len(rows) else pd.DataFrame()
    failed = rows[rows["status"] == "failed"] if len(rows) else pd.DataFrame()
    table = []
    for (layer, spec), (planned, plan_error) in zip(pairs, plans):
        line = {"layer": layer, "multiplier": Path(spec).name if "/" in spec else spec, "status": "failed"}
        keys = planned[3] if planned else None
        if keys is None:
            line["error"] = plan_error
        elif keys["approx"] in ok.index:
            a, fq = ok.loc[keys["approx"]], ok.loc[keys["fakequant"]] if keys["fakequant"] in ok.index else None
            line.update({"multiplier": a["multiplier"], "status": "ok", "accuracy": a["accuracy"],
                         "fakequant_accuracy": None if fq is None else fq["accuracy"],
                         "mult_energy_rel": a.get("mult_energy_rel"), "op_acc_nrmse": a.get("op_acc_nrmse"),
                         "row_key": keys["approx"]})
            if fq is not None:
                # a difference of two count fractions: 9 decimals hold it, the float digits beyond are noise
                line["loss_pts"] = round(100 * (fq["accuracy"] - a["accuracy"]), 9)
        elif len(failed) and "run_dir" in failed:
            err = failed[failed["run_dir"].astype(str).str.startswith(str(run_dir))]
            line["error"] = str(err["error"].iloc[-1]).splitlines()[0] if len(err) else "not run"
        table.append(line)
    return pd.DataFrame(table)


def plot_heatmap(table: pd.DataFrame, path: Path, title: str) -> Path | None:
    """Accuracy loss (points below fake-quant) per layer and multiplier; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ok = table[table["status"] == "ok"]
    if ok.empty:
        return None
    grid = ok.pivot_table(index="layer", columns="multiplier", values="loss_pts", aggfunc="last")
    grid = grid.reindex(index=list(dict.fromkeys(table["layer"])))
    fig, ax = plt.subplots(figsize=(1.0 + 0.42 * grid.shape[1], 1.2 + 0.45 * grid.shape[0]), dpi=100)
    from matplotlib.colors import PowerNorm

    # a square-root-like scale: a loss of half a point stays visible beside one of 40
    im = ax.imshow(grid.clip(lower=0).values, cmap="Reds", aspect="auto",
                   norm=PowerNorm(0.4, vmin=0, vmax=max(1.0, float(grid.max().max()))))
    ax.set_xticks(range(grid.shape[1]), grid.columns, rotation=60, ha="right", fontsize=8)
    ax.set_yticks(range(grid.shape[0]), grid.index, fontsize=9)
    for (r, c), v in pd.DataFrame(grid.values).stack().items():
        ax.text(c, r, f"{v:.1f}", ha="center", va="center", fontsize=6,
                color="white" if v > 0.3 * grid.max().max() else "black")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label="accuracy loss (points)", fraction=0.03)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    from runner.console import console

    t0 = time.time()
    composed = compose_command("sensitivity", argv, KEY, __doc__, "")
    if composed is None:
        return 0
    cfg, names = composed
    layers = layer_names(cfg, cfg.sensitivity.layers)
    run_dir = make_run_dir(cfg)
    pairs = [(layer, name) for layer in layers for name in names]
    table = run_pairs(cfg, pairs, run_dir)
    from runner.store import write_csv

    write_csv(run_dir / "sensitivity.csv", table)
    png = plot_heatmap(table, run_dir / "sensitivity.png",
                       f"accuracy loss, one layer approximated ({cfg.data.name}, {cfg.quant.name})") \
        if cfg.sensitivity.plot else None
    counts = table["status"].value_counts().to_dict()
    console.print(f"sensitivity: {len(table)} evaluations in {time.time() - t0:.1f}s "
                  f"({', '.join(f'{v} {k}' for k, v in counts.items())}); table {run_dir / 'sensitivity.csv'}"
                  + (f"; heat map {png}" if png else ""))
    failed = table[table["status"] == "failed"]
    for _, r in failed.iterrows():
        print(f"  failed {r['layer']} x {r['multiplier']}: {r.get('error', '')}", file=sys.stderr)
    if len(failed):  # the exit code says so too, for scripts that do not read the table
        print(f"sensitivity: {len(failed)} of {len(table)} evaluations failed (recorded as failed rows); fix them "
              "and rerun: rows recorded ok are not redone.", file=sys.stderr)
        return 1
    return 0
