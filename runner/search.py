"""`approx-run search`: a multiplier per layer at the lowest estimated energy within an accuracy budget.

    approx-run search search.multipliers='mul8*' search.max_loss=0.5

1. A validation split is carved from the training images (seeded, stratified: search.validation_*);
   every choice below looks at it only, never at the test set.
2. Sensitivity on that split: each layer alone on each candidate (the others fake-quant int8).
3. Greedy descent from exact everywhere: the move (one layer to a cheaper multiplier) that saves the
   most energy per point of loss the sensitivity table predicts (losses assumed to add up; moves it
   predicts within budget first) is tried, and kept only when a real evaluation of the whole assignment
   stays within search.max_loss points of fake-quant; a move that fails is not tried again. Ends when
   no move is left (or after search.max_evals evaluations of the descent; the table and the uniform
   choices are not counted, so the budget does not shrink as candidates are added). Each (layer, multiplier) move is tried at most
   once and each layer only moves to cheaper multipliers, so the evaluations grow linearly with the layers
   (layers x candidates for the table, at most as many again for the descent), not combinatorially.
   search.max_distinct=k (ALWANN's accelerator constraint: k multiplier circuits on the chip) allows only
   assignments that use at most k different tables, the exact one counting while a layer keeps it; the
   uniform assignments (one table everywhere) then compete with the descent's result.
4. The chosen assignment runs once on the test set as an ordinary compare run (its rows go to the
   results file; search.finetune_epochs > 0 also retrains it), and is printed as an override. With
   data=imagefolder the search estimates on data.limit images and this confirmation measures the whole
   val split (search.confirm_limit: null), calibrating on the estimate's training images (data.train_limit);
   without train/, the validation images the choice was made on are left out of the images measured
   (data.exclude_images), so the confirmation looks at none of them.

The run dir holds pareto.csv (every evaluated assignment, the uniform choices too, with the Pareto
front marked) and pareto.png. Energy: runner.energy (multipliers only)."""
from __future__ import annotations

import copy
import sys
import time
from collections import OrderedDict
from pathlib import Path

import pandas as pd
import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from runner.errors import UserError, config_number
from runner.multipliers.registry import canonical_name

KEY = "search.multipliers"


class Evaluator:
    """Validation accuracy of per-layer assignments, sharing the command's session. Layers left exact run the
    exact table through the same LUT kernels: the same integers as fake-quant int8, bit for bit (tested), at
    the kernels' speed (fake-quant's exact integer convolution is far slower on a GPU). Models are converted
    once per pattern of signed / unsigned layers and then only load the tables an assignment changes; with a
    model whose forward is a chain (stages()), an evaluation starts at the first approximated layer from
    kept activations."""

    MAX_MODELS = 4  # converted models kept (one per signedness pattern the descent visits)

    def __init__(self, cfg: DictConfig):
        from runner import compare, session
        from runner.multipliers import resolve
        from runner.quant import QuantConfig, quant_layers

        self.cfg, self.sess = cfg, session.get()
        self.device = compare.eval_device(cfg)
        model, _, self.ckpt, data = self.sess.baseline(cfg)
        s = cfg.search
        if not 0 < float(s.validation_fraction) < 1:
            raise UserError(f"search.validation_fraction={s.validation_fraction}: must be in (0, 1).")
        # a set without a training split calibrates on a held-apart part (runner.train.held_apart): the
        # validation split then comes from the other images, never from those calibrated on
        val = data.carve("train" if data.has_train else "test", float(s.validation_fraction),
                         int(s.validation_seed))
        self.x, self.y = val.test_x, val.test_y
        self.has_train = data.has_train
        self.qcfg = QuantConfig.from_cfg(cfg.quant)
        self.folded, self.stats = self.sess.calibration(model, self.ckpt, data.train_x, self.qcfg, int(cfg.seed))
        self.layers = list(quant_layers(self.folded))
        self.exact = resolve("exact")
        self.evals = 0
        self.on_eval = None  # called after each evaluation (the command's progress line)
        self._models: OrderedDict = OrderedDict()
        self.fakequant_accuracy = self.accuracy({})

    def _model(self, per_layer: dict, fake: bool) -> torch.nn.Module:
        """The converted model with per_layer's tables loaded (fake: the fake-quant int8 model)."""
        from runner.layers import convert_model, quantized_layers

        key = "fake" if fake else tuple(per_layer[n].signed for n in self.layers)
        entry = self._models.get(key)
        if entry is None:
            model = convert_model(self.folded, per_layer, self.qcfg, self.stats, backend=self.cfg.backend.name,
                                  algo=self.cfg.backend.algo, fake=fake)
            entry = self._models[key] = (model, {n: per_layer[n].sha256 for n in self.layers})
            while len(self._models) > self.MAX_MODELS:
                self._models.popitem(last=False)
        model, loaded = entry
        self._models.move_to_end(key)
        if not fake:
            for name, layer in quantized_layers(model).items():
                if loaded[name] != per_layer[name].sha256:
                    layer.set_multiplier(per_layer[name])
                    loaded[name] = per_layer[name].sha256
        return model

    def accuracy(self, assign: dict) -> float:
        """assign: {layer: Multiplier}; layers not in it (or on the exact table) are exact."""
        from runner.session import Prefix, cache_key

        approx = [n for n in self.layers if n in assign and assign[n].sha256 != self.exact.sha256]
        per_layer = {n: assign.get(n, self.exact) if n in approx else self.exact for n in self.layers}
        model = self._model(per_layer, fake=not approx)
        start = approx[0] if approx and approx[0] != self.layers[0] else None
        prefix = Prefix(cache_key({"search": str(self.ckpt), "quant": self.qcfg.as_dict(), "seed": int(self.cfg.seed),
                                   "split": [float(self.cfg.search.validation_fraction),
                                             int(self.cfg.search.validation_seed)]}),
                        tuple(self.layers[:self.layers.index(start)]) if start else ())
        logits = self.sess.logits_from(model, self.x, int(self.cfg.eval.batch_size), self.device, start, prefix)
        self.evals += 1
        if self.on_eval is not None:
            self.on_eval()
        return int((logits.argmax(1) == self.y).sum()) / len(self.y)  # a fraction of counts: no float32 noise


