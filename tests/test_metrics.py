"""utils/observe/: logs (JSON lines, TensorBoard, console), FLOPs and MFU, memory, RMSE, sample images."""

import json
import os
import struct
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from utils.observe import flops, scores
from utils.observe.flops import (device_peak_flops, gpu_spec_peak_flops, measure_matmul_flops, mfu, peak_memory_gb,
                                 reset_peak_memory, train_flops_per_sample)
from utils.observe.logger import MetricsLogger
from utils.observe.pictures import save_sample_png
from utils.observe.scores import RMSEAccumulator, bicubic_upsample

# ----------------------------------------------------------------------------------------- logger


def read_jsonl(path) -> list[dict]:
    # json.loads accepts NaN; parse_constant rejects it, as strict readers (jq, JavaScript) would.
    def reject(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return [json.loads(line, parse_constant=reject) for line in path.read_text().splitlines()]


def test_logger_writes_json_lines_tensorboard_and_console(tmp_path):
    lines = []
    run_dir = tmp_path / "run"
    with MetricsLogger(run_dir, console=lines.append, channel_names=["ke", "t2m", "tcwv"]) as logger:
        logger.log({"kind": "train", "step": 50, "epoch": 0, "loss": torch.tensor(1.2341), "lr": 8e-4,
                    "samples_per_sec": 123.44, "mfu": 0.1234, "peak_mem_gb": np.float32(1.234)})
        logger.log({"kind": "val", "step": 50, "rmse": torch.tensor([0.5, 1.5, 2.5]),
                    "bicubic_rmse": [0.75, 2.0, float("nan")]})

    train, val = read_jsonl(run_dir / "metrics.jsonl")
    assert {"kind", "step", "epoch", "loss", "lr", "samples_per_sec", "mfu", "peak_mem_gb", "time"} == set(train)
    assert train["loss"] == pytest.approx(1.2341) and train["step"] == 50 and train["kind"] == "train"
    assert val["rmse"] == [0.5, 1.5, 2.5] and val["bicubic_rmse"] == [0.75, 2.0, None]  # NaN -> null

    assert lines[0] == ("step     50 | epoch 0 | loss 1.234 | lr 8.0e-04 | 123.4 samples/s | mfu 12.3% | "
                        "mem 1.23 GB")
    assert lines[1] == "val   step     50 | rmse: ke 0.5, t2m 1.5, tcwv 2.5 | bicubic_rmse: ke 0.75, t2m 2, tcwv nan"

    event_files = list(run_dir.glob("events.out.tfevents.*"))
    assert len(event_files) == 1 and event_files[0].stat().st_size > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/mfu", "val/rmse/ke", "val/rmse/tcwv", "val/bicubic_rmse/t2m"} <= tags
    (loss,) = events.Scalars("train/loss")
    assert loss.step == 50 and loss.value == pytest.approx(1.2341)
    assert events.Scalars("val/rmse/t2m")[0].value == pytest.approx(1.5)


def test_logger_appends_on_resume_and_keeps_records_without_close(tmp_path):
    first = MetricsLogger(tmp_path, tensorboard=False, console=None)
    first.log({"kind": "train", "step": 1, "loss": 2.0})
    # Not closed, as when the job is killed: the record must already be on disk.
    assert read_jsonl(tmp_path / "metrics.jsonl")[0]["loss"] == 2.0
    second = MetricsLogger(tmp_path, tensorboard=False, console=None)
    second.log({"kind": "train", "step": 2, "loss": 1.0, "phase": "resumed", "per_channel": {"a": 1}})
    second.close()
    first.close()
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2] and records[1]["per_channel"] == {"a": 1}
    assert not list(tmp_path.glob("events.out.tfevents.*"))


def test_disabled_logger_does_nothing(tmp_path):
    lines = []
    run_dir = tmp_path / "rank1"
    logger = MetricsLogger(run_dir, enabled=False, console=lines.append)
    logger.log({"kind": "train", "step": 1, "loss": 1.0})
    logger.close()
    assert not run_dir.exists() and lines == []


def test_record_without_kind_or_step_is_an_error(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False, console=None) as logger, pytest.raises(ValueError, match="kind"):
        logger.log({"step": 1, "loss": 1.0})


# ------------------------------------------------------------------------------------ FLOPs, MFU


