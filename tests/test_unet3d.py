"""Part III through Part I's scripts: SC22's 3-D U-Net (models/unet3d/network.py) on crops of one simulation box
(utils/data/volume.py).

The model's shapes and SC22's parameter count (by formula); the cube's 48 symmetries, applied alike to input
and target and turning vector fields with the grid; augmentation on the device equal to augmentation on the
host; train_ddp.py and train_fsdp.py on 2 ranks equal to train.py (losses, weights, Adam moments, validation
L1); exact resume; AC / compile / bf16 on the U-Net; bad inputs stop with one line. The miniature run (2
levels of 4 and 8 channels, 16³ crops of 32³ boxes) is tests/conftest.py's ``unet_reference``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from datasets.make_synthetic_volume import write_box
from models import build_model, count_parameters
from tests.conftest import UNET_STEPS, read_metrics, resume_from, run_script, unet_args, weights_at
from tests.test_ddp import train_losses
from tests.test_fsdp import exported
from tests.test_train import expect_error_in_process
from tests.test_vit_training import (assert_ac_and_compile_change_nothing_and_bf16_stays_close,
                                      assert_equals_single_device, val_records)
from utils.checkpoint.single import load_checkpoint
from utils.config import ConfigError, build_config
from utils.data import build_loaders
from utils.data.volume import NUM_SYMMETRIES, VolumeDataset, apply_symmetry

VOLUME_METRICS = ("l1", "mean_l1")
CHECKPOINTS = (2, 4, 6)  # UNET_STEPS: every 2 steps, the end of the epoch (4) and the end


# ------------------------------------------------------------------ the model


def sc22_parameter_count(in_chans: int, out_chans: int, widths: list[int]) -> int:
    """Parameters of SC22's U-Net written out from its architecture: every convolution has a 4³ kernel and a
    bias; down level i maps widths[i-1] (the input's channels for i = 0) to widths[i]; the deepest up block
    maps widths[-1] to widths[-2], every other up block its concatenation [upsampled, skip] (2 widths[i]) to
    widths[i-1]; the last transposed convolution maps 2 widths[0] to the output channels."""
    def conv(c_in, c_out):
        return 4 ** 3 * c_in * c_out + c_out

    down = sum(conv(c_in, c_out) for c_in, c_out in zip([in_chans, *widths[:-1]], widths))
    up = conv(widths[-1], widths[-2]) + sum(conv(2 * widths[i], widths[i - 1]) for i in range(1, len(widths) - 1))
    return down + up + conv(2 * widths[0], out_chans)


def test_sc22_model_has_its_parameter_count_and_keeps_the_crop_size():
    cfg = build_config("unet3d_base")
    with torch.device("meta"):  # 117M parameters: shapes only
        model = build_model(cfg.model)
        out = model(torch.empty(2, 4, 64, 64, 64))
    assert count_parameters(model) == sc22_parameter_count(4, 5, [64, 128, 256, 512, 512, 512]) == 116_977_029
    assert out.shape == (2, 5, 64, 64, 64) and model.levels == 6  # full_scale: a sixth 512 level
    assert len(model.blocks()) == 6 + 5
    tiny = build_model(build_config("unet3d_quickstart", {"model_args.widths": [4, 8, 8],
                                                          "model_args.full_scale": False}).model)
    assert count_parameters(tiny) == sc22_parameter_count(4, 5, [4, 8, 8])
    y = tiny(torch.randn(2, 4, 16, 8, 24))  # any sides divisible by 2**levels
    assert y.shape == (2, 5, 16, 8, 24) and y.abs().max() < 1  # tanh: the stored fields' range
    with pytest.raises(ValueError, match=r"divisible by 2\*\*3 = 8, got \(1, 4, 12, 16, 16\)"):
        tiny(torch.randn(1, 4, 12, 16, 16))


# ------------------------------------------------------------------ the 48 symmetries


def test_the_48_symmetries_are_distinct_permutations_that_turn_vectors_with_the_grid():
    cube = torch.arange(4 ** 3, dtype=torch.float32).view(1, 4, 4, 4)
    turned = [apply_symmetry(cube, code) for code in range(NUM_SYMMETRIES)]
    assert NUM_SYMMETRIES == 48 and torch.equal(turned[0], cube)
    assert len({tuple(t.flatten().tolist()) for t in turned}) == 48
    assert all(torch.equal(t.flatten().sort().values, cube.flatten()) for t in turned)  # voxels moved, not changed
    # The position field r(x) = x - centre is the same field in every turned frame, provided its components turn
    # with the grid (and are negated along reflected axes); moved without turning, it changes under all but one.
    axis = torch.arange(4.0) - 1.5
    position = torch.stack(torch.meshgrid(axis, axis, axis, indexing="ij"))  # component k: coordinate along axis k
    assert all(torch.equal(apply_symmetry(position, code, [[0, 1, 2]]), position) for code in range(48))
    assert sum(torch.equal(apply_symmetry(position, code), position) for code in range(48)) == 1


@pytest.fixture(scope="module")
def pointwise_box(tmp_path_factory):
    """An 8³ box whose targets are pointwise functions of the inputs (2 rho, rho + 1, the velocity itself),
    with the synthetic stand-in's channel names and vector attributes: any crop and turn must keep the relation."""
    nbody = np.random.default_rng(0).standard_normal((4, 8, 8, 8)).astype(np.float32)
    hydro = np.concatenate([2 * nbody[:1], nbody[:1] + 1, nbody[1:]])
    return write_box(tmp_path_factory.mktemp("pointwise") / "train.h5", nbody, hydro, seed=0, split="train"), nbody


def test_each_crop_turns_input_and_target_by_one_symmetry(pointwise_box):
    path, nbody = pointwise_box
    crops = VolumeDataset(path, crop_size=4, samples=64, seed=3, train=True, augment="host")
    codes = {crops.symmetry_code(i) for i in range(len(crops))}
    assert len(codes) > 30  # 64 draws of 48 symmetries
    for i in range(len(crops)):
        inputs, target = crops[i]
        z, y, x = crops.crop_origin(i)
        raw = torch.from_numpy(nbody[:, z:z + 4, y:y + 4, x:x + 4].copy())
        torch.testing.assert_close(inputs, apply_symmetry(raw, crops.symmetry_code(i), [[1, 2, 3]]), rtol=0, atol=0)
        torch.testing.assert_close(target, torch.cat([2 * inputs[:1], inputs[:1] + 1, inputs[1:]]), rtol=0, atol=0)
    valid = VolumeDataset(path, crop_size=4, train=False, augment="host")  # validation: the tiles, never turned
    assert len(valid) == 8 and all(valid.symmetry_code(i) == 0 for i in range(8))


def unet_config(data_dir, **overrides):
    """The miniature run of tests/conftest.py's unet_args as a config."""
    return build_config("unet3d_quickstart", {"data_dir": str(data_dir), "batch_size": 4, "num_workers": 0,
                                              "crop_size": 16, "model_args.widths": [4, 8], "train_samples": 16,
                                              **overrides})


@pytest.mark.parametrize("keys", [{"augment": "device"}, {"device_transforms": True, "prefetch_to_device": True}],
                         ids=["augment_device", "device_transforms+prefetch"])
def test_device_augmentation_gives_the_host_batches(volume_data, keys):
    host, _ = build_loaders(unet_config(volume_data, augment="host"))
    device, _ = build_loaders(unet_config(volume_data, **keys))  # on CPU: the same kernels, after the copy
    assert device.dataset.augment == "device"  # device_transforms moves the host augmentation there
    for epoch in (0, 1):
        for loader in (host, device):
            loader.sampler.set_epoch(epoch)
            loader.dataset.set_epoch(epoch)
        pairs = list(zip(host, device, strict=True))
        assert len(pairs) == 4
        for (x_host, y_host), (x_device, y_device) in pairs:
            assert torch.equal(x_device, x_host) and torch.equal(y_device, y_host)


# ------------------------------------------------------------------ the scripts


def test_reference_run_records_volume_metrics_and_pictures(unet_reference):
    records = val_records(unet_reference)
    assert [r["step"] for r in records] == [3, 6]
    for record in records:
        assert all(len(record[key]) == 5 for key in VOLUME_METRICS)
    assert records[-1]["l1"] != records[0]["l1"]
    assert [r["epoch"] for r in read_metrics(unet_reference) if r["kind"] == "train"] == [0] * 4 + [1] * 2
    assert sorted(p.name for p in (unet_reference / "checkpoints").glob("*.pt")) == [
        f"step_{step:08d}.pt" for step in CHECKPOINTS]
    assert (unet_reference / "samples" / "step_6.png").read_bytes()[:4] == b"\x89PNG"


@pytest.fixture(scope="module")
def unet_runs(volume_data, unet_reference, tmp_path_factory):
    """train_ddp.py and train_fsdp.py on 2 ranks with the reference's global batch and seed; DDP turns its crops
    on the device (the reference on the host), so that one launch also shows the two paths train alike."""
    root = tmp_path_factory.mktemp("unet_runs")
    runs = {"single": unet_reference}
    for name, augment in (("ddp", "device"), ("fsdp", "host")):
        runs[name] = root / name
        proc = run_script(f"train_{name}.py", *unet_args(volume_data, runs[name], *UNET_STEPS, "--augment", augment),
                          ranks=2)
        assert "world_size=2 nodes=1 backend=gloo" in proc.stdout
    return runs


@pytest.mark.parametrize("layout", ["ddp", "fsdp"])
def test_two_ranks_equal_one_device(unet_runs, layout):
    other = unet_runs[layout]
    load = (lambda step: exported(other, step)) if layout == "fsdp" else (
        lambda step: load_checkpoint(other / "checkpoints" / f"step_{step:08d}.pt"))
    assert_equals_single_device(other, unet_runs["single"], load, steps=CHECKPOINTS, metrics=VOLUME_METRICS)


def test_resume_from_step_4_ends_as_the_uninterrupted_run(volume_data, unet_reference, tmp_path):
    run = resume_from(unet_reference, 4, tmp_path / "resumed")  # as if stopped after step 4 (the epoch's end)
    proc = run_script("train.py", *unet_args(volume_data, run, *UNET_STEPS, "--resume"), in_process=True)
    assert "at step 4" in proc.stdout
    assert train_losses(run) == train_losses(unet_reference)[4:]
    for key, value in weights_at(unet_reference, 6).items():
        torch.testing.assert_close(weights_at(run, 6)[key], value, rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("extra, match", [
    (("--crop_size", "64"), "crop_size 64 does not fit the 32³ box"),
    (("--in_chans", "3"), "'Nbody' has 4 channels but the config's in_chans is 3; set --in_chans 4"),
    (("--out_chans", "4"), "'Hydro' has 5 channels but the config's out_chans is 4; set --out_chans 5"),
    (("--crop_size", "18"), "crop_size 18 must be a multiple of 2**2 = 4"),
])
def test_bad_input_is_one_line(volume_data, tmp_path, capsys, extra, match):
    run = tmp_path / "run"
    expect_error_in_process(capsys, *unet_args(volume_data, run), *extra, match=match)
    assert not run.exists()


# ------------------------------------------------------------------ AC, compile, bf16


def test_ac_and_compile_leave_the_unet_step_unchanged_and_bf16_stays_close():
    cfg = build_config("unet3d_quickstart", {"model_args.widths": [4, 8], "model_args.full_scale": False,
                                             "crop_size": 8})
    torch.manual_seed(0)
    model = build_model(cfg.model)
    generator = torch.Generator().manual_seed(1)
    x, y = (0.3 * torch.randn(2, c, 8, 8, 8, generator=generator) for c in (4, 5))
    assert_ac_and_compile_change_nothing_and_bf16_stays_close(cfg, model, x, y)
    with pytest.raises(ConfigError, match="the U-Net's unit is its block"):
        build_config("unet3d_quickstart", {"ac": "layer"})
