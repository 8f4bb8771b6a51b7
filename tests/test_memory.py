"""estimate_memory.py and utils/memory/: the analytic estimate against measurements on CPU.

SwinIR's activations are checked within the issue's 15 %, the ViT's and the 3-D U-Net's to the byte
(every term of their CPU paths is exact: see utils/memory/estimate.py); the CUDA paths are modelled, and checked
here only for their consequences (what fits a 40/80 GB GPU).
"""

import contextlib
import dataclasses
import json

import pytest
import torch

import estimate_memory
from models import build_model, count_parameters
from tests import estimates_golden
from tests.conftest import run_script
from utils.config import ConfigError, build_config, load_named_configs
from utils.memory.estimate import estimate_memory as estimate
from utils.memory.measure import (SavedTensorBytes, build_for_measurement, loss_for, measure_config,
                                  measure_saved_activations, random_batch, trace_saved_activations)
from models.vit.memory import ViTShape
from utils.memory.shapes import model_shape
from utils.memory.traced import estimate_traced
from utils.training import run_cli

# Small enough for a forward in a fraction of a second; two RSTBs with different head counts.
TINY = {"model_args": {"embed_dim": 24, "depths": [2, 2], "num_heads": [2, 3], "window_size": 8, "drop_path_rate": 0.1},
        "img_size": 16, "crop_size": 0, "device": "cpu"}


def tiny_config(**overrides):
    return build_config("quickstart", {**TINY, **overrides})


def relative_error(predicted, measured):
    return abs(predicted - measured) / measured


# ------------------------------------------------------------------ activations: estimate vs measurement

@pytest.mark.parametrize("overrides, lr_size", [
    (dict(batch_size=2), (16, 24)),
    (dict(batch_size=1, ac="block"), (20, 28)),                       # padded to 24 x 32
    (dict(batch_size=3, ac="layer"), (16, 16)),
    (dict(batch_size=2, amp_dtype="bf16"), (16, 32)),
    (dict(batch_size=1, amp_dtype="fp16", ac="block", upscale=4), (12, 20)),
    ({"batch_size": 2, "amp_dtype": "bf16", "ac": "layer", "model_args.resi_connection": "3conv",
      "model_args.upsampler": "nearest+conv", "loss": "mse"}, (16, 24)),
    ({"batch_size": 1, "model_args.upsampler": "pixelshuffledirect", "upscale": 3}, (16, 24)),
    ({"batch_size": 1, "model_args.upsampler": "", "task": "forecast"}, (16, 24)),  # no upsampler: a task on one grid
])
def test_estimated_activations_within_15_percent_of_measured(overrides, lr_size):
    cfg = tiny_config(**overrides)
    lr, hr = random_batch(cfg, lr_size)
    measured = measure_saved_activations(build_for_measurement(cfg), lr, hr, cfg.train.amp_dtype, cfg.train.loss)
    predicted = estimate(cfg, lr_size=lr_size, device_type="cpu").activations
    assert relative_error(predicted, measured.bytes) <= 0.15, (predicted, measured.bytes)


def test_one_training_step_measured_peak_close_to_estimated_total():
    cfg = tiny_config(batch_size=2, amp_dtype="bf16", ac="block")
    lr_size = (16, 32)
    measured = measure_config(cfg, lr_size)
    predicted = estimate(cfg, lr_size=lr_size, device_type="cpu")
    assert measured.method == "torch.profiler CPU allocation trace"
    assert (predicted.params, predicted.grads, predicted.optimizer) == (measured.params, measured.grads,
                                                                          measured.optimizer)
    assert relative_error(predicted.activations, measured.activations) <= 0.15
    assert relative_error(predicted.total, measured.peak) <= 0.2, (predicted.total, measured.peak)
    assert measured.params + measured.optimizer < measured.peak_forward <= measured.peak


