"""`approx-run compare`: one trained baseline, three inference paths over its weights.

pytorch (fp32), fakequant (int8 quantize-dequantize at the same scales) and approx (custom MAC:
every multiply through the multiplier LUT on the chosen backend). One tidy row per path goes to
<run dir>/metrics.csv and is appended to the cumulative results file; run.json records provenance."""
from __future__ import annotations

import copy
import dataclasses
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from runner import distributed, finetune, gpus, session
from runner._ext import backend_status
from runner.console import console, print_table, progress_bar
from runner.errors import UserError, config_number
from runner import operand
from runner.energy import energy, layer_macs
from runner.evaluate import check_eval_config, run_timed, run_timed_sharded
from runner.jobs.plan import Plan
from runner.layer_swaps import LayerSwaps
from runner.layers import auto_picks, convert_model, quantized_layers, select_layers
from runner.models import build_model
from runner.multipliers import metrics_of, resolve_per_layer
from runner.ops import BACKEND_DEVICE, check_algo
from runner.provenance import atomic_write_json, environment, host_device, resolve_device
from runner.quant import QuantConfig, quant_layers
from runner.session import cache_key
from runner.store import append_rows, done_keys, write_csv
from runner.train import model_label, weight_config

PATHS = ("pytorch", "fakequant", "approx", "approx_finetuned")


def eval_device(cfg: DictConfig) -> torch.device:
    """All three paths run on the approx backend's device, so their latencies compare like for like."""
    backend = cfg.backend.name
    status = backend_status().get(backend)
    if status is None:
        raise UserError(f"backend={backend} is unknown; choose python, cpp or cuda.")
    if status != "available":
        raise UserError(f"backend={backend} is not usable here: {status}")
    check_algo(backend, cfg.backend.algo)
    want = BACKEND_DEVICE.get(backend)
    if want is None:
        return resolve_device(cfg.device)
    if cfg.device not in ("auto", want):
        raise UserError(f"backend={backend} runs on {want}, but device={cfg.device}; "
                        f"drop device= or choose backend={'cuda' if want == 'cpu' else 'cpp'}.")
    # on a multi-GPU machine the index is the GPU this job leased (see runner.gpus.gpu_lease)
    return torch.device("cuda", torch.cuda.current_device()) if want == "cuda" else torch.device(want)


def other_layers(cfg: DictConfig) -> str:
    return str(cfg.model.get("other_layers") or "fp32")


def row_keys(cfg: DictConfig, multipliers: dict, layers: list[str], device: torch.device) -> dict[str, str]:
    """Identity of each path's row: what determines its numbers (config and LUT hashes), nothing else."""
    base = {"weights": weight_config(cfg), "limit": cfg.eval.limit, "device": device.type,
            "batch_size": int(cfg.eval.batch_size)}
    quantized = list(multipliers) if other_layers(cfg) == "fakequant" else layers
    quant = {**base, "quant": QuantConfig.from_cfg(cfg.quant).as_dict(), "layers": quantized,
             "signed": {n: multipliers[n].signed for n in quantized}}
    approx = {**quant, "backend": cfg.backend.name, "algo": cfg.backend.algo,
              "luts": {n: multipliers[n].sha256 for n in layers}}
    if quantized != layers:  # only then: the keys of rows recorded before this option existed stay valid
        approx["approx_layers"] = layers
    keys = {"pytorch": cache_key({**base, "path": "pytorch"}), "fakequant": cache_key({**quant, "path": "fakequant"}),
            "approx": cache_key({**approx, "path": "approx"})}
    if finetune.enabled(cfg):
        settings = finetune.FinetuneConfig.from_cfg(cfg.finetune).as_dict()
        scale = lr_scale(cfg)
        keys["approx_finetuned"] = cache_key({**approx, "finetune": settings, "path": "approx_finetuned",
                                              **({"lr_scale": scale} if scale != 1.0 else {})})
    return keys


