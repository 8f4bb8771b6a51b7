"""SwinIR (Liang et al., 2021, arXiv:2108.10257) for super-resolution, as SuperBench uses it.

shallow conv -> residual Swin transformer blocks (RSTB) -> conv + long skip -> upsampler, with
SuperBench's per-channel mean/std shift inside the model, so inputs and outputs are in physical
units (the training loss is too).

Compatibility with the original code (JingyunLiang/SwinIR ``models/network_swinir.py``):
  * same constructor keywords, module names and parameter/buffer shapes, so published SwinIR and
    SuperBench state_dicts load with a plain, strict ``load_state_dict`` (a ``module.`` or
    ``_orig_mod.`` prefix and an ``attn_mask`` saved for another ``img_size`` are accepted);
  * with ``mean=None, std=None`` the shift is the original's (DIV2K RGB mean for 3 channels,
    zero otherwise; std 1); with ``img_range=1`` it is SuperBench's ``ShiftMean``.
  * the same arithmetic: softmax(q k^T * scale + relative position bias + shift mask) v, with the
    original's -100 mask, reflect padding to a window multiple and the output cropped back.
    tests/test_model.py checks the fast path against a dense reference written out in full.

What differs is how it is computed:
  * attention runs through ``F.scaled_dot_product_attention`` with bias (+ mask) as a float mask,
    except for CPU training, where PyTorch has no fused kernel that returns the bias gradient and
    the explicit formula is faster;
  * token <-> image conversions are views (channels-last convolutions), not copies;
  * the shifted-window mask is built once per (padded size, device, dtype) on the device and
    cached (the original rebuilt it on the CPU in every shifted block on every step, because its
    ``img_size`` never equals the padded input); non-shifted blocks get no mask;
  * buffers and the bias table are cast to the activation dtype at use (FSDP2 bf16 parameters),
    while the mean/std shift is always computed in fp32 (bf16 rounds 278.39 K to 278.0 K);
  * every Swin block is a pure function of its inputs, reachable through ``swin_blocks()``, so
    activation checkpointing, FSDP2 and torch.compile can be applied from outside.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from models.common import PhysicalUnitsModel, init_transformer_weights
from models.layers import DropPath, Mlp, trunc_normal_

# Value the original adds to attention logits between tokens that the cyclic shift brought
# together from different image regions (kept for bit-compatible results; exp(-100) ~ 4e-44).
MASKED_LOGIT = -100.0
# The original code's input shift for 3-channel images (DIV2K RGB mean), used when mean is None.
DIV2K_RGB_MEAN = (0.4488, 0.4371, 0.4040)
# CUDA's memory-efficient attention (the fused kernel that takes a bias and returns its gradient)
# needs head_dim % 8 == 0; the tutorial's 180 channels / 6 heads = 30 is padded to 32 there. It also
# needs the bias's last dimension contiguous, hence relative_position_bias's copy (with a permuted view,
# an H200 ran SDPA's math fallback in most blocks: benchmarks/README.md, "Measured on a GPU").
SDPA_HEAD_DIM_MULTIPLE = {"cuda": 8}


def window_partition(x: torch.Tensor, window_size: int) -> torch.Tensor:
    """(B, H, W, C) -> (B * num_windows, window_size * window_size, C), windows in row order."""
    B, H, W, C = x.shape
    x = x.view(B, H // window_size, window_size, W // window_size, window_size, C)
    return x.transpose(2, 3).reshape(-1, window_size * window_size, C)


def window_reverse(windows: torch.Tensor, window_size: int, H: int, W: int) -> torch.Tensor:
    """Inverse of window_partition: (B * num_windows, window_size**2, C) -> (B, H, W, C)."""
    C = windows.shape[-1]
    x = windows.view(-1, H // window_size, W // window_size, window_size, window_size, C)
    return x.transpose(2, 3).reshape(-1, H, W, C)


def compute_shift_mask(height: int, width: int, window_size: int, shift_size: int,
                       device: torch.device | str | None = None,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Additive attention mask of the shifted windows: (num_windows, N, N), N = window_size**2.

    After the cyclic shift by -shift_size, the last window row/column holds pixels from up to
    three regions per axis (original bulk, last window minus the shift, wrapped-around shift);
    tokens may only attend to tokens of their own region (0), others get MASKED_LOGIT.
    """
    def region(length: int) -> torch.Tensor:
        pos = torch.arange(length, device=device)
        return (pos >= length - window_size).long() + (pos >= length - shift_size).long()

    labels = (region(height)[:, None] * 3 + region(width)[None, :])[None, :, :, None]
    labels = window_partition(labels, window_size).squeeze(-1)  # (num_windows, N)
    different = labels[:, :, None] != labels[:, None, :]
    return torch.zeros(different.shape, device=device, dtype=dtype).masked_fill_(different, MASKED_LOGIT)


