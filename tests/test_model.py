"""SwinIR: original-compatible parameters and arithmetic, any input size, mask cache, AC, bf16, benchmark.

Parity with the original (JingyunLiang/SwinIR) is checked against a dense reference written out
here in full: explicit roll, explicit loops over windows and heads, softmax(q k^T * scale + bias +
mask) v, the mask built with the original's slice recipe, and the original's forward (reflect pad,
(x - mean) * img_range, ..., / img_range + mean, crop). The model's fast path (SDPA, cached masks,
fused reshapes) must give the same numbers.
"""

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from torch.distributed._composable import checkpoint as composable_checkpoint
from torch.utils.flop_counter import FlopCounterMode

import models.swinir.network as swinir
from models import build_model, count_parameters
from models.swinir.network import SwinIR, compute_shift_mask
from utils.config import build_config

ERA5_MEAN = [6.3024, 278.3945, 18.4262]
ERA5_STD = [3.7376, 21.0588, 16.4687]


def small_swinir(**overrides) -> SwinIR:
    kwargs = dict(upscale=2, in_chans=3, img_size=16, window_size=4, img_range=1.0, depths=[2, 2], embed_dim=24,
                  num_heads=[2, 3], mlp_ratio=2.0, upsampler="pixelshuffle", resi_connection="1conv",
                  drop_path_rate=0.0)
    kwargs.update(overrides)
    torch.manual_seed(0)
    model = SwinIR(**kwargs)
    with torch.no_grad():  # the bias table starts near zero; make it matter in the comparisons
        for block in model.swin_blocks():
            block.attn.relative_position_bias_table.normal_(0, 1)
    return model


def physical(batch, height, width, mean=ERA5_MEAN, std=ERA5_STD, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, len(mean), height, width, generator=g)
    return x * torch.tensor(std).view(1, -1, 1, 1) + torch.tensor(mean).view(1, -1, 1, 1)


# ---------------------------------------------------------------- dense reference (the original's arithmetic)

def original_mask(height, width, window, shift):
    """The original's calculate_mask: label 9 regions with slices, -100 between different labels."""
    labels = torch.zeros(height, width)
    slices = (slice(0, -window), slice(-window, -shift), slice(-shift, None))
    for count, (hs, ws) in enumerate((hs, ws) for hs in slices for ws in slices):
        labels[hs, ws] = count
    windows = [labels[i:i + window, j:j + window].reshape(-1)
               for i in range(0, height, window) for j in range(0, width, window)]
    return torch.stack([torch.where(w[None, :] != w[:, None], -100.0, 0.0) for w in windows])


def reference_block(block, x, height, width):
    """One Swin block, window by window and head by head."""
    B, L, C = x.shape
    ws, shift, heads = block.window_size, block.shift_size, block.num_heads
    attn = block.attn
    d = C // heads
    h = block.norm1(x).view(B, height, width, C)
    if shift:
        h = torch.roll(h, shifts=(-shift, -shift), dims=(1, 2))
        mask = original_mask(height, width, ws, shift)
    ys, xs = torch.meshgrid(torch.arange(ws), torch.arange(ws), indexing="ij")
    ys, xs = ys.reshape(-1), xs.reshape(-1)
    table_index = (ys[:, None] - ys[None, :] + ws - 1) * (2 * ws - 1) + (xs[:, None] - xs[None, :] + ws - 1)
    out = torch.zeros_like(h)
    for b in range(B):
        for w, (i, j) in enumerate((i, j) for i in range(0, height, ws) for j in range(0, width, ws)):
            tokens = h[b, i:i + ws, j:j + ws].reshape(ws * ws, C)
            q, k, v = (tokens @ attn.qkv.weight.T + attn.qkv.bias).split(C, dim=1)
            head_outputs = []
            for n in range(heads):
                cols = slice(n * d, (n + 1) * d)
                logits = q[:, cols] @ k[:, cols].T * d ** -0.5
                logits = logits + attn.relative_position_bias_table[table_index, n]
                if shift:
                    logits = logits + mask[w]
                head_outputs.append(torch.softmax(logits, dim=-1) @ v[:, cols])
            projected = torch.cat(head_outputs, dim=1) @ attn.proj.weight.T + attn.proj.bias
            out[b, i:i + ws, j:j + ws] = projected.view(ws, ws, C)
    if shift:
        out = torch.roll(out, shifts=(shift, shift), dims=(1, 2))
    x = x + out.view(B, L, C)
    return x + block.mlp(block.norm2(x))