def lr_scale(cfg: DictConfig) -> float:
    """The retraining's learning-rate factor from finetune.lr_scaling and this run's number of ranks."""
    return distributed.lr_scale(finetune.run_settings(cfg)["lr_scaling"], distributed.rank_world()[1])


def wanted_paths(cfg: DictConfig, keys: dict) -> list[str]:
    """The paths whose rows a run records, of its row keys (plan.row_keys)."""
    wanted = [p for p in cfg.eval.paths if p in PATHS]
    if not wanted:
        raise UserError(f"eval.paths={list(cfg.eval.paths)} names none of {list(PATHS)}.")
    if "approx_finetuned" in keys and "approx" in wanted and "approx_finetuned" not in wanted:
        wanted.append("approx_finetuned")  # retraining on: its row goes beside the approx row
    return [p for p in wanted if p in keys]


def has_work(cfg: DictConfig, plan: Plan, recorded: set[str]) -> bool:
    """Whether a run of cfg computes anything: False when skip_done finds each of its rows in `recorded`
    (the results file's keys, runner.store.done_keys), as _run would decide."""
    return not (cfg.skip_done and all(plan.row_keys[p] in recorded for p in wanted_paths(cfg, plan.row_keys)))


def scope_of(path: str, multipliers: dict, layers: list[str]) -> str:
    """What a row's numbers are of (the `scope` column): reference (pytorch, fakequant), network (every layer
    on one table), layer (some layers on one table, the others as model.other_layers says: sensitivity),
    assignment (several tables: search, +multiplier.layers), finetuned (a retrained approx model)."""
    if path in ("pytorch", "fakequant"):
        return "reference"
    if path == "approx_finetuned":
        return "finetuned"
    if len({multipliers[n].sha256 for n in layers}) > 1:
        return "assignment"
    return "network" if set(layers) == set(multipliers) else "layer"


def multiplier_columns(multipliers: dict, layers: list[str]) -> dict:
    from runner.energy import power_mw
    from runner.multipliers.registry import canonical_name

    names = {canonical_name(multipliers[n]) for n in layers}
    first = multipliers[layers[0]]
    cols = {
        "multiplier": canonical_name(first) if len(names) == 1 else "mixed",
        "multiplier_per_layer": ";".join(f"{n}={canonical_name(multipliers[n])}" for n in layers),
        "multiplier_signed": first.signed if len(names) == 1 else None,
        "lut_sha256": first.sha256 if len(names) == 1 else cache_key({n: multipliers[n].sha256 for n in layers}),
    }
    if len(names) == 1:
        m = metrics_of(first)
        cols.update({f"mult_{k}": v for k, v in m.items()})
        pub = first.published or {}
        for src, dst in (("pwr", "power_mw"), ("area", "area_um2"), ("delay", "delay_ns")):
            cols[f"published_{dst}"] = float(pub[src]) if src in pub else None
        if cols["published_power_mw"] is None:  # one name, one figure: exact_s has mul8s_1KV6's power
            cols["published_power_mw"] = power_mw(first)
    return cols


def _row(path, timed, y, ref_preds, batch_size, device, threads) -> dict:
    n = len(y)
    correct = int((timed.predictions == y).sum())

    def agreement(ref):  # a fraction of counts, as accuracy: no float32 mean's noise (0.7990000247955322)
        return int((timed.predictions == ref_preds[ref]).sum()) / n if ref in ref_preds else None

    row = {
        "path": path, "status": "ok", "error": "",
        "n_images": n, "correct": correct, "accuracy": correct / n,
        "agreement_fakequant": agreement("fakequant"), "agreement_pytorch": agreement("pytorch"),
        # timings to the microsecond and the image per second: the digits beyond are the clock's noise
        "latency_ms_median": round(timed.latency_ms_median, 3),
        "testset_ms_median": round(timed.total_ms_median, 3),
        "throughput_img_s": round(n / (timed.total_ms_median / 1e3), 1) if timed.pass_ms else None,
        "batch_size": batch_size, "threads": threads, "device": host_device(device),
        "timed_as": timed.timed_as if timed.pass_ms else "",  # cuda_graph: the latencies are graph replays
    }
    return row