def test_fake_tensor_trace_counts_what_a_real_forward_saves():
    cfg = tiny_config(batch_size=2, ac="block")
    lr, hr = random_batch(cfg, (16, 24))
    model = build_for_measurement(cfg)
    real = measure_saved_activations(model, lr, hr).bytes
    assert trace_saved_activations(model, tuple(lr.shape)).bytes == real
    assert measure_saved_activations(model, lr, hr).bytes == real  # the mask cache survived the fake run


def test_activations_grow_linearly_with_pixels_measured_and_estimated():
    # Two RSTBs of the tutorial's SwinIR (width 180, 6 heads), traced without computing anything.
    cfg = build_config("full_size", {"model_args.depths": [6, 6], "model_args.num_heads": [6, 6]})
    model = build_model(cfg.model)
    small, large = (trace_saved_activations(model, (1, 3, h, 64)).bytes for h in (32, 64))
    assert large / small == pytest.approx(2.0, rel=0.02)
    per_pixel = [estimate(cfg, lr_size=(h, 720), device_type="cpu").activations / (h * 720) for h in (96, 192, 360)]
    assert max(per_pixel) / min(per_pixel) < 1.001  # windowed attention: a fixed cost per pixel
    # The estimate counts what the real model saves at the tutorial's size too.
    assert relative_error(estimate(cfg, lr_size=(32, 64), device_type="cpu").activations, small) <= 0.15


# ------------------------------------------------------------------ the counter itself

def test_saved_tensor_counter_counts_each_storage_once_and_skips_parameters():
    weight = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    with SavedTensorBytes(exclude=[weight]) as counter:
        y = x @ weight          # saves x and weight (a parameter: not counted)
        z = (y * y[:, :4].repeat(1, 2)).sum() + (x[1:] * 2).exp().sum()  # y twice, a view of x, exp's output
    assert counter.bytes == (4 * 8 + 4 * 8 + 4 * 8 + 3 * 8) * 4  # x, y, repeat's output, exp's output
    z.backward()
    assert x.grad is not None
    with SavedTensorBytes(hold=False) as dropped:
        loss = (x * x).sum()
    assert dropped.bytes == 4 * 8 * 4
    with pytest.raises(RuntimeError, match="backward is impossible"):
        loss.backward()


# ------------------------------------------------------------------ parameters, strategies, full size

def distinct_models() -> dict:
    """One named config per distinct model section (baseline, full_size, ... share the tutorial's)."""
    models = {}
    for name in load_named_configs():
        models.setdefault(json.dumps(build_config(name).model.__dict__, sort_keys=True), name)
    return {name: None for name in models.values()}


@pytest.mark.parametrize("name", distinct_models())
def test_parameter_count_is_exact_for_every_named_config(name):
    assert_same_parameters(build_config(name))


def assert_same_parameters(cfg):
    # ViT configs leave mean/std to the data's statistics: any values build the same parameters.
    m = cfg.model if cfg.model.mean else dataclasses.replace(cfg.model, mean=[0.0] * cfg.model.in_chans,
                                                             std=[1.0] * cfg.model.in_chans)
    # The ViT and the U-Net on the meta device (shapes only: vit_mp's 350M parameters, SC22's 117M cost no
    # memory or init time); SwinIR builds its attention masks from data, so it needs a real device.
    with torch.device("meta") if m.model != "swinir" else contextlib.nullcontext():
        model = build_model(m)
    shape = model_shape(cfg.model)
    assert shape.num_params() == count_parameters(model)
    assert shape.num_param_tensors() == len(list(model.parameters()))  # AdamW's step counts


@pytest.mark.parametrize("overrides", [
    {"model_args.resi_connection": "3conv", "model_args.upsampler": "nearest+conv", "upscale": 4},
    {"model_args.upsampler": "pixelshuffle", "upscale": 3}, {"model_args.upsampler": "", "task": "forecast"},
    {"model_args.qkv_bias": False, "img_size": 8, "model_args.upsampler": "pixelshuffledirect"}])
def test_parameter_count_is_exact_for_model_variants(overrides):
    assert_same_parameters(tiny_config(**overrides))


