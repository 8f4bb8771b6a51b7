"""How a run ends before its last step: a stop request, a checkpoint by the clock, a rank that stopped answering.

- :class:`StopRequest`: SIGTERM (scancel, preemption, a node shutting down) or SIGUSR1 (``sbatch --signal``,
  sent a chosen time before the job's limit) ends the run at the next step boundary, on every rank after
  the same step, with that step's checkpoint and exit code :data:`EXIT_STOPPED`; ``ckpt_every_minutes``
  checkpoints by the wall clock.
- :class:`StepWatchdog`: a step that does not end within 0.8 ``dist_timeout_s`` leaves each rank's Python
  stack in ``<run_dir>/stacks/rank<r>.txt``; at 1.5 ``dist_timeout_s`` a rank of a multi-process job ends
  itself with one line naming where it waits and the ranks that did not arrive (exit 1, which torchrun
  restarts), whatever the wait: a collective that honours the process group's timeout ends long before.
- :func:`describe_timeout`: a collective that timed out, as one line naming it and the ranks that did not
  arrive (utils.training.run_cli prints it).
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import math
import os
import re
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from utils.checkpoint.files import last_write_seconds, newest_complete_checkpoint

EXIT_STOPPED = 75
"""Exit code of a run that stopped on request (SIGTERM, SIGUSR1) after checkpointing the step it was on:
BSD's EX_TEMPFAIL, "try again later". The job scripts requeue on it; --resume (or --resume auto) continues."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
END_TIME_VARIABLE = "JOB_END_TIME"
"""The job's time limit as Unix seconds, exported to the run by the job scripts (submit_multinode.sh): a stop
request compares the time left with the run's last checkpoint write, as SLURM tells a job nothing of its lead."""
REPO = Path(__file__).resolve().parents[1]
HANG_STACK_FRACTION = 0.8
"""The step watchdog writes the stacks once a step has lasted this fraction of dist_timeout_s."""
HANG_EXIT_FRACTION = 1.5
"""... and ends a rank of a multi-process job once the step has lasted this fraction of dist_timeout_s."""
HANG_BACKSTOP_FRACTION = 1.9
"""faulthandler's own timer ends the rank here if the watchdog thread could not run (a hung C call that holds
Python's lock): it needs no Python code to run, so the end of a hang never depends on the wait that hangs."""
EXIT_HUNG = 1
"""Exit code of a rank the watchdog ended: a failure, which torchrun --max-restarts restarts (as a timeout's)."""
TIMEOUT_WORDS = ("Timed out waiting", "timed out", "Watchdog caught collective operation timeout")
"""What gloo's and NCCL's errors say when a collective outlived the process group's timeout."""


