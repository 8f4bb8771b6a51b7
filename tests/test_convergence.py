"""Learning-rate scaling rules and warm-up (docs/performance.md, Large-batch convergence), for both quickstart
models, and benchmarks/convergence.py on tiny runs.

The rules and schedules are written out here once more, independently of utils/training.py: this file is
their specification. The optimizer's lr at every step must follow it, under both schedules (SwinIR's
exponential per epoch, the ViT's cosine per step), and so must the lr that a real run logs.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn

from benchmarks import convergence
from tests.conftest import read_metrics, run_script, tiny_args, vit_args
from utils.config import ConfigError, build_config, lr_scale
from utils.tasks import Forecast, SuperResolution
from utils.training import build_optimizer, scaled_lr

RULE = {"none": lambda k: 1.0, "sqrt": math.sqrt, "linear": lambda k: k}
"""Goyal et al. 2017 (linear), Krizhevsky 2014 / Hoffer et al. 2017 (sqrt): lr x RULE(batch / base batch)."""


def expected_lr(peak: float, step: int, warmup: int, schedule: str, gamma: float, steps_per_epoch: int,
                total: int) -> float:
    """The lr of optimizer step ``step`` (from 0): linear warm-up to ``peak`` over ``warmup`` steps, then
    exponential (x gamma once per epoch, counted from step 0) or cosine (from peak to 0 at the last step)."""
    warm = min(1.0, (step + 1) / warmup) if warmup else 1.0
    if schedule == "exponential":
        return peak * warm * gamma ** (step // steps_per_epoch)
    if step < warmup:
        return peak * warm
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


@pytest.mark.parametrize("name, schedule", [("quickstart", "exponential"), ("vit_quickstart", "cosine")])
def test_each_quickstart_lr_is_tuned_at_its_own_batch(name, schedule):
    """base_batch_size is the batch the config's lr was tuned at: at that batch every rule keeps the lr."""
    cfg = build_config(name)
    assert cfg.train.lr_schedule == schedule
    assert cfg.dist.base_batch_size == cfg.train.batch_size
    for rule in RULE:
        cfg.dist.lr_scaling = rule
        assert scaled_lr(cfg) == cfg.train.lr


@pytest.mark.parametrize("rule", sorted(RULE))
@pytest.mark.parametrize("name", ["quickstart", "vit_quickstart"])
def test_optimizer_lr_follows_the_rule_and_the_warmup_at_every_step(name, rule):
    cfg = build_config(name, {"batch_size": 32, "lr_scaling": rule, "warmup_steps": 5, "max_steps": 40})
    steps_per_epoch = 7  # 40 steps cross 5 epoch boundaries: the exponential schedule decays 5 times
    peak = cfg.train.lr * RULE[rule](32 / cfg.dist.base_batch_size)
    assert lr_scale(rule, 32, cfg.dist.base_batch_size) * cfg.train.lr == pytest.approx(peak, rel=1e-12)
    optimizer, scheduler = build_optimizer(nn.Linear(2, 2), cfg, steps_per_epoch, torch.device("cpu"))
    for step in range(40):
        want = expected_lr(peak, step, 5, cfg.train.lr_schedule, cfg.train.lr_gamma, steps_per_epoch, 40)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(want, rel=1e-9), f"step {step}"
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] < peak  # decayed, under both schedules


@pytest.mark.parametrize("overrides, match", [({"base_batch_size": 0}, "base_batch_size must be > 0"),
                                              ({"warmup_steps": -1}, "warmup_steps >= 0")])
def test_bad_scaling_settings_say_what_is_valid(overrides, match):
    with pytest.raises(ConfigError, match=match):
        build_config("quickstart", overrides)


@pytest.fixture
def no_pictures(monkeypatch):
    """Validation pictures (matplotlib, ~1 s each on 2 cores) are not what these runs test (tests/test_train.py
    and tests/test_vit_training.py check them)."""
    for task in (SuperResolution, Forecast):
        monkeypatch.setattr(task, "save_picture", lambda *args: None)


def test_a_real_vit_run_logs_the_scaled_cosine_lr(vit_data, tmp_path, no_pictures):
    """train.py logs, after step s, the lr of the next step: expected_lr(peak, s) under the linear rule."""
    run = tmp_path / "run"
    run_script("train.py", *vit_args(vit_data, run, "--lr_scaling", "linear", "--base_batch_size", "2",
                                     "--warmup_steps", "2", "--max_steps", "5", "--log_every", "1",
                                     "--val_every", "5"), in_process=True)
    cfg = build_config("vit_quickstart")
    logged = [r for r in read_metrics(run) if r["kind"] == "train"]
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5]
    for r in logged:  # batch 4 from base 2: twice the lr
        assert r["lr"] == pytest.approx(expected_lr(2 * cfg.train.lr, r["step"], 2, "cosine", 0, 1, 5), rel=1e-6)


