"""Step 0c's config keys: each rung of the optimisation ladder changes speed, never the numbers.

device_transforms (the low-res input made on the device) gives the loader's (low-res, high-res) pairs;
prefetch_to_device yields the same batches in the same order, also from a mid-epoch start; the fused
AdamW takes the for-each implementation's steps; train.py with all of them on trains as the reference
run. cuda_graphs refuses what it cannot do in one line; where CUDA exists, its step equals eager.
(Part III's device-side symmetries: tests/test_unet3d.py.)
"""

import copy

import pytest
import torch
from conftest import REFERENCE_STEPS, read_metrics, run_script, tiny_args

from models import build_model
from utils.config import ConfigError, build_config
from utils.data import build_loaders
from utils.data.common import DataError
from utils.data.device_pipeline import DeviceLoader
from utils.data.era5 import ERA5Dataset
from utils.parallel.techniques import apply_compile
from utils.training import build_optimizer


def sr_config(data_dir, **overrides):
    """tests/conftest.py's tiny quickstart run as a config."""
    return build_config("quickstart", {"data_dir": str(data_dir), "crop_size": 32, "n_patches": 2, "batch_size": 4,
                                       "num_workers": 0, "val_samples": 4, "img_size": [16],
                                       "model_args": {"depths": [2], "num_heads": [2], "embed_dim": 16,
                                                      "drop_path_rate": 0.0}, **overrides})


def batches(loader, epoch: int, start_batch: int = 0) -> list:
    loader.sampler.set_epoch(epoch, start_batch=start_batch)
    loader.dataset.set_epoch(epoch)
    return list(loader)


@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("keys", [{"device_transforms": True}, {"prefetch_to_device": True},
                                  {"device_transforms": True, "prefetch_to_device": True}],
                         ids=["transforms", "prefetch", "both"])
def test_device_side_pipeline_yields_the_host_batches_in_order(tiny_data, keys, where):
    host, _ = build_loaders(sr_config(tiny_data, device="cpu"))
    device, device_val = build_loaders(sr_config(tiny_data, device=where, **keys))
    assert isinstance(device, DeviceLoader) and not isinstance(device_val, DeviceLoader)  # validation stays as it was
    assert (device.dataset.highres_only, device.prefetch) == (keys.get("device_transforms", False),
                                                                      keys.get("prefetch_to_device", False))
    for epoch, start in ((0, 0), (1, 0), (1, 5)):  # new crops each epoch; a resumed run starts mid-epoch
        expected, got = batches(host, epoch, start), batches(device, epoch, start)
        assert len(got) == len(expected) == 8 - start
        for (lr, hr), (lr_device, hr_device) in zip(expected, got):
            assert hr_device.device.type == where
            assert torch.equal(hr_device.cpu(), hr)
            # One batched bicubic call instead of one per sample: the same arithmetic per pixel (CUDA's within 1e-4).
            torch.testing.assert_close(lr_device.cpu(), lr, rtol=1e-5, atol=1e-4 if where == "cuda" else 1e-6)


def test_the_prefetcher_reads_one_batch_ahead_and_no_further():
    reads = []

    class Source(list):
        def __iter__(self):
            for i in range(5):
                reads.append(i)
                yield [torch.full((2,), float(i))]

    seen = []
    for (batch,) in DeviceLoader(Source(), torch.device("cpu"), prefetch=True):
        seen.append((int(batch[0]), list(reads)))
    assert seen == [(0, [0, 1]), (1, [0, 1, 2]), (2, [0, 1, 2, 3]), (3, [0, 1, 2, 3, 4]), (4, [0, 1, 2, 3, 4])]
    reads.clear()
    assert [int(b[0]) for (b,) in DeviceLoader(Source(), torch.device("cpu"))] == [0, 1, 2, 3, 4]
    assert len(reads) == 5


@pytest.mark.cuda
def test_cuda_stream_prefetch_gives_the_plain_batches_while_the_gpu_is_busy():
    """The copy of batch k+1 runs on a side stream while step k's kernels run: each batch the step reads must be
    complete (the compute stream waits for its copy) and must not be overwritten by a later copy."""
    torch.manual_seed(0)
    source = [[torch.randn(64, 1024).pin_memory(), torch.randn(16, 1024).pin_memory()] for _ in range(12)]
    cuda = torch.device("cuda")
    prefetched = DeviceLoader(source, cuda, prefetch=True)
    assert prefetched.stream is not None
    seen = []
    for moved in prefetched:
        torch.cuda._sleep(2_000_000)  # a long kernel on the compute stream: the next copy overlaps it
        seen.append([(t * 1).cpu() for t in moved])  # read through a kernel on the compute stream
    plain = [[t.cpu() for t in moved] for moved in DeviceLoader(source, cuda)]
    assert len(seen) == len(plain) == len(source)
    for mine, theirs, host in zip(seen, plain, source):
        for a, b, c in zip(mine, theirs, host):
            assert torch.equal(a, c) and torch.equal(b, c)


