"""SwinIR's domain parallelism (utils/parallel/domain_parallel.py, train_mp.py --cp for SwinIR): one field in bands.

- Every layout (cp4 with an uneven 8 + 8 + 8 + 6 split, dp2 x cp2 with activation checkpointing and a
  16 + 6 split, tp2 x cp2), every band boundary crossing a shifted window: each step's output, loss and
  all gradients, and the weights after 2 AdamW steps, equal one process (tests/dp_layouts.py, one
  4-process launch). bf16 autocast is as close to fp32 as one process's bf16. Leaving out the halo
  exchange, or the cp ranks' gradient reduction, must be caught.
- Memory: each band saves about 1/cp of the field's activations, as estimate_memory predicts.
- The loader: each rank reads only its band's rows and the bicubic downsampling's reach, and the bands
  put together are the whole (low-res, high-res) pair.
- Bad input: one line each.
(train_mp.py --cp 2 end to end, resumed from a tp 2 checkpoint: tests/test_mp.py.)
"""

from __future__ import annotations

import json

import pytest
import torch

from models.swinir import SwinIR
from tests.conftest import FakeMesh, assert_layout_equal, run_script
from utils.config import ConfigError, build_config
from utils.data.era5 import ERA5Dataset
from utils.memory.estimate import estimate_memory
from utils.parallel.context_parallel import apply_cp
from utils.parallel.domain_parallel import BICUBIC_REACH, FieldBands, band_bounds, field_bands

ALL_FP32_LAYOUTS = ["cp4", "dp2xcp2+ac", "tp2xcp2"]


@pytest.fixture(scope="module")
def layouts() -> dict[str, dict]:
    proc = run_script("tests/dp_layouts.py", ranks=4)
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {r["layout"]: r for r in results}


def test_every_band_layout_equals_one_device(layouts):
    assert {name: layouts[name]["bands"] for name in ALL_FP32_LAYOUTS} == {
        "cp4": [8, 8, 8, 6], "dp2xcp2+ac": [16, 6], "tp2xcp2": [16, 6]}
    for name in ALL_FP32_LAYOUTS:
        result = layouts[name]
        assert result["parameters"] == 70  # two RSTBs: every weight, relative-position tables included
        assert result["outputs_equal"] and result["losses_equal"], result
        assert_layout_equal(result)


def test_a_missing_halo_or_cp_reduction_is_caught(layouts):
    no_halo, dp_only = layouts["cp4-no-halo"], layouts["dp2xcp2-dp-only"]
    assert not no_halo["outputs_equal"] and no_halo["grads_differ"]
    for broken in (no_halo, dp_only):  # check_layouts.py's verdict: FAIL, naming the worst gradient
        assert not broken["passed"] and broken["worst_grad"] in broken["grads_differ"], broken
    # Without the reduction over cp each rank steps with its own band's gradient: every weight drifts.
    assert len(dp_only["grads_differ"]) > 30 and len(dp_only["weights_differ"]) > 30


def test_bf16_bands_are_as_close_to_fp32_as_one_device(layouts):
    bf16 = layouts["cp4-bf16"]
    assert bf16["outputs_equal"] and bf16["losses_equal"]  # at bf16's tolerance
    assert bf16["grad_error"] <= 1.5 * bf16["single_grad_error"], bf16


def test_each_band_saves_a_quarter_of_the_field_as_estimated(layouts):
    cp4 = layouts["cp4"]
    per_rank, single = cp4["activation_bytes"], cp4["single_bytes"]
    # The goal: memory(cp=1) / memory(cp=N) >= 0.8 N, here on the largest band (8 of 32 padded rows).
    assert single / max(per_rank) >= 0.8 * 4, (single, per_rank)
    cfg = build_config("quickstart", {"img_size": 16, "cp": 4, "batch_size": 2,
                                      "model_args": {"depths": [2, 2], "num_heads": [2, 2], "embed_dim": 16,
                                                     "window_size": 8, "upsampler": "pixelshuffle"}})
    predicted = estimate_memory(cfg, world_size=4, strategy="fsdp", device_type="cpu", lr_size=(30, 24)).activations
    assert predicted == pytest.approx(per_rank[0], rel=0.15)


# ------------------------------------------------------------------ the loader reads its band only


@pytest.mark.parametrize("cp, crop_size, train", [(2, 0, False), (3, 0, False), (3, 48, True)])
def test_each_rank_reads_only_its_band(tiny_data, cp, crop_size, train):
    # 64 x 128 fields (32 low-res rows: 16 + 16, or 16 + 8 + 8), or random 48 x 48 crops (8 + 8 + 8).
    common = dict(upscale=2, crop_size=crop_size, n_patches=2, train=train)
    whole = ERA5Dataset(tiny_data / "train", **common)
    index = 3
    lr, hr = whole[index]
    origin, rows = whole.crop_origin(index)[0], whole.sample_rows
    lr_parts, hr_parts = [], []
    for rank in range(cp):
        band = ERA5Dataset(tiny_data / "train", bands=FieldBands(rank, cp, window=8), **common)
        reads = []
        read = band.read_field
        band.read_field = lambda *args, **kwargs: reads.append((args[2], kwargs["height"])) or read(*args, **kwargs)
        x, y = band[index]
        start, stop = band_bounds(rows // 2, 8, cp)[rank]
        (row, height), = reads
        assert max(2 * start - BICUBIC_REACH, 0) == row - origin  # the band and the taps' reach, nothing more
        assert row - origin + height == min(2 * stop + BICUBIC_REACH, rows)
        lr_parts.append(x)
        hr_parts.append(y)
    torch.testing.assert_close(torch.cat(hr_parts, 1), hr, rtol=0, atol=0)
    torch.testing.assert_close(torch.cat(lr_parts, 1), lr, rtol=1e-6, atol=1e-5)


# ------------------------------------------------------------------ bad input


def test_bands_and_their_errors():
    assert band_bounds(90, 8, 4) == [(0, 24), (24, 48), (48, 72), (72, 90)]  # the last: 18 rows + 6 of padding
    assert band_bounds(30, 8, 4) == [(0, 8), (8, 16), (16, 24), (24, 30)]
    with pytest.raises(ConfigError, match="cp 5 would make bands thinner than a window: the 30-row low-resolution "
                                          "field holds 4 rows of 8x8 windows .* use --cp 4 or fewer"):
        band_bounds(30, 8, 5)
    with pytest.raises(ConfigError, match="cp 40 is larger than the 30 rows"):
        band_bounds(30, 8, 40)
    with pytest.raises(ConfigError, match="leaves the last band 2 rows, too few for the 6 rows of reflect padding"):
        band_bounds(18, 8, 3)


def test_what_domain_parallelism_refuses():
    args = {"depths": [1], "num_heads": [2], "embed_dim": 8, "window_size": 8}
    with pytest.raises(ConfigError, match="does not split the absolute position embedding .* use cp 1"):
        apply_cp(SwinIR(**args, img_size=16, ape=True), FakeMesh())
    with pytest.raises(ConfigError, match="loss .* is not a mean over the field's points"):
        field_bands(build_config("quickstart", {"model_args": args, "img_size": 16, "loss": "relative_l2"}), FakeMesh())
    assert field_bands(build_config("vit_quickstart"), FakeMesh()) is None  # the ViT's cp splits tokens