def test_train_flops_per_sample_is_exact_on_a_known_model():
    channels, height, width = 3, 8, 10
    conv1 = 2 * (4 * channels * 3 * 3) * height * width   # 2 x MACs; output 4 x 8 x 10
    conv2 = 2 * (6 * 4 * 3 * 3) * height * width
    linear = 2 * (6 * height * width) * 5

    def model_fn():
        return nn.Sequential(nn.Conv2d(channels, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 6, 3, padding=1),
                             nn.Flatten(), nn.Linear(6 * height * width, 5))

    # Backward is 2x forward (input and weight gradients) except for the first layer: the input
    # needs no gradient, so only its weight gradient is computed.
    expected = (conv1 + conv1) + (conv2 + 2 * conv2) + (linear + 2 * linear)
    assert train_flops_per_sample(model_fn, (channels, height, width)) == expected


def test_train_flops_per_sample_needs_no_memory():
    # 10^10 parameters (40 GB in fp32) would not fit; on the meta device nothing is allocated.
    flops = train_flops_per_sample(lambda: nn.Linear(100_000, 100_000, bias=False), (100_000,))
    assert flops == 2 * 2 * 100_000 * 100_000


def test_train_flops_per_sample_with_a_constructor_that_reads_values():
    # Like SwinIR's stochastic-depth schedule: torch.linspace(...).tolist() has no values on meta.
    def model_fn():
        rates = torch.linspace(0, 0.1, 3).tolist()
        return nn.Sequential(nn.Dropout(rates[1]), nn.Linear(4, 3))

    assert train_flops_per_sample(model_fn, (4,)) == 2 * 4 * 3 * 2  # forward + weight gradient


def test_mfu():
    assert mfu(1e9, 100.0, 1e12) == pytest.approx(0.1)
    with pytest.raises(ValueError):
        mfu(1e9, 100.0, 0.0)


@pytest.mark.parametrize("name, precision, tflops", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
    ("NVIDIA H100 80GB HBM3", "fp32", 66.9),
    ("NVIDIA H100 PCIe", "tf32", 378.0),
    ("NVIDIA H100 NVL", "bf16", 835.5),
    ("NVIDIA H200", "tf32", 494.7),
    ("NVIDIA GH200 480GB", "bf16", 989.4),
    ("NVIDIA A100-SXM4-40GB", "fp32", 19.5),
    ("NVIDIA A100 80GB PCIe", "bf16", 312.0),
    ("NVIDIA A10", "bf16", 125.0),
    ("NVIDIA L40S", "fp16", 362.05),
    ("NVIDIA L4", "tf32", 60.0),
    ("Tesla V100-SXM2-16GB", "fp16", 125.0),
    ("Tesla V100-PCIE-32GB", "fp32", 14.0),
    ("Tesla V100-SXM2-16GB", "bf16", None),  # no bf16 tensor cores: measured instead
    ("NVIDIA A10G", "bf16", None),           # not in the table; must not match "A10"
    ("NVIDIA GeForce RTX 4090", "bf16", None),
])
def test_gpu_spec_table(name, precision, tflops):
    peak = gpu_spec_peak_flops(name, precision)
    assert peak == (None if tflops is None else pytest.approx(tflops * 1e12))


def test_device_peak_flops_cpu_is_measured_once(monkeypatch):
    flops._peak_cache.clear()
    peak = device_peak_flops("cpu", "none")  # the amp_dtype spelling of float32
    assert 1e8 < peak < 1e14  # 0.1 GFLOP/s .. 100 TFLOP/s: a plausible CPU

    def must_not_run(*args, **kwargs):
        raise AssertionError("the peak should come from the cache")

    monkeypatch.setattr(flops, "measure_matmul_flops", must_not_run)
    assert device_peak_flops(torch.device("cpu"), torch.float32) == peak
    with pytest.raises(ValueError, match="unknown dtype"):
        device_peak_flops("cpu", "fp8")


def test_measuring_leaves_the_global_rng_alone():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    assert measure_matmul_flops("cpu", budget_s=0.05) > 0
    assert torch.equal(torch.rand(3), expected)


def _slowed_matmul(monkeypatch, slow) -> None:
    """torch.mm as the probe calls it, but sleeping ``slow(side, call)`` seconds first: a busy machine, injected."""
    real, calls = torch.mm, []

    def mm(a, b):
        calls.append(a.shape[0])
        time.sleep(slow(a.shape[0], len(calls)))
        return real(a, b)

    monkeypatch.setattr(torch, "mm", mm)