def run(cfg: DictConfig, out_dir: Path, quiet: bool = False, plan: Plan | None = None) -> dict:
    """`approx-run compare`. plan: what plan_run(cfg) returned earlier in this process (a sweep plans every
    job first)."""
    t_start = time.time()
    try:
        with _leased_gpu(cfg):
            return _run(cfg, out_dir, _common(cfg, out_dir), quiet, plan)
    except Exception as exc:  # noqa: BLE001  (a crash in one sweep job must not end the sweep)
        # In a process group a rank that fails ends its process: the launcher stops the others (which would
        # wait in a collective for it) and the job's caller records the failure once (runner.jobs.run).
        if cfg.get("on_error", "raise") != "record" or distributed.rank_world()[1] > 1:
            raise
        # A sweep records the failure and goes on with the next multiplier; a user error's message is
        # the reason, anything else keeps a short traceback for the bug report.
        reason = str(exc) if isinstance(exc, UserError) else \
            f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"
        row = record_failed(cfg, out_dir, reason, time.time() - t_start)
        console.print(f"[red]failed[/] {row['multiplier']}: {exc}")
        return {"status": "failed", "error": reason}


def _common(cfg: DictConfig, out_dir: Path | None) -> dict:
    """The columns every row of a run shares."""
    return {"run_dir": str(out_dir), "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "data": cfg.data.name, "model": model_label(cfg.model), "quant": cfg.quant.get("name", ""),
            "backend": cfg.backend.name, "algo": cfg.backend.algo, "seed": int(cfg.seed)}


def record_failed(cfg: DictConfig, out_dir: Path, reason: str, elapsed_s: float | None) -> dict:
    """A failed approx row of a job (its run dir's metrics.csv and the results file): what a sweep records
    for a job that could not run, with the reason."""
    spec = OmegaConf.to_container(cfg.multiplier, resolve=True)
    scope = "assignment" if spec.get("layers") else "layer" if cfg.model.get("approx_layers") else "network"
    row = {**_common(cfg, out_dir), "path": "approx", "scope": scope, "status": "failed", "error": reason,
           "multiplier": str(spec.get("name", spec)), "row_key": "", "elapsed_s": elapsed_s}
    write_csv(Path(out_dir) / "metrics.csv", [row])
    append_rows(Path(cfg.results_file), [row])
    return row


def prepare(cfg: DictConfig, plan: Plan | None = None) -> dict:
    """What a run of cfg sets up, left in this process's session (runner.session) for the runs that follow,
    without the run's own work and without writing anything: data, baseline, calibration, the fake-quant and
    approx models, operand histograms, the reference predictions, and the first calls its retraining and its
    approx evaluation make (a few throwaway training steps on a copy, one approx batch: _warm_first_calls).
    A pool worker calls it before it takes a job (runner.workers), so its first job costs what a later one
    does. Raises what the run would raise; {"status": "skipped"} when every row of cfg is recorded."""
    with _leased_gpu(cfg):
        return _run(cfg, None, {}, quiet=True, plan=plan, prepare_only=True)


@contextmanager
def _leased_gpu(cfg: DictConfig):
    """This process's GPU for a run (runner.gpus.gpu_lease: one of several on a multi-GPU machine)."""
    n_gpus = torch.cuda.device_count() if cfg.backend.name == "cuda" else 0
    with gpus.gpu_lease(Path(cfg.paths.results) / ".gpu-locks", n_gpus) as gpu:
        if n_gpus:
            torch.cuda.set_device(gpu)
        yield