def _energy(assign: dict, macs: dict) -> float | None:
    from runner.energy import energy

    full = {n: assign.get(n) for n in macs}
    return energy(full, [n for n in macs if full[n] is not None], macs)["mult_energy_rel"]


def _label(assign: dict) -> str:
    return ";".join(f"{n}={canonical_name(m)}" for n, m in assign.items())


def first_estimate(advance, total: int):
    """An on_eval that advances the progress line (its ETA) and, after the first evaluation, says what the
    `total` would take at that pace (the first runs every layer: an upper bound for the later ones, which start
    at their first approximated layer)."""
    from runner.console import console, fmt_seconds

    t0, done = time.perf_counter(), [0]

    def on_eval():
        done[0] += 1
        if done[0] == 1 and total > 1:
            first = time.perf_counter() - t0
            console.print(f"first evaluation {fmt_seconds(first)}: the {total} take at most about "
                          f"{fmt_seconds(first * total)}", highlight=False)
        advance(1)
    return on_eval


def evaluate_uniform(ev: Evaluator, candidates: list, layers: list[str], macs: dict, log: list) -> None:
    """Each candidate alone in every searched layer: the uniform rows of the Pareto plot."""
    for m in candidates:
        uniform = {n: m for n in layers}
        log.append({"kind": "uniform", "assignment": canonical_name(m), "val_accuracy": ev.accuracy(uniform),
                    "mult_energy_rel": _energy(uniform, macs)})


def distinct(assign: dict) -> int:
    """How many different tables an assignment uses (by content: two names of one table are one circuit)."""
    return len({m.sha256 for m in assign.values()})


