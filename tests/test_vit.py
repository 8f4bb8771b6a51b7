"""The ViT forecaster (models/vit/network.py): NERSC's parameter counts, shapes, layout, normalisation, attention.

The arithmetic is checked against references written out here: a dense per-head attention
softmax(q kᵀ / sqrt(d)) v, and a patchify by plain indexing whose inverse unpatchify must be.
"""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
import timm.layers

from models import build_model, count_parameters
from models.layers import DropPath, Mlp, trunc_normal_
from models.vit.network import Block, ViT
from utils.config import ConfigError, build_config

# Physical scales like ERA5's: kelvins, pascals, m/s; bf16 would round them (278.39 K -> 278.0 K).
MEAN = [278.39, 101325.0, -1.5]
STD = [21.06, 1200.0, 5.2]


def tiny_vit(img_size=(8, 12), patch_size=4, in_chans=3, embed_dim=16, depth=2, num_heads=2, **kwargs) -> ViT:
    torch.manual_seed(0)
    return ViT(img_size=img_size, patch_size=patch_size, in_chans=in_chans, embed_dim=embed_dim, depth=depth,
               num_heads=num_heads, **kwargs)


def on_meta(name: str, **overrides) -> ViT:
    """A named config's ViT with shapes only (no memory, no initialisation): for counting."""
    cfg = build_config(name, overrides)
    m = dataclasses.replace(cfg.model, mean=[0.0] * cfg.model.in_chans, std=[1.0] * cfg.model.in_chans)
    with torch.device("meta"):
        return build_model(m)


# ------------------------------------------------------------------ parameters

@pytest.mark.parametrize("name, overrides, expected", [
    ("vit_base", {}, 23_832_960),
    ("vit_base", {"model_args.embed_dim": 1024}, 157_926_400),
    ("vit_mp", {}, 350_135_808),
])
def test_parameter_counts_of_nersc_sizes(name, overrides, expected):
    model = on_meta(name, **overrides)
    assert count_parameters(model) == expected
    if name == "vit_base" and not overrides:  # 45 x 90 tokens of width 384
        assert model.pos_embed.numel() == 1_555_200 and model.grid == (45, 90)


def test_blocks_are_the_transformer_blocks_in_order():
    model = tiny_vit(depth=3)
    blocks = model.blocks()
    assert len(blocks) == 3 and all(isinstance(b, Block) for b in blocks)
    assert all(a is b for a, b in zip(blocks, model.transformer))


def seeded(make, seed: int = 0):
    torch.manual_seed(seed)
    return make()


def test_hand_written_layers_are_timms():
    # models/layers.py replaces timm.layers to save each process timm's import (see there): same
    # parameters from the same seed, same outputs, same gradients, same random draws.
    pairs = [(lambda: Mlp(8, 16, drop=0.25), lambda: timm.layers.Mlp(8, 16, drop=0.25)),
             (lambda: DropPath(0.3), lambda: timm.layers.DropPath(0.3))]
    for make_ours, make_theirs in pairs:
        ours, theirs = seeded(make_ours), seeded(make_theirs)
        assert [(n, p.shape) for n, p in ours.named_parameters()] == [(n, p.shape) for n, p in theirs.named_parameters()]
        assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters()))
        x = torch.randn(6, 5, 8, requires_grad=True)
        outputs = [seeded(lambda: layer.train()(x), seed=1) for layer in (ours, theirs)]
        grads = [torch.autograd.grad(out.square().sum(), x)[0] for out in outputs]
        assert torch.equal(*outputs) and torch.equal(*grads)
        assert not torch.equal(outputs[0], x)  # the random drop did something
    a = seeded(lambda: trunc_normal_(torch.empty(1000), std=0.02), seed=2)
    b = seeded(lambda: timm.layers.trunc_normal_(torch.empty(1000), std=0.02), seed=2)
    assert torch.equal(a, b)


def test_drop_path_modules_only_with_a_positive_rate():
    assert not any(isinstance(m, DropPath) for m in tiny_vit(depth=3, drop_path_rate=0.0).modules())
    rates = [getattr(b.drop_path, "drop_prob", 0.0) for b in tiny_vit(depth=3, drop_path_rate=0.2).blocks()]
    assert rates == pytest.approx([0.0, 0.1, 0.2])  # linear decay; block 0 keeps an Identity


# ------------------------------------------------------------------ shapes and input checks

@pytest.mark.parametrize("img_size, patch, chans, embed, heads", [
    ((8, 12), 4, 3, 16, 2),
    ((16, 16), 8, 1, 24, 3),
    ((6, 10), 2, 20, 8, 1),
    ((12, 24), 3, 5, 32, 4),
])
def test_forward_and_backward_shapes(img_size, patch, chans, embed, heads):
    model = tiny_vit(img_size, patch, chans, embed, num_heads=heads)
    x = torch.randn(2, chans, *img_size)
    out = model(x)
    assert out.shape == x.shape and out.dtype == torch.float32
    out.square().mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape and torch.isfinite(p.grad).all(), name


