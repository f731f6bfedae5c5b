"""The jobs of one command spread over several devices of a host (cluster chunks: runner.jobs.chunks).

A pool of devices [d0, d1, ...]: this process serves d0 itself (its session already holds the data, the
baseline and the reference predictions) and one long-lived worker process per other device, started with the
spawn method (CUDA cannot fork), pulls jobs too, keeping its own session (runner.session) for all its jobs.
Jobs are claimed through one shared counter, so each runs exactly once; rows go through the store's lock
(runner.store). A worker sees only its GPU (CUDA_VISIBLE_DEVICES, set before CUDA starts in it).

Started early (Pool): a command that knows it will spread jobs starts the workers as soon as it knows its
devices (runner.sweep: right after composing), so a worker's interpreter, torch import, CUDA context and
modules overlap the command's prelude; its tasks come later (Pool.run, or Pool.send once the jobs are planned
and their baselines exist), through a pipe fed from a thread. run_tasks is the pool started and run at once.

Pre-warm: a started worker first builds its session for the next job's configuration (run_tasks' `prepare`:
data, baseline, calibration, models, references, the first calls of a retraining and an evaluation), then for
one job of each other setup left (Task.setup), so its first job of any setup costs what a later one does. This
process pre-warms the same way before its first pooled job, so "whoever is free takes the next job" spreads
equal jobs evenly (8 over 4 devices: 2 each, also with a worker a little late). One whose pre-warm fails goes
on cold, and this process does the jobs meanwhile.

Timing: every outcome carries its job's start and end (time.monotonic()) and the pool each process's
milestones (up: torch imported; tasks: received; ready: pre-warmed), which runner.jobs.run.run_jobs turns into
the schedule a sweep writes (schedule.json) and prints.

The claim rule (worker_claims, fed by claim_estimates): this process takes the next job whenever it is free;
a worker takes one only when it is expected to finish it before this process, working through the rest of
the queue alone, would have finished them all. A pre-warmed worker is costed as this process's time per job;
a cold one's first job carries its warm-up, so with short jobs it takes none.

Ending: a worker exits when no job is left; one that died (killed, out of memory, a crash in a kernel) has its
job reported failed with the reason; the parent never waits on a worker without bound. Ctrl-C or SIGTERM: no
job is started any more, the workers are stopped, and every finished row stays recorded."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable

from runner.errors import UserError
from runner.jobs.claims import Pace, claim_estimates, worker_claims

# How long the end of the pool waits for a worker's process and for the reader of their reports.
JOIN_TIMEOUT_S = 10.0
# How often a worker that the claim rule holds back looks again (the estimates change as jobs end).
CLAIM_POLL_S = 0.05
# How long the end of the pool gives a started worker that took no job left to leave by itself.
IDLE_EXIT_S = 1.0
# The most set-ups a worker pre-warms: the signedness and quant-scheme groups of a table sweep are a few; a
# sweep of many (models x data) would keep it building set-ups that its jobs build anyway.
PREWARM_SETUPS = 4


@dataclass(frozen=True)
class Task:
    """One job: fn(*args) in whichever process claims it (args are pickled for the workers). Tasks of one
    setup share their set-up (data, baseline, calibration, references): a worker pre-warms one of each."""
    num: int
    args: tuple
    setup: str = ""


@dataclass(frozen=True)
class Outcome:
    num: int
    status: str
    error: str = ""
    device: str = ""
    worker: int | None = None  # 0: this process, 1..: the worker of devices[worker]; None: never run
    started: float | None = None  # time.monotonic() at the job's start and end (None: not run, or unknown)
    ended: float | None = None


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count()


def resolve_devices(spec, uses_cuda: bool, key: str = "sweep.devices") -> list[str]:
    """A devices setting (`key`, for the messages) as device names. auto: every visible GPU when the jobs
    run on CUDA, else one device (the jobs then run in this process, as without a pool); a list names
    them (cpu, cuda, cuda:N; a name twice is two workers on one device)."""
    if spec is None or str(spec) == "auto":
        n = _cuda_count() if uses_cuda else 0
        return [f"cuda:{i}" for i in range(n)] if n > 1 else ["cuda:0" if uses_cuda else "cpu"]
    items = [spec] if isinstance(spec, str) else list(spec)
    items = [s.strip() for item in items for s in str(item).split(",") if s.strip()]
    if not items:
        raise UserError(f"{key} is empty; give auto or a list such as [cuda:0,cuda:1].")
    devices = []
    for item in items:
        kind, _, index = item.partition(":")
        if kind == "cpu" and not index:
            devices.append("cpu")
            continue
        if kind != "cuda" or (index and not index.isdigit()):
            raise UserError(f"{key}: {item!r} is not a device; use cpu, cuda or cuda:N, "
                            f"e.g. {key}=[cuda:0,cuda:1], or {key}=auto.")
        n = _cuda_count()
        i = int(index or 0)
        if i >= n:
            raise UserError(f"{key}: {item} is not here: torch sees {n} GPU(s)"
                            f"{' (cuda:0 .. cuda:' + str(n - 1) + ')' if n else ''}.")
        devices.append(f"cuda:{i}")
    return devices


def devices_of(cfgs: list, section: str) -> list[str]:
    """The devices of a command's jobs: its `<section>.devices` setting (the first job's: one value for
    the command), auto meaning every GPU when any job runs on CUDA."""
    return resolve_devices(cfgs[0][section].get("devices", "auto"),
                           uses_cuda=any(c.backend.name == "cuda" or c.device == "cuda" for c in cfgs),
                           key=f"{section}.devices")


def _gpu_index(device: str) -> int | None:
    kind, _, index = device.partition(":")
    return int(index or 0) if kind == "cuda" else None


def _see_only(device: str) -> None:
    """Before CUDA starts in this process: make `device` its only GPU (none for cpu)."""
    index = _gpu_index(device)
    if index is None:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        return
    from runner.gpus import visible_gpu_ids

    ids = visible_gpu_ids()
    os.environ["CUDA_VISIBLE_DEVICES"] = ids[index] if ids else str(index)


def _threads_each(devices: list[str]) -> int:
    """Processes of one host share its cores: the set-up on the CPU (calibration, conversion) and CPU
    jobs would otherwise oversubscribe them."""
    return max(1, (os.cpu_count() or 1) // len(devices))


# One process's job times in an array of doubles (shared for this process, so every worker reads them):
# first job (-1: none ended), sum and count of the later ones, monotonic start of the current job (0: none).
_FIRST, _REST_SUM, _REST_N, _SINCE = range(4)
_NO_TIMES = (-1.0, 0.0, 0.0, 0.0)


def _started(times, now: float) -> None:
    times[_SINCE] = now


def _ended(times, seconds: float) -> None:
    if times[_FIRST] < 0:
        times[_FIRST] = seconds
    else:
        times[_REST_SUM] += seconds
        times[_REST_N] += 1
    times[_SINCE] = 0.0


def _pace(times, now: float) -> Pace:
    first, total, count, since = times[_FIRST], times[_REST_SUM], times[_REST_N], times[_SINCE]
    return Pace(first if first >= 0 else None, total / count if count else None, now - since if since else None)


NOT_NOW = -1  # _claim: the rule holds this worker back for now


def _claim(counter, owner, n: int, wid: int, may: Callable[[int], bool] | None = None,
           times=None) -> int | None:
    """The next job, marked as this process's (owner) in the same step, so a worker's death with it is
    known even if it could not say so. None: no job left; NOT_NOW: may(remaining unclaimed) said no,
    decided under the same lock as the claim. times: this process's shared job times, its current job's
    start set in the same step (a worker reads them under this lock)."""
    with counter.get_lock():
        i = counter.value
        if i >= n:
            return None
        if may is not None and not may(n - i):
            return NOT_NOW
        counter.value = i + 1
        owner[i] = wid
        if times is not None:
            _started(times, time.monotonic())
        return i


def _status(result) -> tuple[str, str]:
    if isinstance(result, dict):
        return str(result.get("status") or "ok"), str(result.get("error") or "")
    return "ok", ""


def _failure(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"


# A process's milestones in the pool's shared array of doubles (3 per device, time.monotonic(); 0: not yet):
# up (interpreter, torch and the warm imports done), tasks (received), ready (pre-warmed: it claims from then)
_UP, _TASKS, _READY = range(3)
MILESTONES = ("up", "tasks", "ready")


def _serve(wid: int, device: str, fn: Callable, tasks_conn, counter, owner, conn, threads: int,
           parent_times, ready, stamps, go, prepare: Callable | None = None, imports: tuple = ()) -> None:
    """A worker process: while its tasks are not there yet, torch, the CUDA context and `imports` (the jobs'
    modules); then its tasks (from tasks_conn, with the time they were sent and _handover), its pre-warm (prepare),
    then jobs while the claim rule gives it one and until none is left, each reported as it ends through its own pipe (a
    worker that dies mid-message breaks only its own). Milestones go to `stamps` (the clock is the host's
    time.monotonic(), shared by processes). It claims nothing before the parent runs the jobs (go[0]): a job
    taken while the parent still records the reference rows would record them itself."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops the pool on Ctrl-C (the whole group gets it)
    _see_only(device)
    import importlib

    import torch

    torch.set_num_threads(threads)
    if _gpu_index(device) is not None:
        from runner.gpus import warm_up_cuda

        warm_up_cuda()  # the CUDA context and the libraries' first calls, in a thread, while the rest imports
    for name in imports:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001  (a job that needs it reports the failure)
            pass
    stamps[3 * wid + _UP] = time.monotonic()
    try:
        tasks, sent, handover = tasks_conn.recv()
    except EOFError:  # none came (Pool.close, runner.workers._send_later): nothing to do here
        os._exit(0)
    tasks_conn.close()
    _adopt(handover)
    got = stamps[3 * wid + _TASKS] = time.monotonic()
    # what the worker's start cost beyond its tasks being there (spawn, interpreter, imports, the tasks
    # unpickled): about 0 when it was up and waiting for them (a pool started early)
    start_s = max(0.0, got - sent)
    own = list(_NO_TIMES)
    if prepare is not None:
        own[_FIRST] = _prewarm(prepare, tasks, counter, device)
    stamps[3 * wid + _READY] = time.monotonic()
    ready[wid] = 1  # after the pre-warm: one still in it when the jobs are all done is stopped at once

    def may(remaining: int) -> bool:
        if not go[0]:
            return False
        now = time.monotonic()
        estimates = claim_estimates(_pace(parent_times, now), _pace(own, now), start_s)
        return estimates is not None and worker_claims(remaining, *estimates)

    while (i := _claim(counter, owner, len(tasks), wid, may)) is not None:
        if i == NOT_NOW:
            time.sleep(CLAIM_POLL_S)
            continue
        t0 = time.monotonic()
        try:
            status, error = _status(fn(*tasks[i].args))
            raised = False
        except Exception as exc:  # noqa: BLE001  (one job's crash must not take the others' worker)
            status, error, raised = "failed", _failure(exc), True
        t1 = time.monotonic()
        _ended(own, t1 - t0)
        conn.send((i, status, error, raised, t0, t1))
    conn.close()
    # Everything is reported and every row written atomically: skip the interpreter's teardown (a CUDA
    # context's takes about a second, a stall at the end of the sweep).
    os._exit(0)