def preflight(cfgs: list[DictConfig]) -> None:
    """What every job of a command would fail alike, checked once before the first (a UserError: exit 2,
    nothing written): the backend runs here and on the device asked for, the model builds, its approx_layers
    name its layers, it runs on the data's first batch, and its baseline checkpoint, when there is one, loads
    (into the session, for the jobs). Otherwise a sweep of 50 tables would record 50 failed rows of one typo."""
    from runner.train import check_model_fits, checkpoint_path

    seen = set()
    for cfg in cfgs:
        key = cache_key([OmegaConf.to_container(cfg[k], resolve=True) for k in ("backend", "model", "data")]
                        + [str(cfg.device)])
        if key not in seen:
            seen.add(key)
            eval_device(cfg)
            model_layers(cfg.model)
            check_model_fits(cfg, session.get().dataset(cfg.data))
        path = checkpoint_path(cfg)
        if str(path) not in seen and path.exists() and not cfg.train.get("force", False):
            seen.add(str(path))
            session.get().baseline(cfg)


def plan_run(cfg: DictConfig) -> Plan:
    """What a run will evaluate and record, without running it; sweeps use it to group jobs sharing
    pytorch/fakequant rows and to find each job's rows afterwards."""
    check_eval_config(cfg.eval)
    device = eval_device(cfg)
    layer_names, approx_layers = model_layers(cfg.model)
    multipliers = resolve_per_layer(cfg.multiplier, layer_names)
    return Plan(device, approx_layers, multipliers, row_keys(cfg, multipliers, approx_layers, device))


def model_layers(model_cfg: DictConfig) -> tuple[list[str], list[str]]:
    """(every quantized layer, the approximated ones) of a model config, from a build without weights; once
    per distinct model config in this process (a sweep plans many jobs of one model)."""
    def build():
        with torch.device("meta"):  # only the layers' names and shapes: no weights to initialise
            return build_model(model_cfg, 0.0, 1.0)

    # the build does not read approx_layers / other_layers: a sensitivity table's 54 one-layer configs of a
    # ResNet-50 build it once (a torchvision build is a quarter of a second)
    built = {k: v for k, v in OmegaConf.to_container(model_cfg, resolve=True).items()
             if k not in ("approx_layers", "other_layers")}
    model = session.get().memo(("model_layers", cache_key(built)), build)
    wanted = model_cfg.get("approx_layers")
    key = ("select_layers", cache_key(built), cache_key(OmegaConf.to_container(wanted) if OmegaConf.is_config(wanted)
                                                       else wanted))
    names, approx = session.get().memo(key, lambda: (tuple(quant_layers(model)),
                                                     tuple(select_layers(model, wanted))))
    return list(names), list(approx)


def build_models(cfg: DictConfig, model, ckpt, calib_x, multipliers: dict, approx_layers: list[str], keys: dict,
                 approx: bool = True):
    """(fake-quant model, approx model or None when not `approx`, calibration stats) of a run; calibration and
    the fake-quant model come from the session when an earlier evaluation of this command built them."""
    qcfg = QuantConfig.from_cfg(cfg.quant)
    others = other_layers(cfg)
    folded, stats = session.get().calibration(model, ckpt, calib_x, qcfg, int(cfg.seed))
    fq = session.get().memo(("fakequant", keys["fakequant"]), lambda: convert_model(
        folded, multipliers, qcfg, stats, fake=True, layers=approx_layers, others=others))
    if not approx:
        return fq, None, stats
    # Jobs that differ only in their tables share one converted model (converting took longer than a GPU
    # evaluation); each loads its own tables into it. With every other layer fake-quant, jobs that approximate
    # different layers (sensitivity, search) share one too: their layers are swapped in (LayerSwaps).
    if others == "fakequant":
        swaps = session.get().memo(("approx-swaps", keys["fakequant"], id(folded), cfg.backend.name, cfg.backend.algo),
                                   lambda: LayerSwaps(fq, folded, qcfg, stats, cfg.backend.name, cfg.backend.algo))
        model = swaps.install(multipliers, approx_layers)
    else:
        model = session.get().memo(("approx", keys["fakequant"], id(folded), cfg.backend.name, cfg.backend.algo,
                                    tuple(approx_layers), others), lambda: convert_model(
            folded, multipliers, qcfg, stats, backend=cfg.backend.name, algo=cfg.backend.algo, layers=approx_layers,
            others=others))
    for name, layer in quantized_layers(model).items():
        if name in approx_layers:
            layer.set_multiplier(multipliers[name])
    return fq, model, stats