@functools.lru_cache(maxsize=16)
def _cached_shift_mask(height, width, window_size, shift_size, device, dtype) -> torch.Tensor:
    # Inference tensors must not enter the cache: a later training step would have to save them.
    with torch.inference_mode(False):
        return compute_shift_mask(height, width, window_size, shift_size, device, dtype)


def shift_mask(height: int, width: int, window_size: int, shift_size: int,
               device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """compute_shift_mask, computed once per (size, device, dtype) and reused (do not modify it).

    Under torch.compile the mask is computed in the graph (constant shapes: compiled once).
    """
    if torch.compiler.is_compiling():
        return compute_shift_mask(height, width, window_size, shift_size, device, dtype)
    return _cached_shift_mask(height, width, window_size, shift_size, torch.device(device), dtype)


def activation_dtype(x: torch.Tensor) -> torch.dtype:
    """dtype that matmuls on x will produce: the autocast dtype if autocast is on, else x's.

    Under torch.compile the availability check is skipped: dynamo cannot trace it (a graph break, which splits a
    block into CUDA graphs whose outputs a validation forward overwrote on a GPU), and a compiled block runs
    on a device that has autocast (CPU or CUDA)."""
    device = x.device.type
    if (torch.compiler.is_compiling() or torch.amp.is_autocast_available(device)) and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


class WindowAttention(nn.Module):
    """Multi-head self-attention inside windows, with a learned relative position bias."""

    def __init__(self, dim: int, window_size: tuple[int, int], num_heads: int, qkv_bias: bool = True,
                 qk_scale: Optional[float] = None, attn_drop: float = 0.0, proj_drop: float = 0.0):
        super().__init__()
        self.dim = dim
        self.window_size = window_size
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = qk_scale or self.head_dim ** -0.5
        wh, ww = window_size
        # One learned bias per head and relative offset (dy, dx) in [-(wh-1), wh-1] x [-(ww-1), ww-1].
        self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * wh - 1) * (2 * ww - 1), num_heads))
        coords = torch.stack(torch.meshgrid(torch.arange(wh), torch.arange(ww), indexing="ij")).flatten(1)
        offsets = coords[:, :, None] - coords[:, None, :]  # (2, N, N): offset from token j to token i
        index = (offsets[0] + wh - 1) * (2 * ww - 1) + (offsets[1] + ww - 1)
        self.register_buffer("relative_position_index", index)
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        trunc_normal_(self.relative_position_bias_table, std=0.02)

    def relative_position_bias(self) -> torch.Tensor:
        """(num_heads, N, N) bias added to the attention logits of every window."""
        n = self.relative_position_index.shape[0]
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)]
        return bias.view(n, n, -1).permute(2, 0, 1).contiguous()  # contiguous: CUDA's fused kernel takes it

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x: (B * num_windows, N, C); mask: (num_windows, N, N) additive, or None."""
        B_, N, _ = x.shape
        # Heads from the width of qkv's output, so a tensor-parallel plan that gives each rank whole heads needs
        # no change here (as the ViT).
        q, k, v = self.qkv(x).view(B_, N, 3, -1, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        # Cast at use: under FSDP2 mixed precision q is bf16 while buffers stay fp32.
        attn_bias = self.relative_position_bias().to(q.dtype).unsqueeze(0)  # (1, heads, N, N)
        if mask is not None:
            attn_bias = attn_bias + mask.to(q.dtype).unsqueeze(1)  # (num_windows, heads, N, N)
        if attn_bias.requires_grad and q.device.type == "cpu":
            x = self._explicit_attention(q, k, v, attn_bias)
        else:
            x = self._fused_attention(q, k, v, attn_bias)
        x = x.transpose(1, 2).reshape(B_, N, -1)
        return self.proj_drop(self.proj(x))

    def _explicit_attention(self, q, k, v, attn_bias):
        """softmax(q k^T * scale + bias) v, as the original computes it.

        Used for CPU training: PyTorch's fused CPU attention cannot return the bias gradient, so
        SDPA would fall back to an unfused kernel that is slower than this (measured).
        """
        B_, heads, N, _ = q.shape
        attn = torch.matmul(q * self.scale, k.transpose(-2, -1))
        attn = (attn.view(-1, *attn_bias.shape) + attn_bias).view(B_, heads, N, N)  # broadcast over images
        return torch.matmul(self.attn_drop(attn.softmax(dim=-1)), v)

    def _fused_attention(self, q, k, v, attn_bias):
        """The same through F.scaled_dot_product_attention (fused kernels where PyTorch has one)."""
        if attn_bias.shape[0] not in (1, q.shape[0]):  # SDPA wants the mask per (image, window)
            attn_bias = attn_bias.expand(q.shape[0] // attn_bias.shape[0], -1, -1, -1, -1).flatten(0, 1)
        head_dim = q.shape[-1]
        pad = -head_dim % SDPA_HEAD_DIM_MULTIPLE.get(q.device.type, 1)
        if pad:  # zero channels change neither q k^T nor the kept part of the output
            q, k, v = (F.pad(t, (0, pad)) for t in (q, k, v))
        x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias, scale=self.scale,
                                           dropout_p=self.attn_drop.p if self.training else 0.0)
        return x[..., :head_dim]

    def extra_repr(self) -> str:
        return f"dim={self.dim}, window_size={self.window_size}, num_heads={self.num_heads}"


class SwinTransformerBlock(nn.Module):
    """LayerNorm -> (shifted) window attention -> residual; LayerNorm -> MLP -> residual.

    ``use_checkpoint`` recomputes this block's activations in backward (non-reentrant).
    """

    def __init__(self, dim: int, input_resolution: tuple[int, int], num_heads: int, window_size: int = 7,
                 shift_size: int = 0, mlp_ratio: float = 4.0, qkv_bias: bool = True,
                 qk_scale: Optional[float] = None, drop: float = 0.0, attn_drop: float = 0.0,
                 drop_path: float = 0.0, act_layer: type[nn.Module] = nn.GELU,
                 norm_layer: type[nn.Module] = nn.LayerNorm, use_checkpoint: bool = False):
        super().__init__()
        self.dim = dim
        self.input_resolution = tuple(input_resolution)
        self.num_heads = num_heads
        self.window_size = window_size
        self.shift_size = shift_size
        self.mlp_ratio = mlp_ratio
        self.use_checkpoint = use_checkpoint
        if min(self.input_resolution) <= self.window_size:
            # As the original: an img_size no larger than the window means one unshifted window
            # (this also sets the bias table's shape, hence checkpoint compatibility).
            self.shift_size = 0
            self.window_size = min(self.input_resolution)
        if not 0 <= self.shift_size < self.window_size:
            raise ValueError(f"shift_size {self.shift_size} must be in [0, window_size {self.window_size})")
        self.norm1 = norm_layer(dim)
        self.attn = WindowAttention(dim, window_size=(self.window_size, self.window_size), num_heads=num_heads,
                                    qkv_bias=qkv_bias, qk_scale=qk_scale, attn_drop=attn_drop, proj_drop=drop)
        self.drop_path = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.norm2 = norm_layer(dim)
        self.mlp = Mlp(in_features=dim, hidden_features=int(dim * mlp_ratio), act_layer=act_layer, drop=drop)
        # Kept only so that state_dicts have the original's keys; forward uses the shift_mask cache.
        mask = compute_shift_mask(*self.input_resolution, self.window_size, self.shift_size) if self.shift_size else None
        self.register_buffer("attn_mask", mask)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # A mask saved for another img_size: keep ours (the mask is a function of the size only).
        key = prefix + "attn_mask"
        if key in state_dict and self.attn_mask is not None and state_dict[key].shape != self.attn_mask.shape:
            state_dict[key] = self.attn_mask
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x: torch.Tensor, x_size: tuple[int, int]) -> torch.Tensor:
        if self.use_checkpoint and torch.is_grad_enabled():
            return checkpoint(self._forward, x, x_size, use_reentrant=False)
        return self._forward(x, x_size)

    def _forward(self, x: torch.Tensor, x_size: tuple[int, int]) -> torch.Tensor:
        H, W = x_size
        B, L, C = x.shape
        ws, shift = self.window_size, self.shift_size
        shortcut = x
        x = self.norm1(x).view(B, H, W, C)
        mask = None
        if shift:
            x = self.roll(x, -shift)
            mask = self.attention_mask(H, W, x)
        x = self.attn(window_partition(x, ws), mask=mask)
        x = window_reverse(x, ws, H, W)
        if shift:
            x = self.roll(x, shift)
        x = shortcut + self.drop_path(x.view(B, L, C))
        return x + self.drop_path(self.mlp(self.norm2(x)))

    # The only two places where a block looks beyond its own rows of the field (the cyclic shift wraps the
    # bottom rows round to the top): methods, so that domain parallelism can give them the whole field's
    # meaning for a band of it (utils/parallel/domain_parallel.py).
    def roll(self, x: torch.Tensor, shift: int) -> torch.Tensor:
        """(B, H, W, C) cyclically shifted by ``shift`` rows and columns."""
        return torch.roll(x, shifts=(shift, shift), dims=(1, 2))

    def attention_mask(self, H: int, W: int, x: torch.Tensor) -> torch.Tensor:
        """The shifted windows' mask of an H x W field, in the dtype of the attention logits (cached)."""
        return shift_mask(H, W, self.window_size, self.shift_size, x.device, activation_dtype(x))

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, input_resolution={self.input_resolution}, num_heads={self.num_heads}, "
                f"window_size={self.window_size}, shift_size={self.shift_size}, mlp_ratio={self.mlp_ratio}")


