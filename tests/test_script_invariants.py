"""Bugs earlier tutorials shipped, checked on every training script by spying on a real run.

- optimizer.zero_grad() between backward() and step() (the update then uses zero gradients);
- no sampler.set_epoch (every epoch sees the same order);
- one random seed on every rank (every rank then drops the same blocks for its i-th sample).
"""

import re
import runpy
import sys

import pytest
import torch

from tests.conftest import REPO, in_this_process, tiny_args
from utils import training
from utils.data.common import ResumableDistributedSampler
from utils.parallel.pipeline_parallel import Pipeline

SCRIPTS = [p.name for p in sorted(REPO.glob("train*.py"))]


@pytest.mark.parametrize("script", SCRIPTS)
def test_step_order_and_epochs(script, tiny_data, tmp_path, monkeypatch, capsys):
    calls = []

    def spy(cls, name, record):
        original = getattr(cls, name)

        def wrapper(self, *args, **kwargs):
            calls.append(record(self, *args, **kwargs) if callable(record) else record)
            return original(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, wrapper)

    spy(torch.optim.Optimizer, "zero_grad", "zero_grad")
    spy(torch.Tensor, "backward", "backward")
    spy(Pipeline, "step", "backward")  # train_pp.py: the schedule runs every microbatch's backward
    spy(torch.optim.AdamW, "step", "step")
    spy(ResumableDistributedSampler, "set_epoch", lambda self, epoch, *a, **k: f"epoch{epoch}")
    real_seed_step = training.seed_step

    def seed_step_spy(seed, step, rank=0):
        calls.append(f"seed{step}")
        real_seed_step(seed, step, rank)

    monkeypatch.setattr(training, "seed_step", seed_step_spy)
    # 8 steps per epoch: 10 steps run two epochs. Profiling off: its throughput breakdown trains more steps.
    monkeypatch.setattr(sys, "argv", [script, *tiny_args(tiny_data, tmp_path / "run", "--max_steps", "10",
                                                         "--profile", "false")])
    with pytest.raises(SystemExit) as exit_info, in_this_process():
        runpy.run_path(str(REPO / script), run_name="__main__")
    assert exit_info.value.code in (0, None)
    # Without torchrun a distributed script trains on one process: it must say so, not pass silently.
    said = "note: started without torchrun or srun, so this is 1 process on cpu" in capsys.readouterr().out
    assert said == (script in ("train_ddp.py", "train_fsdp.py", "train_mp.py", "train_pp.py"))

    epochs = [c for c in calls if c.startswith("epoch")]
    assert epochs[:2] == ["epoch0", "epoch1"], f"set_epoch calls: {epochs}"
    steps = [c for c in calls if c in ("zero_grad", "backward", "step") or c.startswith("seed")]
    steps = steps[steps.index("seed0"):]  # set-up may run a backward (FLOP counting) before training
    assert steps.count("step") == 10
    assert [steps[i:i + 4] for i in range(0, len(steps), 4)] == [
        [f"seed{i}", "zero_grad", "backward", "step"] for i in range(10)], steps[:12]


@pytest.mark.parametrize("script", [s for s in SCRIPTS if "ddp" in s or "fsdp" in s])
def test_distributed_scripts_seed_each_step_with_the_global_rank(script):
    """A one-process run cannot tell env.rank from 0; the call itself must pass the global rank
    (env.rank: RANK under torchrun, SLURM_PROCID under srun; tests/test_distributed_env.py)."""
    source = (REPO / script).read_text()
    assert re.search(r"seed_step\(tcfg\.seed, state\.step, env\.rank\)", source)
    assert "local_rank" not in re.search(r"seed_step\([^)]*\)", source).group(0)


@pytest.mark.parametrize("script", ["train_mp.py", "train_pp.py"])
def test_model_parallel_ranks_of_one_replica_seed_alike(script):
    """Under train_mp.py (train_pp.py) the tp x cp ranks (the stages) of one replica hold parts of the same
    samples: they must draw alike, so the step is seeded with the data-parallel rank, not the global one."""
    source = (REPO / script).read_text()
    assert re.search(r"seed_step\(tcfg\.seed, state\.step, dp_rank\)", source)
    assert re.search(r"dp_rank, dp_size = mesh\[\"dp\"\]\.get_local_rank\(\), mesh\[\"dp\"\]\.size\(\)", source)


def test_seed_step_draws_differ_by_rank_and_step_and_repeat_exactly():
    def draws(step, rank):
        training.seed_step(0, step, rank)
        return torch.rand(4)

    assert torch.equal(draws(5, 1), draws(5, 1))
    assert not torch.equal(draws(5, 0), draws(5, 1))
    assert not torch.equal(draws(5, 0), draws(6, 0))