def test_highres_only_is_for_whole_sr_samples(tiny_data):
    with pytest.raises(DataError, match="device_transforms false with cp > 1"):
        ERA5Dataset(tiny_data / "train", task="forecast", highres_only=True)


def test_fused_adamw_takes_the_foreach_steps():
    cfg = sr_config("unused", max_steps=3)
    model = build_model(cfg.model)
    x, y = torch.randn(2, 3, 16, 16), torch.randn(2, 3, 32, 32)
    weights = {}
    for fused in (True, False):
        cfg.train.fused_optimizer = fused
        trained = copy.deepcopy(model)
        optimizer, _ = build_optimizer(trained, cfg, steps_per_epoch=3, device=torch.device("cpu"))
        assert optimizer.defaults["fused"] is (True if fused else None)
        for _ in range(3):
            optimizer.zero_grad()
            torch.nn.functional.l1_loss(trained(x), y).backward()
            optimizer.step()
        weights[fused] = trained.state_dict()
    moved = [k for k in weights[True] if not torch.equal(weights[True][k], model.state_dict()[k])]
    assert len(moved) > 10  # the steps did change the weights
    for key in weights[True]:
        torch.testing.assert_close(weights[True][key], weights[False][key], rtol=1e-5, atol=1e-6)


def test_train_py_with_the_ladder_keys_trains_as_the_reference(reference_run, tiny_data, tmp_path):
    run = tmp_path / "ladder"
    run_script("train.py", *tiny_args(tiny_data, run, *REFERENCE_STEPS, "--max_steps", "5", "--device_transforms",
                                      "true", "--prefetch_to_device", "true", "--fused_optimizer", "false"),
               in_process=True)
    got, expected = read_metrics(run), [r for r in read_metrics(reference_run) if r["step"] <= 5]
    assert [(r["kind"], r["step"]) for r in got] == [(r["kind"], r["step"]) for r in expected]
    for mine, ref in zip(got, expected):
        key = "loss" if mine["kind"] == "train" else "rmse"
        torch.testing.assert_close(torch.tensor(mine[key]), torch.tensor(ref[key]), rtol=1e-4, atol=1e-6)


def test_cuda_graphs_refuses_in_one_line():
    with pytest.raises(ConfigError, match="add --compile true --compile_backend inductor"):
        build_config("quickstart", {"cuda_graphs": True})
    with pytest.raises(ConfigError, match="add --compile true --compile_backend inductor"):
        build_config("quickstart", {"cuda_graphs": True, "compile": True, "compile_backend": "aot_eager"})
    model = build_model(sr_config("unused").model)
    with pytest.raises(ConfigError, match="not on a CUDA device: drop --cuda_graphs"):
        apply_compile(model, True, "inductor", cuda_graphs=True)


def test_cuda_graphs_begin_one_step_per_call_of_the_model(monkeypatch):
    """Each call of the whole model begins one step of the CUDA graphs, not each call of a compiled block: on a GPU a
    no_grad validation otherwise fed each block an output torch had already released. A pipeline stage (called once
    per microbatch, backwards pending) keeps torch's own rule."""
    from utils.parallel import techniques

    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(torch.is_grad_enabled()))
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kwargs: None)  # here only the marks matter
    monkeypatch.setattr(techniques, "on_cuda", lambda model: True)
    model = apply_compile(build_model(sr_config("unused").model), True, "inductor", cuda_graphs=True)
    assert len(list(model.swin_blocks())) > 1
    x = torch.randn(1, 3, 16, 16)
    model(x).sum().backward()
    with torch.no_grad():
        model(x)
        model(x)
    assert marks == [True, False, False]
    stage = apply_compile(build_model(sr_config("unused").model), True, "inductor", cuda_graphs=True,
                          call_is_step=False)
    stage(x)
    assert len(marks) == 3


@pytest.mark.cuda
def test_cuda_graphs_step_equals_eager():
    cfg = sr_config("unused")
    torch.manual_seed(0)
    eager = build_model(cfg.model).cuda()
    graphed = apply_compile(copy.deepcopy(eager), True, "inductor", cuda_graphs=True)
    x, y = torch.randn(2, 3, 16, 16, device="cuda"), torch.randn(2, 3, 32, 32, device="cuda")
    optimizers = [build_optimizer(m, cfg, 3, torch.device("cuda"))[0] for m in (eager, graphed)]
    for _ in range(4):  # warm-up, recording, replays
        losses = []
        for model, optimizer in zip((eager, graphed), optimizers):
            optimizer.zero_grad()
            loss = torch.nn.functional.l1_loss(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        assert losses[1] == pytest.approx(losses[0], rel=1e-4)
    for (name, a), b in zip(eager.state_dict().items(), graphed.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=name)
    # Then a validation: no_grad forwards, replayed too (H200, torch 2.11: each block's call once released the
    # previous block's output, its input).
    for model in (eager, graphed):
        model.eval()
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(graphed(x), eager(x), rtol=1e-4, atol=1e-5)
