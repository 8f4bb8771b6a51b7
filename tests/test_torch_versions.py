"""The runner of `make test-torch` (tests/torch_versions.py), without running a script: its commands parse, its pins
keep torch's own tree out, and a failing, refusing or hanging command is reported as such by the runner it shares
with `make test-libraries` (tests/smoke.py; a second in all)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from unittest import mock

import pytest

from tests import smoke as runner
from tests import torch_versions as tv
from utils.config import parse_config
from utils.parallel.pipeline_parallel import SCHEDULES

LADDER = {"train.py", "train_with_profiling.py", "train_ddp.py", "train_fsdp.py", "train_mp.py", "train_pp.py"}


def test_commands_cover_every_script_and_schedule():
    names = [smoke.name for smoke in tv.SMOKES]
    assert len(names) == len(set(names))
    for i, smoke in enumerate(tv.SMOKES):
        assert (tv.REPO / smoke.script).is_file(), smoke.script
        assert all(need in names[:i] for need in smoke.needs), f"{smoke.name} runs before what it needs"
    assert LADDER | {"rollout.py", "estimate_memory.py", "plan.py", "comm_check.py"} <= {s.script for s in tv.SMOKES}
    schedules = {arg for s in tv.SMOKES if s.script == "train_pp.py" for arg in s.args if arg in SCHEDULES}
    assert schedules == set(SCHEDULES)
    assert [s.name for s in runner.selected(tv.SMOKES, ["pp"])] == [f"pp_{name}" for name in SCHEDULES]
    assert [s.name for s in runner.selected(tv.SMOKES, ["rollout"])] == ["vit_train", "rollout"]  # with what it needs


@pytest.mark.parametrize("smoke", [s for s in tv.SMOKES if s.script in LADDER], ids=lambda s: s.name)
def test_training_commands_parse(smoke, tmp_path):
    argv = runner.command(smoke, Path("python"), tmp_path)[len(runner.TORCHRUN) + 2 if smoke.torchrun else 2:]
    with mock.patch.object(sys, "argv", [smoke.script]):  # the script's name decides which keys it applies
        parse_config("", argv)


def test_other_pins_leave_torch_and_its_tree_to_the_release():
    constraints = "# comment\nnumpy==2.4.6\nsympy==1.14.0\ntorch==2.15.0\ntorchvision==0.29.2\nnvidia-nccl-cu13==2.30.7\n"
    installed = ["torch==2.7.1", "sympy==1.13.3", "nvidia_nccl_cu12==2.26.2", "pip==23.2.1"]
    assert tv.other_pins(constraints, installed, "2.7.1").splitlines() == ["numpy==2.4.6", "nvidia-nccl-cu13==2.30.7",
                                                                          "torch==2.7.1"]


def run(tmp_path, code: str, timeout_s: float = 30) -> runner.Result:
    return runner.run_one("fake", [sys.executable, "-c", code], timeout_s, tmp_path / "fake.log")


def test_each_outcome_is_reported(tmp_path, monkeypatch):
    assert run(tmp_path, "print('fine')").status == "ok"
    failed = run(tmp_path, "import sys; print('[rank0]: RuntimeError: boom'); print('ChildFailedError'); sys.exit(1)")
    assert (failed.status, failed.detail) == ("FAIL", "exit 1: [rank0]: RuntimeError: boom")
    refused = run(tmp_path, "import sys; sys.exit('error: X needs torch >= 9.1; this is torch 2.7.1')")
    assert (refused.status, refused.detail) == ("refused", "error: X needs torch >= 9.1; this is torch 2.7.1")
    monkeypatch.setattr(runner, "GRACE_S", 0.2)
    start = time.perf_counter()
    hung = run(tmp_path, "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); "
                         "time.sleep(60)", timeout_s=1)
    assert (hung.status, hung.detail) == ("TIMEOUT", "timed out after 1 s")
    assert time.perf_counter() - start < 10  # ended by SIGKILL after the grace, though it ignores SIGTERM
    assert runner.summary([hung, refused], "torch 2.7.1").startswith("torch 2.7.1: 0 ok, 1 refused, 0 failed, 1 timed "
                                                                    "out")
    assert runner.failed([hung]) and not runner.failed([refused])


def test_replicated_convolutions_computed_locally_give_the_plain_values_and_replicated_gradients(monkeypatch):
    # What torch < 2.15 gets (its DTensor convolution backward sums a replicated weight gradient over tp; see
    # utils/parallel/versions.py), forced on the pin: one process, a 1-rank tp mesh.
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    from utils.parallel import versions
    from utils.parallel.tensor_parallel import replicate_rest

    monkeypatch.setattr(versions, "REPLICATED_CONV_GRADIENT_FIXED", (99, 0))
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.GELU(), nn.Conv2d(4, 2, 2, stride=2))
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.GELU(), nn.Conv2d(4, 2, 2, stride=2))
    model.load_state_dict(plain.state_dict())
    x = torch.randn(2, 3, 8, 8)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        replicate_rest(model, init_device_mesh("cpu", (1,)), local_output=True)
        assert all(m.forward.__func__ is versions._local_convolution for m in (model[0], model[2]))
        out = model(x)
        plain(x).pow(2).sum().backward()
        out.pow(2).sum().backward()
        torch.testing.assert_close(out, plain(x))
        for ours, theirs in zip(model.parameters(), plain.parameters()):
            assert isinstance(ours.grad, DTensor) and ours.grad.placements == (Replicate(),)
            torch.testing.assert_close(ours.grad.to_local(), theirs.grad)
    finally:
        dist.destroy_process_group()


def test_commands_run_two_at_a_time_once_what_they_need_has_passed(tmp_path):
    def sleeps(name: str) -> runner.Smoke:  # writes when it started and ended
        return runner.smoke(name, "-c", f"import time; s = time.time(); time.sleep(1); "
                                        f"open({str(tmp_path / name)!r}, 'w').write(f'{{s}} {{time.time()}}')")
    smokes = [sleeps("a"), sleeps("b"), runner.smoke("broken", "-c", "raise SystemExit('error: no')"),
              runner.smoke("after_a", "-c", "pass", needs=["a"]),
              runner.smoke("after_broken", "-c", "pass", needs=["broken"])]
    results = runner.run_all(smokes, Path(sys.executable), tmp_path, timeout_s=60, jobs=2)
    (a_start, a_end), (b_start, b_end) = ([float(t) for t in (tmp_path / n).read_text().split()] for n in "ab")
    assert a_start < b_end and b_start < a_end  # side by side
    assert [(r.name, r.status) for r in results] == [("a", "ok"), ("b", "ok"), ("broken", "FAIL"), ("after_a", "ok"),
                                                     ("after_broken", "FAIL")]
    assert results[-1].detail == "not run: broken did not pass"