class StopRequest:
    """The step boundary, where a run may end early. Build it on every rank at the same point, before the loop.

    The signal handler only notes the signal. :meth:`agreed` (every step, on every rank) shares it: one
    max all-reduce of two numbers (the signal, and whether ``ckpt_every_minutes`` have passed on rank 0's
    clock) over a gloo group on the CPU (over a CUDA job's NCCL group it would cost a host sync each
    step), so a signal that reached one rank stops them all together and none is left waiting in a
    collective. Each call also tells the :class:`StepWatchdog` that the step moved.
    """

    def __init__(self, cfg):
        self.signal: Optional[str] = None  # the agreed signal's name, once a rank got one
        self._received = 0
        self._stop_at: Optional[float] = None  # monotonic time at which the ranks agreed to stop
        self._left_s: Optional[float] = None  # seconds then left before the job's time limit, if known
        self._interval_s, self._last_due = 60.0 * cfg.train.ckpt_every_minutes, time.monotonic()
        for signum in STOP_SIGNALS:
            _previous_handlers.setdefault(signum, signal.signal(signum, self._note))
        self._group = None
        if dist.is_initialized() and dist.get_world_size() > 1:
            gloo = dist.get_backend() == "gloo"  # the CPU's own group serves; NCCL's needs a gloo twin
            self._group = dist.group.WORLD if gloo else dist.new_group(backend="gloo")
        self._watchdog = StepWatchdog(cfg.dist.dist_timeout_s, cfg.train.run_dir)

    def _note(self, signum, _frame) -> None:
        self._received = self._received or signum

    def agreed(self) -> tuple[bool, bool]:
        """(whether any rank has been asked to stop, whether a time-based checkpoint is due); collective."""
        self._watchdog.kick()  # a new step, a new deadline
        due = bool(self._interval_s) and time.monotonic() - self._last_due >= self._interval_s
        due = due and (self._group is None or dist.get_rank() == 0)  # rank 0's clock decides
        received = self._received
        if self._group is not None:
            flags = torch.tensor([received, int(due)], dtype=torch.int64)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
            received, due = int(flags[0]), bool(flags[1])
        if due:
            self._last_due = time.monotonic()
        if received and not self.signal:
            self.signal = signal.Signals(received).name
            self._stop_at = time.monotonic()
            self._warn_if_lead_is_short()
        return bool(received), due

    def _warn_if_lead_is_short(self) -> None:
        """Rank 0 says so when the time left before the job's limit may not hold the stop's checkpoint."""
        end, written_s = os.environ.get(END_TIME_VARIABLE, ""), last_write_seconds()
        if not end.isdigit():
            return
        self._left_s = max(0.0, int(end) - time.time())
        if written_s is not None and written_s > self._left_s / 2 and _is_rank0():
            print(f"warning: {self._left_s:.0f} s are left before the job's time limit, and this run's last "
                  f"checkpoint took {written_s:.1f} s to write: this one may not finish (the run would resume from "
                  f"the one before); ask for a longer lead, e.g. sbatch --signal=B:USR1@{_lead_for(written_s)}",
                  flush=True)

    @property
    def exit_code(self) -> int:
        return EXIT_STOPPED if self.signal else 0

    def summary(self, step: int, run_dir) -> str:
        """The run's last line (done, or stopped: by which signal, the checkpoint, how to continue); disarms the
        watchdog and removes this rank's stack file if nothing was written to it."""
        stop_watching()
        if not self.signal:
            return f"done: {step} steps; outputs in {run_dir}"
        checkpoint = newest_complete_checkpoint(f"{run_dir}/checkpoints")
        line = (f"stopped at step {step} by {self.signal}: checkpoint {checkpoint}; continue with the same "
                f"command and --resume auto (exit code {EXIT_STOPPED})")
        if self._left_s is not None:  # what a user needs to choose the signal's lead
            took = time.monotonic() - self._stop_at
            line += f"; the stop took {took:.1f} s of the {self._left_s:.0f} s left before the job's time limit"
            if took > self._left_s / 2:
                line += f": ask for a longer lead next time (sbatch --signal=B:USR1@{_lead_for(took)})"
        return line


