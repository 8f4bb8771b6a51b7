"""Part II through Part I's scripts: the ViT forecaster under train.py, train_ddp.py and train_fsdp.py
equals one device (losses, every weight and every Adam moment, i.e. the gradient history, and the
validation metrics), resumes exactly, also across layouts, and keeps AMP / AC / compile working."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

from models import build_model
from tests.conftest import VIT_STEPS, read_metrics, resume_from, run_script, vit_args, weights_at
from tests.test_ddp import assert_same_weights, train_losses
from tests.test_fsdp import exported
from utils.checkpoint.single import load_checkpoint
from utils.config import build_config
from utils.parallel.techniques import apply_ac, apply_compile
from utils.precision import autocast
from utils.training import build_loss

FORECAST_METRICS = ("rmse", "acc", "persistence_rmse", "persistence_acc", "climatology_rmse", "climatology_acc")


@pytest.fixture(scope="module")
def vit_runs(vit_data, vit_reference, tmp_path_factory):
    """train.py, train_ddp.py and train_fsdp.py (2 ranks each) with the same global batch and seed."""
    root = tmp_path_factory.mktemp("vit_runs")
    runs = {"single": vit_reference, "ddp": root / "ddp", "fsdp": root / "fsdp"}
    for name in ("ddp", "fsdp"):
        proc = run_script(f"train_{name}.py", *vit_args(vit_data, runs[name], *VIT_STEPS), ranks=2)
        assert "world_size=2 nodes=1 backend=gloo" in proc.stdout
    return runs


def optimizer_moments(payload: dict) -> list[torch.Tensor]:
    """Adam's exp_avg and exp_avg_sq of every parameter: a running record of every gradient so far."""
    state = payload["optimizer"]["state"]
    return [state[index][key] for index in sorted(state) for key in ("exp_avg", "exp_avg_sq")]


def val_records(run_dir) -> list[dict]:
    return [r for r in read_metrics(run_dir) if r["kind"] == "val"]


def test_single_device_run_records_forecast_metrics(vit_runs):
    records = val_records(vit_runs["single"])
    assert [r["step"] for r in records] == [4, 7]
    for record in records:
        assert all(len(record[key]) == 20 for key in FORECAST_METRICS)
        assert record["climatology_acc"] == [0.0] * 20
    assert (vit_runs["single"] / "samples" / "step_7.png").exists()


def assert_equals_single_device(other, single, load=None, steps=(3, 7), metrics=FORECAST_METRICS) -> None:
    """``other`` run ended as ``single`` did: losses, weights and Adam moments at ``steps`` (``load(step)``:
    its checkpoint as a train.py payload; by default its DCP checkpoint, exported), and every validation metric."""
    torch.testing.assert_close(train_losses(other), train_losses(single), rtol=1e-4, atol=1e-6)
    for step in steps:
        payload = load(step) if load is not None else exported(other, step)
        reference = load_checkpoint(single / "checkpoints" / f"step_{step:08d}.pt")
        assert_same_weights(payload["model"], reference["model"])
        for mine, theirs in zip(optimizer_moments(payload), optimizer_moments(reference), strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-7)
    for mine, theirs in zip(val_records(other), val_records(single), strict=True):
        for key in metrics:
            torch.testing.assert_close(mine[key], theirs[key], rtol=1e-4, atol=1e-6, msg=key)


def assert_resumed_equals_single_device(resumed, single, step: int = 3, last: int = 7) -> None:
    """``resumed``, a DCP run resumed at ``step`` in another layout (conftest's run_then_resume), continued as
    ``single`` did: its losses from there on, and its weights at ``last``."""
    torch.testing.assert_close(train_losses(resumed), train_losses(single)[step:], rtol=1e-4, atol=1e-6)
    assert_same_weights(exported(resumed, last)["model"], weights_at(single, last))


@pytest.mark.parametrize("layout", ["ddp", "fsdp"])
def test_two_ranks_equal_one_device(vit_runs, layout):
    other = vit_runs[layout]
    load = (lambda step: exported(other, step)) if layout == "fsdp" else (
        lambda step: load_checkpoint(other / "checkpoints" / f"step_{step:08d}.pt"))
    assert_equals_single_device(other, vit_runs["single"], load)


