"""How a run ends before its last step: a stop request, a checkpoint by the clock, a rank that stopped answering.

- :class:`StopRequest`: SIGTERM (scancel, preemption, a node shutting down) or SIGUSR1 (``sbatch --signal``,
  sent a chosen time before the job's limit) ends the run at the next step boundary, on every rank after
  the same step, with that step's checkpoint and exit code :data:`EXIT_STOPPED`; ``ckpt_every_minutes``
  checkpoints by the wall clock; and a step that does not end within 0.8 ``dist_timeout_s`` leaves each
  rank's Python stack in ``<run_dir>/stacks/rank<r>.txt``.
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
import time
import traceback
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from utils.checkpoint import last_write_seconds, newest_complete_checkpoint

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
TIMEOUT_WORDS = ("Timed out waiting", "timed out", "Watchdog caught collective operation timeout")
"""What gloo's and NCCL's errors say when a collective outlived the process group's timeout."""


class StopRequest:
    """The step boundary, where a run may end early. Build it on every rank at the same point, before the loop.

    The signal handler only notes the signal. :meth:`agreed` (every step, on every rank) shares it: one
    max all-reduce of two numbers (the signal, and whether ``ckpt_every_minutes`` have passed on rank 0's
    clock) over a gloo group on the CPU (over a CUDA job's NCCL group it would cost a host sync each
    step), so a signal that reached one rank stops them all together and none is left waiting in a
    collective. Each call also re-arms a watchdog (``faulthandler``) that writes this rank's Python stack
    if the next step boundary does not come within 0.8 ``dist_timeout_s``: the stack of a rank that hangs,
    and of those that wait for it.
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
        rank = dist.get_rank() if dist.is_initialized() else 0
        self._stacks = Path(cfg.train.run_dir) / "stacks" / f"rank{rank}.txt"
        self._stacks.parent.mkdir(parents=True, exist_ok=True)
        self._stack_file = open(self._stacks, "w")  # faulthandler writes to an open file, from a signal-safe thread
        # Before the collective's own timeout, which ends the rank (and cancels this) without a stack otherwise.
        self._hang_after_s = HANG_STACK_FRACTION * cfg.dist.dist_timeout_s
        faulthandler.dump_traceback_later(self._hang_after_s, file=self._stack_file)

    def _note(self, signum, _frame) -> None:
        self._received = self._received or signum

    def agreed(self) -> tuple[bool, bool]:
        """(whether any rank has been asked to stop, whether a time-based checkpoint is due); collective."""
        faulthandler.dump_traceback_later(self._hang_after_s, file=self._stack_file)  # a new step, a new deadline
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
        self._stack_file.close()
        if self._stacks.stat().st_size == 0:
            self._stacks.unlink()
            with contextlib.suppress(OSError):  # other ranks' files are still there, or another rank removed it
                self._stacks.parent.rmdir()
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
    faulthandler.cancel_dump_traceback_later()
    for signum, handler in _previous_handlers.items():
        signal.signal(signum, handler)
    _previous_handlers.clear()


def describe_timeout(error: BaseException, grace_s: float = 2.0) -> Optional[str]:
    """One line for a collective that timed out (None for any other error): which collective, after how long,
    and which ranks did not arrive. The ranks that time out note themselves in the job's store and, after
    ``grace_s``, every rank that has not is named (it hangs, or has died)."""
    if not any(words in str(error) for words in TIMEOUT_WORDS):
        return None
    frames = traceback.extract_tb(error.__traceback__)
    public = [f.name for f in frames if f.filename.endswith("distributed_c10d.py") and not f.name.startswith("_")]
    ours = [f for f in frames if f.filename.startswith(str(REPO)) and "site-packages" not in f.filename]
    collective = public[-1] if public else "a collective"
    if ours:  # where the project's code waited: the innermost of its frames
        collective += f" ({Path(ours[-1].filename).relative_to(REPO)}:{ours[-1].lineno}: {ours[-1].line})"
    waited = re.search(r"(?:waiting |Timeout\(ms\)=)(\d+)\s*ms|Timeout\(ms\)=(\d+)", str(error))
    line = f"{collective} timed out"
    if waited:
        line += f" after {int(next(g for g in waited.groups() if g)) / 1000:g} s"
    if dist.is_initialized():
        missing = _ranks_not_answering(grace_s)
        if missing:
            line += f": rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did not arrive"
    return line + "; each rank's Python stack at the deadline is in <run_dir>/stacks/"


def _ranks_not_answering(grace_s: float) -> list[int]:
    # PyTorch has no public accessor for the job's store; the ranks that are still alive note themselves there.
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(datetime.timedelta(seconds=grace_s + 3))
        store.set(f"timed_out/{dist.get_rank()}", "1")
        time.sleep(grace_s)
        return [rank for rank in range(dist.get_world_size()) if not store.check([f"timed_out/{rank}"])]
    except Exception:  # the store's host may itself be the rank that stopped answering
        return []