def test_convergence_benchmark_on_tiny_runs(tiny_data, tmp_path, monkeypatch, capsys, no_pictures):
    """2 batches x 2 rules (3 runs: the base batch once), 16 samples each: the figures hang together."""
    monkeypatch.setattr(convergence, "run_train",  # in this interpreter: no torch import per run
                        lambda args: run_script("train.py", *args, in_process=True, check=False))
    out = tmp_path / "conv"
    # tiny_args' own batch, run folder and log interval are replaced by the benchmark's (refused after --)
    train_args = [a for a in tiny_args(tiny_data, tmp_path / "unused") if a not in ("--config", "quickstart")]
    for key in ("--run_dir", "--batch_size", "--log_every"):
        del train_args[train_args.index(key):train_args.index(key) + 2]
    argv = ["--batches", "2", "4", "--rules", "none", "sqrt", "--samples", "16", "--val_every_samples", "8",
            "--warmup_samples", "4", "--out", str(out), "--", *train_args, "--train_samples", "4"]
    result = convergence.main(argv)
    printed = capsys.readouterr().out
    assert (out / "convergence.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "convergence.json").read_text())["runs"] == json.loads(json.dumps(result["runs"]))
    cfg = build_config("quickstart")
    assert [(r["batch"], r["rule"]) for r in result["runs"]] == [(2, "base"), (4, "none"), (4, "sqrt")]
    steps_per_epoch = {2: 2, 4: 1}  # train_samples 4: 4 samples per epoch, 16 samples = 4 epochs
    for run in result["runs"]:
        batch, rule = run["batch"], run["rule"]
        assert run["steps"] * batch == 16 and run["warmup_steps"] == 4 // batch
        assert run["lr"] == pytest.approx(cfg.train.lr * RULE["none" if rule == "base" else rule](batch / 2))
        assert [p["samples"] for p in run["points"]] == [8, 16]
        assert all(p["samples"] == p["step"] * batch for p in run["points"])
        assert all(p["metric"] > 0 for p in run["points"]) and run["final_metric"] == run["points"][-1]["metric"]
        assert 0 < run["points"][0]["time_s"] < run["points"][1]["time_s"] == run["train_s"] < run["wall_s"]
        for r in run["logged"]:  # the lr the run logged: the rule, the warm-up and one decay per epoch
            assert r["lr"] == pytest.approx(expected_lr(run["lr"], r["step"], run["warmup_steps"], "exponential",
                                                        cfg.train.lr_gamma, steps_per_epoch[batch], run["steps"]))
        assert f"{batch:>5}  {rule:<6} {run['lr']:>8.2e} {run['steps']:>6}" in printed
    assert result["runs"][0]["relative_to_base"] == 1.0 and not any(run["diverged"] for run in result["runs"])
    assert result["runs"][2]["relative_to_base"] == pytest.approx(
        result["runs"][2]["final_metric"] / result["runs"][0]["final_metric"])

    # The same command again (an interrupted benchmark restarted) reads the finished runs, trains none.
    monkeypatch.setattr(convergence, "run_train", lambda args: pytest.fail(f"trained again: {args}"))
    assert convergence.main(argv)["runs"] == result["runs"]


def test_a_diverged_run_is_a_result_not_a_failure(tmp_path, monkeypatch, capsys):
    """train.py's exit code 3 (NaN loss): the run is reported as diverged, the benchmark goes on."""
    def diverging(args):  # a run whose loss is NaN at its first log, as train.py leaves it
        run_dir = Path(args[args.index("--run_dir") + 1])
        run_dir.mkdir(parents=True)
        (run_dir / "metrics.jsonl").write_text(json.dumps(
            {"kind": "train", "step": 1, "lr": 1.0, "loss": float("nan"), "samples_per_sec": 4.0}) + "\n")
        return subprocess.CompletedProcess(args, 3, "", "error: loss is nan by step 1")

    monkeypatch.setattr(convergence, "run_train", diverging)
    result = convergence.main(["--batches", "4", "--base_batch", "4", "--samples", "8", "--out", str(tmp_path / "out")])
    assert [(r["rule"], r["diverged"], r["final_metric"], r["points"]) for r in result["runs"]] == [
        ("base", True, None, [])]
    assert "diverged" in capsys.readouterr().out and (tmp_path / "out" / "convergence.png").exists()


@pytest.mark.parametrize("argv, match", [
    (["--batches", "4", "8", "--samples", "12"], "--samples 12 must be a positive multiple of every batch"),
    (["--", "--batch_size", "4"], "--batch_size is set by this benchmark"),
    (["--batches", "0"], "--batches must be distinct positive sizes"),
])
def test_convergence_bad_input_is_one_line_and_exit_2(argv, match, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        convergence.main([*argv, "--out", str(tmp_path / "out")])
    message = capsys.readouterr().err
    assert match in message and message.strip().count("\n") == 0
    assert exit_.value.code == 2 and not (tmp_path / "out").exists()