def reference_forward(model, x):
    """The original SwinIR.forward (pixelshuffle), with dense blocks and the original's mean shift."""
    H, W = x.shape[-2:]
    ws = model.window_size
    x = F.pad(x, (0, -W % ws, 0, -H % ws), mode="reflect")
    mean = model.data_mean
    x = (x - mean) * model.img_range
    x = model.conv_first(x)
    Hp, Wp = x.shape[-2:]
    tokens = model.patch_embed.norm(x.flatten(2).transpose(1, 2))
    for layer in model.layers:
        t = tokens
        for block in layer.residual_group.blocks:
            t = reference_block(block, t, Hp, Wp)
        image = t.transpose(1, 2).reshape(t.shape[0], -1, Hp, Wp)
        tokens = layer.conv(image).flatten(2).transpose(1, 2) + tokens
    features = model.norm(tokens).transpose(1, 2).reshape(x.shape)
    x = model.conv_after_body(features) + x
    x = model.conv_last(model.upsample(model.conv_before_upsample(x)))
    x = x / model.img_range + mean
    return x[:, :, :H * model.upscale, :W * model.upscale]


# ---------------------------------------------------------------- structure and compatibility

def test_tutorial_config_has_the_original_parameters_and_keys():
    model = build_model(build_config("baseline"))  # built, not run
    assert count_parameters(model) == 11_752_487
    keys = list(model.state_dict())
    assert len(keys) == 548
    assert sum(k.endswith("attn_mask") for k in keys) == 18
    assert sum(k.endswith("relative_position_index") for k in keys) == 36
    for key in ("conv_first.weight", "patch_embed.norm.weight", "layers.0.residual_group.blocks.1.attn_mask",
                "layers.5.residual_group.blocks.5.attn.relative_position_bias_table", "layers.2.conv.weight",
                "layers.0.residual_group.blocks.0.mlp.fc2.bias", "norm.bias", "conv_after_body.weight",
                "conv_before_upsample.0.weight", "upsample.0.weight", "conv_last.bias"):
        assert key in keys
    assert model.state_dict()["layers.0.residual_group.blocks.0.attn.relative_position_bias_table"].shape == (225, 6)
    assert len(model.swin_blocks()) == 36 and len(model.rstb_layers()) == 6
    assert model.swin_blocks()[1] is model.layers[0].residual_group.blocks[1]


def test_build_model_accepts_model_section_or_whole_config():
    cfg = build_config("quickstart")
    a, b = build_model(cfg), build_model(cfg.model)
    assert count_parameters(a) == count_parameters(b)
    assert a.data_mean.flatten().tolist() == pytest.approx(ERA5_MEAN)


@pytest.mark.parametrize("upsampler, upscale", [("pixelshuffle", 2), ("pixelshuffle", 3), ("pixelshuffledirect", 2),
                                                ("nearest+conv", 4), ("", 1)])
@pytest.mark.parametrize("size", [(60, 90), (64, 128), (5, 3)])
def test_output_shape_for_any_input_size(upsampler, upscale, size):
    model = small_swinir(upsampler=upsampler, upscale=upscale, window_size=8, depths=[2], num_heads=[2],
                         embed_dim=16, mean=ERA5_MEAN, std=ERA5_STD)
    with torch.no_grad():
        y = model(physical(2, *size))
    assert y.shape == (2, 3, size[0] * upscale, size[1] * upscale)
    assert y.dtype == torch.float32 and torch.isfinite(y).all()


def test_bad_input_gives_a_clear_error():
    model = small_swinir()
    with pytest.raises(ValueError, match="expects"):
        model(torch.zeros(1, 1, 8, 8))
    with pytest.raises(ValueError, match="upsampler"):
        small_swinir(upsampler="bilinear")


