"""What both models share: per-channel normalisation inside the model, and the transformer weight init."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn as nn

from .layers import trunc_normal_


def init_transformer_weights(m: nn.Module) -> None:
    """Linear: truncated normal (std 0.02), zero bias; LayerNorm: weight 1, bias 0 (SwinIR's and ViT's init)."""
    if isinstance(m, nn.Linear):
        trunc_normal_(m.weight, std=0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.LayerNorm):
        nn.init.zeros_(m.bias)
        nn.init.ones_(m.weight)


class PhysicalUnitsModel(nn.Module):
    """A model whose inputs and outputs are in physical units: it keeps the per-channel mean and std
    as fp32 buffers (``data_mean``, ``data_std``, shape (1, C, 1, 1); the outputs' ``target_mean``,
    ``target_std``), outside the state_dict (they come from the config), and rebuilds them in fp32
    after any cast or move."""

    def register_normalization(self, mean: Sequence[float], std: Sequence[float],
                               out_mean: Optional[Sequence[float]] = None,
                               out_std: Optional[Sequence[float]] = None) -> None:
        """``out_mean``/``out_std``: the outputs', where they are other channels than the inputs (a diagnostic
        model); empty or None: the inputs'."""
        self.mean_values, self.std_values = tuple(map(float, mean)), tuple(map(float, std))
        self.out_mean_values = tuple(map(float, out_mean)) if out_mean else self.mean_values
        self.out_std_values = tuple(map(float, out_std)) if out_std else self.std_values
        for name, values in self._normalization().items():
            self.register_buffer(name, self._channel_constant(values), persistent=False)

    def _normalization(self) -> dict[str, tuple[float, ...]]:
        return {"data_mean": self.mean_values, "data_std": self.std_values,
                "target_mean": self.out_mean_values, "target_std": self.out_std_values}

    @staticmethod
    def _channel_constant(values: Sequence[float], device=None) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device).view(1, -1, 1, 1)

    def _apply(self, fn, recurse=True):
        # model.to(torch.bfloat16) must not round the physical mean/std (278.39 K -> 278.0 K), and
        # to_empty() (meta-device init) must not lose them.
        super()._apply(fn, recurse)
        device = self.data_mean.device
        for name, values in self._normalization().items():
            setattr(self, name, self._channel_constant(values, device))
        return self
