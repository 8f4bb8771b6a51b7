"""A small Fourier neural operator (FNO-2D) for the forecast task: a model of your own, outside the repository's
models/, plugged in by the config beside it (fno.yaml: ``model_class: fno:FNO2d``). docs/part4-your-model.md walks
it through every script.

Li et al.'s operator (arXiv 2010.08895): lift each grid point's channels to ``width`` with a 1x1 convolution, then
``layers`` Fourier layers, each the sum of a spectral convolution (the field's lowest ``modes`` x ``modes``
frequencies times learned complex weights, back to the grid) and a 1x1 convolution, then GELU; project back to the
channels. It forecasts the next state as the input plus a learned increment.

What makes it a model of this project, the contract (docs/part4-your-model.md):
- it takes ``in_chans`` and the data's ``mean`` and ``std`` by name and normalises inside (the forecast task feeds
  physical units: z500 ~5e4), here with models/common.py's PhysicalUnitsModel;
- its spectral weights are complex parameters, as neuraloperator's FNO keeps them: ``build_model`` stores each as
  its real view, which fused AdamW, FSDP2 and DCP take, and the layer still reads a complex tensor;
- ``blocks()`` returns its Fourier layers: the units of activation checkpointing, torch.compile and FSDP2, as its
  plan, declared below with ``register_plan``, says. It has no tensor-parallel, context-parallel or pipeline plan:
  those scripts refuse it in one line.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from models.common import PhysicalUnitsModel
from utils.parallel.plans import ModelPlan, register_plan


class SpectralConv2d(nn.Module):
    """The field's lowest modes x modes frequencies (both signs of the first axis), each mixed across channels by
    a complex weight; the other frequencies are dropped."""

    def __init__(self, width: int, modes: int):
        super().__init__()
        self.modes = modes
        scale = 1.0 / (width * width)
        # Two corners of the rfft2 spectrum: frequencies 0..modes-1 and -modes..-1 along the first axis.
        self.weights = nn.Parameter(scale * torch.randn(2, width, width, modes, modes, dtype=torch.cfloat))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        height, width_px = x.shape[-2:]
        spectrum = torch.fft.rfft2(x.float(), norm="ortho")
        weights = self.weights
        m = min(self.modes, height // 2, width_px // 2 + 1)
        out = torch.zeros_like(spectrum)
        out[..., :m, :m] = torch.einsum("bixy,ioxy->boxy", spectrum[..., :m, :m], weights[0, :, :, :m, :m])
        out[..., -m:, :m] = torch.einsum("bixy,ioxy->boxy", spectrum[..., -m:, :m], weights[1, :, :, :m, :m])
        return torch.fft.irfft2(out, s=(height, width_px), norm="ortho").to(x.dtype)


class FourierLayer(nn.Module):
    def __init__(self, width: int, modes: int):
        super().__init__()
        self.spectral = SpectralConv2d(width, modes)
        self.pointwise = nn.Conv2d(width, width, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.spectral(x) + self.pointwise(x))


class FNO2d(PhysicalUnitsModel):
    """(B, in_chans, H, W) in physical units -> the same shape, the state ``lead`` steps later; any H, W."""

    def __init__(self, in_chans: int, mean: Sequence[float], std: Sequence[float], width: int = 32,
                 modes: int = 12, layers: int = 4):
        super().__init__()
        if width < 1 or modes < 1 or layers < 1:
            raise ValueError(f"width, modes and layers must be >= 1, got {width}, {modes}, {layers}")
        self.register_normalization(mean, std)
        self.lift = nn.Conv2d(in_chans, width, kernel_size=1)
        self.layers = nn.ModuleList(FourierLayer(width, modes) for _ in range(layers))
        self.project = nn.Sequential(nn.Conv2d(width, 2 * width, 1), nn.GELU(), nn.Conv2d(2 * width, in_chans, 1))

    def blocks(self) -> list[nn.Module]:
        return list(self.layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normalized = (x - self.data_mean) / self.data_std  # in fp32, before any cast (278.39 K stays 278.39 K)
        h = self.lift(normalized.to(self.lift.weight.dtype))
        for layer in self.layers:
            h = layer(h)
        increment = self.project(h).float()
        return (normalized + increment) * self.data_std + self.data_mean


# The plan, beside the model: AC, compile and FSDP2 wrap each Fourier layer. (Without this line the units would
# come from blocks() all the same; a model that has tensor-parallel or pipeline plans declares them here too.)
register_plan(FNO2d, ModelPlan(units={"block": lambda model: model.blocks()}))