def _prewarm(prepare: Callable, tasks: list[Task], counter, device: str) -> float:
    """prepare(*args) of the next unclaimed task (the one this process would take first), then of the next
    task of each other setup left in the queue (up to PREWARM_SETUPS in all): a warm worker is costed as
    this process's time per job, which a job of a setup it has not built (another signedness: its own
    calibration and references) would overrun. Returns the seconds, which stand for the first job's
    one-off costs (claim_estimates), or -1 (cold) when no job is left or the first failed: the worker then
    goes on as if it had none, its session holding whatever was built, and the failure is left to its
    jobs to report."""
    t0, built = time.monotonic(), set()
    while len(built) < PREWARM_SETUPS:
        i = counter.value
        task = next((t for t in tasks[i:] if t.setup not in built), None)
        if task is None:
            break
        try:
            prepare(*task.args)
        except Exception as exc:  # noqa: BLE001  (a failed pre-warm must not lose the worker, nor the pool)
            # warm for the set-ups built before this one; cold when it was the first
            then = "claiming as a cold worker" if not built else "its jobs of that set-up build it themselves"
            print(f"worker on {device}: pre-warm failed, {then} ({type(exc).__name__}: {exc})",
                  file=sys.stderr, flush=True)
            break
        built.add(task.setup)
    return time.monotonic() - t0 if built else _NO_TIMES[_FIRST]