class StepWatchdog:
    """Ends a wait that never ends. :meth:`kick` says the run moved (each step boundary, each validation batch
    through :func:`heartbeat`); a daemon thread looks every tenth of ``timeout_s`` (at most every second).

    At 0.8 ``timeout_s`` without a kick it writes every thread's Python stack to ``<run_dir>/stacks/rank<r>.txt``
    (the hung rank's, and those of the ranks that wait for it). At 1.5 ``timeout_s``, in a multi-process job, it
    prints one line that names the wait and the ranks that did not arrive and ends the process (exit 1, which
    torchrun restarts): the guarantee that does not depend on the backend honouring its timeout (seen: FSDP2's
    reduce-scatter on gloo, a pipeline's receive, a process group made without one). A lone process only gets
    its stack: nobody waits for it, and a slow step is not a hang. PyTorch has no such watchdog for gloo (NCCL's
    own, on GPUs, aborts the communicator of a timed-out collective), hence this one.
    """

    def __init__(self, timeout_s: float, run_dir, beats: bool = False):
        self._timeout_s = timeout_s
        self._rank = dist.get_rank() if dist.is_initialized() else 0
        self._ends_rank = dist.is_initialized() and dist.get_world_size() > 1
        self._path = Path(run_dir) / "stacks" / f"rank{self._rank}.txt"
        self._path.parent.mkdir(parents=True, exist_ok=True)
        # beats: each kick also touches rank<r>.beat beside the stack file, for a launcher that watches its ranks
        # from outside (check_layouts.py): a rank frozen whole (SIGSTOP, a stopped node) cannot end itself. It stays
        # after close (the launcher's folder goes with it), so that a rank done is not taken for one not started.
        self._beat = self._path.with_suffix(".beat") if beats else None
        self._file = open(self._path, "w")  # faulthandler writes to an open file, also without the interpreter
        self._closed = threading.Event()
        self.kick()
        threading.Thread(target=self._watch, name="step-watchdog", daemon=True).start()
        global _watchdog
        _watchdog = self

    def kick(self) -> None:
        self._last, self._dumped = time.monotonic(), False
        if self._beat is not None:
            self._beat.touch()
        if self._ends_rank:  # re-armed at each kick: only a hang lets it fire
            faulthandler.dump_traceback_later(HANG_BACKSTOP_FRACTION * self._timeout_s, exit=True, file=self._file)

    def _watch(self) -> None:
        while not self._closed.wait(min(1.0, self._timeout_s / 10)):
            idle = time.monotonic() - self._last
            if idle >= HANG_STACK_FRACTION * self._timeout_s and not self._dumped:
                self._dumped = True
                self._file.write(f"rank {self._rank}: the step has not moved for {idle:.1f} s\n")
                self._file.flush()
                faulthandler.dump_traceback(self._file, all_threads=True)
            if self._ends_rank and idle >= HANG_EXIT_FRACTION * self._timeout_s:
                self._end(idle)

    def _end(self, idle: float) -> None:
        # The line waits for the store's answer: the backstop, armed for 1.9 x the timeout since the last kick, moves
        # past that wait (bounded still), or on a loaded machine it ended the rank first, without the line.
        grace = min(2.0, self._timeout_s / 4)
        faulthandler.dump_traceback_later(grace + STORE_ANSWER_S + 1.0, exit=True, file=self._file)
        frames = _waiting_frames()
        line = (f"[rank {self._rank}] error: {_where(frames, 'a wait')} has not returned for {idle:.0f} s "
                f"({HANG_EXIT_FRACTION:g} x --dist_timeout_s {self._timeout_s:g})")
        line += _naming(_ranks_not_answering(grace_s=grace))
        print(line + "; this rank ends itself (exit 1: torchrun --max-restarts restarts the job); each rank's "
              "Python stack is in <run_dir>/stacks/ (a step that is just slow needs a larger --dist_timeout_s)",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(EXIT_HUNG)  # from this thread: the main thread is the one that waits

    def close(self) -> None:
        """Disarm; remove this rank's stack file if nothing was written to it."""
        if self._closed.is_set():
            return
        self._closed.set()
        faulthandler.cancel_dump_traceback_later()
        self._file.close()
        if self._path.stat().st_size == 0:
            self._path.unlink()
            with contextlib.suppress(OSError):  # other ranks' files are still there, or another rank removed it
                self._path.parent.rmdir()


_watchdog: Optional[StepWatchdog] = None  # this process's, while a run's loop is on


def heartbeat() -> None:
    """The run moved (a validation batch, say): the step watchdog's deadlines start again. Cheap; any layer
    above this one may call it, and without a watchdog it does nothing."""
    if _watchdog is not None:
        _watchdog.kick()


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _lead_for(write_s: float) -> int:
    """A signal lead, in seconds, with room for a checkpoint write that took ``write_s``: writes of the same
    checkpoint vary by up to 3x (benchmarks/README.md), and the stop must also reach the step boundary."""
    return 60 * math.ceil((3 * write_s + 60) / 60)


_previous_handlers: dict = {}  # the signal handlers a StopRequest replaced, restored by stop_watching()


def stop_watching() -> None:
    """Hand SIGTERM and SIGUSR1 back to their previous handlers and disarm the step watchdog: the run is over
    (utils.training.run_cli calls it when a run fails, for a process that lives on, as a test's does)."""
    global _watchdog
    if _watchdog is not None:
        _watchdog.close()
        _watchdog = None
    faulthandler.cancel_dump_traceback_later()
    for signum, handler in _previous_handlers.items():
        signal.signal(signum, handler)
    _previous_handlers.clear()


def describe_timeout(error: BaseException, grace_s: float = 2.0) -> Optional[tuple[str, list[int]]]:
    """For a collective that timed out (None for any other error): one line that says which collective, after
    how long, and which ranks did not arrive; and those ranks. The ranks that time out note themselves in the
    job's store and, after ``grace_s``, every rank that has not is named (it hangs, or has died)."""
    if not any(words in str(error) for words in TIMEOUT_WORDS):
        return None
    waited = re.search(r"(?:waiting |Timeout\(ms\)=)(\d+)\s*ms|Timeout\(ms\)=(\d+)", str(error))
    line = f"{_where(traceback.extract_tb(error.__traceback__))} timed out"
    if waited:
        line += f" after {int(next(g for g in waited.groups() if g)) / 1000:g} s"
    missing = _ranks_not_answering(grace_s) if dist.is_initialized() else []
    return line + _naming(missing) + "; each rank's Python stack at the deadline is in <run_dir>/stacks/", missing


def _naming(missing: list[int]) -> str:
    return f": rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did not arrive" if missing else ""


def _where(frames: list[traceback.FrameSummary], unknown: str = "a collective") -> str:
    """The wait in a stack: the collective (the innermost public function of torch.distributed, else its
    innermost frame, e.g. a pipeline's receive) and the innermost line of the project's code that led there."""
    public = [f.name for f in frames if f.filename.endswith("distributed_c10d.py") and not f.name.startswith("_")]
    torch_dist = [f for f in frames if f"torch{os.sep}distributed{os.sep}" in f.filename]
    ours = [f for f in frames if f.filename.startswith(str(REPO)) and "site-packages" not in f.filename]
    if public:
        where = public[-1]
    elif torch_dist:
        where = f"{Path(torch_dist[-1].filename).stem}.{torch_dist[-1].name}"
    else:
        where = unknown
    if ours:  # where the project's code waited: the innermost of its frames
        where += f" ({Path(ours[-1].filename).relative_to(REPO)}:{ours[-1].lineno}: {ours[-1].line})"
    return where


def _waiting_frames() -> list[traceback.FrameSummary]:
    """The stack of the thread that waits in torch.distributed (the main thread's, or autograd's on a GPU, where
    FSDP2's backward collectives run); the main thread's if none does."""
    stacks = {ident: traceback.extract_stack(frame) for ident, frame in sys._current_frames().items()
              if ident != threading.get_ident()}
    main = stacks.get(threading.main_thread().ident, [])
    in_torch = f"torch{os.sep}distributed{os.sep}"
    waiting = [stack for stack in stacks.values() if any(in_torch in f.filename for f in stack)]
    return main if main in waiting or not waiting else waiting[0]


STORE_ANSWER_S = 1.0  # beyond the grace: a store answers in milliseconds, so past this its host is taken as frozen


def _ranks_not_answering(grace_s: float) -> list[int]:
    """The ranks that have not noted themselves in the job's store within ``grace_s`` (they hang, or have died).

    Bounded also when the store's host is frozen: ``store.set_timeout`` bounds waiting for a key, not a request to a
    server that accepted the connection and never answers (a stopped process, a node on a hung file system). So
    the requests run in a thread of their own, waited for ``grace_s`` + STORE_ANSWER_S at most; past that the host
    is the rank named: rank 0, where each attempt has a store of its own (the job scripts' setting), else nobody."""
    found: list = []

    def ask() -> None:
        # PyTorch has no public accessor for the job's store; the ranks that are still alive note themselves there.
        try:
            store = dist.distributed_c10d._get_default_store()
            store.set_timeout(datetime.timedelta(seconds=grace_s + 3))
            store.set(f"timed_out/{dist.get_rank()}", "1")
            keys = [f"timed_out/{rank}" for rank in range(dist.get_world_size())]
            until = time.monotonic() + grace_s
            while not store.check(keys) and time.monotonic() < until:  # done as soon as every rank has noted itself
                time.sleep(0.05)
            found.append([rank for rank, key in enumerate(keys) if not store.check([key])])
        except Exception:  # the store's host has gone: nobody can be named
            found.append([])

    thread = threading.Thread(target=ask, name="ranks-not-answering", daemon=True)
    thread.start()
    thread.join(grace_s + STORE_ANSWER_S)
    if found:
        return found[0]
    return [0] if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" else []
