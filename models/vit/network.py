"""The ViT weather forecaster of NERSC's "Deep Learning at Scale" tutorials (SC23-SC25, DL4SCI25).

Input: the atmosphere at time t, (batch, C, H, W) in physical units; output: the same fields at
t + lead (six hours on NERSC's data), also in physical units. The architecture, as theirs:

    per-channel normalisation -> Conv2d patch embedding (kernel = stride = patch) -> + learned
    position embedding (no class token) -> depth x pre-norm transformer block -> LayerNorm ->
    Linear(D, C*p*p, no bias) -> unpatchify -> de-normalisation

A block is ``x + proj(SDPA(q(LN(x)), k(LN(x)), v(LN(x))))`` then ``x + fc2(GELU(fc1(LN(x))))``,
LayerNorm eps 1e-6, separate q, k and v linears with bias, MLP width 4D, no dropout. With 20
channels, 360x720 fields and patch 8 (4050 tokens): embed 384, depth 12, 8 heads -> 23.8M
parameters (1.56M of them the position embedding); embed 1024 -> 157.9M; embed 1536 -> 350.1M.

What this module adds to theirs, without changing the arithmetic:
  * the normalisation is inside the model (mean/std buffers, always applied in fp32, as SwinIR
    does), so data, loss and metrics stay in physical units;
  * a clear error when the input is not the size the position embedding was made for;
  * attention takes its head count from the width of q (width // head_dim) and the number of keys
    from k, so a tensor-parallel plan that splits q, k, v column-wise (whole heads per rank) and a
    context-parallel one that gathers the keys and values of other ranks need no change here;
  * ``blocks()`` exposes the transformer blocks for activation checkpointing, torch.compile and
    FSDP2, applied from outside (utils/parallel/techniques.py).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.common import PhysicalUnitsModel, init_transformer_weights
from models.layers import DropPath, Mlp, trunc_normal_

LAYER_NORM_EPS = 1e-6


class Attention(nn.Module):
    """Multi-head self-attention with separate q, k, v projections and SDPA."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"embed_dim {dim} is not divisible by num_heads {num_heads}")
        self.head_dim = dim // num_heads
        self.q = nn.Linear(dim, dim, bias=qkv_bias)
        self.k = nn.Linear(dim, dim, bias=qkv_bias)
        self.v = nn.Linear(dim, dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # (B, n, h*hd) -> (B, h, n, hd); h and n from t
            return t.view(B, t.shape[1], -1, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)))
        return self.proj(out.transpose(1, 2).reshape(B, N, -1))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, qkv_bias: bool = True,
                 drop_path: float = 0.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=LAYER_NORM_EPS)
        self.attn = Attention(dim, num_heads, qkv_bias)
        self.norm2 = nn.LayerNorm(dim, eps=LAYER_NORM_EPS)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=nn.GELU)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x)))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class ViT(PhysicalUnitsModel):
    """NERSC's ViT forecaster; ``img_size`` (H, W) must be divisible by ``patch_size``. ``out_mean``/``out_std``: the
    outputs' statistics where they are other channels than the inputs (a diagnostic model: as many outputs as
    values); empty: it outputs the ``in_chans`` input channels."""

    def __init__(self, img_size: int | Sequence[int] = (360, 720), patch_size: int = 8, in_chans: int = 20,
                 embed_dim: int = 384, depth: int = 12, num_heads: int = 8, mlp_ratio: float = 4.0,
                 qkv_bias: bool = True, drop_path_rate: float = 0.0,
                 mean: Optional[Sequence[float]] = None, std: Optional[Sequence[float]] = None,
                 out_mean: Optional[Sequence[float]] = None, out_std: Optional[Sequence[float]] = None):
        super().__init__()
        height, width = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
        if height % patch_size or width % patch_size:
            raise ValueError(f"img_size {height}x{width} is not divisible by patch_size {patch_size}")
        self.img_size, self.patch_size, self.in_chans = (height, width), patch_size, in_chans
        self.grid = (height // patch_size, width // patch_size)
        num_tokens = self.grid[0] * self.grid[1]

        mean = (0.0,) * in_chans if mean is None else tuple(map(float, mean))
        std = (1.0,) * in_chans if std is None else tuple(map(float, std))
        if len(mean) != in_chans or len(std) != in_chans or min(std) <= 0:
            raise ValueError(f"mean {list(mean)} and std {list(std)} need {in_chans} values (std > 0)")
        out_mean, out_std = tuple(out_mean or ()), tuple(out_std or ())
        if len(out_mean) != len(out_std) or (out_std and min(out_std) <= 0):
            raise ValueError(f"out_mean {list(out_mean)} and out_std {list(out_std)} need as many values (std > 0)")
        self.out_chans = len(out_mean) or in_chans
        self.register_normalization(mean, std, out_mean, out_std)  # constants from the config, not learned

        self.patch_embed = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)
        self.pos_embed = nn.Parameter(torch.zeros(1, num_tokens, embed_dim))
        drop_path = [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]  # stochastic depth decay
        self.transformer = nn.ModuleList(
            Block(embed_dim, num_heads, mlp_ratio, qkv_bias, drop_path[i]) for i in range(depth))
        self.norm = nn.LayerNorm(embed_dim, eps=LAYER_NORM_EPS)
        self.head = nn.Linear(embed_dim, self.out_chans * patch_size**2, bias=False)

        trunc_normal_(self.pos_embed, std=0.02)
        self.apply(init_transformer_weights)

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        return {"pos_embed"}

    def blocks(self) -> list[nn.Module]:
        """The transformer blocks, in order (the unit of activation checkpointing, compile and FSDP)."""
        return list(self.transformer)

    def unpatchify(self, x: torch.Tensor) -> torch.Tensor:
        """(B, tokens, p*p*C) -> (B, C, H, W); each token's vector is laid out (p, p, C)."""
        B, p, (h, w) = x.shape[0], self.patch_size, self.grid
        x = x.reshape(B, h, w, p, p, self.out_chans)
        return torch.einsum("bhwpqc->bchpwq", x).reshape(B, self.out_chans, h * p, w * p)

    def stem(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        """Physical input (B, C, H, W) -> (tokens,): what the first block takes (``forward`` = stem, blocks, tail)."""
        if x.dim() != 4 or x.shape[1] != self.in_chans or tuple(x.shape[2:]) != self.img_size:
            raise ValueError(f"this ViT takes (batch, {self.in_chans}, {self.img_size[0]}, {self.img_size[1]}) "
                             f"(its position embedding is sized for img_size), got {tuple(x.shape)}")
        # Normalise in fp32 (bf16 would round 278.39 K to 278.0 K), then cast to the weights' dtype.
        x = ((x.to(torch.promote_types(x.dtype, torch.float32)) - self.data_mean) / self.data_std)
        x = self.patch_embed(x.to(self.patch_embed.weight.dtype)).flatten(2).transpose(1, 2)
        return (x + self.pos_embed,)  # (B, tokens, D)

    @staticmethod
    def run_block(block: nn.Module, carry: tuple[torch.Tensor]) -> tuple[torch.Tensor]:
        return (block(carry[0]),)

    def tail(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens after the last block -> the forecast (or the diagnosed fields) in physical units (fp32)."""
        x = self.unpatchify(self.head(self.norm(x))).to(torch.promote_types(x.dtype, torch.float32))
        return x * self.target_std + self.target_mean

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        carry = self.stem(x)
        for block in self.transformer:
            carry = self.run_block(block, carry)
        return self.tail(*carry)


def build(img_size, in_chans: int, mean: Sequence[float], std: Sequence[float], out_mean: Sequence[float] = (),
          out_std: Sequence[float] = (), patch_size: int = 8, embed_dim: int = 384, depths: Sequence[int] = (12,),
          num_heads: Sequence[int] = (8,), mlp_ratio: float = 4.0, qkv_bias: bool = True,
          drop_path_rate: float = 0.0) -> ViT:
    """The ViT from the data's keys and the config's model_args, whose defaults are NERSC's ViT (the name ``vit``
    stands for this function: models/__init__.py). patch_size: side of the square patch each token embeds;
    embed_dim: channels of a token; depths and num_heads: one entry each, as its one stage (transformer blocks, and
    attention heads in each); mlp_ratio: hidden width of the MLP relative to embed_dim; qkv_bias: bias in the
    query/key/value projection; drop_path_rate: stochastic depth."""
    return ViT(img_size=img_size, patch_size=patch_size, in_chans=in_chans, embed_dim=embed_dim, depth=depths[0],
               num_heads=num_heads[0], mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, drop_path_rate=drop_path_rate,
               mean=mean, std=std, out_mean=out_mean, out_std=out_std)