def _handover() -> dict:
    """What this process has decoded that the workers' pre-warm would decode again (the IDX data files: their
    decompression was a third of a Fashion-MNIST worker's data load), sent with the tasks. Only what is
    loaded already: nothing is imported for it."""
    mnist = sys.modules.get("runner.data.mnist")
    return {"idx": mnist.decoded_files()} if mnist is not None else {}


def _adopt(handover: dict) -> None:
    if handover.get("idx"):
        from runner.data.mnist import adopt_decoded

        adopt_decoded(handover["idx"])


def _send_later(conn, payload) -> None:
    """payload down conn from a thread. The spawned process reads what it is started with only as it
    unpickles it, importing torch on the way: a start payload over the pipe's buffer (a sweep's tasks, with
    their configs) held this process there for seconds before its own first job."""
    def send():
        try:
            conn.send(payload)
        except Exception:  # noqa: BLE001  (the worker died before it read them, or they do not pickle: it
            pass           # then gets none and leaves, and this process does the jobs)
        finally:
            conn.close()

    threading.Thread(target=send, name="approx-run-pool-tasks", daemon=True).start()


class _Board:
    """What the parent knows of the jobs, filled from the workers' pipes by a reader thread."""

    def __init__(self, tasks: list[Task], devices: list[str], advance: Callable, on_failure: Callable | None):
        self.tasks, self.devices, self.advance, self.on_failure = tasks, devices, advance, on_failure
        self.lock = threading.Lock()
        self.outcomes: dict[int, Outcome] = {}
        self.stop = threading.Event()

    def finish(self, num: int, status: str, error: str, raised: bool, wid: int | None,
               started: float | None = None, ended: float | None = None) -> None:
        """raised: the job did not return (it raised, or its worker died): on_failure records it."""
        device = "" if wid is None else self.devices[wid]
        with self.lock:
            if num in self.outcomes:
                return
            self.outcomes[num] = Outcome(num, status, error, device, wid, started, ended)
            if raised and self.on_failure is not None:
                self.on_failure(self.tasks[num], error)
            self.advance(1, job=num, status=status, device=device)

    def read(self, conns: dict, poll_s: float) -> None:
        from multiprocessing.connection import wait

        open_ = dict(conns)  # connection -> worker id
        while open_ and not self.stop.is_set():
            for conn in wait(list(open_), timeout=poll_s):
                try:
                    num, status, error, raised, started, ended = conn.recv()
                except (EOFError, OSError):  # the worker ended (its last message, if cut short, is lost)
                    open_.pop(conn)
                    continue
                self.finish(num, status, error, raised, open_[conn], started, ended)