def test_full_size_fields_run_out_of_memory_in_fp32_and_fit_with_bf16_and_checkpointing():
    on_gpu = {(amp, ac): estimate(build_config("full_size", {"amp_dtype": amp, "ac": ac}), device_type="cuda")
              for amp, ac in (("none", "none"), ("bf16", "none"), ("bf16", "block"))}
    assert on_gpu["none", "none"].total > 80e9  # batch 1 does not fit an 80 GB GPU
    assert on_gpu["bf16", "block"].total < 16e9
    assert on_gpu["none", "none"].activations / on_gpu["bf16", "block"].activations >= 5
    assert on_gpu["bf16", "none"].activations < on_gpu["none", "none"].activations
    cpu = estimate(build_config("full_size"), device_type="cpu")
    assert cpu.setting["lr_input"] == [360, 720] and cpu.setting["tokens_per_rank"] == 360 * 720


def test_per_rank_values_for_ddp_and_fsdp():
    cfg = build_config("full_size", {"batch_size": 8, "amp_dtype": "bf16", "ac": "block"})
    one = estimate(build_config("full_size", {"amp_dtype": "bf16", "ac": "block"}), device_type="cuda")
    ddp = estimate(cfg, world_size=8, strategy="ddp", device_type="cuda")
    fsdp = estimate(cfg, world_size=8, strategy="fsdp", device_type="cuda")
    assert ddp.activations == pytest.approx(one.activations)  # batch 8 over 8 ranks: 1 sample each
    assert (ddp.params, ddp.grads, ddp.optimizer) == (one.params, one.grads, one.optimizer)
    assert fsdp.optimizer == pytest.approx(one.optimizer / 8, rel=1e-3)  # step counts are not sharded
    assert fsdp.params < one.params / 2 and fsdp.grads < one.grads / 2
    assert fsdp.params_detail["sharded_fp32"] == pytest.approx(one.params / 8)
    hsdp = estimate(build_config("full_size", {"batch_size": 8, "hsdp_replicas": 2}), 8, "fsdp", "cuda")
    assert hsdp.optimizer == pytest.approx(one.optimizer / 4, rel=1e-3)
    with pytest.raises(ConfigError, match="divisible"):
        estimate(build_config("full_size", {"batch_size": 4}), world_size=8, strategy="ddp")
    with pytest.raises(ConfigError, match="strategy"):
        estimate(build_config("full_size"), world_size=2, strategy="none")


# ------------------------------------------------------------------ the ViT forecaster

# Three channels of different scale, so that normalisation matters; 4x6 tokens of patch 4.
TINY_VIT = {"in_chans": 3, "img_size": [16, 24], "mean": [1.0, 280.0, -3.0], "std": [2.0, 20.0, 0.5],
            "channel_names": [], "key_channels": [], "batch_size": 2, "device": "cpu",
            "model_args": {"patch_size": 4, "embed_dim": 32, "depths": [2], "num_heads": [4], "drop_path_rate": 0.0}}


def tiny_vit_config(**overrides):
    return build_config("vit_quickstart", {**TINY_VIT, **overrides})  # relative L2 on normalised fields


@pytest.mark.parametrize("overrides", [
    dict(),
    dict(amp_dtype="bf16"),
    dict(ac="block"),
    dict(amp_dtype="bf16", ac="block"),
    {"img_size": [32, 48], "model_args.patch_size": 8, "model_args.embed_dim": 48, "model_args.num_heads": [3],
     "batch_size": 3},
    {"img_size": [32, 48], "model_args.patch_size": 8, "model_args.embed_dim": 48, "model_args.num_heads": [3],
     "amp_dtype": "bf16", "ac": "block"},
    {"amp_dtype": "fp16", "model_args.depths": [3], "model_args.drop_path_rate": 0.1, "loss": "mse",
     "loss_space": "physical"},
    {"batch_size": 1, "loss": "l1", "loss_space": "normalized", "model_args.qkv_bias": False,
     "model_args.mlp_ratio": 2.0},
])
def test_vit_estimated_activations_equal_measured_to_the_byte(overrides):
    cfg = tiny_vit_config(**overrides)
    lr, hr = random_batch(cfg)
    model = build_for_measurement(cfg)
    measured = measure_saved_activations(model, lr, hr, cfg.train.amp_dtype, loss_for(cfg)).bytes
    assert estimate(cfg, device_type="cpu").activations == measured
    assert trace_saved_activations(model, tuple(lr.shape), cfg.train.amp_dtype, loss_for(cfg)).bytes == measured