class BasicLayer(nn.Module):
    """Swin blocks of one RSTB; every second block shifts its windows by half a window."""

    def __init__(self, dim: int, input_resolution: tuple[int, int], depth: int, num_heads: int,
                 window_size: int, mlp_ratio: float = 4.0, qkv_bias: bool = True, qk_scale: Optional[float] = None,
                 drop: float = 0.0, attn_drop: float = 0.0, drop_path: float | Sequence[float] = 0.0,
                 norm_layer: type[nn.Module] = nn.LayerNorm, downsample=None, use_checkpoint: bool = False):
        super().__init__()
        if downsample is not None:
            raise ValueError("SwinIR uses no downsampling between Swin blocks (downsample must be None)")
        self.dim = dim
        self.input_resolution = input_resolution
        self.depth = depth
        self.blocks = nn.ModuleList([
            SwinTransformerBlock(dim=dim, input_resolution=input_resolution, num_heads=num_heads,
                                 window_size=window_size, shift_size=0 if i % 2 == 0 else window_size // 2,
                                 mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, qk_scale=qk_scale, drop=drop,
                                 attn_drop=attn_drop,
                                 drop_path=drop_path[i] if isinstance(drop_path, Sequence) else drop_path,
                                 norm_layer=norm_layer, use_checkpoint=use_checkpoint)
            for i in range(depth)])
        self.downsample = None

    def forward(self, x: torch.Tensor, x_size: tuple[int, int]) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, x_size)
        return x