def prefix_of(cfg: DictConfig, multipliers: dict, approx_layers: list[str], keys: dict):
    """(first approximated layer, key of what the layers before it compute), or (None, None) when the
    approximation starts at the first layer and there is nothing before it to reuse."""
    names = list(multipliers)
    start = next(n for n in names if n in approx_layers)
    before = names[:names.index(start)]
    if not before:
        return None, None
    kind = other_layers(cfg)
    return start, session.Prefix(
        cache_key({"reference": keys["pytorch"], "quant": QuantConfig.from_cfg(cfg.quant).as_dict(),
                   "seed": int(cfg.seed)}),
        tuple((n, kind, multipliers[n].signed if kind != "fp32" else None) for n in before))


def _run(cfg: DictConfig, out_dir: Path | None, common: dict, quiet: bool = False, plan: Plan | None = None,
         prepare_only: bool = False) -> dict:
    """quiet: no progress bar, table or skip message (a command that runs many evaluations reports them).
    prepare_only: the set-up alone (prepare), stopping before the retraining, the evaluations and the rows."""
    qcfg = QuantConfig.from_cfg(cfg.quant)
    # a plan made earlier keeps all but the device: this run may hold a different leased GPU
    plan = plan_run(cfg) if plan is None else plan.on(eval_device(cfg))
    device, approx_layers, multipliers, keys = plan.device, plan.approx_layers, plan.multipliers, plan.row_keys
    results_file = Path(cfg.results_file)
    wanted = wanted_paths(cfg, keys)
    if "approx_finetuned" in keys and distributed.rank_world()[1] == 1 and not prepare_only and \
            str(finetune.run_settings(cfg)["devices"]) != "1" and len(finetune_devices(cfg)) > 1:
        raise UserError("finetune.devices spreads one retraining over several devices in `approx-run finetune`; "
                        "compare and sweep retrain on one device per job (a sweep spreads its jobs with "
                        "sweep.devices).")
    if distributed.rank_world()[1] == 1 and not prepare_only and str(cfg.eval.get("devices", 1)) != "1" and \
            len(eval_devices(cfg)) > 1:
        raise UserError("eval.devices shards the one evaluation of `approx-run compare` (`approx-run finetune` "
                        "evaluates over its finetune.devices); a sweep spreads its jobs with sweep.devices.")
    recorded = done_keys(results_file)  # also checks the file: a damaged one stops the run before the work
    # the ranks of a distributed retraining decide as rank 0 read the file (a row appended meanwhile must not
    # make one rank train and another skip)
    skip = distributed.broadcast_object(recorded if cfg.skip_done else set())
    if all(keys[p] in skip for p in wanted):
        if not quiet:
            console.print(f"[yellow]skipping[/] {common['backend']}/{multipliers[approx_layers[0]].name}: "
                          f"already in {results_file}")
        return {"status": "skipped"}

    sess = session.get()
    model, meta, ckpt, data = sess.baseline(cfg)
    x, y = data.test_x, data.test_y
    if cfg.eval.limit:
        x, y = x[: int(cfg.eval.limit)], y[: int(cfg.eval.limit)]
    # a reference run (sweep) records no approx row: no approx model to build
    fq, approx, stats = build_models(cfg, model, ckpt, data.train_x, multipliers, approx_layers, keys,
                                     approx=any(p.startswith("approx") for p in wanted))
    models = {"pytorch": model, "fakequant": fq, "approx": approx}
    extra = {p: {} for p in PATHS}
    ft_info = None
    if prepare_only:
        _warm_first_calls(cfg, approx, model, data, x, qcfg, device, "approx_finetuned" in wanted and
                          keys["approx_finetuned"] not in skip)
    elif "approx_finetuned" in wanted and keys["approx_finetuned"] not in skip:
        fcfg = finetune.FinetuneConfig.from_cfg(cfg.finetune)
        ident = finetune.identity(weight_config(cfg), multipliers, approx_layers, qcfg, fcfg, lr_scale(cfg))
        models["approx_finetuned"], ft_meta, ft_ckpt = finetune.obtain(
            cfg, approx, data, ident, qcfg, device, out_dir, label=multiplier_columns(multipliers, approx_layers)[
                "multiplier"], teacher=model)
        extra["approx_finetuned"] = finetune.row_columns(fcfg, ft_meta, ft_ckpt)
        ft_info = {"checkpoint": str(ft_ckpt), **ft_meta}
    bs = int(cfg.eval.batch_size)
    threads = torch.get_num_threads()
    mcols = multiplier_columns(multipliers, approx_layers)
    # multiplies per layer depend on the architecture and the image shape only: one forward per command
    macs = sess.memo(("macs", str(ckpt), tuple(x.shape[1:])), lambda: layer_macs(model, tuple(x.shape[1:])))
    spent = energy(multipliers, approx_layers, macs)
    # every fake-quant layer's histogram: the fake-quant model (its key) is shared by runs that approximate
    # different layers of it (sensitivity). On the evaluation's device: 512 ImageNet images through a fake-quant
    # ResNet-50 took three minutes of a 16-core host's CPU, seconds on its GPU. Rank 0 alone records them
    hists = sess.memo(("operand", keys["fakequant"]), lambda: operand.operand_histograms(
        fq, list(quantized_layers(fq, weights_only=True)), data.train_x, qcfg, int(cfg.seed),
        device)) if distributed.is_main() else {}
    op_cols, op_layers = operand.metrics(multipliers, {n: hists[n] for n in approx_layers if n in hists}, macs)
    extra["fakequant"]["mult_energy_rel"] = 1.0  # exact int8 multiplies everywhere
    extra["approx"].update({"mult_energy_rel": spent["mult_energy_rel"], **op_cols})
    extra["approx_finetuned"]["mult_energy_rel"] = spent["mult_energy_rel"]
    env = sess.memo(("environment", str(device)), lambda: environment(device))  # git runs once per command
    data_sha = weight_config(cfg)["data"]["sha256"]
    rows, preds = [], {}
    # fakequant predictions are needed for agreement even when its row is already recorded
    order = ["pytorch", "fakequant"] + [p for p in ("approx", "approx_finetuned")
                                        if p in models and p in wanted and not prepare_only]
    n_batches = (len(x) + bs - 1) // bs
    graphs = bool(cfg.eval.get("cuda_graph", True))
    world = distributed.rank_world()[1]
    # a sharded evaluation's rows say over which devices (the numbers are the one-device run's)
    sharded = {"eval_world_size": world, "eval_devices": distributed.rank_devices(device)} if world > 1 else {}
    start, prefix_key = prefix_of(cfg, multipliers, approx_layers, keys)
    if not (cfg.get("sensitivity") or {}).get("prefix_cache", True):  # the rows are the same either way
        start = prefix_key = None
    if not quiet and not prepare_only and distributed.is_main():
        def passes(p):  # run_timed's passes over the set, as the loop below runs it (0: not run)
            record = p in wanted and keys[p] not in skip
            if not record:
                return 0 if sess.predictions(keys[p]) is not None else 1
            return max(1, int(cfg.eval.warmup)) + int(cfg.eval.repeats) if int(cfg.eval.repeats) else 1
        _announce([p for p in order if passes(p)], models, x, bs, device, passes)
    bar = _no_progress() if quiet else progress_bar(f"compare {mcols['multiplier']} on {device}", total=len(order))
    with bar as advance:
        for path in order:
            record = path in wanted and keys[path] not in skip and not prepare_only
            preds[path] = sess.predictions(keys[path])
            if preds[path] is not None and not record:  # a reference whose predictions this command has seen
                advance(1, path=path)
                continue
            if world > 1:  # every rank runs its share of the batches; every rank gets every prediction
                timed = run_timed_sharded(models[path], x, bs, device, warmup=int(cfg.eval.warmup) if record else 0,
                                          repeats=int(cfg.eval.repeats) if record else 0, cuda_graph=graphs)
            else:
                timed = run_timed(models[path], x, bs, device,
                                  warmup=int(cfg.eval.warmup) if record else 0,
                                  repeats=int(cfg.eval.repeats) if record else 0, cuda_graph=graphs,
                                  logits=sess.logits_from(models[path], x, bs, device, start, prefix_key)
                                  if path in ("approx", "fakequant") and start else None)
            preds[path] = timed.predictions
            sess.keep_predictions(keys[path], timed.predictions)
            if record:
                row = _row(path, timed, y, preds, bs, device, threads)
                is_quant = path != "pytorch"
                is_lut = path.startswith("approx")
                rows.append({**common, **row, **(mcols if is_lut else {}), **extra[path],
                             "scope": scope_of(path, multipliers, approx_layers),
                             "multiplier": mcols["multiplier"] if is_quant else "",
                             "quant": common["quant"] if is_quant else "",
                             "backend": common["backend"] if is_lut else "torch",
                             "algo": common["algo"] if is_lut else "",
                             "row_key": keys[path], "data_sha256": data_sha, "checkpoint": str(ckpt),
                             "baseline_test_accuracy":
                             meta["test_accuracy"], "device_name": env["device_name"],
                             "git_sha": env["git_sha"], "git_dirty": env["git_dirty"],
                             "torch_version": env["torch"], "n_batches": n_batches, **sharded})
            advance(1, path=path)
    if prepare_only:
        return {"status": "prepared"}
    if not distributed.is_main():  # rank 0 records
        return {"status": "ok", "rank": distributed.rank_world()[0]}
    write_csv(out_dir / "metrics.csv", rows)
    # with skip_done, a row another process recorded meanwhile (concurrent sweeps) is not added twice
    append_rows(results_file, rows, skip_recorded=bool(cfg.skip_done))
    atomic_write_json(out_dir / "run.json", {
        **env, "seed": int(cfg.seed), "checkpoint": str(ckpt), "baseline": meta,
        "config": OmegaConf.to_container(cfg, resolve=True),
        "multipliers": {n: {"name": m.name, "signed": m.signed, "lut_sha256": m.sha256, "source": m.source}
                        for n, m in multipliers.items() if n in approx_layers},
        "calibration": {n: vars(s) for n, s in stats.items()},
        "energy": spent, "operand_metrics": op_layers,
        "finetune": ft_info,
        "auto_picks": {p: auto_picks(models[p]) for p in order if p.startswith("approx")},
        "rows": len(rows), "results_file": str(results_file),
    })
    if not quiet:
        _print_table(rows)
    return {"status": "ok", "rows": rows}