@pytest.mark.parametrize("amp_dtype, ac", [("none", "none"), ("bf16", "block")])
def test_vit_bf16_parameters_equal_measured_to_the_byte(amp_dtype, ac):
    # What FSDP2's param_dtype bf16 computes with: bf16 weights, a bf16 stream, on CPU bf16 LayerNorm statistics.
    cfg = tiny_vit_config(amp_dtype=amp_dtype, ac=ac, param_dtype="bf16")
    lr, hr = random_batch(cfg)
    model = build_for_measurement(cfg).to(torch.bfloat16)
    measured = measure_saved_activations(model, lr, hr, amp_dtype, loss_for(cfg)).bytes
    assert estimate(cfg, 1, "fsdp", "cpu").activations == measured


def test_vit_training_step_measured_against_estimate():
    cfg = tiny_vit_config(img_size=[32, 64], amp_dtype="bf16", ac="block", **{"model_args.embed_dim": 64})
    measured = measure_config(cfg)
    predicted = estimate(cfg, device_type="cpu")
    assert (predicted.params, predicted.grads, predicted.optimizer) == (measured.params, measured.grads,
                                                                          measured.optimizer)
    assert predicted.activations == measured.activations
    assert 0 <= predicted.total - measured.peak <= 0.2 * measured.peak, (predicted.total, measured.peak)
    assert_traced_within_10_percent(cfg, measured)


def assert_traced_within_10_percent(cfg, measured):
    """The traced estimate (utils/memory/traced.py) of the same step: what autograd saves, to the byte (the
    hand-written count is exact on CPU), and the peak within the issue's 10 % (measure_config counts parameters,
    AdamW's state and the step's rise: not the buffers, and AdamW unfused on the CPU as measure.py makes it)."""
    traced = estimate_traced(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, fused_optimizer=False)))
    assert traced.setting["saved_activations_gb"] * 1e9 == pytest.approx(measured.activations, abs=0.5)
    assert abs(traced.total / measured.peak - 1) <= 0.10, (traced.total, measured.peak)


def test_vit_activations_at_full_size_equal_the_fake_tensor_trace():
    # NERSC's 23.8M ViT at 360x720 (4050 tokens), batch 2, traced without computing anything.
    for amp in ("none", "bf16"):
        cfg = build_config("vit_base", {"batch_size": 2, "amp_dtype": amp, "device": "cpu"})
        model = build_for_measurement(cfg)
        traced = trace_saved_activations(model, (2, 20, 360, 720), amp, loss_for(cfg)).bytes
        assert estimate(cfg, device_type="cpu").activations == traced
    # Fused attention saves no tokens x tokens matrix: a fixed cost per token (4x the tokens, 4x the bytes).
    per_token = [estimate(build_config("vit_base", {"img_size": size}), device_type="cuda").activations
                 for size in ([360, 720], [720, 1440])]
    assert per_token[1] / per_token[0] == pytest.approx(4.0, rel=0.01)