def tokens_to_image(x: torch.Tensor, x_size: tuple[int, int]) -> torch.Tensor:
    """(B, H*W, C) -> (B, C, H, W) as a view with channels-last memory, which convolutions keep.

    (x.transpose(1, 2).unflatten(...) would give a batch stride that, for batch 1, makes the
    convolution reorder to NCHW and every later LayerNorm and residual add copy.)
    """
    return x.view(x.shape[0], *x_size, x.shape[2]).permute(0, 3, 1, 2)


def image_to_tokens(x: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H*W, C); a view when x is channels-last."""
    return x.permute(0, 2, 3, 1).flatten(1, 2)


def residual_conv(dim: int, resi_connection: str) -> nn.Module:
    """Convolution closing an RSTB and the body: one 3x3 conv, or three cheaper ones (3conv)."""
    if resi_connection == "1conv":
        return nn.Conv2d(dim, dim, 3, 1, 1)
    if resi_connection == "3conv":
        return nn.Sequential(nn.Conv2d(dim, dim // 4, 3, 1, 1), nn.LeakyReLU(negative_slope=0.2, inplace=True),
                             nn.Conv2d(dim // 4, dim // 4, 1, 1, 0), nn.LeakyReLU(negative_slope=0.2, inplace=True),
                             nn.Conv2d(dim // 4, dim, 3, 1, 1))
    raise ValueError(f"resi_connection {resi_connection!r} is not one of '1conv', '3conv'")


class RSTB(nn.Module):
    """Residual Swin transformer block: Swin blocks -> conv, plus the input."""

    def __init__(self, dim: int, input_resolution: tuple[int, int], depth: int, num_heads: int, window_size: int,
                 mlp_ratio: float = 4.0, qkv_bias: bool = True, qk_scale: Optional[float] = None, drop: float = 0.0,
                 attn_drop: float = 0.0, drop_path: float | Sequence[float] = 0.0,
                 norm_layer: type[nn.Module] = nn.LayerNorm, downsample=None, use_checkpoint: bool = False,
                 img_size: int | tuple[int, int] = 224, patch_size: int = 4, resi_connection: str = "1conv"):
        super().__init__()
        self.dim = dim
        self.input_resolution = input_resolution
        self.residual_group = BasicLayer(dim=dim, input_resolution=input_resolution, depth=depth,
                                         num_heads=num_heads, window_size=window_size, mlp_ratio=mlp_ratio,
                                         qkv_bias=qkv_bias, qk_scale=qk_scale, drop=drop, attn_drop=attn_drop,
                                         drop_path=drop_path, norm_layer=norm_layer, downsample=downsample,
                                         use_checkpoint=use_checkpoint)
        self.conv = residual_conv(dim, resi_connection)

    def forward(self, x: torch.Tensor, x_size: tuple[int, int]) -> torch.Tensor:
        return image_to_tokens(self.conv(tokens_to_image(self.residual_group(x, x_size), x_size))) + x


class PatchEmbed(nn.Module):
    """Image -> tokens (SwinIR's patches are single pixels), with an optional LayerNorm."""

    def __init__(self, embed_dim: int, norm_layer: Optional[type[nn.Module]] = None):
        super().__init__()
        self.norm = norm_layer(embed_dim) if norm_layer is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = image_to_tokens(x)
        return self.norm(x) if self.norm is not None else x


class Upsample(nn.Sequential):
    """Conv + PixelShuffle(2) per factor of 2 (scale 2^n), or one conv + PixelShuffle(3)."""

    def __init__(self, scale: int, num_feat: int):
        if scale & (scale - 1) == 0:
            steps = [(4, 2)] * int(math.log2(scale))
        elif scale == 3:
            steps = [(9, 3)]
        else:
            raise ValueError(f"upscale {scale} is not supported by upsampler 'pixelshuffle': use 2^n or 3")
        modules = []
        for channel_factor, factor in steps:
            modules += [nn.Conv2d(num_feat, channel_factor * num_feat, 3, 1, 1), nn.PixelShuffle(factor)]
        super().__init__(*modules)


class UpsampleOneStep(nn.Sequential):
    """One conv to scale**2 * out channels + PixelShuffle (lightweight SR)."""

    def __init__(self, scale: int, num_feat: int, num_out_ch: int, input_resolution=None):
        self.num_feat = num_feat
        self.input_resolution = input_resolution
        super().__init__(nn.Conv2d(num_feat, scale ** 2 * num_out_ch, 3, 1, 1), nn.PixelShuffle(scale))


UPSAMPLERS = ("pixelshuffle", "pixelshuffledirect", "nearest+conv", "")


class SwinIR(PhysicalUnitsModel):
    """SwinIR with the original's keywords, plus ``mean``/``std`` (per channel, physical units).

    The input (B, in_chans, H, W) may have any H, W: it is reflect-padded to a window multiple
    and the output (B, in_chans, H * upscale, W * upscale) is cropped back.
    ``img_size`` only sets the shape of the stored ``attn_mask`` buffers (and of
    ``absolute_pos_embed`` when ``ape``), as in the original.
    """

    def __init__(self, img_size: int | tuple[int, int] = 64, patch_size: int = 1, in_chans: int = 3,
                 embed_dim: int = 96, depths: Sequence[int] = (6, 6, 6, 6), num_heads: Sequence[int] = (6, 6, 6, 6),
                 window_size: int = 7, mlp_ratio: float = 4.0, qkv_bias: bool = True,
                 qk_scale: Optional[float] = None, drop_rate: float = 0.0, attn_drop_rate: float = 0.0,
                 drop_path_rate: float = 0.1, norm_layer: type[nn.Module] = nn.LayerNorm, ape: bool = False,
                 patch_norm: bool = True, use_checkpoint: bool = False, upscale: int = 2, img_range: float = 1.0,
                 upsampler: str = "", resi_connection: str = "1conv",
                 mean: Optional[Sequence[float]] = None, std: Optional[Sequence[float]] = None):
        super().__init__()
        if patch_size != 1:
            raise ValueError(f"patch_size {patch_size} is not supported: SwinIR embeds single pixels (patch_size=1)")
        if upsampler is None:
            upsampler = ""
        if upsampler not in UPSAMPLERS:
            raise ValueError(f"upsampler {upsampler!r} is not one of {UPSAMPLERS}")
        if len(depths) != len(num_heads):
            raise ValueError(f"depths {list(depths)} and num_heads {list(num_heads)} need the same length")
        num_out_ch, num_feat = in_chans, 64
        self.in_chans = in_chans
        self.img_range = img_range
        self.upscale = upscale
        self.upsampler = upsampler
        self.window_size = window_size

        if mean is None:
            mean = DIV2K_RGB_MEAN if in_chans == 3 else (0.0,) * in_chans
        if std is None:
            std = (1.0,) * in_chans
        if len(mean) != in_chans or len(std) != in_chans or min(std) <= 0:
            raise ValueError(f"mean {list(mean)} and std {list(std)} need {in_chans} values (std > 0)")
        # Buffers (they follow the model's device) but not in the state_dict (the original's keys).
        self.register_normalization(mean, std)

        # 1. shallow features
        self.conv_first = nn.Conv2d(in_chans, embed_dim, 3, 1, 1)

        # 2. deep features: RSTBs, norm, conv (the long skip is added in forward)
        self.num_layers = len(depths)
        self.embed_dim = self.num_features = embed_dim
        self.ape = ape
        self.patch_norm = patch_norm
        self.mlp_ratio = mlp_ratio
        self.patches_resolution = [img_size, img_size] if isinstance(img_size, int) else list(img_size)
        self.patch_embed = PatchEmbed(embed_dim, norm_layer if patch_norm else None)
        if ape:
            num_patches = self.patches_resolution[0] * self.patches_resolution[1]
            self.absolute_pos_embed = nn.Parameter(torch.zeros(1, num_patches, embed_dim))
            trunc_normal_(self.absolute_pos_embed, std=0.02)
        self.pos_drop = nn.Dropout(p=drop_rate)
        drop_path_per_block = torch.linspace(0, drop_path_rate, sum(depths)).tolist()  # stochastic depth decay
        self.layers = nn.ModuleList()
        for i, (depth, heads) in enumerate(zip(depths, num_heads)):
            first = sum(depths[:i])
            self.layers.append(RSTB(dim=embed_dim, input_resolution=tuple(self.patches_resolution), depth=depth,
                                    num_heads=heads, window_size=window_size, mlp_ratio=mlp_ratio,
                                    qkv_bias=qkv_bias, qk_scale=qk_scale, drop=drop_rate, attn_drop=attn_drop_rate,
                                    drop_path=drop_path_per_block[first:first + depth], norm_layer=norm_layer,
                                    use_checkpoint=use_checkpoint, img_size=img_size, patch_size=patch_size,
                                    resi_connection=resi_connection))
        self.norm = norm_layer(self.num_features)
        self.conv_after_body = residual_conv(embed_dim, resi_connection)

        # 3. reconstruction
        if upsampler == "pixelshuffle":
            self.conv_before_upsample = nn.Sequential(nn.Conv2d(embed_dim, num_feat, 3, 1, 1), nn.LeakyReLU(inplace=True))
            self.upsample = Upsample(upscale, num_feat)
            self.conv_last = nn.Conv2d(num_feat, num_out_ch, 3, 1, 1)
        elif upsampler == "pixelshuffledirect":
            self.upsample = UpsampleOneStep(upscale, embed_dim, num_out_ch, tuple(self.patches_resolution))
        elif upsampler == "nearest+conv":
            if upscale not in (2, 4):  # the original supports x4, SuperBench added x2
                raise ValueError(f"upscale {upscale} is not supported by upsampler 'nearest+conv': use 2 or 4")
            self.conv_before_upsample = nn.Sequential(nn.Conv2d(embed_dim, num_feat, 3, 1, 1), nn.LeakyReLU(inplace=True))
            self.conv_up1 = nn.Conv2d(num_feat, num_feat, 3, 1, 1)
            if upscale == 4:
                self.conv_up2 = nn.Conv2d(num_feat, num_feat, 3, 1, 1)
            self.conv_hr = nn.Conv2d(num_feat, num_feat, 3, 1, 1)
            self.conv_last = nn.Conv2d(num_feat, num_out_ch, 3, 1, 1)
            self.lrelu = nn.LeakyReLU(negative_slope=0.2, inplace=True)
        else:  # no upsampling (denoising, artefact removal): the output is a residual on the input
            self.conv_last = nn.Conv2d(embed_dim, num_out_ch, 3, 1, 1)

        self.apply(init_transformer_weights)
        self.register_load_state_dict_pre_hook(_strip_wrapper_prefixes)

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        return {"absolute_pos_embed"}

    @torch.jit.ignore
    def no_weight_decay_keywords(self) -> set[str]:
        return {"relative_position_bias_table"}

    def swin_blocks(self) -> list[nn.Module]:
        """Every Swin transformer block, in order (the "block" unit of AC and FSDP)."""
        return [block for layer in self.layers for block in layer.residual_group.blocks]

    def blocks(self) -> list[nn.Module]:
        """The uniform units every model exposes to the techniques: here the Swin blocks."""
        return self.swin_blocks()

    def rstb_layers(self) -> list[nn.Module]:
        """The residual Swin transformer blocks (the "layer" unit of AC and FSDP)."""
        return list(self.layers)

    def pad_to_window(self, x: torch.Tensor) -> torch.Tensor:
        """Reflect-pad bottom/right to a window multiple (replicate where a side is too short to reflect)."""
        h, w = x.shape[-2:]
        pad_h, pad_w = -h % self.window_size, -w % self.window_size
        if not (pad_h or pad_w):
            return x
        mode = "reflect" if pad_h < h and pad_w < w else "replicate"
        return F.pad(x, (0, pad_w, 0, pad_h), mode=mode)

    def _embed(self, shallow: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(shallow)
        if self.ape:
            if x.shape[1] != self.absolute_pos_embed.shape[1]:
                raise ValueError(f"ape=True needs inputs padded to img_size {self.patches_resolution}, "
                                 f"got {list(shallow.shape[2:])}")
            x = x + self.absolute_pos_embed
        return self.pos_drop(x)

    def _normalise(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 (bf16 would round 278.39 K to 278.0 K), then cast to the weights' dtype.
        x = (x.to(torch.promote_types(x.dtype, torch.float32)) - self.data_mean) / self.data_std * self.img_range
        x = self.pad_to_window(x).to(self.conv_first.weight.dtype)
        # Channels-last makes token <-> image conversions views instead of copies.
        return x.contiguous(memory_format=torch.channels_last)

    def stem(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Physical input -> (tokens, shallow features, input): what the first RSTB takes, the long skip
        (the RSTBs pass it on untouched) and the input, whose size the tail crops back to.

        ``forward`` = stem, ``run_block`` for each RSTB, tail.
        """
        if x.dim() != 4 or x.shape[1] != self.in_chans:
            raise ValueError(f"SwinIR expects (batch, {self.in_chans}, height, width) input, got {tuple(x.shape)}")
        shallow = self.conv_first(self._normalise(x))
        return self._embed(shallow), shallow, x

    @staticmethod
    def run_block(layer: nn.Module, carry: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        tokens, shallow, x = carry
        return layer(tokens, shallow.shape[-2:]), shallow, x

    def tail(self, tokens: torch.Tensor, shallow: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Tokens after the last RSTB -> the upsampled field in physical units."""
        out_dtype = torch.promote_types(x.dtype, torch.float32)
        deep = tokens_to_image(self.norm(tokens), shallow.shape[-2:])
        body = self.conv_after_body(deep) + shallow  # the long skip
        if self.upsampler == "pixelshuffle":
            out = self.conv_last(self.upsample(self.conv_before_upsample(body)))
        elif self.upsampler == "pixelshuffledirect":
            out = self.upsample(body)
        elif self.upsampler == "nearest+conv":
            out = self.conv_before_upsample(body)
            out = self.lrelu(self.conv_up1(F.interpolate(out, scale_factor=2, mode="nearest")))
            if self.upscale == 4:
                out = self.lrelu(self.conv_up2(F.interpolate(out, scale_factor=2, mode="nearest")))
            out = self.conv_last(self.lrelu(self.conv_hr(out)))
        else:
            out = self._normalise(x) + self.conv_last(body)
        scale = 1 if self.upsampler == "" else self.upscale
        out = out[:, :, :x.shape[-2] * scale, :x.shape[-1] * scale].to(out_dtype)
        return (out / self.img_range * self.data_std + self.data_mean).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        carry = self.stem(x)
        for layer in self.layers:
            carry = self.run_block(layer, carry)
        return self.tail(*carry)


def _strip_wrapper_prefixes(module, state_dict, prefix, *args) -> None:
    """Accept state_dicts saved from DataParallel/DDP (``module.``) or torch.compile (``_orig_mod.``)."""
    for key in list(state_dict):
        rest = key[len(prefix):] if key.startswith(prefix) else None
        stripped = rest
        while stripped is not None and stripped.startswith(("module.", "_orig_mod.")):
            stripped = stripped.split(".", 1)[1]
        if stripped != rest:
            state_dict[prefix + stripped] = state_dict.pop(key)


def build(img_size, in_chans: int, upscale: int, mean: Sequence[float], std: Sequence[float], embed_dim: int = 180,
          depths: Sequence[int] = (6, 6, 6, 6, 6, 6), num_heads: Sequence[int] = (6, 6, 6, 6, 6, 6),
          window_size: int = 8, mlp_ratio: float = 2.0, qkv_bias: bool = True, drop_path_rate: float = 0.1,
          img_range: float = 1.0, upsampler: str = "pixelshuffle", resi_connection: str = "1conv") -> SwinIR:
    """SwinIR from the data's keys and the config's model_args, whose defaults are NREL's SwinIR for ERA5 (the name
    ``swinir`` stands for this function: models/__init__.py). embed_dim: channels of the token embedding; depths:
    Swin blocks of each residual group (RSTB); num_heads: attention heads in each; window_size: side of the
    attention window in tokens; mlp_ratio: hidden width of the MLP relative to embed_dim; qkv_bias: bias in the
    query/key/value projection; drop_path_rate: stochastic depth (0 makes runs comparable step by step);
    img_range: scale of the normalised input; upsampler: pixelshuffle, pixelshuffledirect, nearest+conv or "" (none);
    resi_connection: 1conv or 3conv at the end of each RSTB."""
    return SwinIR(img_size=img_size, in_chans=in_chans, upscale=upscale, embed_dim=embed_dim, depths=depths,
                  num_heads=num_heads, window_size=window_size, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias,
                  drop_path_rate=drop_path_rate, img_range=img_range, upsampler=upsampler,
                  resi_connection=resi_connection, mean=mean, std=std)
