"""Training (and evaluating) one job over several processes with torch.distributed: DistributedDataParallel
for retraining and baseline training, sharded evaluation.

Two ways in, one per-rank path:
- torchrun (one or several nodes): every process runs the whole command; RANK / WORLD_SIZE / LOCAL_RANK /
  MASTER_ADDR in the environment say which rank it is (init_method env://).
- `<section>.devices=auto|N|[cuda:0,...]` on one host: the command's process spawns one process per device
  (start method spawn, init_method a file in a temporary directory), waits for them and reports a rank that
  died by its number. On the CPU `devices=N` means N gloo processes (how the tests run the distributed path).

Backend nccl on CUDA, gloo on the CPU. Rank 0 alone writes (checkpoints, rows, logs); the other ranks'
stdout is discarded, their errors still reach stderr. The process group is torch's own state
(torch.distributed.is_initialized), read where a step needs the rank: nothing of ours is global."""
from __future__ import annotations

import dataclasses
import hashlib
import importlib
import math
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from runner.errors import UserError

# How to change the learning rate with the number of ranks (a global batch that grows with the ranks):
#   none    the configured lr (the default: `batch_size` is the global batch, so nothing else changes)
#   linear  lr x world size (Goyal et al. 2017);  sqrt: lr x sqrt(world size) (for Adam, Krizhevsky 2014)
LR_SCALING = ("none", "linear", "sqrt")
# A rank whose collective failed because another rank went away exits with this code: the launcher then
# names the rank that died first, not the ones that lost it.
PEER_LOST = 75
# After the first rank ends badly, how long the others get to notice and end before they are stopped.
GRACE_S = 10.0
TORCHRUN_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")


class RankFailed(UserError):
    """A rank of a distributed run died: the message names it; exit code 1 (not bad input)."""

    exit_code = 1


# ---------------------------------------------------------------- where this process stands