def test_vit_mp_does_not_fit_one_gpu_without_model_parallelism():
    def on_gpu(world_size=1, strategy="none", **overrides):
        return estimate(build_config("vit_mp", overrides), world_size, strategy, "cuda")

    fp32, bf16 = on_gpu(amp_dtype="none"), on_gpu()
    assert bf16.setting["attention"] == "flash" and fp32.setting["attention"] == "efficient"
    assert fp32.total > 300e9 and 80e9 < bf16.total < fp32.total  # the whole batch of 64 on one GPU
    assert 40e9 < on_gpu(ac="block").total < 80e9
    # NERSC's run: 4-way data parallel, 16 samples per GPU, AMP: out of memory on a 40 GB A100,
    # 53-54 GiB used (nvidia-smi, CUDA context and allocator cache included) on an 80 GB one.
    ddp = on_gpu(4, "ddp")
    assert ddp.setting["batch_per_rank"] == 16 and 50e9 < ddp.total < 58e9
    fsdp = on_gpu(4, "fsdp")
    shape = ViTShape.from_config(build_config("vit_mp").model)
    # A quarter of the AdamW state, but the position embedding (1, tokens, D) whole: FSDP2 splits dimension 0.
    pos_embed_state = 8 * shape.unsplit_params()
    assert fsdp.optimizer == pytest.approx((ddp.optimizer - pos_embed_state) / 4 + pos_embed_state, rel=1e-3)
    assert fsdp.activations == ddp.activations
    assert shape.num_params() == 350_135_808 and shape.tokens == 4050
    # Root of FSDP = patch embedding + position embedding + final norm + head; units = 12 blocks.
    assert fsdp.params_detail["gathered_root"] == 4 * (shape.num_params() - 12 * shape.block_params()[1])


def test_vit_rejects_what_it_cannot_do():
    with pytest.raises(ConfigError, match="ac/fsdp_unit 'layer'"):
        estimate(build_config("vit_base", {"ac": "layer"}), device_type="cuda")
    with pytest.raises(ConfigError, match="fsdp_unit 'layer'"):
        estimate(build_config("vit_base", {"fsdp_unit": "layer"}), 2, "fsdp", "cuda")
    with pytest.raises(ConfigError, match="img_size"):
        estimate(build_config("vit_base"), field=(720, 1440), device_type="cuda")


# ------------------------------------------------------------------ SC22's 3-D U-Net

# Three levels (4, 8, 8 channels) on 16³ crops: a forward in milliseconds.
TINY_UNET = {"model_args": {"widths": [4, 8, 8], "full_scale": False}, "crop_size": 16, "batch_size": 2,
             "device": "cpu"}


@pytest.mark.parametrize("overrides", [
    dict(),
    dict(amp_dtype="bf16"),
    dict(ac="block"),
    dict(amp_dtype="bf16", ac="block"),
    {"model_args.full_scale": True, "batch_size": 3},
    dict(lambda_rho=0.5, amp_dtype="fp16"),
])
def test_unet_estimated_activations_equal_measured_to_the_byte(overrides):
    cfg = build_config("unet3d_quickstart", {**TINY_UNET, **overrides})
    x, y = random_batch(cfg)
    model = build_for_measurement(cfg)
    measured = measure_saved_activations(model, x, y, cfg.train.amp_dtype, loss_for(cfg)).bytes
    assert estimate(cfg, device_type="cpu").activations == measured
    assert trace_saved_activations(model, tuple(x.shape), cfg.train.amp_dtype, loss_for(cfg)).bytes == measured


def test_unet_training_step_measured_against_estimate():
    cfg = build_config("unet3d_quickstart", {**TINY_UNET, "model_args.widths": [8, 16, 16], "crop_size": 32,
                                             "batch_size": 4, "amp_dtype": "bf16", "ac": "block"})
    measured = measure_config(cfg)
    predicted = estimate(cfg, device_type="cpu")
    assert (predicted.params, predicted.grads, predicted.optimizer) == (measured.params, measured.grads,
                                                                          measured.optimizer)
    assert predicted.activations == measured.activations
    assert relative_error(predicted.total, measured.peak) <= 0.2, (predicted.total, measured.peak)
    assert_traced_within_10_percent(cfg, measured)


def test_unet_table_names_the_model_and_the_crops(capsys):
    assert estimate_memory.main(["--config", "unet3d_base", "--device", "cuda"]) == 0
    table = capsys.readouterr().out
    for words in ("U-Net training memory estimate — config unet3d_base: 116,977,029 parameters",
                  "input 64³ crops, batch 64 per rank = 16,777,216 voxels", "fits 40 GB: yes"):
        assert words in table, words
    fsdp = estimate(build_config("unet3d_base"), 4, "fsdp", "cuda")
    assert fsdp.params_detail["gathered_root"] == 4 * (64 * 128 * 5 + 5)  # the last convolution
    with pytest.raises(ConfigError, match="--field does not apply"):
        estimate(build_config("unet3d_base"), field=(64, 64), device_type="cuda")


