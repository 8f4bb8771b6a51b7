"""Validation scores over a whole validation set, independent of how it is batched or sharded.

- :class:`RMSEAccumulator` gives per-channel (optionally latitude-weighted) RMSE over a whole
  validation set and all ranks; :class:`ACCAccumulator` the anomaly correlation of forecasts;
  :class:`L1Accumulator` per-channel mean absolute errors. Each sums in float64 and divides once at the end.
- :func:`latitude_weights`: cos(latitude) weights of the grid rows; :func:`bicubic_upsample`: the bicubic
  baseline a super-resolution model is compared with.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

# ------------------------------------------------------------------------------------ RMSE, ACC, L1


class RMSEAccumulator:
    """Per-channel RMSE over a whole validation set, independent of how it is batched or sharded.

    Accumulates the (weighted) sum of squared errors and the sum of weights per channel in float64;
    the RMSE is taken once at the end, never averaged over batches. ``row_weights`` (H,) weight the
    latitude rows (forecasting: cos-latitude, mean 1); None weighs every pixel alike.
    """

    def __init__(self, channels: int, device="cpu", row_weights: Optional[torch.Tensor] = None):
        self.channels = channels
        # Row 0: sum of squared errors, row 1: sum of weights; one tensor -> one all_reduce.
        self._sums = torch.zeros(2, channels, dtype=torch.float64, device=device)
        self._weights = None if row_weights is None else row_weights.to(device, torch.float64).view(1, 1, -1, 1)

    def reset(self) -> None:
        self._sums.zero_()

    def update(self, pred: torch.Tensor, target: torch.Tensor) -> None:
        """Add a batch: ``pred`` and ``target`` of shape (B, C, H, W) in the same units."""
        if pred.shape != target.shape or pred.dim() != 4 or pred.shape[1] != self.channels:
            raise ValueError(
                f"RMSEAccumulator({self.channels} channels) needs pred and target of equal shape "
                f"(B, {self.channels}, H, W); got {tuple(pred.shape)} and {tuple(target.shape)}"
            )
        error = pred.detach().to(self._sums.device, torch.float64) - target.detach().to(self._sums.device, torch.float64)
        squared = error.square()
        if self._weights is None:
            self._sums[1] += pred[:, 0].numel()
        else:
            if self._weights.shape[2] != pred.shape[2]:
                raise ValueError(f"RMSEAccumulator: {self._weights.shape[2]} row weights for {pred.shape[2]} rows")
            squared = squared * self._weights
            self._sums[1] += self._weights.sum() * pred.shape[0] * pred.shape[3]
        self._sums[0] += squared.sum(dim=(0, 2, 3))

    def compute(self, all_reduce: bool = False) -> list[float]:
        """Per-channel RMSE. ``all_reduce=True`` sums over all ranks first (every rank must call it;
        a no-op without an initialised process group). The accumulator itself is not changed."""
        sums = _summed(self._sums, all_reduce)
        if (sums[1] == 0).any():
            raise ValueError("RMSEAccumulator.compute: no samples were added (empty validation set?)")
        return torch.sqrt(sums[0] / sums[1]).tolist()


class ACCAccumulator:
    """Anomaly correlation coefficient per channel, averaged over samples (as WeatherBench and FourCastNet).

    For each sample and channel, with anomalies against the climatology ``clim`` (C, H, W) and
    latitude weights w: ``sum(w f' a') / sqrt(sum(w f'^2) sum(w a'^2))``, f' = forecast - clim,
    a' = truth - clim (uncentred). 1 is a perfect pattern, 0 no skill; a sample whose forecast
    anomaly is zero everywhere (the climatology forecast itself) counts as 0.
    """

    def __init__(self, climatology: torch.Tensor, row_weights: torch.Tensor, device="cpu"):
        self.climatology = climatology.to(device, torch.float64)
        self.channels = climatology.shape[0]
        self._weights = row_weights.to(device, torch.float64).view(1, 1, -1, 1)
        self._sums = torch.zeros(2, self.channels, dtype=torch.float64, device=device)  # sum of ACC, samples

    def update(self, pred: torch.Tensor, target: torch.Tensor) -> None:
        if pred.shape != target.shape or pred.shape[1:] != self.climatology.shape:
            raise ValueError(f"ACCAccumulator: pred and target must be (B, {', '.join(map(str, self.climatology.shape))}), "
                             f"got {tuple(pred.shape)} and {tuple(target.shape)}")
        f = pred.detach().to(self._sums.device, torch.float64) - self.climatology
        a = target.detach().to(self._sums.device, torch.float64) - self.climatology
        w = self._weights
        numerator = (w * f * a).sum(dim=(2, 3))
        denominator = torch.sqrt((w * f * f).sum(dim=(2, 3)) * (w * a * a).sum(dim=(2, 3)))
        acc = torch.where(denominator > 0, numerator / denominator.clamp_min(1e-300), torch.zeros_like(numerator))
        self._sums[0] += acc.sum(dim=0)
        self._sums[1] += pred.shape[0]

    def compute(self, all_reduce: bool = False) -> list[float]:
        sums = _summed(self._sums, all_reduce)
        if (sums[1] == 0).any():
            raise ValueError("ACCAccumulator.compute: no samples were added (empty validation set?)")
        return (sums[0] / sums[1]).tolist()


class L1Accumulator:
    """Per-channel mean absolute error over a whole validation set of (B, C, ...) tensors (2-D fields or 3-D
    volumes), independent of batching and of the number of ranks: sums in float64, divided once at the end."""

    def __init__(self, channels: int, device="cpu"):
        self.channels = channels
        self._sums = torch.zeros(2, channels, dtype=torch.float64, device=device)  # |error| sum, values

    def update(self, pred: torch.Tensor, target: torch.Tensor) -> None:
        if pred.shape != target.shape or pred.dim() < 3 or pred.shape[1] != self.channels:
            raise ValueError(f"L1Accumulator({self.channels} channels) needs pred and target of equal shape "
                             f"(B, {self.channels}, ...); got {tuple(pred.shape)} and {tuple(target.shape)}")
        error = pred.detach().to(self._sums.device, torch.float64) - target.detach().to(self._sums.device, torch.float64)
        self._sums[0] += error.abs().transpose(0, 1).reshape(self.channels, -1).sum(dim=1)
        self._sums[1] += pred[:, 0].numel()

    def compute(self, all_reduce: bool = False) -> list[float]:
        sums = _summed(self._sums, all_reduce)
        if (sums[1] == 0).any():
            raise ValueError("L1Accumulator.compute: no samples were added (empty validation set?)")
        return (sums[0] / sums[1]).tolist()


def _summed(sums: torch.Tensor, all_reduce: bool) -> torch.Tensor:
    sums = sums.clone()
    if all_reduce and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    return sums


def latitude_weights(stored_height: int, rows: Optional[int] = None) -> torch.Tensor:
    """cos(latitude) of the first ``rows`` rows of a grid with ``stored_height`` rows from 90N to 90S
    (both poles included, as ERA5's 721), normalised to mean 1 over those rows."""
    rows = stored_height if rows is None else rows
    if stored_height < 2 or not 0 < rows <= stored_height:
        raise ValueError(f"latitude_weights: need 2 <= stored_height and 0 < rows <= stored_height, got {stored_height}, {rows}")
    lat = torch.deg2rad(90.0 - torch.arange(rows, dtype=torch.float64) * 180.0 / (stored_height - 1))
    weights = torch.cos(lat).clamp_min(0.0)
    return weights / weights.mean()


# ----------------------------------------------------------------------------------------- baseline


def bicubic_upsample(lr: torch.Tensor, factor: int, size: Optional[Sequence[int]] = None) -> torch.Tensor:
    """The bicubic baseline: ``lr`` (B, C, h, w) or (C, h, w) resized to ``size`` (H, W) or (h*factor, w*factor).

    Matches how the data's low-res input is made (bicubic, align_corners=False). Computed and
    returned in at least float32, so half-precision inputs do not degrade the baseline.
    """
    unbatched = lr.dim() == 3
    batch = lr.unsqueeze(0) if unbatched else lr
    if batch.dim() != 4:
        raise ValueError(f"bicubic_upsample needs (B, C, h, w) or (C, h, w), got shape {tuple(lr.shape)}")
    if size is None:
        size = (batch.shape[-2] * factor, batch.shape[-1] * factor)
    batch = batch.to(torch.promote_types(batch.dtype, torch.float32))
    upsampled = F.interpolate(batch, size=tuple(size), mode="bicubic", align_corners=False)
    return upsampled[0] if unbatched else upsampled
