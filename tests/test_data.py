"""Data layer: synthetic generator, ERA5Dataset, sampler, loaders, bad input (CPU, seconds)."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path
from unittest import mock

import h5py
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import datasets.check_data as check_data
import datasets.make_synthetic_era5 as gen
from datasets.make_synthetic_era5 import make_synthetic_era5
from benchmarks import bench_data as data_bench
from utils.config import Config
from utils.data import build_loaders
from utils.data.common import DataError, ResumableDistributedSampler, build_dataloader
from utils.data.era5 import CHANNEL_NAMES, SUPERBENCH_MEAN, SUPERBENCH_STD, ERA5Dataset, bicubic_downsample
from tests.conftest import exit_in_one_process

REPO = Path(__file__).resolve().parent.parent
DAYS, HEIGHT, WIDTH = 6, 49, 96  # 48 x 96 after dropping the last row
CROP, PATCHES = 16, 3


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("era5")
    make_synthetic_era5(out, samples_per_year=DAYS, height=HEIGHT, width=WIDTH, seed=0,
                        train_years=(2008, 2010), valid_years=(2015,), chunk=32, progress=False)
    return out


@pytest.fixture(scope="module")
def contiguous_root(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("era5_contiguous")
    make_synthetic_era5(out, samples_per_year=DAYS, height=HEIGHT, width=WIDTH, seed=0,
                        train_years=(2008, 2010), valid_years=(), chunk=0, progress=False)
    return out


def raw(path: Path) -> np.ndarray:
    with h5py.File(path, "r") as f:
        return f["fields"][:]


def dataset(root: Path, **kwargs) -> ERA5Dataset:
    options = dict(upscale=2, crop_size=CROP, n_patches=PATCHES, seed=0)
    options.update(kwargs)
    return ERA5Dataset(root / "train", **options)


def write_fields(path: Path, array: np.ndarray, key: str = "fields") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w") as f:
        f.create_dataset(key, data=array)
    return path


def assert_one_line_error(excinfo, *fragments: str) -> None:
    message = str(excinfo.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


# ----------------------------------------------------------------------------------------------
# Generator
# ----------------------------------------------------------------------------------------------


def test_layout_and_dtype(root):
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    assert files == ["train/2008.h5", "train/2010.h5", "valid/2015.h5"]  # no .partial left behind
    with h5py.File(root / "train" / "2008.h5", "r") as f:
        assert list(f.keys()) == ["fields"]
        fields = f["fields"]
        assert fields.shape == (DAYS, 3, HEIGHT, WIDTH)
        assert fields.dtype == np.float32
        assert fields.chunks == (1, 1, 25, 32)  # one channel of one day per tile, evenly split
        assert list(fields.attrs["channels"]) == list(CHANNEL_NAMES)


def test_generator_targets_are_superbench_statistics():
    assert gen.TARGET_MEAN == SUPERBENCH_MEAN and gen.TARGET_STD == SUPERBENCH_STD
    assert gen.chunk_shape(721, 1440, 128) == (1, 1, 121, 120)
    assert gen.chunk_shape(721, 1440, 0) is None


def test_generator_is_deterministic_per_seed_and_file(root, tmp_path):
    # One year alone, other splits absent: the file is still bit-identical (per-file streams).
    again = make_synthetic_era5(tmp_path / "a", samples_per_year=DAYS, height=HEIGHT, width=WIDTH, seed=0,
                                train_years=(2010,), valid_years=(), chunk=0, progress=False)
    assert again == [tmp_path / "a" / "train" / "2010.h5"]
    np.testing.assert_array_equal(raw(again[0]), raw(root / "train" / "2010.h5"))
    other_seed = make_synthetic_era5(tmp_path / "b", samples_per_year=DAYS, height=HEIGHT, width=WIDTH, seed=1,
                                     train_years=(2010,), valid_years=(), progress=False)
    assert not np.allclose(raw(other_seed[0]), raw(again[0]))
    assert not np.allclose(raw(root / "train" / "2008.h5"), raw(again[0]))  # years differ


def test_fields_behave_like_era5():
    grid = gen.Grid(91, 180)
    x = np.stack(list(gen.generate_samples(grid, 48, seed=3, split="train", year=2008))).astype(np.float64)
    mean, std = x.mean(axis=(0, 2, 3)), x.std(axis=(0, 2, 3))
    np.testing.assert_allclose(mean, SUPERBENCH_MEAN, rtol=0.08)
    np.testing.assert_allclose(std, SUPERBENCH_STD, rtol=0.12)
    assert x[:, 0].min() >= 0 and x[:, 2].min() >= 0  # kinetic energy and water vapour
    temperature_by_lat = x[:, 1].mean(axis=(0, 2))
    assert temperature_by_lat[45] - max(temperature_by_lat[0], temperature_by_lat[-1]) > 30  # cold poles
    # Periodic in longitude: across the date line the field jumps no more than between neighbours.
    across = np.abs(x[..., 0] - x[..., -1]).mean()
    neighbours = np.abs(x[..., 1] - x[..., 0]).mean()
    assert across < 1.3 * neighbours
    anomaly = x - x.mean(axis=(0, 3), keepdims=True)
    for c in range(3):  # coherent from one day to the next
        assert np.corrcoef(anomaly[:-1, c].ravel(), anomaly[1:, c].ravel())[0, 1] > 0.5
    # Advected: day t moved by the model's wind predicts day t+1 better than day t itself
    # (anomalies from each pixel's mean, which also removes the static geography).
    moving = x - x.mean(axis=0, keepdims=True)
    shift = gen.zonal_wind_deg_per_day(grid.lat_deg)[:, None] / 360.0
    k = np.arange(grid.width // 2 + 1)[None, :]
    moved = np.fft.irfft(np.fft.rfft(moving[:-1], axis=-1) * np.exp(-2j * np.pi * k * shift), n=grid.width, axis=-1)
    for c in range(3):
        assert (np.corrcoef(moved[:, c].ravel(), moving[1:, c].ravel())[0, 1]
                > np.corrcoef(moving[:-1, c].ravel(), moving[1:, c].ravel())[0, 1] + 0.02)
    # Fine-scale structure: power-law zonal spectrum, and bicubic x2 round trip is not perfect.
    power = (np.abs(np.fft.rfft(anomaly[:, 1, 20:70], axis=-1)) ** 2).mean(axis=(0, 1))
    k = np.arange(6, 61)
    slope = np.polyfit(np.log(k), np.log(power[k]), 1)[0]
    assert -3.5 < slope < -1.5
    hr = torch.from_numpy(x[:, :, :-1]).float()
    up = F.interpolate(bicubic_downsample(hr, 2), scale_factor=2, mode="bicubic", align_corners=False)
    relative_error = ((up - hr).pow(2).mean(dim=(0, 2, 3)).sqrt() / hr.std(dim=(0, 2, 3)))
    assert torch.all(relative_error > 0.02) and torch.all(relative_error < 0.5)


def test_interrupted_generation_leaves_no_file_that_looks_complete(tmp_path, monkeypatch):
    real = gen.generate_samples

    def interrupted(grid, n_samples, seed, split, year):
        for t, sample in enumerate(real(grid, n_samples, seed, split, year)):
            if year == 2010 and t == 2:
                raise KeyboardInterrupt
            yield sample

    monkeypatch.setattr(gen, "generate_samples", interrupted)
    with pytest.raises(KeyboardInterrupt):
        make_synthetic_era5(tmp_path, samples_per_year=4, height=9, width=16, train_years=(2008, 2010), progress=False)
    assert sorted(p.name for p in (tmp_path / "train").iterdir()) == ["2008.h5"]


def test_cli(tmp_path):
    script = str(REPO / "datasets" / "make_synthetic_era5.py")
    ok = subprocess.run([sys.executable, script, "--out", str(tmp_path), "--samples-per-year", "2", "--height", "9",
                         "--width", "16", "--seed", "1", "--train-years", "2008", "--split", "test=2017,2018", "--quiet"],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.h5")) == [
        "test/2017.h5", "test/2018.h5", "train/2008.h5", "valid/2015.h5"]
    assert raw(tmp_path / "train" / "2008.h5").shape == (2, 3, 9, 16)
    bad = subprocess.run([sys.executable, script, "--out", str(tmp_path), "--height", "2"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "at least 3 x 4" in bad.stderr


# ----------------------------------------------------------------------------------------------
# Dataset
# ----------------------------------------------------------------------------------------------


def test_length_and_index_arithmetic_as_superbench(root):
    crops = dataset(root)
    assert len(crops) == 2 * DAYS * PATCHES
    for i in range(len(crops)):  # SuperBench: file i // (days * n_patches), day (i // n_patches) % days
        assert crops.locate(i) == (i // (DAYS * PATCHES), (i // PATCHES) % DAYS)
    assert len(dataset(root, crop_size=0)) == 2 * DAYS  # whole fields: n_patches ignored
    forecast = dataset(root, task="forecast")
    assert len(forecast) == 2 * (DAYS - 1) * PATCHES
    assert forecast.locate(len(forecast) - 1) == (1, DAYS - 2)


@pytest.mark.parametrize("layout", ["chunked", "contiguous"])
@pytest.mark.parametrize("read", ["hyperslab", "whole"])
def test_crop_equals_full_read_then_crop(root, contiguous_root, layout, read):
    data_root = root if layout == "chunked" else contiguous_root
    ds = dataset(data_root, read=read)
    years = [raw(data_root / "train" / name) for name in ("2008.h5", "2010.h5")]
    origins = set()
    for i in range(0, len(ds), 5):
        file, day = ds.locate(i)
        row, col = ds.crop_origin(i)
        origins.add((row, col))
        lr, hr = ds[i]
        expected = years[file][day, :, :-1][:, row:row + CROP, col:col + CROP]
        np.testing.assert_array_equal(hr.numpy(), expected)
        assert hr.dtype == lr.dtype == torch.float32
    assert len(origins) > 5  # crops move around


def test_hyperslab_reader_reads_only_the_crop(root):
    ds = dataset(root)
    fields = ds._fields(0)
    requested = []

    class Recorder:
        def __getitem__(self, key):
            requested.append(key)
            return fields[key]

    ds._handles[0] = (ds._handles[0][0], Recorder())
    ds[0]
    (key,) = requested
    day, channels, rows, cols = key
    assert channels == slice(None)
    assert rows.stop - rows.start == CROP and cols.stop - cols.start == CROP


def test_lr_is_bicubic_of_hr(root):
    ds = dataset(root, upscale=4)
    lr, hr = ds[7]
    assert hr.shape == (3, CROP, CROP) and lr.shape == (3, CROP // 4, CROP // 4)
    expected = F.interpolate(hr[None], scale_factor=1 / 4, mode="bicubic", align_corners=False)[0]
    assert torch.equal(lr, expected)
    assert 200 < hr[1].mean() < 350  # physical units (kelvin), not normalised


def test_whole_field_mode(root):
    ds = dataset(root, crop_size=0)
    lr, hr = ds[DAYS + 1]  # second file, second day
    assert hr.shape == (3, HEIGHT - 1, WIDTH) and lr.shape == (3, (HEIGHT - 1) // 2, WIDTH // 2)
    np.testing.assert_array_equal(hr.numpy(), raw(root / "train" / "2010.h5")[1, :, :-1])
    assert torch.equal(lr, bicubic_downsample(hr, 2))


def test_forecast_pairs_are_consecutive_days_of_one_file(root):
    ds = dataset(root, task="forecast")
    years = [raw(root / "train" / name) for name in ("2008.h5", "2010.h5")]
    for i in (0, (DAYS - 1) * PATCHES - 1, (DAYS - 1) * PATCHES, len(ds) - 1):  # across the file boundary
        file, day = ds.locate(i)
        row, col = ds.crop_origin(i)
        x, y = ds[i]
        assert x.shape == y.shape == (3, CROP, CROP)
        np.testing.assert_array_equal(x.numpy(), years[file][day, :, row:row + CROP, col:col + CROP])
        np.testing.assert_array_equal(y.numpy(), years[file][day + 1, :, row:row + CROP, col:col + CROP])


def test_crop_positions_depend_on_seed_epoch_index_only(root):
    a, b = dataset(root), dataset(root)
    n = len(a)
    epoch0 = [a.crop_origin(i) for i in range(n)]
    assert epoch0 == [b.crop_origin(i) for i in range(n)]  # another instance (another rank, a resumed run)
    a.set_epoch(1)
    epoch1 = [a.crop_origin(i) for i in range(n)]
    assert sum(p != q for p, q in zip(epoch0, epoch1)) > n * 0.8
    assert [dataset(root, seed=1).crop_origin(i) for i in range(n)] != epoch0
    valid = ERA5Dataset(root / "valid", crop_size=CROP, n_patches=PATCHES, train=False)
    fixed = [valid.crop_origin(i) for i in range(len(valid))]
    valid.set_epoch(5)
    assert [valid.crop_origin(i) for i in range(len(valid))] == fixed
    assert len(set(fixed)) > len(fixed) // 2


def test_close_and_pickle(root):
    ds = dataset(root)
    ds[0]
    h5 = ds._handles[0][0]
    clone = pickle.loads(pickle.dumps(ds))  # open handles stay behind
    assert clone._handles == {} and torch.equal(clone[0][1], ds[0][1])
    ds.close()
    assert not h5.id.valid and ds._handles == {}
    assert torch.equal(ds[0][1], clone[0][1])  # reopens lazily
    ds.close()
    clone.close()


# ----------------------------------------------------------------------------------------------
# Sampler and loaders
# ----------------------------------------------------------------------------------------------


def batches(loader) -> list[torch.Tensor]:
    return [hr for _, hr in loader]


def test_multi_worker_loading_matches_single_process_and_sees_set_epoch(root):
    ds = dataset(root)
    single = build_dataloader(ds, 4, shuffle=True, seed=0, num_workers=0, persistent_workers=True)
    workers = build_dataloader(ds, 4, shuffle=True, seed=0, num_workers=2, persistent_workers=True,
                               pin_memory=True, prefetch_factor=2)
    assert workers.pin_memory == torch.cuda.is_available()
    results = {}
    for epoch in (0, 1):
        for name, loader in (("single", single), ("workers", workers)):
            loader.sampler.set_epoch(epoch)  # also moves the crops, through shared memory to the workers
            results[name, epoch] = batches(loader)
    for epoch in (0, 1):
        assert len(results["single", epoch]) == len(results["workers", epoch]) == len(ds) // 4
        for x, y in zip(results["single", epoch], results["workers", epoch]):
            assert torch.equal(x, y)
    assert not torch.equal(results["single", 0][0], results["single", 1][0])
    ds.close()


def test_loader_leaves_the_global_rng_alone(root):
    loader = build_dataloader(dataset(root), 4, shuffle=True, num_workers=0)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    next(iter(loader))
    assert torch.equal(torch.rand(3), expected)  # model randomness does not depend on when epochs start


def test_spawned_workers_receive_the_dataset_and_its_epoch(root):
    # forkserver is Python 3.14's default on Linux: the dataset must pickle, with its shared epoch.
    ds = dataset(root)
    loader = DataLoader(ds, batch_size=len(ds), num_workers=1, persistent_workers=True, multiprocessing_context="spawn")
    first = next(iter(loader))[1]
    ds.set_epoch(3)
    after = next(iter(loader))[1]
    expected = torch.stack([ds[i][1] for i in range(len(ds))])
    assert torch.equal(after, expected) and not torch.equal(first, after)


def test_ranks_together_make_the_global_batch(root):
    ds = dataset(root)
    n, per_rank, world = len(ds), 3, 2
    global_batches = list(torch.utils.data.BatchSampler(
        ResumableDistributedSampler(ds, 1, 0, shuffle=True, seed=7, drop_last=True), per_rank * world, drop_last=True))
    local = []
    for rank in range(world):
        sampler = ResumableDistributedSampler(ds, world, rank, shuffle=True, seed=7, drop_last=True, batch_size=per_rank)
        local.append(list(torch.utils.data.BatchSampler(sampler, per_rank, drop_last=True)))
    assert len(global_batches) == n // (per_rank * world) == len(local[0]) == len(local[1])
    for k, batch in enumerate(global_batches):
        assert sorted(batch) == sorted(local[0][k] + local[1][k])


def test_set_epoch_start_batch_skips_this_epoch_only(root):
    ds = dataset(root)
    sampler = ResumableDistributedSampler(ds, 2, 1, shuffle=True, seed=0, batch_size=4)
    sampler.set_epoch(3)
    full = list(sampler)
    sampler.set_epoch(3, start_batch=2)
    assert list(sampler) == full[8:] and len(sampler) == len(full) - 8
    sampler.set_epoch(4)
    assert len(list(sampler)) == len(full) and ds.epoch == 4
    loader = build_dataloader(ds, 4, shuffle=True, rank=1, world_size=2)
    loader.sampler.set_epoch(3, start_batch=2)
    assert len(loader) == -(-(len(full) - 8) // 4)


def make_config(root: Path, **overrides) -> Config:
    cfg = Config()
    cfg.data.data_dir = str(root)
    cfg.data.valid_split = "valid"
    cfg.data.crop_size, cfg.data.n_patches = CROP, PATCHES
    cfg.data.num_workers, cfg.data.val_samples = 0, 5
    cfg.train.batch_size = 4
    cfg.model.mean, cfg.model.std = list(SUPERBENCH_MEAN), list(SUPERBENCH_STD)
    for key, value in overrides.items():
        section = next(s for s in ("data", "train", "model") if hasattr(getattr(cfg, s), key))
        setattr(getattr(cfg, section), key, value)
    return cfg


def test_build_loaders(root):
    train, valid = build_loaders(make_config(root), rank=1, world_size=2)
    assert train.batch_size == 2 and train.sampler.num_replicas == 2 and train.sampler.rank == 1
    assert train.drop_last and train.sampler.shuffle
    assert len(valid.dataset) == 5 and not valid.sampler.shuffle and not valid.drop_last
    lr, hr = next(iter(train))
    assert hr.shape == (2, 3, CROP, CROP) and lr.shape == (2, 3, CROP // 2, CROP // 2)
    _, valid_all = build_loaders(make_config(root, val_samples=0, val_batch_size=3))
    assert len(valid_all.dataset) == DAYS * PATCHES and valid_all.batch_size == 3
    with pytest.raises(DataError) as excinfo:
        build_loaders(make_config(root, batch_size=5), world_size=2)
    assert_one_line_error(excinfo, "batch_size 5", "2 ranks")
    with pytest.raises(DataError) as excinfo:
        build_loaders(make_config(root / "nowhere"))
    assert_one_line_error(excinfo, str(root / "nowhere"), "datasets/README.md", "make_synthetic_era5.py --out")


# ----------------------------------------------------------------------------------------------
# Bad input: one line naming the path, what is wrong, what to do
# ----------------------------------------------------------------------------------------------

GOOD_DAY = np.zeros((2, 3, 9, 16), dtype=np.float32)


@pytest.mark.parametrize(
    "name, make, fragments",
    [
        ("missing directory", lambda d: None, ["no such directory", "make_synthetic_era5.py"]),
        ("no h5", lambda d: (d.mkdir(), (d / "notes.txt").write_text("x")), ["no .h5 files"]),
        ("no fields", lambda d: write_fields(d / "2008.h5", GOOD_DAY, key="data"), ["no dataset 'fields'", "found: data"]),
        ("wrong rank", lambda d: write_fields(d / "2008.h5", GOOD_DAY[0]), ["3 dimensions", "expected (samples, channels"]),
        ("wrong channels", lambda d: write_fields(d / "2008.h5", GOOD_DAY[:, :2]), ["has 2 channels", "in_chans is 3", "--in_chans 2"]),
        ("channels differ", lambda d: (write_fields(d / "2008.h5", GOOD_DAY), write_fields(d / "2010.h5", GOOD_DAY[:, :2])),
         ["different channel counts", "2008.h5 has 3", "2010.h5 has 2"]),
        ("different grids", lambda d: (write_fields(d / "2008.h5", GOOD_DAY),
                                       write_fields(d / "2010.h5", GOOD_DAY[..., :8])),
         ["different grids", "2008.h5 is 9x16", "2010.h5 is 9x8"]),
        ("corrupt", lambda d: (d.mkdir(), (d / "2008.h5").write_bytes(b"not an hdf5 file" * 64)),
         ["2008.h5", "cannot be read as HDF5", "corrupt"]),
    ],
)
def test_bad_split_folder(tmp_path, name, make, fragments):
    split = tmp_path / "train"
    make(split)
    with pytest.raises(DataError) as excinfo:
        ERA5Dataset(split, crop_size=4, channels=3)
    assert_one_line_error(excinfo, str(split), *fragments)


def test_truncated_file(root, tmp_path):
    source = (root / "train" / "2008.h5").read_bytes()
    split = tmp_path / "train"
    split.mkdir()
    path = split / "2008.h5"
    path.write_bytes(source[: len(source) // 2])
    with pytest.raises(DataError) as excinfo:
        ERA5Dataset(split, crop_size=CROP)
    assert_one_line_error(excinfo, str(path), "truncated")
    # Truncated after the dataset was built: the worker's error reaches the caller as one line.
    path.write_bytes(source)
    ds = ERA5Dataset(split, crop_size=CROP)
    path.write_bytes(source[: len(source) // 2])
    iterator = iter(build_dataloader(ds, 2, shuffle=False, num_workers=1))
    with pytest.raises(DataError) as excinfo:
        next(iterator)
    assert_one_line_error(excinfo, str(path), "truncated")
    # Stop the worker now: left to the cycle collector, torch's shutdown waits out a 5 s poll.
    iterator._shutdown_workers()


def test_bad_geometry(root):
    with pytest.raises(DataError) as excinfo:
        dataset(root, crop_size=64)
    assert_one_line_error(excinfo, "crop_size 64 is larger than the 48x96 field", "crop_size <= 48")
    with pytest.raises(DataError) as excinfo:
        dataset(root, crop_size=18, upscale=4)
    assert_one_line_error(excinfo, "crop_size 18 is not divisible by upscale 4", "16")
    with pytest.raises(DataError) as excinfo:
        dataset(root, crop_size=0, upscale=5)
    assert_one_line_error(excinfo, "cannot be downsampled by upscale 5")
    assert len(dataset(root, task="forecast", crop_size=18, upscale=4)) > 0  # forecasting has no low-res input


def test_data_error_keeps_one_line_through_worker_rewrapping():
    wrapped = "Caught DataError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n" \
              '  File "x.py", line 1, in f\nutils.data.DataError: /data/2008.h5: broken; do this\n'
    assert str(DataError(wrapped)) == "/data/2008.h5: broken; do this"


def test_benchmark_runs(root, capsys):
    assert data_bench.main([str(root), "--crop-size", "16", "--batch-size", "4", "--batches", "2",
                            "--num-workers", "0", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "hyperslab" in out and "whole day then crop" in out and "speed-up" in out


def test_one_stand_in_recipe_in_the_makefile_and_the_errors(tmp_path, monkeypatch):
    from utils.config import build_config
    from utils.data.era5 import stand_in_command
    from utils.data.files import HOW_TO_GET_DATA

    makefile = (REPO / "Makefile").read_text().replace("\\\n", " ")
    recipe = next(line for line in makefile.splitlines() if "--out $(QUICKSTART_DATA)" in line)
    recipe = " ".join(recipe.replace("$(PY) ", "python ").replace("$(QUICKSTART_DATA)", "OUT").split())
    assert recipe in HOW_TO_GET_DATA.format(root="OUT")
    assert stand_in_command(build_config("quickstart", {"data_dir": "OUT"})) == recipe
    # A relative data_dir that exists only in the repository: the error says where it looked.
    monkeypatch.chdir(tmp_path)
    cfg = build_config("quickstart", {"data_dir": "datasets"})
    with pytest.raises(DataError, match=f"relative to the current directory {tmp_path}; from the repository root"):
        build_loaders(cfg)


def test_check_data_lists_what_a_config_reads_and_stops_in_one_line_at_what_it_cannot(tiny_data, tmp_path, capsys):
    with mock.patch.object(sys, "argv", ["datasets/check_data.py", "--config", "quickstart", "--data_dir",
                                         str(tiny_data)]):
        assert check_data.main() == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith(f"ok: {tiny_data} holds what --config quickstart reads: ") and len(out) == 4, out
    assert all(": fields (" in line and line.endswith(" GB") for line in out[:3]), out
    broken = tmp_path / "broken"
    (broken / "train").mkdir(parents=True)
    (broken / "train" / "2008.h5").symlink_to(next((tiny_data / "train").glob("*.h5")))
    code, err = exit_in_one_process(capsys, "datasets/check_data.py", "--config", "quickstart", "--data_dir", str(broken))
    assert code == 2 and len(err) == 1 and err[0].startswith("check_data.py: error: ") and "valid" in err[0], err