# ------------------------------------------------------------------ the command line

@pytest.mark.parametrize("name", list(load_named_configs()))
def test_json_for_every_named_config(name, capsys):
    assert estimate_memory.main(["--config", name, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    keys = ("params_gb", "grads_gb", "optimizer_gb", "activations_gb", "temporary_gb")
    assert all(result[k] > 0 for k in keys)
    parts = sum(result[k] for k in keys)
    assert result["total_gb"] == pytest.approx(parts, abs=1e-5)


def test_table_with_overrides_and_fsdp(capsys):
    assert estimate_memory.main(["--config", "baseline", "--crop_size", "64", "--batch_size", "2",
                                 "--amp_dtype", "bf16", "--ac", "block", "--world_size", "2", "--strategy", "fsdp",
                                 "--device", "cpu"]) == 0
    table = capsys.readouterr().out
    for words in ("activations", "temporary peak", "total", "gathered units", "32x32 low-res",
                  "batch 1 per rank", "bf16 autocast", "checkpointing block"):
        assert words in table, words
    assert estimate_memory.main(["--config", "full_size", "--field", "1440x2880", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["lr_input"] == [720, 1440]


def test_vit_table_names_the_model_and_the_gpu_sizes(capsys):
    assert estimate_memory.main(["--config", "vit_mp", "--device", "cuda"]) == 0
    table = capsys.readouterr().out
    for words in ("ViT training memory estimate — config vit_mp: 350,135,808 parameters", "patch 8 -> 4,050 tokens",
                  "batch 64 per rank", "flash attention", "bf16 autocast", "fits 40 GB: no; fits 80 GB: no"):
        assert words in table, words
    assert estimate_memory.main(["--config", "vit_mp", "--device", "cuda", "--strategy", "fsdp", "--world_size", "4",
                                 "--ac", "block", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["model"] == "ViT" and result["batch_per_rank"] == 16 and result["total_gb"] < 40


def test_bad_input_is_one_line_and_exit_code_2(capsys):
    proc = run_script("estimate_memory.py", "--config", "full_size", "--crop_sise", "64", check=False, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "unrecognized arguments: --crop_sise" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    for args, message in ((["--world_size", "3", "--strategy", "ddp"], "divisible by the 3 data-parallel ranks"),
                          (["--cp", "4", "--world_size", "6", "--strategy", "fsdp"], "not a multiple of cp 4"),
                          (["--cp", "2"], "cp > 1 is train_mp.py's domain parallelism"),
                          (["--amp_dtype", "fp8"], "not one of"),
                          (["--field", "720"], "HEIGHTxWIDTH")):
        with pytest.raises(SystemExit) as exit_info:
            run_cli(lambda: estimate_memory.main(["--config", "full_size", *args]))
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_whole_field_size_comes_from_the_data(tiny_data):
    cfg = build_config("full_size", {"data_dir": str(tiny_data)})  # 65 x 128 fields: the last row is dropped
    result = estimate(cfg, device_type="cpu")
    assert result.setting["field"] == [64, 128] and result.setting["lr_input"] == [32, 64]
    assert str(tiny_data) in result.setting["field_source"]


def test_the_estimate_and_the_plan_of_every_named_config_stay_as_recorded():
    # tests/golden/estimates.json: what a refactor of how models are described must keep (a deliberate change
    # records them again: python -m tests.estimates_golden --write).
    now, recorded = estimates_golden.figures(), json.loads(estimates_golden.GOLDEN.read_text())
    moved = sorted(k for k in now.keys() | recorded.keys() if now.get(k) != recorded.get(k))
    assert not moved, f"{len(moved)} of {len(now)} figures moved, e.g. {moved[:5]}"
    assert len(now) > 200 and not [k for k, v in now.items() if isinstance(v, str)]  # none refused