def test_resume_is_exact_and_crosses_layouts(vit_runs, vit_data, tmp_path):
    single = vit_runs["single"]
    # Same layout: bit-identical.
    run = resume_from(single, 3, tmp_path / "same")
    run_script("train.py", *vit_args(vit_data, run, *VIT_STEPS, "--resume"), in_process=True)
    for key, value in weights_at(single, 7).items():
        torch.testing.assert_close(weights_at(run, 7)[key], value, rtol=0, atol=0, msg=key)
    # An FSDP checkpoint exported to a file continues on one device to the same weights (a DDP checkpoint
    # is a train.py file: tests/test_ddp.py resumes one).
    run = tmp_path / "from_fsdp"
    (run / "checkpoints").mkdir(parents=True)
    exported(vit_runs["fsdp"], 3)
    shutil.copyfile(vit_runs["fsdp"] / "exported" / "step_3.pt", run / "checkpoints" / "step_00000003.pt")
    run_script("train.py", *vit_args(vit_data, run, *VIT_STEPS, "--resume"), in_process=True)
    assert_same_weights(weights_at(run, 7), weights_at(single, 7))


# ------------------------------------------------------------------ AMP, AC, compile on the ViT


def tiny_vit():
    cfg = build_config("vit_quickstart", {"img_size": [8, 16], "in_chans": 3, "channel_names": ["a", "b", "c"],
                                          "model_args": {"patch_size": 4, "embed_dim": 16, "depths": [2],
                                                         "num_heads": [2]},
                                          "key_channels": [], "mean": [1.0, 280.0, 5.0], "std": [2.0, 20.0, 3.0]})
    torch.manual_seed(0)
    model = build_model(cfg.model)
    generator = torch.Generator().manual_seed(1)
    mean, std = torch.tensor(cfg.model.mean).view(1, -1, 1, 1), torch.tensor(cfg.model.std).view(1, -1, 1, 1)
    x, y = (mean + std * torch.randn(2, 3, 8, 16, generator=generator) for _ in range(2))
    return cfg, model, x, y


def loss_and_grads(cfg, model, x, y, amp_dtype="none"):
    model.zero_grad(set_to_none=True)
    with autocast(torch.device("cpu"), amp_dtype):
        pred = model(x)
    loss = build_loss(cfg)(pred.float(), y)
    loss.backward()
    return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])


def assert_ac_and_compile_change_nothing_and_bf16_stays_close(cfg, model, x, y) -> None:
    """One step of ``model`` on (``x``, ``y``): with activation checkpointing of every block, the same loss and
    gradients to the bit; compiled (aot_eager), to rounding; under bf16 autocast, close."""
    loss, grads = loss_and_grads(cfg, model, x, y)
    checkpointed_loss, checkpointed_grads = loss_and_grads(cfg, apply_ac(copy.deepcopy(model), "block"), x, y)
    assert checkpointed_loss == loss  # recomputing a block's forward in backward changes no bit
    torch.testing.assert_close(checkpointed_grads, grads, rtol=0, atol=0)
    compiled = apply_compile(copy.deepcopy(model), True, "aot_eager")
    compiled_loss, compiled_grads = loss_and_grads(cfg, compiled, x, y)
    torch.testing.assert_close(compiled_loss, loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(compiled_grads, grads, rtol=1e-5, atol=1e-7)
    bf16_loss, bf16_grads = loss_and_grads(cfg, model, x, y, "bf16")
    assert bf16_loss.item() == pytest.approx(loss.item(), rel=2e-2)
    assert torch.nn.functional.cosine_similarity(bf16_grads, grads, dim=0) > 0.99


def test_ac_and_compile_leave_the_vit_step_unchanged_and_bf16_stays_close():
    cfg, model, x, y = tiny_vit()
    assert_ac_and_compile_change_nothing_and_bf16_stays_close(cfg, model, x, y)
    with pytest.raises(Exception, match="blocks only"):
        apply_ac(copy.deepcopy(model), "layer")
