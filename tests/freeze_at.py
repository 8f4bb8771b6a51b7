"""python tests/freeze_at.py --freeze SPEC [--freeze SPEC ...] SCRIPT ARGS...: run SCRIPT as `python SCRIPT ARGS`
does, with one rank made to stop answering at a chosen point of a chosen step (tests/test_hang.py).

SPEC is ATTEMPT:RANK:POINT:STEP[:HOW]: in torchrun's attempt ATTEMPT (TORCHELASTIC_RESTART_COUNT; 0 without
torchrun), rank RANK stops during step STEP of that attempt (counted from its first step, 1 = the first) at
POINT: ``forward`` (the first module call), ``backward`` or ``backward@N`` (when the gradient of the N-th
module output is reached, default the first), ``optimizer`` (the optimizer step) or ``checkpoint`` (inside the
first checkpoint write from step STEP on: torch.save's, or a DCP shard write, in the background for an
asynchronous save). HOW: ``stop`` (SIGSTOP, the default: a process that no longer runs at all), ``kill``
(SIGKILL: a crash), ``sleep`` (the main thread sleeps in Python: a wait that never returns) or ``hold`` (a C
call that sleeps holding Python's lock: not even another Python thread runs). The rank prints
"freeze_at: rank R stops in POINT of step S" first.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint.filesystem as dcp_files
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

REPO = Path(__file__).resolve().parent.parent


def parse(argv: list[str]) -> tuple[list[tuple[str, int, str]], list[str]]:
    """(the specs that apply to this process: (point, step, how), the script's argv)."""
    attempt, rank = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"), os.environ.get("RANK", "0")
    mine = []
    while argv and argv[0] == "--freeze":
        parts = argv[1].split(":")
        if parts[:2] == [attempt, rank]:
            mine.append((parts[2], int(parts[3]), parts[4] if len(parts) > 4 else "stop"))
        argv = argv[2:]
    return mine, argv


class Freezer:
    def __init__(self, specs: list[tuple[str, int, str]]):
        self.specs, self.steps_done, self.calls = specs, 0, 0
        register_optimizer_step_post_hook(self._stepped)
        register_optimizer_step_pre_hook(lambda *_: self.at("optimizer"))
        nn.modules.module.register_module_forward_pre_hook(lambda *_: self.at("forward"))
        # A hook on each module's output tensor (not a module backward hook, which wraps the module in autograd
        # functions of its own and moves the gradients by rounding): the run's numbers stay the run's.
        nn.modules.module.register_module_forward_hook(self._watch_backward)
        save, write = torch.save, dcp_files._FileSystemWriter.write_data
        torch.save = lambda *a, **k: (self.at("checkpoint"), save(*a, **k))[1]
        dcp_files._FileSystemWriter.write_data = lambda *a, **k: (self.at("checkpoint"), write(*a, **k))[1]

    def _watch_backward(self, _module, _inputs, output) -> None:
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda _grad: self.at("backward"))

    def _stepped(self, *_) -> None:
        self.steps_done += 1
        self.calls = 0

    def at(self, point: str) -> None:
        for spec_point, step, how in self.specs:
            name, _, nth = spec_point.partition("@")
            due = self.steps_done == step - 1 or (point == "checkpoint" and self.steps_done >= step)
            if name != point or not due:
                continue
            self.calls += 1
            if point == "backward" and self.calls != int(nth or 1):
                continue
            self.specs.remove((spec_point, step, how))
            print(f"freeze_at: rank {os.environ.get('RANK', '0')} stops in {spec_point} of step {step}", flush=True)
            if how in ("stop", "kill"):
                os.kill(os.getpid(), signal.SIGSTOP if how == "stop" else signal.SIGKILL)
            elif how == "sleep":
                time.sleep(10**6)
            else:
                ctypes.PyDLL(None).sleep(10**6)  # PyDLL keeps the lock that ctypes.CDLL would release


def main() -> None:
    specs, argv = parse(sys.argv[1:])
    Freezer(specs)
    sys.argv = argv
    sys.path.insert(0, str(REPO))
    os.chdir(REPO)
    runpy.run_path(str(REPO / argv[0]), run_name="__main__")


if __name__ == "__main__":
    main()