def test_a_slow_small_matmul_does_not_stop_the_probe_below_512(monkeypatch):
    # What a busy 2-core machine did: a 128x128 matmul took 24 ms, the probe stopped there and reported
    # ~0.17 GFLOP/s, and train.py printed "mfu 6237.7%".
    a = torch.randn(512, 512)
    now = []
    for _ in range(3):  # this machine's speed now, however loaded: the bound is relative to it
        start = time.perf_counter()
        torch.mm(a, a)
        now.append(2 * 512**3 / (time.perf_counter() - start))
    _slowed_matmul(monkeypatch, lambda side, call: 0.024 if side < flops.MIN_PROBE_SIDE["cpu"] else 0.0)
    peak = flops.measure_matmul_peak("cpu", budget_s=0.3)
    assert peak.side >= 512
    assert peak.flops > 0.2 * max(now), (peak.flops, now)  # stuck, the probe reported 1/100 of the real speed


def test_a_busy_machine_is_said_and_measured_again(monkeypatch):
    # Two repetitions in three preempted for 60 ms: the spread gives it away, and a warning says so.
    _slowed_matmul(monkeypatch, lambda side, call: 0.06 if call % 3 else 0.0)
    peak = flops.measure_matmul_peak("cpu", budget_s=0.3)
    assert peak.busy and peak.spread > flops.BUSY_SPREAD
    with pytest.warns(RuntimeWarning, match="too busy to measure its peak"):
        assert measure_matmul_flops("cpu", budget_s=0.2) > 0


def test_an_idle_probe_is_not_busy():
    peak = flops.measure_matmul_peak("cpu", budget_s=0.3)
    assert peak.side >= 512 and peak.flops > 1e8
    # (not asserting busy is False: the test suite may share the machine with other jobs)


def test_mfu_above_100_percent_is_clamped_with_a_warning():
    with pytest.warns(RuntimeWarning, match="too low: measured while the machine was busy"):
        assert mfu(1e9, 200.0, 1e10) == 1.0  # the step did 200 GFLOP/s against a "peak" of 10
    assert mfu(1e9, 5.0, 1e10) == pytest.approx(0.5)


def test_peak_memory_cpu_is_the_process_peak_rss_in_gb():
    import psutil

    reset_peak_memory("cpu")  # a no-op on CPU, but callable
    block = torch.ones(64 * 2**20)  # 256 MiB, touched, so it is resident now
    current_gb = psutil.Process().memory_info().rss / 1e9
    peak = peak_memory_gb(torch.device("cpu"))
    del block
    # The peak is at least what is resident now; a KiB/byte mix-up would be off by 1024x either way.
    assert current_gb * 0.99 <= peak <= psutil.virtual_memory().total / 1e9


# ----------------------------------------------------------------------------------------- RMSE


def test_rmse_matches_direct_computation_and_is_independent_of_batching():
    generator = torch.Generator().manual_seed(0)
    target = torch.randn(10, 3, 6, 7, generator=generator) * torch.tensor([1.0, 20.0, 5.0]).view(1, 3, 1, 1) + 280
    pred = target + torch.randn(target.shape, generator=generator) * torch.tensor([0.1, 2.0, 0.5]).view(1, 3, 1, 1)
    direct = (pred.double() - target.double()).square().mean(dim=(0, 2, 3)).sqrt().tolist()

    results = []
    for splits in ([10], [1] * 10, [3, 7], [4, 4, 2]):
        accumulator = RMSEAccumulator(3)
        for p, t in zip(pred.split(splits), target.split(splits)):
            accumulator.update(p, t)
        results.append(accumulator.compute())
    for result in results:
        assert result == pytest.approx(direct, rel=1e-12)

    # The data are such that averaging per-batch RMSEs (the common mistake) would be caught.
    naive = np.mean([(p - t).square().mean(dim=(0, 2, 3)).sqrt().numpy() for p, t in
                     zip(pred.split([3, 7]), target.split([3, 7]))], axis=0)
    assert not np.allclose(naive, direct, rtol=1e-9)