def test_wrong_input_size_is_a_value_error_naming_img_size():
    model = tiny_vit()
    for bad in (torch.randn(1, 3, 8, 16), torch.randn(1, 2, 8, 12), torch.randn(3, 8, 12)):
        with pytest.raises(ValueError, match="img_size"):
            model(bad)


def test_img_size_not_divisible_by_patch():
    with pytest.raises(ConfigError, match="not divisible by patch_size"):
        build_config("vit_quickstart", {"img_size": [30, 64], "model_args.patch_size": 4})
    with pytest.raises(ValueError, match="not divisible by patch_size"):
        ViT(img_size=(30, 64), patch_size=4)


# ------------------------------------------------------------------ layout

def patchify_reference(x: torch.Tensor, p: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, tokens, p*p*C): tokens row-major over the patch grid, each laid out (p, p, C)."""
    B, C, H, W = x.shape
    tokens = []
    for i in range(H // p):
        for j in range(W // p):
            patch = x[:, :, i * p:(i + 1) * p, j * p:(j + 1) * p]  # (B, C, p, p)
            tokens.append(patch.permute(0, 2, 3, 1).reshape(B, -1))
    return torch.stack(tokens, dim=1)


def test_unpatchify_inverts_the_patch_embedding_order():
    p, C = 4, 3
    model = tiny_vit(img_size=(8, 12), patch_size=p, in_chans=C, embed_dim=p * p * C, num_heads=1)
    x = torch.randn(2, C, 8, 12)
    assert torch.equal(model.unpatchify(patchify_reference(x, p)), x)
    # A patch embedding that copies each pixel to the (p, p, C) slot the head writes it back from:
    # its tokens are the reference's, in the same order, so unpatchify(embedding) is the identity.
    weight = torch.zeros(p * p * C, C, p, p)
    for pi in range(p):
        for pj in range(p):
            for c in range(C):
                weight[(pi * p + pj) * C + c, c, pi, pj] = 1.0
    with torch.no_grad():
        model.patch_embed.weight.copy_(weight)
        model.patch_embed.bias.zero_()
        tokens = model.patch_embed(x).flatten(2).transpose(1, 2)
    assert torch.equal(tokens, patchify_reference(x, p))
    assert torch.equal(model.unpatchify(tokens), x)


# ------------------------------------------------------------------ normalisation and precision

def test_output_follows_the_physical_offset_and_scale():
    torch.manual_seed(1)
    x = torch.randn(2, 3, 8, 12)
    unit = tiny_vit()
    shifted = tiny_vit(mean=MEAN, std=[1.0, 1.0, 1.0])
    scaled = tiny_vit(mean=MEAN, std=STD)
    for other in (shifted, scaled):
        other.load_state_dict(unit.state_dict())  # mean/std are not in the state_dict: same weights
    mean, std = torch.tensor(MEAN).view(1, -1, 1, 1), torch.tensor(STD).view(1, -1, 1, 1)
    with torch.no_grad():
        reference = unit(x)
        torch.testing.assert_close(shifted(x + mean), reference + mean, rtol=0, atol=1e-2)  # fp32 at 1e5 Pa
        torch.testing.assert_close(scaled(x * std + mean), reference * std + mean, rtol=0, atol=1e-2)


def test_bf16_model_keeps_fp32_statistics_and_physical_output():
    model = tiny_vit(mean=MEAN, std=STD)
    x = torch.randn(2, 3, 8, 12) * torch.tensor(STD).view(1, -1, 1, 1) + torch.tensor(MEAN).view(1, -1, 1, 1)
    with torch.no_grad():
        fp32 = model(x)
        model.to(torch.bfloat16)
        assert model.patch_embed.weight.dtype == torch.bfloat16
        assert model.data_mean.dtype == model.data_std.dtype == torch.float32
        assert torch.equal(model.data_mean.flatten(), torch.tensor(MEAN))  # 278.39, not bf16's 278.0
        bf16 = model(x)
    assert bf16.dtype == torch.float32
    # Within bf16's rounding of the normalised output (a few 1e-2 of one std), not of 278 K or 101325 Pa.
    error = ((bf16 - fp32) / torch.tensor(STD).view(1, -1, 1, 1)).abs().max()
    assert error < 0.1, error


# ------------------------------------------------------------------ attention

def test_attention_equals_a_dense_reference():
    torch.manual_seed(2)
    block = tiny_vit(embed_dim=12, num_heads=3).blocks()[0]
    attn = block.attn
    x = torch.randn(2, 5, 12)
    heads, d = 3, 4
    q, k, v = (F.linear(x, lin.weight, lin.bias) for lin in (attn.q, attn.k, attn.v))
    out = torch.zeros(2, 5, 12)
    for b in range(2):
        for h in range(heads):
            cols = slice(h * d, (h + 1) * d)
            scores = q[b, :, cols] @ k[b, :, cols].T / math.sqrt(d)
            out[b, :, cols] = torch.softmax(scores, dim=-1) @ v[b, :, cols]
    expected = F.linear(out, attn.proj.weight, attn.proj.bias)
    torch.testing.assert_close(attn(x), expected, rtol=1e-5, atol=1e-6)