def rank_world() -> tuple[int, int]:
    """(rank, world size) of this process: (0, 1) outside a process group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_main() -> bool:
    return rank_world()[0] == 0


def under_torchrun() -> bool:
    """torchrun (or any launcher setting its variables) started this process as one rank of several."""
    return all(k in os.environ for k in TORCHRUN_KEYS) and int(os.environ.get("WORLD_SIZE", "1")) > 1


def torchrun_rank() -> int | None:
    return int(os.environ["RANK"]) if under_torchrun() else None


def lr_scale(rule: str, world: int) -> float:
    if rule not in LR_SCALING:
        raise UserError(f"finetune.lr_scaling={rule!r}: choose one of {', '.join(LR_SCALING)}.")
    return {"none": 1.0, "linear": float(world), "sqrt": math.sqrt(world)}[rule]


def check_batch(batch: int, world: int, key: str) -> int:
    """The per-rank batch of a global batch: every rank takes the same number of images per step, so the mean
    of the ranks' gradients is the gradient of the global batch's mean loss."""
    if batch % world:
        raise UserError(f"{key}={batch} is the global batch; it must divide evenly over the {world} ranks "
                        f"(e.g. {key}={max(world, batch - batch % world)}).")
    return batch // world


# ---------------------------------------------------------------- the devices setting

def resolve(spec, uses_cuda: bool, key: str) -> list[str]:
    """A `<section>.devices` setting as one device name per rank. 1 / null: one process (no process group);
    auto: every visible GPU when the run is on CUDA, else one process; N: the first N GPUs on CUDA, N
    processes on the CPU; a list: those devices (all cuda:N or all cpu)."""
    from runner.workers import resolve_devices

    if spec is None or str(spec) in ("1", ""):
        return ["cuda:0" if uses_cuda else "cpu"]
    if isinstance(spec, int) or str(spec).isdigit():
        n = int(spec)
        if n < 1:
            raise UserError(f"{key}={spec}: give a number of devices >= 1, auto, or a list such as [cuda:0,cuda:1].")
        if not uses_cuda:
            return ["cpu"] * n
        have = torch.cuda.device_count()
        if n > have:
            raise UserError(f"{key}={n}: torch sees {have} GPU(s) here.")
        return [f"cuda:{i}" for i in range(n)]
    devices = resolve_devices(spec, uses_cuda, key=key)
    kinds = {d.partition(":")[0] for d in devices}
    if kinds != {"cuda" if uses_cuda else "cpu"}:
        want = "cuda:N" if uses_cuda else "cpu"
        raise UserError(f"{key}={spec}: this run computes on {'cuda' if uses_cuda else 'the cpu'}, so its devices "
                        f"are {want} entries (the backend decides where the run computes).")
    if uses_cuda and len(set(devices)) != len(devices):
        raise UserError(f"{key}={spec} names a GPU twice; NCCL needs one GPU per rank.")
    return devices


# ---------------------------------------------------------------- running a command over ranks

def run(cfg, out_dir: Path, fn, devices: list[str], before=None, resumable: bool = False):
    """fn(cfg, out_dir) as every rank of the run: under torchrun in this process (one rank of it); with several
    devices in one spawned process per device; else plainly here. before(cfg): what the command's process
    does once before spawning (a baseline the ranks then load instead of each training it). resumable: a rank
    that dies is reported with the finetune.resume hint."""
    if under_torchrun():
        if len(devices) > 1:
            raise UserError("under torchrun the ranks are torchrun's (--nproc_per_node, --nnodes): leave "
                            "finetune.devices, train.devices and eval.devices at 1.")
        local = int(os.environ["LOCAL_RANK"])
        device = f"cuda:{local}" if devices[0].startswith("cuda") else "cpu"
        with process_group(device, "env://", int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])):
            return fn(cfg, out_dir)
    if len(devices) == 1:
        return fn(cfg, out_dir)
    if before is not None:
        before(cfg)
    return launch(f"{fn.__module__}:{fn.__qualname__}", cfg, out_dir, devices, resumable)


@contextmanager
def process_group(device: str, init_method: str, rank: int, world: int):
    """This process as rank `rank` of `world` on `device`, for the with block."""
    import torch.distributed as dist

    from runner import gpus

    dev = torch.device(device)
    if rank != 0:  # one voice: rank 0's progress and tables; errors still go to stderr
        sys.stdout = open(os.devnull, "w")
        from runner.console import console

        console.quiet = True
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", init_method=init_method, rank=rank,
                            world_size=world, **({"device_id": dev} if dev.type == "cuda" else {}))
    try:
        with gpus.pinned(dev.index or 0):  # this rank's GPU: no per-job lease (runner.gpus)
            yield
    finally:
        dist.destroy_process_group()


def launch(entry: str, cfg, out_dir: Path, devices: list[str], resumable: bool = False):
    """entry ("module:function") as one spawned process per device, as ranks 0..n-1; returns when all end.
    A rank that ends badly stops the others and raises RankFailed naming it (the first to end, not the
    ones whose collective failed because it went away)."""
    ranks = spawn_ranks(entry, cfg, out_dir, devices)
    if ranks.ok:
        return {"status": "ok", "world_size": len(devices), "devices": devices}
    if all(c == 2 for c in ranks.codes.values()):  # the same bad input on every rank: rank 0 has said it (exit 2)
        raise SystemExit(2)
    if ranks.interrupted:
        raise KeyboardInterrupt
    raise RankFailed(f"{ranks.failure()}; the run stopped (exit codes by rank: "
                     f"{', '.join(f'{r}={c}' for r, c in ranks.codes.items())}). No checkpoint and no row were "
                     "written. " + ("Rerun with finetune.resume=true to continue the retraining from its last "
                                    "finished epoch." if resumable else "Rerun the command."))


@dataclasses.dataclass
class Ranks:
    """How the spawned ranks of one run ended: exit codes by rank, the order they were seen to end, each
    failed rank's first line of error, and rank 0's return value when it ended well (None otherwise, or
    when the value does not pickle)."""
    devices: list[str]
    pids: list[int]
    codes: dict[int, int | None]
    order: list[int]
    errors: dict[int, str]
    result: object = None

    @property
    def ok(self) -> bool:
        return all(c == 0 for c in self.codes.values())

    @property
    def interrupted(self) -> bool:
        """Ctrl-C (or the launcher's stop after one): no rank failed of itself."""
        return all(c in (0, 130, 143, PEER_LOST) for c in self.codes.values()) and \
            any(c == 130 for c in self.codes.values())

    def first_failed(self) -> int:
        """The rank that ended badly first: not one that only lost its peer, unless every failed one did."""
        died = [r for r in self.order if self.codes[r] not in (0, PEER_LOST)] or \
            [r for r in self.order if self.codes[r] != 0]
        return died[0]

    def failure(self) -> str:
        """'rank 1 of 2 (cpu, pid 8101) was killed by SIGKILL (its error)'."""
        first = self.first_failed()
        said = f" ({self.errors[first].strip()})" if first in self.errors else ""
        return (f"rank {first} of {len(self.devices)} ({self.devices[first]}, pid {self.pids[first]}) "
                f"{_how(self.codes[first])}{said}")


def spawn_ranks(entry: str, cfg, out_dir: Path, devices: list[str], stop=None) -> Ranks:
    """entry ("module:function") as one spawned process per device, as ranks 0..n-1; returns how they ended.
    Once a rank ends badly the others get GRACE_S to end, then are stopped. Ctrl-C here, or `stop` (a
    threading.Event, for a caller that waits on several runs from threads) set, stops them all and raises
    KeyboardInterrupt."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    world = len(devices)
    with tempfile.TemporaryDirectory(prefix="approx-run-ranks-") as tmp:
        init = f"file://{Path(tmp) / 'rendezvous'}"
        procs = [ctx.Process(target=_rank_main, args=(entry, cfg, Path(out_dir), r, devices, init, tmp),
                             name=f"approx-run rank {r}", daemon=False) for r in range(world)]
        for p in procs:
            p.start()
        print(f"ranks: {world} processes on {', '.join(devices)} (pids {', '.join(str(p.pid) for p in procs)})",
              flush=True)
        try:
            order = _wait(procs, stop)
        except KeyboardInterrupt:
            _stop(procs, 5.0)
            raise
        errors = {r: (Path(tmp) / f"rank{r}.error").read_text() for r in range(world)
                  if (Path(tmp) / f"rank{r}.error").exists()}
        result = _read_result(Path(tmp)) if procs[0].exitcode == 0 else None
    return Ranks(list(devices), [p.pid for p in procs], {r: procs[r].exitcode for r in range(world)}, order, errors,
                 result)


def _read_result(tmp: Path):
    import pickle

    try:
        return pickle.loads((tmp / "rank0.result").read_bytes())
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError):
        return None


def _how(code: int | None) -> str:
    import signal

    if code is None:
        return "did not end"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _wait(procs, stop=None) -> list[int]:
    """Wait for every process; once one ends badly the rest get GRACE_S to end by themselves, then are stopped.
    Returns the ranks in the order they were seen to end. stop (an Event) set: KeyboardInterrupt."""
    from multiprocessing.connection import wait

    order, pending = [], {p.sentinel: r for r, p in enumerate(procs)}
    deadline = None
    while pending:
        if stop is not None and stop.is_set():
            raise KeyboardInterrupt
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        if stop is not None:  # look at it a few times a second
            timeout = 0.2 if timeout is None else min(timeout, 0.2)
        ready = wait(list(pending), timeout=timeout)
        if not ready and (deadline is None or time.monotonic() < deadline):
            continue
        if not ready:  # the grace period is over
            _stop([procs[r] for r in pending.values()], 5.0)
            order += sorted(pending.values())
            break
        # a rank killed outright ends before the ranks that noticed it: its exit code (a signal) tells it apart
        for s in sorted(ready, key=lambda s: procs[pending[s]].exitcode not in (None, 0, PEER_LOST), reverse=True):
            r = pending.pop(s)
            procs[r].join()
            order.append(r)
            if procs[r].exitcode != 0 and deadline is None:
                deadline = time.monotonic() + GRACE_S
    return order


def _stop(procs, timeout_s: float) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


class _Terminated(KeyboardInterrupt):
    """SIGTERM in a spawned rank."""


def _rank_main(entry: str, cfg, out_dir: Path, rank: int, devices: list[str], init: str, tmp: str) -> None:
    """A spawned rank: the command's function in a process group; exit codes as the command's (0, 2 for bad
    input, 130 interrupted), PEER_LOST when another rank went away, 1 for anything else. An error's message
    goes to <tmp>/rank<r>.error, for the launcher's report of the rank that failed first."""
    import signal

    from runner.jobs.hydra_app import report_error

    def terminated(*_):
        raise _Terminated

    signal.signal(signal.SIGTERM, terminated)  # the launcher stopping the ranks: end like Ctrl-C, code 143
    if devices[rank] == "cpu":  # ranks of one host share its cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // len(devices)))
    module, _, name = entry.partition(":")
    fn = getattr(importlib.import_module(module), name)
    code = 0
    try:
        with process_group(devices[rank], init, rank, len(devices)):
            result = fn(cfg, out_dir)
        if rank == 0:
            _keep_result(tmp, result)
    except UserError as exc:
        if rank == 0:
            report_error(exc)
        code = exc.exit_code
        _note(tmp, rank, str(exc))
    except KeyboardInterrupt as exc:
        code = 143 if isinstance(exc, _Terminated) else 130
    except Exception as exc:  # noqa: BLE001 - the exit code is what the launcher reads
        if _peer_lost(exc):
            code = PEER_LOST
        else:
            import traceback

            print(f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}", file=sys.stderr,
                  flush=True)
            code = 1
            _note(tmp, rank, f"{type(exc).__name__}: {exc}")
    sys.stdout.flush()
    os._exit(code)  # no interpreter teardown: a CUDA context or a gloo pair can hang it