def greedy(ev: Evaluator, candidates: list, layers: list[str], macs: dict, max_loss: float, max_evals: int,
           log: list, max_distinct: int | None = None) -> dict:
    """The lowest-energy verified assignment found (see the module docstring); log gets every evaluation."""
    from runner.energy import power_mw

    def loss(acc):
        return 100 * (ev.fakequant_accuracy - acc)

    single = {}
    for layer in layers:
        for m in candidates:
            acc = ev.accuracy({layer: m})
            single[layer, m.name] = max(0.0, loss(acc))
            log.append({"kind": "one layer", "assignment": f"{layer}={m.name}", "val_accuracy": acc,
                        "mult_energy_rel": _energy({layer: m}, macs)})
    power = {m.name: power_mw(m) for m in candidates}
    current = {layer: ev.exact for layer in layers}
    current_power = {layer: power_mw(ev.exact) for layer in layers}
    rejected: set = set()
    everywhere_exact = {n: ev.exact for n in ev.layers}
    best = dict(current)
    log.append({"kind": "candidate", "assignment": _label(current), "val_accuracy": ev.fakequant_accuracy,
                "mult_energy_rel": _energy(current, macs), "accepted": True})  # the start: exact everywhere
    descent_start = ev.evals
    while ev.evals - descent_start < max_evals:
        predicted = sum(single.get((n, m.name), 0.0) for n, m in current.items())
        moves = []
        for layer in layers:
            for m in candidates:
                saving = macs[layer] * (current_power[layer] - power[m.name])
                if saving <= 0 or (layer, m.name) in rejected:
                    continue
                # the layers outside the search keep the exact table, which then counts too
                if max_distinct is not None and distinct({**everywhere_exact, **current, layer: m}) > max_distinct:
                    continue
                extra = single[layer, m.name] - single.get((layer, current[layer].name), 0.0)
                # moves the table predicts within budget first, each by energy saved per point lost
                moves.append((predicted + extra <= max_loss, saving / max(extra, 0.05), layer, m))
        if not moves:
            break
        *_, layer, m = max(moves, key=lambda t: t[:2])
        trial = {**current, layer: m}
        acc = ev.accuracy(trial)
        ok = loss(acc) <= max_loss
        log.append({"kind": "candidate", "assignment": _label(trial), "val_accuracy": acc,
                    "mult_energy_rel": _energy(trial, macs), "accepted": ok})
        if ok:
            current, current_power[layer] = trial, power[m.name]
            best = dict(current)
        else:
            rejected.add((layer, m.name))
    return best


def cheapest_within(chosen: dict, candidates: list, layers: list[str], macs: dict, log: list, fq_acc: float,
                    max_loss: float) -> dict:
    """The descent's choice, or a uniform assignment the log verified within budget if that costs less energy
    (under a max_distinct limit the descent from exact may not reach one: with k=1 it cannot move)."""
    best, best_energy = chosen, _energy(chosen, macs)
    for m in candidates:
        row = next((r for r in log if r["kind"] == "uniform" and r["assignment"] == m.name), None)
        if row is None or 100 * (fq_acc - row["val_accuracy"]) > max_loss:
            continue
        if row["mult_energy_rel"] < best_energy:
            best, best_energy = {n: m for n in layers}, row["mult_energy_rel"]
    if best is not chosen:  # the table marks the uniform row's assignment written per layer as chosen too
        log.append({"kind": "candidate", "assignment": _label(best), "val_accuracy": next(
            r["val_accuracy"] for r in log if r["kind"] == "uniform" and r["assignment"] == best[layers[0]].name),
            "mult_energy_rel": best_energy, "accepted": True})
    return best


def on_front(table: pd.DataFrame) -> list[bool]:
    """True for the assignments no other one beats on both validation accuracy (higher) and multiplier energy
    (lower): the Pareto front of runner.report.pareto_front, over this search's evaluations."""
    from runner.report import pareto_front

    front = set(pareto_front(list(table["mult_energy_rel"]), list(table["val_accuracy"])))
    return [i in front for i in range(len(table))]


