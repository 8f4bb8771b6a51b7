"""Bugs earlier tutorials shipped, checked on every training script by spying on a real run.

- optimizer.zero_grad() between backward() and step() (the update then uses zero gradients);
- no sampler.set_epoch (every epoch sees the same order).
"""

import runpy
import sys

import pytest
import torch

from tests.conftest import REPO, tiny_args
from utils.data import ResumableDistributedSampler

SCRIPTS = [p.name for p in sorted(REPO.glob("train*.py"))]


@pytest.mark.parametrize("script", SCRIPTS)
def test_step_order_and_epochs(script, tiny_data, tmp_path, monkeypatch):
    calls = []

    def spy(cls, name, record):
        original = getattr(cls, name)

        def wrapper(self, *args, **kwargs):
            calls.append(record(self, *args, **kwargs) if callable(record) else record)
            return original(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, wrapper)

    spy(torch.optim.Optimizer, "zero_grad", "zero_grad")
    spy(torch.Tensor, "backward", "backward")
    spy(torch.optim.AdamW, "step", "step")
    spy(ResumableDistributedSampler, "set_epoch", lambda self, epoch, *a, **k: f"epoch{epoch}")
    # 8 steps per epoch: 10 steps run two epochs.
    monkeypatch.setattr(sys, "argv", [script, *tiny_args(tiny_data, tmp_path / "run", "--max_steps", "10")])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(REPO / script), run_name="__main__")
    assert exit_info.value.code in (0, None)

    epochs = [c for c in calls if c.startswith("epoch")]
    assert epochs[:2] == ["epoch0", "epoch1"], f"set_epoch calls: {epochs}"
    steps = [c for c in calls if c in ("zero_grad", "backward", "step")]
    steps = steps[steps.index("zero_grad"):]  # set-up may run a backward (FLOP counting) before training
    assert steps.count("step") == 10
    pattern = ["zero_grad", "backward", "step"]
    assert [steps[i:i + 3] for i in range(0, len(steps), 3)] == [pattern] * 10, steps[:12]