def _keep_result(tmp: str, result) -> None:
    """Rank 0's return value for the launcher (spawn_ranks): what a job's rows came to (its status)."""
    import pickle

    try:
        (Path(tmp) / "rank0.result").write_bytes(pickle.dumps(result))
    except Exception:  # noqa: BLE001 - a value that does not pickle: the launcher gets None, the run stands
        pass


def _note(tmp: str, rank: int, text: str) -> None:
    try:
        (Path(tmp) / f"rank{rank}.error").write_text(text.splitlines()[0][:500] if text else "")
    except OSError:  # the launcher's report is the poorer for it, nothing else
        pass


def _peer_lost(exc: BaseException) -> bool:
    """A collective that failed because another rank went away (gloo: the connection closed; NCCL: the
    communicator aborted)."""
    import torch.distributed as dist

    text = str(exc).lower()
    return isinstance(exc, getattr(dist, "DistError", ())) or any(
        s in text for s in ("connection closed", "connection reset", "broken pipe", "gloo", "nccl", "timed out"))


# ---------------------------------------------------------------- helpers of the training loops

@torch.no_grad()
def broadcast_module(model: torch.nn.Module) -> None:
    """Every parameter and buffer of `model` as rank 0 has it: the ranks start training from one state even
    where their set-up (calibration, code maps, bias correction on a GPU) could round differently."""
    import torch.distributed as dist

    for t in (*model.parameters(), *model.buffers()):
        if t.dtype != torch.bool and not t.is_meta:
            dist.broadcast(t.data, src=0)


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        # copied into a fresh 1-D tensor: an expanded one (a scalar broadcast to [1]) is "contiguous" with
        # stride 0, which neither contiguous() nor reshape() changes and view(uint8) refuses
        flat = torch.empty(t.numel(), dtype=t.dtype).copy_(t.detach().cpu().reshape(-1))
        h.update(flat.view(torch.uint8).numpy().tobytes() if t.dtype != torch.bool else flat.numpy().tobytes())
    return h.hexdigest()


