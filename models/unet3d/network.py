"""Part III: NERSC SC22's 3-D U-Net, mapping N-body dark-matter fields to hydrodynamic gas fields
(Harrington et al. 2021, arXiv:2106.12662).

The architecture of the SC22 tutorial (networks/UNet.py, config/UNet.yaml of NERSC/sc22-dl-tutorial):
each down block is Conv3d(kernel 4, stride 2, padding 1) + LeakyReLU (slope 0.01), widths 64, 128,
256, 512, 512 (and a sixth 512 level with ``full_scale``), halving the side each time; each up block is
ConvTranspose3d(4, 2, 1) + ReLU, its output concatenated with the down block of the same size
([upsampled, skip]); a last ConvTranspose3d back to the input size, then tanh (the data are stored
scaled into (-1, 1)). No normalisation layers, no dropout; convolution weights normal(0, 0.02),
biases 0. The activations work in place, as SC22's: each overwrites its convolution's output, which
backward does not need (a convolution keeps its input), so a level holds one tensor for backward, not two.
A side must be divisible by 2 ** levels (64 with full_scale: 6 levels).

Inputs and outputs are the stored fields themselves (no normalisation inside, unlike SwinIR and the
ViT): SC22's files hold log-densities over 14 and scaled velocities, already in the range of tanh.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

SC22_WIDTHS = (64, 128, 256, 512, 512)
CONV_STD = 0.02  # SC22's weight_init: conv_scale


def _down(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv3d(c_in, c_out, 4, stride=2, padding=1), nn.LeakyReLU(0.01, inplace=True))


def _up(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.ConvTranspose3d(c_in, c_out, 4, stride=2, padding=1), nn.ReLU(inplace=True))


class UNet3D(nn.Module):
    """(B, in_chans, D, H, W) -> (B, out_chans, D, H, W) in (-1, 1)."""

    def __init__(self, in_chans: int = 4, out_chans: int = 5, widths: Sequence[int] = SC22_WIDTHS,
                 full_scale: bool = True):
        super().__init__()
        widths = list(widths) + ([widths[-1]] if full_scale else [])
        self.in_chans, self.out_chans, self.levels = in_chans, out_chans, len(widths)
        self.down = nn.ModuleList(_down(c_in, c_out) for c_in, c_out in zip([in_chans, *widths[:-1]], widths))
        # Up block i (deepest first) maps to the width of down level i - 1; from the second on, its input
        # is the previous up block's output concatenated with that level's skip (twice the width).
        self.up = nn.ModuleList(_up(widths[i] * (1 if i == len(widths) - 1 else 2), widths[i - 1])
                                for i in range(len(widths) - 1, 0, -1))
        self.last = nn.ConvTranspose3d(2 * widths[0], out_chans, 4, stride=2, padding=1)
        for module in self.modules():
            if isinstance(module, (nn.Conv3d, nn.ConvTranspose3d)):
                nn.init.normal_(module.weight, 0.0, CONV_STD)
                nn.init.zeros_(module.bias)

    def blocks(self) -> list[nn.Module]:
        """The uniform units of the techniques (AC, compile, FSDP): every down and up block."""
        return [*self.down, *self.up]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        side = 2 ** self.levels
        if x.dim() != 5 or x.shape[1] != self.in_chans or any(s % side for s in x.shape[2:]):
            raise ValueError(f"UNet3D takes (batch, {self.in_chans}, D, H, W) with sides divisible by 2**{self.levels} "
                             f"= {side}, got {tuple(x.shape)}")
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
        skips.pop()  # the deepest output is the up path's input, not a skip
        for block in self.up:
            x = torch.cat([block(x), skips.pop()], dim=1)
        return torch.tanh(self.last(x))