def plot(table: pd.DataFrame, fq_acc: float, max_loss: float, chosen: str, path: Path, title: str) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=100)
    cand = table[table["kind"] != "uniform"]
    ax.scatter(cand["mult_energy_rel"], 100 * cand["val_accuracy"], s=8, c="0.7", label="evaluated assignments")
    uni = table[table["kind"] == "uniform"]
    ax.scatter(uni["mult_energy_rel"], 100 * uni["val_accuracy"], s=22, marker="s", c="tab:blue",
               label="one multiplier everywhere")
    front = table[table["on_front"]].sort_values("mult_energy_rel")
    ax.plot(front["mult_energy_rel"], 100 * front["val_accuracy"], "-", c="tab:red", lw=1, label="Pareto front")
    pick = table[table["assignment"] == chosen]
    ax.scatter(pick["mult_energy_rel"], 100 * pick["val_accuracy"], s=120, marker="*", c="tab:red", zorder=5,
               label="chosen")
    ax.axhline(100 * fq_acc - max_loss, ls="--", c="0.4", lw=0.8, label=f"fake-quant - {max_loss:g} points")
    lo = max(100 * fq_acc - 10 * max(max_loss, 0.5), float(100 * table["val_accuracy"].min()))
    ax.set_ylim(lo, 100 * fq_acc + 0.6)
    ax.set_xlabel("multiplier energy per inference (1 = exact 8-bit everywhere)")
    ax.set_ylabel("validation accuracy (%)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _spec(m, specs: dict):
    """A layer's multiplier config: the name, or for a table file the file node."""
    from runner.jobs.plan import multiplier_node

    node = multiplier_node(specs.get(m.name, m.name))
    return node["name"] if len(node) == 1 else node


def override(assign: dict, layers: list[str], specs: dict) -> str:
    def show(node):
        if isinstance(node, str):
            return node
        return "{" + ", ".join(f"{k}: {v}" for k, v in node.items() if v is not None) + "}"

    inner = ", ".join(f"{n}: {show(_spec(assign[n], specs))}" for n in layers if n in assign)
    return f"multiplier=exact '+multiplier.layers={{{inner}}}'"


def assignment_config(cfg: DictConfig, assign: dict, specs: dict) -> DictConfig:
    """The compare config that runs the chosen assignment on the test set (and retrains it if asked)."""
    job = copy.deepcopy(cfg)
    with open_dict(job):
        job.multiplier = OmegaConf.create({"name": "exact",
                                           "layers": {n: _spec(m, specs) for n, m in assign.items()}})
        job.model.approx_layers = None
        job.model.other_layers = "fp32"
        job.finetune.epochs = int(cfg.search.finetune_epochs)
    return job


def confirm_data(cfg: DictConfig, job: DictConfig, ev: Evaluator, run_dir: Path) -> None:
    """The images of the confirming compare run (job, changed in place): the whole split (or
    search.confirm_limit's subset) where the search estimated on data.limit's; without a training split, less
    the validation images it chose on (written to the run dir), which would otherwise be measured again."""
    if "limit" not in cfg.data:  # a set read whole: the test split is the estimate's already, disjoint from it
        return
    confirm = config_number(cfg.search.get("confirm_limit"), "search.confirm_limit", minimum=1, optional=True)
    with open_dict(job):
        if confirm != cfg.data.limit:
            job.data.limit = confirm
            # calibration keeps the estimate's training images (all of ImageNet's would take hours to decode)
            job.data.train_limit = cfg.data.get("train_limit") or cfg.data.limit
        if ev.has_train:
            return
        names = ev.x.names() if hasattr(ev.x, "names") else None
        if names is None:
            return
        if cfg.data.get("exclude_images"):  # the user's own exclusions stay excluded
            from runner.data.imagefolder import excluded_names

            names = sorted(set(names) | excluded_names(cfg.data))
        listed = run_dir / "search_validation_images.txt"
        listed.write_text("".join(f"{n}\n" for n in names))
        job.data.exclude_images = str(listed)


def confirm_scope(cfg: DictConfig, job: DictConfig) -> str:
    """Which images the confirmation measured, in words."""
    if "limit" not in job.data:
        return "the test split"
    which = f"data.limit={job.data.limit} of the {job.data.get('val_split', 'val')} split" if job.data.limit \
        else f"the whole {job.data.get('val_split', 'val')} split"
    if job.data.get("exclude_images"):
        which += " less the images held apart for calibration and those the search validated on"
    return which


def check(cfg: DictConfig) -> None:
    s = cfg.search
    config_number(s.get("confirm_limit"), "search.confirm_limit", minimum=1, optional=True)
    # the accuracy budget, in points below fake-quant
    config_number(s.max_loss, "search.max_loss", minimum=0, kind=float)
    config_number(s.max_evals, "search.max_evals", minimum=1)
    config_number(s.finetune_epochs, "search.finetune_epochs", minimum=0)
    k = s.get("max_distinct")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise UserError(f"search.max_distinct={k}: the number of different multipliers allowed in the network, "
                        "an integer >= 1 (or null: no limit).")


def main(argv: list[str] | None = None) -> int:
    from runner import compare
    from runner.console import console, progress_bar
    from runner.energy import layer_macs, power_mw
    from runner.multipliers import resolve
    from runner.store import write_csv
    from runner.jobs.hydra_app import compose_command
    from runner.jobs.plan import make_run_dir, multiplier_node
    from runner.sensitivity import layer_names

    composed = compose_command("search", argv, KEY, __doc__, "")
    if composed is None:
        return 0
    cfg, names = composed
    check(cfg)
    t0 = time.time()
    layers = layer_names(cfg, cfg.search.layers)
    candidates = [resolve(multiplier_node(n)) for n in names]
    specs = {m.name: n for m, n in zip(candidates, names)}  # a table file's multiplier is named after the file
    missing = [m.name for m in candidates if power_mw(m) is None]
    candidates = [m for m in candidates if power_mw(m) is not None]
    if missing:
        console.print(f"[yellow]search:[/] no power figure for {', '.join(missing)}, left out; give one with "
                      "`approx-run lut import FILE --name NAME --power-mw MW` and search NAME")
    if not candidates:
        raise UserError("search: no candidate multiplier has a power figure, so there is no energy to minimise.")
    compare.preflight([cfg])  # what every evaluation would fail alike: once, before any work

    ev = Evaluator(cfg)
    macs = layer_macs(ev.folded, tuple(ev.x.shape[1:]))
    max_loss = float(cfg.search.max_loss)
    log: list[dict] = []
    max_distinct = cfg.search.get("max_distinct")
    n_table = len(candidates) * (1 + len(layers))
    # each (layer, multiplier) move is tried at most once: the descent's bound below max_evals
    n_descent = min(int(cfg.search.max_evals), len(layers) * len(candidates))
    console.print(f"search: {n_table} evaluations (each candidate everywhere, then each layer alone on each) and at "
                  f"most {n_descent} of the descent, on {len(ev.y):,} validation images; then the pick on the test "
                  "set (compare)", highlight=False, soft_wrap=True)
    with progress_bar("search", total=n_table + n_descent) as advance:
        ev.on_eval = first_estimate(advance, n_table + n_descent)
        evaluate_uniform(ev, candidates, layers, macs, log)
        chosen = greedy(ev, candidates, layers, macs, max_loss, int(cfg.search.max_evals), log, max_distinct)
    ev.on_eval = None
    if max_distinct is not None:
        chosen = cheapest_within(chosen, candidates, layers, macs, log, ev.fakequant_accuracy, max_loss)
    label = _label(chosen)
    table = pd.DataFrame(log)
    table["val_loss_pts"] = (100 * (ev.fakequant_accuracy - table["val_accuracy"])).round(9)  # no float noise
    table["val_images"] = len(ev.y)  # what each estimate is over (the test row's n_images: the confirmation's)
    table["on_front"] = on_front(table)
    table["chosen"] = table["assignment"] == label
    run_dir = make_run_dir(cfg)  # with the first result: a search stopped by a user error leaves no empty dir
    write_csv(run_dir / "pareto.csv", table)
    png = plot(table, ev.fakequant_accuracy, max_loss, label, run_dir / "pareto.png",
               f"search on {cfg.data.name} validation split ({len(ev.y)} images), budget {max_loss:g} points") \
        if cfg.search.plot else None
    console.print(f"search: {ev.evals} validation evaluations in {time.time() - t0:.1f}s; fake-quant "
                  f"{100 * ev.fakequant_accuracy:.2f} %")

    job = assignment_config(cfg, chosen, specs)
    confirm_data(cfg, job, ev, run_dir)
    out = run_dir / "test"
    out.mkdir(exist_ok=True)
    result = compare.run(job, out)
    rows = {r["path"]: r for r in result.get("rows", [])}
    keys = compare.plan_run(job).row_keys
    if len(rows) < 2:  # recorded before: the numbers are in the results file
        from runner.store import read_csv

        df = read_csv(Path(cfg.results_file))
        df = df[df["status"] == "ok"].drop_duplicates("row_key", keep="last").set_index("row_key")
        rows = {p: df.loc[k].to_dict() for p, k in keys.items() if k in df.index}
    val_row = table[table["chosen"]].iloc[-1]
    console.print(f"chosen ({cfg.data.name}): {label}\n"
                  f"  validation: {100 * val_row['val_accuracy']:.2f} % ({val_row['val_loss_pts']:.2f} points below "
                  f"fake-quant), multiplier energy {val_row['mult_energy_rel']:.4f} of exact")
    if "approx" in rows and "fakequant" in rows:
        a, f = rows["approx"], rows["fakequant"]
        console.print(f"  test: {100 * a['accuracy']:.2f} % (fake-quant {100 * f['accuracy']:.2f} %, "
                      f"{100 * (f['accuracy'] - a['accuracy']):.2f} points below) on {int(a['n_images']):,} images "
                      f"({confirm_scope(cfg, job)}; the search estimated on {len(ev.y):,} validation images)",
                      highlight=False, soft_wrap=True)
    if "approx_finetuned" in rows:
        console.print(f"  retrained: {100 * rows['approx_finetuned']['accuracy']:.2f} % on the test set")
    console.print(f"  pareto {run_dir / 'pareto.csv'}" + (f", {png}" if png else ""))
    print(f"\napprox-run compare {override(chosen, layers, specs)}")
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    sys.exit(main())