# ---------------------------------------------------------------- parity with the original arithmetic

def test_shift_mask_equals_the_originals():
    for height, width, window in [(16, 24, 4), (8, 8, 8), (64, 96, 8)]:
        expected = original_mask(height, width, window, window // 2)
        assert torch.equal(compute_shift_mask(height, width, window, window // 2), expected)


@pytest.mark.parametrize("shift", [0, 2])
def test_block_matches_dense_reference_forward_and_backward(shift):
    torch.manual_seed(0)
    block = swinir.SwinTransformerBlock(24, (16, 16), num_heads=3, window_size=4, shift_size=shift, mlp_ratio=2.0)
    with torch.no_grad():
        block.attn.relative_position_bias_table.normal_(0, 1)
    x = torch.randn(2, 12 * 20, 24, requires_grad=True)
    fast = block(x, (12, 20))
    grads_fast = torch.autograd.grad(fast.square().sum(), [x, *block.parameters()])
    reference = reference_block(block, x, 12, 20)
    grads_reference = torch.autograd.grad(reference.square().sum(), [x, *block.parameters()])
    torch.testing.assert_close(fast, reference, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # without gradients the bias goes through F.scaled_dot_product_attention
        torch.testing.assert_close(block(x, (12, 20)), reference, rtol=1e-5, atol=1e-5)
    for g_fast, g_reference in zip(grads_fast, grads_reference):
        torch.testing.assert_close(g_fast, g_reference, rtol=1e-4, atol=1e-4)


def test_padded_head_dim_for_fused_kernels_gives_the_same_result(monkeypatch):
    model = small_swinir(embed_dim=30, num_heads=[3, 5])  # head_dim 10 and 6
    x = physical(2, 12, 12)
    with torch.no_grad():
        expected = model(x)
        monkeypatch.setattr(swinir, "SDPA_HEAD_DIM_MULTIPLE", {"cpu": 8})  # what CUDA does
        torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("shift, batch", [(0, 1), (2, 1), (2, 2)])
def test_cuda_sdpa_equals_the_explicit_formula_with_the_bias_gradient(monkeypatch, shift, batch):
    """On CUDA, training goes through F.scaled_dot_product_attention with a bias that needs a gradient (a CPU
    takes the explicit formula): output and every gradient, the bias table's included, must agree, and the
    memory-efficient kernel must take the bias (only it allowed: the math fallback would raise)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cuda = torch.device("cuda")
    torch.manual_seed(0)
    # head_dim 10: padded to 16 for the fused kernels; shifted windows: a mask per window, 6 windows per image.
    block = swinir.SwinTransformerBlock(30, (16, 16), num_heads=3, window_size=4, shift_size=shift, mlp_ratio=2.0)
    with torch.no_grad():
        block.attn.relative_position_bias_table.normal_(0, 1)
    block = block.to(cuda)
    x = torch.randn(batch, 8 * 12, 30, device=cuda, requires_grad=True)

    def output_and_grads():
        out = block(x, (8, 12))
        return [out, *torch.autograd.grad(out.square().sum(), [x, *block.parameters()])]

    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # both sides in true fp32
    try:
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            fused = output_and_grads()
        monkeypatch.setattr(swinir.WindowAttention, "_fused_attention", swinir.WindowAttention._explicit_attention)
        explicit = output_and_grads()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    names = ["output", "x", *(name for name, _ in block.named_parameters())]
    assert "attn.relative_position_bias_table" in names
    for name, a, b in zip(names, fused, explicit):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-3, msg=name)  # gradients reach ~100


def test_model_computes_what_the_original_computes():
    model = small_swinir()  # mean=None, std=None: the original's (DIV2K RGB mean, std 1)
    x = torch.rand(2, 3, 10, 14)  # not a window multiple: padded, then cropped
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference_forward(model, x), rtol=1e-5, atol=1e-5)


def test_mean_std_shift_is_superbench_shiftmean():
    plain = small_swinir(mean=[0.0] * 3, std=[1.0] * 3)
    shifted = small_swinir(mean=ERA5_MEAN, std=ERA5_STD)
    shifted.load_state_dict(plain.state_dict())
    mean, std = torch.tensor(ERA5_MEAN).view(1, 3, 1, 1), torch.tensor(ERA5_STD).view(1, 3, 1, 1)
    x = physical(1, 12, 12)
    with torch.no_grad():
        torch.testing.assert_close(shifted(x), plain((x - mean) / std) * std + mean, rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------- attention masks

def test_masks_are_cached_per_size_and_only_for_shifted_blocks(monkeypatch):
    model = small_swinir().eval()
    x = physical(1, 10, 14)
    with torch.no_grad():
        cached = model(x)
    calls = []
    monkeypatch.setattr(swinir, "compute_shift_mask", lambda *a: calls.append(a) or original_mask(*a[:4]))
    with torch.no_grad():
        again = model(x)
    assert calls == []  # second forward at the same size: nothing rebuilt
    swinir._cached_shift_mask.cache_clear()
    monkeypatch.setattr(swinir, "shift_mask", lambda *a: calls.append(a) or original_mask(*a[:4]))
    masks = {}
    for i, block in enumerate(model.swin_blocks()):
        block.attn.register_forward_pre_hook(lambda m, args, kwargs, i=i: masks.update({i: kwargs["mask"]}),
                                             with_kwargs=True)
    with torch.no_grad():
        recomputed = model(x)
    assert torch.equal(cached, again) and torch.equal(cached, recomputed)
    assert len(calls) == 2  # recomputed in each of the 2 shifted blocks
    assert [masks[i] is None for i in range(4)] == [True, False, True, False]
    key = (12, 16, 4, 2, torch.device("cpu"), torch.float32)
    assert swinir._cached_shift_mask(*key) is swinir._cached_shift_mask(*key)


def test_inference_mode_forward_does_not_poison_the_mask_cache():
    swinir._cached_shift_mask.cache_clear()
    model = small_swinir()
    with torch.inference_mode():
        model(physical(1, 8, 8))
    model(physical(1, 8, 8)).mean().backward()
    assert model.conv_first.weight.grad is not None


# ---------------------------------------------------------------- checkpoints

def test_state_dict_round_trip_with_prefixes_and_other_img_size():
    source = small_swinir(img_size=16)
    target = small_swinir(img_size=24)  # attn_mask buffers of another shape
    target.apply(lambda m: torch.nn.init.zeros_(m.weight) if isinstance(m, torch.nn.Conv2d) else None)
    x = physical(1, 12, 20)
    state = source.state_dict()
    for prefix in ("", "module.", "_orig_mod.", "module._orig_mod."):
        target.load_state_dict({prefix + k: v for k, v in state.items()})  # strict
        with torch.no_grad():
            assert torch.equal(target(x), source(x))
    assert target.layers[0].residual_group.blocks[1].attn_mask.shape == (36, 16, 16)
    with pytest.raises(RuntimeError, match="Missing key"):
        target.load_state_dict({k: v for k, v in state.items() if not k.startswith("conv_last")})


# ---------------------------------------------------------------- activation checkpointing

def _step(model, x):
    loss = model(x).square().mean()
    return loss, torch.autograd.grad(loss, list(model.parameters()))


def _backward_flops(model, x):
    loss = model(x).square().mean()
    with FlopCounterMode(display=False) as counter:
        loss.backward()
    return counter.get_total_flops()


def test_activation_checkpointing_same_result_more_backward_flops():
    model = small_swinir()
    x = physical(2, 12, 12)
    loss, grads = _step(model, x)
    checkpointed = copy.deepcopy(model)
    for block in checkpointed.swin_blocks():
        composable_checkpoint(block)  # as utils/parallel/techniques.apply_ac does
    flagged = small_swinir(use_checkpoint=True)  # the original's switch, per block
    for name, variant in (("composable", checkpointed), ("use_checkpoint", flagged)):
        loss_ac, grads_ac = _step(variant, x)
        assert torch.equal(loss_ac, loss), name
        for g, g_ac in zip(grads, grads_ac):
            torch.testing.assert_close(g_ac, g, rtol=1e-6, atol=1e-7)
        assert _backward_flops(variant, x) > _backward_flops(model, x), name


# ---------------------------------------------------------------- reduced precision

def test_bf16_autocast_forward_backward_keeps_the_shift_in_fp32():
    model = small_swinir(mean=ERA5_MEAN, std=ERA5_STD)
    x = physical(2, 12, 20)
    with torch.no_grad():
        reference = model(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, reference, rtol=0, atol=0.1 * max(ERA5_STD))
    y.mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    # A network that outputs zeros returns exactly the mean: 278.3945, not bf16's 278.0.
    torch.nn.init.zeros_(model.conv_last.weight)
    torch.nn.init.zeros_(model.conv_last.bias)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        temperature = model(x)[:, 1]
    assert torch.equal(temperature, torch.full((2, 24, 40), ERA5_MEAN[1]))


def test_bf16_parameters_with_fp32_buffers_as_fsdp2_mixed_precision():
    model = small_swinir(mean=ERA5_MEAN, std=ERA5_STD)
    x = physical(1, 12, 20)
    for p in model.parameters():  # FSDP2 MixedPrecisionPolicy(param_dtype=bf16) casts parameters only
        p.data = p.data.bfloat16()
    y = model(x.bfloat16())
    assert y.dtype == torch.float32 and torch.isfinite(y).all()
    y.mean().backward()
    model.to(torch.bfloat16)  # casting the whole model keeps the physical mean/std in fp32
    assert model.data_mean.dtype == torch.float32 and model.data_mean[0, 1].item() == pytest.approx(278.3945, abs=1e-4)


# ---------------------------------------------------------------- benchmark

def test_benchmark_runs_tiny(capsys):
    from benchmarks.bench_model import main

    assert main(["--config", "quickstart", "--size", "16", "--steps", "1", "--warmup", "0",
                 "--peak_seconds", "0.01"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"sec_per_step", "flops_per_step", "matmul_peak_flops", "fraction_of_peak"} <= set(result)
    assert result["flops_per_step"] > 0 and result["sec_per_step"] > 0 and 0 < result["fraction_of_peak"]
    assert main(["--config", "no_such_config", "--steps", "1"]) == 2
    assert "unknown config" in capsys.readouterr().err


def test_benchmark_breakdown_finds_every_counted_op_in_the_profile(capsys):
    from benchmarks.bench_model import main

    assert main(["--config", "quickstart", "--size", "16", "--steps", "1", "--warmup", "0",
                 "--peak_seconds", "0.01", "--breakdown"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    counted = result["flops_by_op"]
    assert {"aten.mm", "aten.addmm", "aten.bmm", "aten.convolution", "aten.convolution_backward"} <= set(counted)
    assert sum(counted.values()) == result["flops_per_step"]
    # FlopCounterMode's "aten.mm" must be found as the profiler's "aten::mm": no op without time.
    assert set(result["seconds_by_op"]) == set(counted) and min(result["seconds_by_op"].values()) > 0
    assert result["fraction_ceiling"] > 0 and "ceiling: fraction_of_peak would be" in out


def test_benchmark_breakdown_table_and_ceiling(capsys):
    from benchmarks.bench_model import print_breakdown

    ceiling = print_breakdown({"aten.mm": 2e9, "aten.bmm": 1e9}, {"aten.mm": 0.01, "aten.bmm": 0.02},
                              sec_per_step=0.05, peak_flops=2e11)
    assert ceiling == pytest.approx(0.5)  # 3 GFLOP in 0.03 s = 100 GFLOP/s of 200
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].split() == ["aten.bmm", "1.0", "0.020", "50.0", "0.25"]  # slowest first
    assert lines[3].split() == ["aten.mm", "2.0", "0.010", "200.0", "1.00"]
    assert lines[5].split()[:3] == ["everything", "else", "0.020"]
    assert print_breakdown({"aten.mm": 2e9}, {"aten.mm": 0.0}, sec_per_step=0.05, peak_flops=2e11) is None
    assert "no time" in capsys.readouterr().out