def check_same(model: torch.nn.Module, what: str = "weights") -> None:
    """RuntimeError unless every rank holds the same state: what DDP promises after each step (the gradients
    all-reduced, every rank applying the same update), checked once at the end of a run."""
    import torch.distributed as dist

    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest(model))
    if len(set(digests)) > 1:
        raise RuntimeError(f"the ranks ended with different {what} ({', '.join(d[:8] for d in digests)})")


def rank_devices(device) -> str:
    """Every rank's device as its host numbers it, in rank order, ';'-joined (host/device when the ranks span
    several hosts); this process's device alone outside a process group."""
    import platform

    from runner.provenance import host_device

    mine = host_device(device)
    world = rank_world()[1]
    if world == 1:
        return mine
    import torch.distributed as dist

    every = [None] * world
    dist.all_gather_object(every, (platform.node(), mine))
    several = len({host for host, _ in every}) > 1
    return ";".join(f"{host}/{d}" if several else d for host, d in every)


def all_reduce_(*tensors: torch.Tensor, op: str = "sum") -> None:
    import torch.distributed as dist

    for t in tensors:
        if t.dtype == torch.bool:
            flag = t.to(torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            t.copy_(flag.bool())
        else:
            dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)


def barrier() -> None:
    import torch.distributed as dist

    if rank_world()[1] > 1:
        dist.barrier()


def broadcast_object(obj):
    """rank 0's obj on every rank."""
    import torch.distributed as dist

    if rank_world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def shard(order: torch.Tensor, world: int) -> torch.Tensor:
    """An epoch's permutation padded (with its own first images, as torch's DistributedSampler pads) to a
    multiple of the world size, so every global batch splits evenly and every rank takes as many steps."""
    pad = (-len(order)) % world
    return torch.cat([order, order[:pad]]) if pad else order


def my_part(batch: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s images of a global batch: positions rank, rank + world, ... (DistributedSampler's
    interleaving; the union over the ranks is the global batch)."""
    return batch[rank::world]