def test_rmse_compute_does_not_change_state_and_checks_input():
    accumulator = RMSEAccumulator(2)
    with pytest.raises(ValueError, match="no samples"):
        accumulator.compute()
    accumulator.update(torch.ones(1, 2, 2, 2, dtype=torch.bfloat16), torch.zeros(1, 2, 2, 2))
    assert accumulator.compute() == accumulator.compute() == [1.0, 1.0]
    assert accumulator.compute(all_reduce=True) == [1.0, 1.0]  # no process group: local result
    with pytest.raises(ValueError, match=r"\(B, 2, H, W\)"):
        accumulator.update(torch.ones(1, 3, 2, 2), torch.ones(1, 3, 2, 2))
    accumulator.reset()
    with pytest.raises(ValueError):
        accumulator.compute()


def test_rmse_all_reduce_sums_over_ranks(monkeypatch):
    """Two ranks with uneven shards give the single-process RMSE (the other rank simulated: a real
    two-process run costs seconds; train_ddp's tests run the real thing under torchrun)."""
    generator = torch.Generator().manual_seed(1)
    target = torch.randn(5, 3, 4, 4, generator=generator)
    pred = target + torch.randn(target.shape, generator=generator) * torch.arange(1.0, 4.0).view(1, 3, 1, 1)
    single = RMSEAccumulator(3)
    single.update(pred, target)
    rank0, rank1 = RMSEAccumulator(3), RMSEAccumulator(3)
    rank0.update(pred[:1], target[:1])
    rank1.update(pred[1:], target[1:])

    def all_reduce_with_rank1(tensor, op):
        assert op == scores.dist.ReduceOp.SUM and tensor.dtype == torch.float64
        tensor += rank1._sums

    monkeypatch.setattr(scores.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(scores.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(scores.dist, "all_reduce", all_reduce_with_rank1)
    assert rank0.compute(all_reduce=True) == pytest.approx(single.compute(), rel=1e-12)
    assert rank0.compute(all_reduce=True) == pytest.approx(single.compute(), rel=1e-12)  # state unchanged
    assert rank0.compute() != pytest.approx(single.compute(), rel=1e-3)  # without the reduce: rank 0 only


# ------------------------------------------------------------------------------- bicubic, images


def test_bicubic_upsample():
    lr = torch.randn(2, 3, 5, 7)
    expected = F.interpolate(lr, scale_factor=2, mode="bicubic", align_corners=False)
    assert torch.equal(bicubic_upsample(lr, 2), expected)
    assert bicubic_upsample(lr, 2, size=(9, 14)).shape == (2, 3, 9, 14)  # e.g. 721 -> odd HR sizes
    unbatched = bicubic_upsample(lr[0].to(torch.bfloat16), 4)
    assert unbatched.shape == (3, 20, 28) and unbatched.dtype == torch.float32


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def sample_fields(channels: int, height: int, width: int):
    generator = torch.Generator().manual_seed(0)
    hr = torch.randn(channels, height, width, generator=generator).cumsum(-1)
    lr = hr[:, ::2, ::2]
    return lr, bicubic_upsample(lr, 2), hr + 0.1 * torch.randn(hr.shape, generator=generator), hr


def test_save_sample_png(tmp_path):
    square = tmp_path / "samples" / "step_00000050.png"  # parent folder does not exist yet
    lr, bicubic, pred, hr = sample_fields(3, 32, 32)
    save_sample_png(square, lr, bicubic, pred.to(torch.bfloat16), hr.unsqueeze(0),
                    channel_names=["ke", "t2m", "tcwv"], title="step 50", dpi=40)
    wide = tmp_path / "samples" / "wide.png"
    save_sample_png(wide, *sample_fields(3, 32, 64), dpi=40)
    assert sorted(os.listdir(tmp_path / "samples")) == ["step_00000050.png", "wide.png"]  # no temp files

    square_w, square_h = png_size(square)
    wide_w, wide_h = png_size(wide)
    # 5 panels side by side, 3 rows: wider than tall; fields twice as wide -> a flatter figure.
    assert square_w > square_h > 0.3 * square_w and square_w == wide_w and wide_h < 0.8 * square_h

    with pytest.raises(ValueError, match="one shape"):
        save_sample_png(tmp_path / "bad.png", lr, bicubic, pred[:, :16], hr)
    assert not (tmp_path / "bad.png").exists()