def _warm_first_calls(cfg: DictConfig, approx, teacher, data, x, qcfg: QuantConfig, device: torch.device,
                      retrains: bool) -> None:
    """The one-off costs of a process's first retraining and first approx evaluation, paid on throwaway work:
    the kernels' timed picks per shape (`auto`), their first launches, backward kernels, the optimizer and
    CUDA graph capture: on a GPU most of what a first retraining job costs beyond a later one (measured in
    benchmarks/README.md, several GPUs). Training: a copy of the approx model, one epoch over just enough
    batches of the job's batch size to be captured and replayed once; evaluation: one batch."""
    from runner.train_step import GRAPH_WARMUP

    if approx is None:
        return
    if retrains:
        fcfg = finetune.FinetuneConfig.from_cfg(cfg.finetune)
        n = int(fcfg.batch_size) * (GRAPH_WARMUP + 2)
        few = dataclasses.replace(data, train_x=data.train_x[:n], train_y=data.train_y[:n])
        finetune.train_epochs(copy.deepcopy(approx), few, dataclasses.replace(fcfg, epochs=1), qcfg, device,
                              int(cfg.seed), "first calls", teacher=teacher,
                              cuda_graph=finetune.cuda_graph_setting(cfg))
    bs = int(cfg.eval.batch_size)
    run_timed(approx, x[:bs], bs, device, warmup=0, repeats=0)


