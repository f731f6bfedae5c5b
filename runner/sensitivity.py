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

from runner.jobs.hydra_app import compose_command
from runner.jobs.plan import Job, make_run_dir, multiplier_node, removed_on_user_error

KEY = "sensitivity.multipliers"


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
    from runner.jobs.run import plan_all, run_jobs
    from runner.workers import shard_setting
    from runner.workers import devices_of
    from runner.store import read_csv

    jobs = plan_all([Job(i, [f"model.approx_layers=[{layer}]", f"multiplier={spec}"], pair_config(cfg, layer, spec),
                          run_dir / f"{i}_{layer}", label={"layer": layer, "multiplier": Path(spec).name})
                      for i, (layer, spec) in enumerate(pairs)])
    run_jobs(jobs, f"{cfg.command}: {len(jobs)} evaluations", devices=devices_of([cfg], "sensitivity"),
             shard=shard_setting(cfg, "sensitivity"))
    rows = read_csv(Path(cfg.results_file))
    ok = rows[rows["status"] == "ok"].drop_duplicates("row_key", keep="last").set_index("row_key") \
        if len(rows) else pd.DataFrame()
    failed = rows[rows["status"] == "failed"] if len(rows) else pd.DataFrame()
    table = []
    for (layer, spec), job in zip(pairs, jobs):
        line = {"layer": layer, "multiplier": Path(spec).name if "/" in spec else spec, "status": "failed"}
        keys = job.plan.row_keys if job.plan else None
        if keys is None:
            line["error"] = job.plan_error
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
    rows, cols = grid.shape
    # 50-150 layers (an ImageNet network): thinner rows and smaller labels, so the figure stays a page or two
    # tall, and no numbers in the cells once they are too small to read (the colour still says it). The labels'
    # width in the figure's: a transformer's names (layers.3.self_attention.q_proj) would otherwise squeeze the
    # cells to nothing beside them
    row_h = 0.45 if rows <= 40 else 0.24
    label_pt = 9 if rows <= 40 else 6
    numbers = rows * cols <= 1500 and rows <= 80
    label_in = 0.065 * max(len(str(n)) for n in grid.index) * label_pt / 9
    fig, ax = plt.subplots(figsize=(1.0 + label_in + 0.42 * cols, 1.2 + row_h * rows), dpi=100)
    from matplotlib.colors import PowerNorm

    # a square-root-like scale: a loss of half a point stays visible beside one of 40
    im = ax.imshow(grid.clip(lower=0).values, cmap="Reds", aspect="auto",
                   norm=PowerNorm(0.4, vmin=0, vmax=max(1.0, float(grid.max().max()))))
    ax.set_xticks(range(grid.shape[1]), grid.columns, rotation=60, ha="right", fontsize=8)
    ax.set_yticks(range(rows), grid.index, fontsize=label_pt)
    for (r, c), v in (pd.DataFrame(grid.values).stack().items() if numbers else ()):
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
    from runner.compare import preflight

    preflight([cfg])  # what every evaluation would fail alike: once, before the run dir
    run_dir = make_run_dir(cfg)
    pairs = [(layer, name) for layer in layers for name in names]
    with removed_on_user_error(run_dir, Path(str(cfg.paths.results))):
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