class Pool:
    """The worker processes of `devices[1:]`, started now, before their tasks are known (up to `capacity` of
    them, handed over with send or run): each imports torch, starts its GPU and imports `imports` meanwhile.
    This process serves devices[0] in run. fn, prepare: as run_tasks takes them. A pool runs once; close()
    (also after run) stops what is left of it."""

    def __init__(self, fn: Callable, devices: list[str], capacity: int, prepare: Callable | None = None,
                 imports: tuple = ()):
        import torch.multiprocessing as mp

        self.fn, self.devices, self.capacity, self.prepare = fn, list(devices), int(capacity), prepare
        ctx = mp.get_context("spawn")
        self.counter = ctx.Value("i", 0)
        self.owner = ctx.Array("i", [-1] * self.capacity, lock=False)
        # this process's job times (read by the workers' claim rule, under the counter's lock); which workers
        # are pre-warmed (one that took no job then leaves by itself at the end); every process's milestones
        self.times = ctx.Array("d", _NO_TIMES, lock=False)
        self.ready = ctx.Array("b", len(self.devices), lock=False)
        self.stamps = ctx.Array("d", 3 * len(self.devices), lock=False)
        self.go = ctx.Array("b", 1, lock=False)  # set by run: the workers may claim
        self.threads = _threads_each(self.devices)
        self.procs, self.conns, self.feeds = {}, {}, {}
        self.tasks: list[Task] | None = None
        self.start = time.monotonic()
        with _sigint_ignored():  # inherited through exec: a Ctrl-C while a worker starts is the parent's alone
            for wid, device in enumerate(self.devices[1:], start=1):
                receive, send = ctx.Pipe(duplex=False)
                tasks_in, tasks_out = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_serve, args=(wid, device, fn, tasks_in, self.counter, self.owner, send,
                                                        self.threads, self.times, self.ready, self.stamps,
                                                        self.go, prepare, tuple(imports)),
                                   name=f"approx-run-worker-{wid}-{device}", daemon=True)
                proc.start()
                send.close()  # the worker's end only: its death is then the end of this pipe
                tasks_in.close()
                self.procs[wid], self.conns[receive], self.feeds[wid] = proc, wid, tasks_out

    def send(self, tasks: list[Task]) -> None:
        """The tasks to every worker, from threads (this process goes on at once); once."""
        if self.tasks is not None:
            return
        if len(tasks) > self.capacity:
            raise ValueError(f"{len(tasks)} tasks for a pool of {self.capacity}")
        self.tasks = list(tasks)
        sent = time.monotonic()
        handover = _handover() if self.feeds else {}
        for feed in self.feeds.values():
            _send_later(feed, (self.tasks, sent, handover))
        self.feeds = {}

    def close(self) -> None:
        """The workers stopped: after run, what is left of them; before it (the jobs went another way, or the
        command stopped before them), at once: they claimed nothing (go) and write nothing before a job."""
        for feed in self.feeds.values():
            feed.close()  # EOF: a worker waiting for its tasks exits
        self.feeds = {}
        with self.counter.get_lock():
            self.counter.value = max(self.counter.value, len(self.tasks or ()))
        _stop(self.procs, 0.0)
        for conn in self.conns:
            conn.close()
        self.conns = {}

    def milestones(self) -> dict[int, dict[str, float]]:
        """worker id -> {up, tasks, ready: time.monotonic()} of what it reached (this process: ready only)."""
        out = {}
        for wid in range(len(self.devices)):
            got = {name: self.stamps[3 * wid + k] for k, name in enumerate(MILESTONES) if self.stamps[3 * wid + k]}
            out[wid] = got
        return out

    def run(self, tasks: list[Task], advance: Callable, on_failure: Callable | None = None,
            join_timeout_s: float = JOIN_TIMEOUT_S, poll_s: float = 0.1) -> list[Outcome]:
        """run_tasks on this pool (tasks: those sent already, if any were)."""
        import torch

        from runner import gpus

        self.send(tasks)
        tasks = self.tasks
        counter, owner, times, ready, procs, conns = (self.counter, self.owner, self.times, self.ready,
                                                      self.procs, self.conns)
        devices = self.devices
        board = _Board(tasks, devices, advance, on_failure)
        reader = threading.Thread(target=board.read, args=(conns, poll_s), name="approx-run-pool-reader",
                                  daemon=True)
        reader.start()
        self.go[0] = 1
        own_threads = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        index = _gpu_index(devices[0])
        interrupted = True
        try:
            with gpus.pinned(index) if index is not None else nullcontext():
                if index is not None:
                    torch.cuda.set_device(index)
                if self.prepare is not None:  # as the workers do: every process's jobs then cost alike
                    first = _prewarm(self.prepare, tasks, counter, devices[0])
                    with counter.get_lock():
                        times[_FIRST] = first
                self.stamps[_READY] = time.monotonic()
                ready[0] = 1
                while (i := _claim(counter, owner, len(tasks), 0, times=times)) is not None:
                    try:
                        status, error = _status(self.fn(*tasks[i].args))
                        raised = False
                    except Exception as exc:  # noqa: BLE001
                        status, error, raised = "failed", _failure(exc), True
                    with counter.get_lock():
                        started, ended = times[_SINCE], time.monotonic()
                        _ended(times, ended - started)
                    board.finish(i, status, error, raised, 0, started, ended)
            _wait_for_workers(board, procs, reader, poll_s)
            interrupted = False
        finally:  # also on Ctrl-C / SIGTERM: nothing more starts, the workers stop, finished rows stay
            with counter.get_lock():
                counter.value = len(tasks)
            torch.set_num_threads(own_threads)
            # Every job reported (or an interrupt): a worker still alive has no job left. One that started (the
            # claim rule gave it none) sees that within CLAIM_POLL_S and exits by itself; one still starting or
            # pre-warming (torch's import, the CUDA context, its session: seconds, longer than a short sweep's
            # jobs; it writes nothing) is not waited for.
            # Otherwise the workers all ended already.
            if interrupted or len(board.outcomes) == len(tasks):
                if not interrupted:
                    _stop({w: p for w, p in procs.items() if ready[w]}, IDLE_EXIT_S)
                _stop(procs, 0.0)
            else:
                _stop(procs, join_timeout_s)
            reader.join(join_timeout_s)  # reads what the workers sent before they ended
            board.stop.set()
            reader.join(join_timeout_s)
            for conn in conns:
                conn.close()
            self.conns = {}
        for num in range(len(tasks)):
            if num in board.outcomes:
                continue
            wid = owner[num]
            if wid > 0:  # a job its worker took and never reported: the worker died with it
                board.finish(num, "failed", f"its worker on {devices[wid]} ended (exit code {procs[wid].exitcode}) "
                             "during the job", True, wid)
            else:
                board.finish(num, "failed", "not run", True, None)
        return [board.outcomes[n] for n in range(len(tasks))]


