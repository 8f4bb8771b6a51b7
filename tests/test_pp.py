"""train_pp.py: pipeline parallelism (GPipe, 1F1B, interleaved 1F1B, ZB-V) equals one device.

- Every schedule, for SwinIR (4 RSTBs, the long skip passed along) and the ViT (4 blocks), on 2 ranks:
  the loss and all gradients of each step and all weights after 2 AdamW steps equal one process, and the
  stages together hold every parameter once (check_layouts.py's harness, utils/layouts/equivalence.py, one
  2-process launch). dp 2 x pp 2
  with FSDP2 (+ activation checkpointing) and with replicated ("ddp") pipelines: the same (one
  4-process launch).
- train_pp.py end to end: the ViT's 1F1B pipeline reproduces train.py's losses, weights, Adam moments and
  validation metrics (the schedule's eval path), and its checkpoint resumes as dp 2 x pp 1 to the same
  weights; SwinIR's ZB-V pipeline (4 stages on 2 ranks) reproduces train.py's losses and weights.
  Both report a measured bubble per rank and the memory of each rank.
- Bad input: one line each.
"""

from __future__ import annotations

import pytest
import torch

from models import build_model
from tests.conftest import (VIT_STEPS, assert_layout_equal, check_layouts, exit_in_one_process, read_metrics,
                            run_script, run_then_resume, tiny_args, vit_args, weights_at)
from tests.plan_memory import assert_within
from tests.test_ddp import assert_same_weights, train_losses
from tests.test_fsdp import exported
from tests.test_vit_training import assert_equals_single_device, assert_resumed_equals_single_device
from utils.config import ConfigError, build_config
from utils.parallel.pipeline_parallel import balanced_split, bubble_theory, cut_stage, plan_for, stage_ids

SWINIR_4 = ("--model_args.depths", "[1,1,1,1]", "--model_args.num_heads", "[2,2,2,2]")


def test_every_swinir_layout_equals_one_process():
    # One 4-process run of check_layouts.py, 2 steps, on SwinIR with 4 RSTBs of one block and activation
    # checkpointing per block: dp 2 x tp 2, and dp 2 x pp 2 under gpipe, 1f1b and interleaved 1F1B with FSDP2
    # across the pipelines (the long skip passed along); ZB-V refuses activation checkpointing in one line (ZB-V
    # itself: the end-to-end run below). (SwinIR's DDP, FSDP and HSDP: tests/test_ddp.py and test_fsdp.py, end to
    # end; its cp: tests/test_domain_parallel.py.)
    code, rows = check_layouts("--config", "quickstart", *SWINIR_4, "--model_args.embed_dim", "16", "--img_size", "16",
                               "--ac", "block", "--only", "tp,pp", "--steps", "2")
    assert code == 0
    ran = {r["layout"]: r for r in rows if "not_run" not in r}
    assert list(ran) == ["dp2 x tp2", "dp2 x pp2 gpipe m2", "dp2 x pp2 1f1b m2", "dp2 x pp2 interleaved_1f1b m2"]
    for row in ran.values():  # every weight, relative-position bias tables included; each held by a stage
        assert row["parameters"] == 70
        assert_layout_equal(row)
    assert ran["dp2 x pp2 1f1b m2"]["detail"] == "stages of [2, 2] units"
    assert ran["dp2 x pp2 interleaved_1f1b m2"]["detail"] == "stages of [1, 1, 1, 1] units"
    assert rows[-1] == {"layout": "dp2 x pp2 zbv m2", "not_run": (
        "not run: zbv splits each backward into an input and a weight half, and activation checkpointing cannot "
        "recompute a unit for the second half in torch 2.15 (AttributeError in torch.utils.checkpoint): use --ac "
        "none with zbv, or another schedule")}


# ------------------------------------------------------------------ train_pp.py end to end


@pytest.fixture(scope="module")
def pp_runs(vit_data, vit_reference, tmp_path_factory):
    """The ViT as 2 stages (1F1B, 2 microbatches); resumed from its step-3 checkpoint as dp 2 x pp 1."""
    pp2_says = ["mesh dp 1 x pp 2 | 2 stages of [1, 1] units, 1f1b, 2 microbatches",
                "warning: 2 microbatches for 2 stages leave the ranks idle while the pipeline fills and drains (33% in "
                "theory); use >= 4 microbatches"]
    return run_then_resume(tmp_path_factory.mktemp("pp_runs"), vit_reference, "train_pp.py",
                           lambda run, *flags: vit_args(vit_data, run, *VIT_STEPS, *flags),
                           ("pp2", ["--pp", "2", "--pp_microbatches", "2"], pp2_says),
                           ("dp2", ["--pp", "1", "--pp_microbatches", "2"], "mesh dp 2 x pp 1"))


def test_vit_pipeline_equals_one_device(pp_runs):
    assert_equals_single_device(pp_runs["pp2"], pp_runs["single"])


def test_a_pipeline_checkpoint_resumes_in_another_layout(pp_runs):
    assert_resumed_equals_single_device(pp_runs["dp2"], pp_runs["single"])


