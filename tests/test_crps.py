"""Training on the CRPS (Part V, issue 59 item 3): --ensemble M --loss crps, members on train_mp.py's ens dimension.

- The loss against the Bureau of Meteorology's `scores` package on the same arrays: the fair CRPS, and AIFS-CRPS's
  almost fair CRPS as alpha x fair + (1 - alpha) x the plain (ECDF) CRPS, to 1e-12 in float64.
- Member k's noise depends on (seed, step, sample, k) only: the members a rank of ens 2 holds, and the samples a dp
  rank holds, are those rows of one process's members, bit for bit.
- ens 2 on gloo equals one process holding all members (check_layouts.py's harness: the loss and every gradient of
  each step, the weights after 2 steps; DDP and FSDP, every member on each rank, too).
- train_mp.py --ens 2 end to end equals train.py --ensemble 4 (losses, weights and Adam moments at steps 3 and 7,
  validation), its checkpoint resumes under --tp 2 to the same weights, and train.py resumes its own bit for bit.
- Bad input: one line each.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xarray as xr
from scores.probability import crps_for_ensemble

from tests.conftest import (VIT_STEPS, assert_layout_equal, check_layouts, exit_in_one_process, resume_from,
                            run_script, run_then_resume, vit_args, weights_at)
from tests.plan_memory import assert_within
from tests.test_mp import VIT_TINY
from tests.test_vit_training import assert_equals_single_device, assert_resumed_equals_single_device
from utils.config import ConfigError, build_config
from utils.parallel.ensemble import Members
from utils.plan.clusters import load_cluster
from utils.plan.planner import plan
from utils.training import build_loss, crps

CRPS = ("--ensemble", "4", "--loss", "crps")


@pytest.mark.parametrize("alpha", [1.0, 0.95, 0.5])
def test_crps_equals_the_scores_package(alpha):
    rng = np.random.default_rng(59)
    members, truth = rng.normal(size=(5, 3, 4, 6)), rng.normal(size=(3, 4, 6))
    members[1] = members[0]  # a coinciding pair: where fair and plain CRPS differ most
    fcst = xr.DataArray(members, dims=["member", "time", "lat", "lon"])
    obs = xr.DataArray(truth, dims=["time", "lat", "lon"])
    fair = float(crps_for_ensemble(fcst, obs, "member", method="fair"))
    plain = float(crps_for_ensemble(fcst, obs, "member", method="ecdf"))
    mine = crps(torch.from_numpy(members), torch.from_numpy(truth), alpha).item()
    assert mine == pytest.approx(alpha * fair + (1 - alpha) * plain, rel=1e-12, abs=1e-12)


def test_build_loss_normalises_the_members_as_the_targets():
    cfg = build_config("vit_quickstart", {"ensemble": 2, "loss": "crps", "loss_space": "normalized", "in_chans": 2,
                                          "mean": [0.0, 10.0], "std": [1.0, 100.0], "channel_names": []})
    members = torch.tensor([0.0, 10.0]).view(1, 1, 2, 1, 1).expand(2, 1, 2, 1, 1)  # both at the mean
    target = torch.tensor([1.0, 110.0]).view(1, 2, 1, 1)  # 1 std above it in both channels
    assert build_loss(cfg)(members, target).item() == pytest.approx(1.0)  # identical members: the MAE


class _EnsMesh:
    """train_mp.py's mesh as the members read it: a dimension "ens" of 2 ranks, seen from ``rank``."""
    mesh_dim_names = ("dp", "ens")

    def __init__(self, rank):
        self.rank = rank

    def __getitem__(self, name):
        return self

    def size(self):
        return 2

    def get_local_rank(self):
        return self.rank


def test_a_members_noise_depends_on_seed_step_sample_and_member_only():
    cfg = build_config("vit_quickstart", {"ensemble": 4, "loss": "crps", "in_chans": 3, "mean": [0.0] * 3,
                                          "std": [1.0, 2.0, 4.0], "channel_names": [], "member_noise": 0.1})
    x = torch.randn(4, 3, 5, 6)
    every = Members(cfg).inputs(x, step=7).view(4, 4, 3, 5, 6)  # (member, sample, ...)
    noise = every - x
    assert noise.std(dim=(0, 1, 3, 4)).tolist() == pytest.approx([0.1, 0.2, 0.4], rel=0.25)  # per channel std
    assert not torch.equal(every[0], every[1]) and not torch.equal(every[0, 0], every[0, 1])
    # ens rank 1 of 2: members 2 and 3; dp rank 1 of 2: the samples at places 1 and 3 of the global batch
    assert torch.equal(Members(cfg, _EnsMesh(1)).inputs(x, step=7).view(2, 4, 3, 5, 6), every[2:])
    assert torch.equal(Members(cfg, dp=(1, 2)).inputs(x[1::2], step=7).view(4, 2, 3, 5, 6), every[:, 1::2])
    assert not torch.equal(Members(cfg).inputs(x, step=8), every.flatten(0, 1))  # another step, other noise
    one = build_config("vit_quickstart", {"in_chans": 3, "channel_names": []})
    assert Members(one).inputs(x, step=7) is x