def run_tasks(fn: Callable, tasks: list[Task], devices: list[str], advance: Callable,
              on_failure: Callable | None = None, join_timeout_s: float = JOIN_TIMEOUT_S,
              poll_s: float = 0.1, prepare: Callable | None = None) -> list[Outcome]:
    """fn(*task.args) for every task, over `devices` (this process serves the first). fn is a module-level
    function (the workers import it by name); it returns a dict with "status" (and "error"), or raises:
    the task is then failed. advance(1, **info) after each task, in this process; on_failure(task, error)
    for a task that did not return (it raised, or its worker died). prepare: a module-level function every
    process calls on a task's args before it takes any (its pre-warm: fn's set-up for them, kept for its
    jobs; its result is ignored, its failure leaves the process cold). Returns the outcomes in task order."""
    pool = Pool(fn, devices, len(tasks), prepare=prepare)
    try:
        return pool.run(tasks, advance, on_failure, join_timeout_s, poll_s)
    finally:
        pool.close()


@contextmanager
def _sigint_ignored():
    """SIGINT ignored while worker processes are started: they keep ignoring it from their first
    instruction (a Ctrl-C reaches the whole process group; one that came while a worker imported torch
    printed its traceback), and the parent stops them itself."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def _wait_for_workers(board: _Board, procs: dict, reader: threading.Thread, poll_s: float) -> None:
    """Until every job is reported or the workers have all ended and their pipes are read (the job of one
    that died is reported failed by the caller; the others' jobs were still run)."""
    while len(board.outcomes) < len(board.tasks) and reader.is_alive():
        reader.join(poll_s)


def _stop(procs: dict, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for proc in procs.values():
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs.values():
        if proc.is_alive():
            proc.terminate()
    for proc in procs.values():
        proc.join(5.0)
        if proc.is_alive():
            proc.kill()
            proc.join(5.0)


def shard_setting(cfg: DictConfig, section: str) -> bool:
    """`<section>.shard` (sweep, sensitivity) as a bool; anything else is refused before any work."""
    value = cfg[section].get("shard", True)
    if not isinstance(value, bool):
        raise UserError(f"{section}.shard={value!r}: choose true or false.")
    return value