def run_compare(cfg: DictConfig, out_dir: Path) -> dict:
    """`approx-run compare`: one evaluation, its images sharded over eval.devices (or torchrun's ranks) when
    there are several, rank 0 recording the rows."""
    check_eval_config(cfg.eval)
    devices = eval_devices(cfg)

    def baseline_first(cfg):
        plan_run(cfg)
        session.get().baseline(cfg)

    return distributed.run(cfg, out_dir, run, devices, before=baseline_first)


def eval_devices(cfg: DictConfig) -> list[str]:
    return distributed.resolve(cfg.eval.get("devices", 1), _uses_cuda(cfg), "eval.devices")


def _uses_cuda(cfg: DictConfig) -> bool:
    return BACKEND_DEVICE.get(cfg.backend.name, "cuda" if resolve_device(cfg.device).type == "cuda" else "cpu") \
        == "cuda"


def run_finetune(cfg: DictConfig, out_dir: Path) -> dict:
    """`approx-run finetune`: compare with retraining on (finetune.epochs >= 1); with finetune.devices or under
    torchrun, retrained by every rank (runner.distributed), evaluated and recorded by rank 0."""
    if config_number(cfg.finetune.epochs, "finetune.epochs") < 1:
        raise UserError(f"finetune.epochs={cfg.finetune.epochs}: `approx-run finetune` needs at least one epoch.")
    fcfg = finetune.FinetuneConfig.from_cfg(cfg.finetune)
    finetune.cuda_graph_setting(cfg)
    devices = finetune_devices(cfg)
    distributed.check_batch(int(fcfg.batch_size), len(devices), "finetune.batch_size")

    def baseline_first(cfg):  # trained (or found) once here, not by every rank
        plan_run(cfg)
        session.get().baseline(cfg)

    return distributed.run(cfg, out_dir, run, devices, before=baseline_first, resumable=True)


