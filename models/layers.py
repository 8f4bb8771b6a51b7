"""What both transformers take from timm: stochastic depth, the MLP and the truncated-normal init.

Hand-written, with timm's arithmetic, module names and random-number use (tests/test_vit.py checks
them against ``timm.layers`` output for output, gradient for gradient): importing timm costs each
process about 3.6 s on a 2-core CPU, because its layers import torchvision and with it
``torch._dynamo`` — more than importing torch itself, paid again by every rank of every launch.
"""

from __future__ import annotations

import math

import torch
from torch import nn


@torch.no_grad()
def trunc_normal_(tensor: torch.Tensor, std: float = 1.0, a: float = -2.0, b: float = 2.0) -> torch.Tensor:
    """Fill ``tensor`` with N(0, std) truncated to [a, b] (absolute bounds), drawn as timm draws it: the
    inverse CDF of a uniform sample. (torch 2.15's nn.init.trunc_normal_ draws other numbers, which
    would change every initial weight and so every figure these pages quote.)"""
    cdf = lambda v: (1.0 + math.erf(v / std / math.sqrt(2.0))) / 2.0  # noqa: E731
    tensor.uniform_(2 * cdf(a) - 1, 2 * cdf(b) - 1)
    tensor.erfinv_()
    tensor.mul_(std * math.sqrt(2.0))
    return tensor.clamp_(min=a, max=b)


class DropPath(nn.Module):
    """Stochastic depth: zero the residual branch of whole samples with probability ``drop_prob`` in
    training, scaling the kept ones by 1 / (1 - drop_prob)."""

    def __init__(self, drop_prob: float = 0.0):
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep = 1 - self.drop_prob
        mask = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(keep)  # one draw per sample
        if keep > 0.0:
            mask.div_(keep)
        return x * mask

    def extra_repr(self) -> str:
        return f"drop_prob={self.drop_prob:.3f}"


class Mlp(nn.Module):
    """fc1 -> activation -> dropout -> fc2 -> dropout (timm's names: fc1 and fc2 are what tensor
    parallelism splits column- and row-wise)."""

    def __init__(self, in_features: int, hidden_features: int, act_layer: type[nn.Module] = nn.GELU,
                 drop: float = 0.0):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = act_layer()
        self.drop1 = nn.Dropout(drop)
        self.norm = nn.Identity()  # timm's optional norm: kept so that module and checkpoint keys match timm's
        self.fc2 = nn.Linear(hidden_features, in_features)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop2(self.fc2(self.norm(self.drop1(self.act(self.fc1(x))))))
