"""benchmarks/precision_skill.py: what it reads from evaluate.py's output, how it flags a difference, what it skips.

The benchmark itself (train.py, predict.py and evaluate.py per setting and seed) takes minutes: its one measured run
is on the pages (docs/performance.md, Step 0c); here its parts, on inputs whose answers are known.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks import precision_skill


def test_a_difference_is_flagged_only_beyond_twice_the_pooled_seed_spread():
    fp32 = [1.0, 1.1, 0.9]  # sd 0.1
    assert precision_skill.cell([1.5, 1.6, 1.4], fp32).endswith("(+0.5 *)")  # 0.5 > 2 x 0.1
    assert precision_skill.cell([1.15, 1.25, 1.05], fp32).endswith("(+0.15)")  # within the spread
    assert precision_skill.cell(fp32, None) == "1 ± 0.1"


def test_the_gpu_rungs_are_skipped_on_a_cpu_with_why():
    cpu = torch.device("cpu")
    assert precision_skill.why_skipped("bf16", cpu) == precision_skill.why_skipped("bf16+keep_fp32", cpu) == ""
    assert "GPU" in precision_skill.why_skipped("tf32", cpu)
    assert "FP8" in precision_skill.why_skipped("fp8", cpu) and "none does yet" in precision_skill.why_skipped("fp8", cpu)


def test_skill_reads_rmse_acc_and_the_high_wavenumber_energy_ratio(tmp_path):
    xr = pytest.importorskip("xarray")
    leads = np.array([6, 12], dtype="timedelta64[h]").astype("timedelta64[ns]")
    metrics = np.zeros((3, 4, 2))
    metrics[0, 0], metrics[0, 3] = [1.5, 2.5], [0.9, 0.8]  # the model's rmse and acc at each lead
    scores = xr.Dataset({"geopotential": (("forecast", "metric", "lead_time", "level"),
                                          np.repeat(metrics[..., None], 2, axis=-1) * [1, 10])},
                        coords={"forecast": ["model", "persistence", "climatology"],
                                "metric": ["rmse", "bias", "mae", "acc"], "lead_time": leads, "level": [500.0, 850.0]})
    energy = np.ones((4, 2, 2, 9))  # forecast (model, persistence, climatology, truth), lead, level, wavenumber 0..8
    energy[0, :, :, 5:] = 0.5  # the model has half the truth's energy above wavenumber 4 (the upper half of 0..8)
    energy[0, :, :, :5] = 7.0  # and any energy below it, which the ratio must not count
    spectra = xr.Dataset({"geopotential": (("forecast", "lead_time", "level", "zonal_wavenumber"), energy)},
                         coords={"forecast": ["model", "persistence", "climatology", "truth"], "lead_time": leads,
                                 "level": [500.0, 850.0], "zonal_wavenumber": np.arange(9)})
    path = tmp_path / "scores.nc"
    scores.to_netcdf(path)
    spectra.to_netcdf(path, group="spectra", mode="a")
    got = precision_skill.skill(path, ["z500", "t2m"])  # t2m: not in the file, left out
    assert got == {"z500": {"6": {"rmse": 1.5, "acc": 0.9, "spectrum_ratio": 0.5},
                            "12": {"rmse": 2.5, "acc": 0.8, "spectrum_ratio": 0.5}}}