def finetune_devices(cfg: DictConfig) -> list[str]:
    """finetune.devices as one device per rank (runner.distributed.resolve), on the backend's device kind."""
    return distributed.resolve(finetune.run_settings(cfg)["devices"], _uses_cuda(cfg), "finetune.devices")


def _announce(order: list[str], models: dict, x, bs: int, device: torch.device, passes) -> None:
    """The evaluations about to run and their time at the pace of a small batch of each path, timed now:
    compare's whole work is these few passes, so no evaluation of its own can be timed first to estimate it."""
    from runner.console import fmt_seconds

    k = min(bs, 8, len(x))
    if not k or not order:
        return
    said, seconds = [], 0.0
    for path in order:
        runs = passes(path)
        took = []
        for _ in range(2):  # the first call's one-off costs (kernel picks, allocation) once, then the pace
            t0 = time.perf_counter()
            run_timed(models[path], x[:k], k, device, warmup=0, repeats=0)
            took.append(time.perf_counter() - t0)
        seconds += max(0.0, took[0] - took[1]) + took[1] / k * len(x) * runs
        said.append(f"{path} x{runs}" if runs > 1 else path)
    console.print(f"compare: {len(order)} evaluations ({', '.join(said)}) of {len(x):,} images, about "
                  f"{fmt_seconds(seconds)} at the pace of {k} images of each", highlight=False, soft_wrap=True)


@contextmanager
def _no_progress():
    yield lambda n=1, **info: None


def _print_table(rows: list[dict]) -> None:
    print_table(rows, "approx-run compare", columns=("path", "multiplier", "backend", "accuracy",
                                                      "agreement_fakequant", "latency_ms_median", "throughput_img_s"))
