"""A model the project never described: a small 2-D Fourier neural operator, for the traced memory estimate.

Lifting 1x1 convolution, spectral blocks (``torch.fft.rfft2``, the lowest modes of both latitude ends multiplied by
complex weights, ``irfft2``, plus a 1x1 skip and GELU), a two-layer 1x1 projection. Its complex weights are stored as
real tensors (``torch.view_as_real``'s layout, last dimension 2) and viewed back in forward: what fused AdamW and
FSDP2 need. ``blocks()`` are its spectral blocks (activation checkpointing and FSDP units).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class SpectralConv2d(nn.Module):
    def __init__(self, channels: int, modes: int):
        super().__init__()
        self.modes = modes
        scale = 1.0 / channels
        # (in, out, modes, modes, real/imaginary) for the low rows and the high (negative-frequency) rows.
        self.low = nn.Parameter(scale * torch.randn(channels, channels, modes, modes, 2))
        self.high = nn.Parameter(scale * torch.randn(channels, channels, modes, modes, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        height, width, m = x.shape[-2], x.shape[-1], self.modes
        spectrum = torch.fft.rfft2(x.float())  # (no half-precision FFT on the CPU)
        out = torch.zeros_like(spectrum)
        mix = "bixy,ioxy->boxy"
        out[..., :m, :m] = torch.einsum(mix, spectrum[..., :m, :m], torch.view_as_complex(self.low))
        out[..., -m:, :m] = torch.einsum(mix, spectrum[..., -m:, :m], torch.view_as_complex(self.high))
        return torch.fft.irfft2(out, s=(height, width))


class SpectralBlock(nn.Module):
    def __init__(self, channels: int, modes: int):
        super().__init__()
        self.spectral = SpectralConv2d(channels, modes)
        self.skip = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.spectral(x) + self.skip(x))


class SpectralNet(nn.Module):
    """(batch, channels, height, width) -> the same shape."""

    def __init__(self, channels: int = 3, width: int = 16, modes: int = 4, depth: int = 3):
        super().__init__()
        self.lift = nn.Conv2d(channels, width, 1)
        self.layers = nn.ModuleList(SpectralBlock(width, modes) for _ in range(depth))
        self.project = nn.Sequential(nn.Conv2d(width, 2 * width, 1), nn.GELU(), nn.Conv2d(2 * width, channels, 1))

    def blocks(self) -> list[nn.Module]:
        return list(self.layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.lift(x)
        for layer in self.layers:
            x = layer(x)
        return self.project(x)