def test_bubble_and_memory_per_rank(pp_runs, vit_data):
    records = read_metrics(pp_runs["pp2"])
    bubble = next(r for r in records if r["kind"] == "pipeline")
    assert bubble["schedule"] == "1f1b" and bubble["bubble_theory"] == pytest.approx(1 / 3, abs=1e-3)
    assert len(bubble["bubble_per_rank"]) == 2 and all(0 < b < 1 for b in bubble["bubble_per_rank"])
    # The timeline of the last step: rank r runs stage r's forward and backward of each of the 2 microbatches,
    # one chunk after the other.
    for rank, chunks in enumerate(bubble["timeline_ms"]):
        assert sorted((kind, stage) for kind, stage, _, _ in chunks) == [("B", rank)] * 2 + [("F", rank)] * 2
        assert all(0 <= start < end <= next_start for (*_, start, end), (*_, next_start, _) in zip(chunks, chunks[1:]))
    memory = next(r for r in records if r["kind"] == "memory")
    # Each rank holds its stage's parameters: about half of the model (the stem and tail are not equal).
    assert memory["ranks"] == 2 and memory["activations_mb"] > 0
    assert 0.3 < memory["vs_ddp"] < 0.7
    # The estimate plan.py ranks layouts by: each rank's stage, its microbatches in flight under 1F1B.
    assert_within(pp_runs["pp2"], vit_args(vit_data, pp_runs["pp2"], "--pp", "2", "--pp_microbatches", "2"), 2)


def test_swinir_zero_bubble_pipeline_equals_one_device(tiny_data, tmp_path):
    # 4 RSTBs as 4 stages, V-shaped on 2 ranks (rank 0: the first and the last), 4 microbatches of 1.
    steps = ("--max_steps", "3", "--log_every", "1", "--ckpt_every", "3", "--val_every", "3", *SWINIR_4)
    single, pipelined = tmp_path / "single", tmp_path / "zbv"
    run_script("train.py", *tiny_args(tiny_data, single, *steps), in_process=True)
    proc = run_script("train_pp.py", *tiny_args(tiny_data, pipelined, *steps, "--pp", "2", "--pp_schedule", "zbv"),
                      ranks=2)
    assert "4 stages of [1, 1, 1, 1] units, zbv, 4 microbatches; this rank: stages [0, 3]" in proc.stdout
    torch.testing.assert_close(train_losses(pipelined), train_losses(single), rtol=1e-4, atol=1e-5)
    assert_same_weights(exported(pipelined, 3)["model"], weights_at(single, 3))
    val = [r for r in read_metrics(pipelined) if r["kind"] == "val"]
    reference = [r for r in read_metrics(single) if r["kind"] == "val"]
    torch.testing.assert_close(val[0]["rmse"], reference[0]["rmse"], rtol=1e-4, atol=1e-6)
    assert_within(pipelined, tiny_args(tiny_data, pipelined, *steps, "--pp", "2", "--pp_schedule", "zbv"), 2)


# ------------------------------------------------------------------ the cut, and bad input


def test_balanced_split_and_placement():
    assert balanced_split([1, 1, 1, 1], 2) == [2, 2]
    assert balanced_split([1, 1, 1, 1], 2, first_extra=3) == [1, 3]  # a heavy stem: fewer units first
    assert balanced_split([5, 1, 1, 1, 1, 1], 2) == [1, 5]
    assert stage_ids("1f1b", 4, 1) == [1] and stage_ids("interleaved_1f1b", 2, 1) == [1, 3]
    assert stage_ids("zbv", 2, 0) == [0, 3] and stage_ids("zbv", 2, 1) == [1, 2]
    assert bubble_theory("gpipe", 4, 8) == pytest.approx(3 / 11)
    assert bubble_theory("interleaved_1f1b", 4, 8) == pytest.approx(3 / 19)


def test_a_stage_holds_only_its_parts_under_the_model_names():
    model = build_model(build_config("quickstart", {"model_args": {"depths": [1, 1, 1], "num_heads": [2, 2, 2]}}).model)
    plan = plan_for(model)
    first, last = (cut_stage(model, plan, i, 2, units) for i, units in ((0, range(0, 2)), (1, range(2, 3))))
    names = [set(dict(stage.named_parameters())) for stage in (first, last)]
    assert not names[0] & names[1] and names[0] | names[1] == set(dict(model.named_parameters()))
    assert "conv_first.weight" in names[0] and "layers.2.conv.weight" in names[1] and "conv_after_body.weight" in names[1]
    x = torch.randn(2, 3, 12, 20)
    torch.testing.assert_close(last(*first(x)), model(x))
    with pytest.raises(ConfigError, match=r"the Linear has no pipeline \(stages\) plan: use --pp 1"):
        plan_for(torch.nn.Linear(2, 2))


def test_unknown_schedule_and_indivisible_ranks_are_one_line(vit_data, tmp_path, capsys):
    for extra, message in ((("--pp_schedule", "dualpipe"), "pp_schedule"),
                           (("--pp", "2"), "error: pp 2 does not divide the 1 ranks: choose a pp that divides "
                                           "the number of processes (dp = ranks / pp)")):
        code, err = exit_in_one_process(capsys, "train_pp.py", *vit_args(vit_data, tmp_path / "run", *extra))
        assert code == 2
        assert len(err) == 1 and message in err[0], err
        assert not (tmp_path / "run").exists()