@pytest.mark.parametrize("overrides, message", [
    ({"loss": "crps"}, "loss crps compares the members of an ensemble"),
    ({"ensemble": 4}, "loss crps compares the members of an ensemble"),
    ({"ensemble": 4, "loss": "crps", "ens": 3}, "ens 3 must divide ensemble 4"),
    ({"ensemble": 4, "loss": "crps", "crps_alpha": 0}, "crps_alpha must be in \\(0, 1\\]"),
])
def test_bad_ensembles_are_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        build_config("vit_quickstart", overrides)


def test_a_pipeline_refuses_members_in_one_line(vit_data, tmp_path, capsys):
    code, err = exit_in_one_process(capsys, "train_pp.py", *vit_args(vit_data, tmp_path / "run", *CRPS))
    assert code == 2 and len(err) == 1 and "--ensemble 4 is applied by train.py" in err[0]


def test_ens_layouts_equal_one_process_holding_every_member():
    # One 2-process run of check_layouts.py, 2 steps: the members shared over ens 2, and DDP / FSDP with all 4 on
    # each rank (dp 2), against one process with all of them.
    code, rows = check_layouts(*VIT_TINY, *CRPS, "--only", "ddp,fsdp,ens", "--steps", "2", ranks=2)
    assert code == 0
    assert [r["layout"] for r in rows] == ["dp2 DDP", "dp2 FSDP", "ens2"]
    for row in rows:
        assert row["parameters"] == 70 and not row["missing"], row
        assert_layout_equal(row)
    assert {r["layout"]: r["loss"] for r in rows}["ens2"] < 1e-6  # every rank: the same gathered members


@pytest.fixture(scope="module")
def crps_runs(vit_data, tmp_path_factory):
    """train.py with 4 members (the reference); train_mp.py with them over ens 2 from scratch, and its step-3
    checkpoint resumed under tp 2 (every member on each rank)."""
    root = tmp_path_factory.mktemp("crps_runs")
    single = root / "single"
    run_script("train.py", *vit_args(vit_data, single, *VIT_STEPS, *CRPS), in_process=True)
    return run_then_resume(root, single, "train_mp.py", lambda run, *flags: vit_args(vit_data, run, *VIT_STEPS, *CRPS,
                                                                                     *flags),
                           ("ens2", ["--ens", "2"], ["mesh dp 1 x ens 2 x cp 1 x tp 1"]),
                           ("tp2", ["--tp", "2"], "mesh dp 1 x cp 1 x tp 2"))


def test_members_on_ens_ranks_train_as_one_process(crps_runs):
    assert_equals_single_device(crps_runs["ens2"], crps_runs["single"])


def test_an_ens_checkpoint_resumes_under_tp(crps_runs):
    assert_resumed_equals_single_device(crps_runs["tp2"], crps_runs["single"])


def test_a_resumed_crps_run_is_bit_identical(crps_runs, vit_data, tmp_path):
    # The members' noise of step 4 onwards is drawn from (seed, step, sample, k): no RNG state to restore.
    single = crps_runs["single"]
    run = resume_from(single, 3, tmp_path / "same")
    run_script("train.py", *vit_args(vit_data, run, *VIT_STEPS, *CRPS, "--resume"), in_process=True)
    for key, value in weights_at(single, 7).items():
        torch.testing.assert_close(weights_at(run, 7)[key], value, rtol=0, atol=0, msg=key)


def test_the_estimate_knows_the_members(crps_runs, vit_data):
    # 2 of the 4 members per rank (ens 2): their forwards' activations, and FSDP's shards over dp x ens, within 10 %
    # of what the run measured.
    ens2 = crps_runs["ens2"]
    assert_within(ens2, vit_args(vit_data, ens2, *VIT_STEPS, *CRPS, "--ens", "2"), 2)


def test_plan_ranks_ens_against_dp():
    cfg = build_config("vit_base", {"ensemble": 4, "loss": "crps", "batch_size": 4})
    rows = plan(cfg, load_cluster("perlmutter-a100-40"), nodes=2)
    names = [row.layout.name() for row in rows]
    assert "dp4 x ens2" in names and "dp2 x ens4" in names  # beside dp8's (batch 4: none) and tp/cp's
    ens = next(row for row in rows if row.layout.ens == 2)
    assert ens.speed.terms["ensemble gather"] > 0 and "--ens 2" in ens.command
    assert ens.estimate.setting["members_per_rank"] == 2
