"""Pictures of validation samples, as PNG files written atomically.

:func:`save_sample_png` draws one super-resolution sample next to its bicubic baseline,
:func:`save_forecast_png` one forecast next to persistence, :func:`save_volume_png` a slice of a 3-D
sample (inputs, truth, model, error).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from utils.checkpoint.files import find_run_dir, replaced_atomically, reporting_write_failures


def _as_chw_numpy(tensor: torch.Tensor, name: str):
    if tensor.dim() == 4 and tensor.shape[0] == 1:
        tensor = tensor[0]
    if tensor.dim() != 3:
        raise ValueError(f"save_sample_png: {name} must be (C, H, W), got shape {tuple(tensor.shape)}")
    return tensor.detach().float().cpu().numpy()


def _rmse(a, b) -> float:
    return float(np.sqrt(np.nanmean((a - b) ** 2)))


def save_sample_png(
    path,
    lr: torch.Tensor,
    bicubic: torch.Tensor,
    pred: torch.Tensor,
    hr: torch.Tensor,
    channel_names: Optional[Sequence[str]] = None,
    title: Optional[str] = None,
    panel_width_in: float = 3.0,
    dpi: int = 110,
) -> None:
    """Draw one super-resolution sample: a row per channel; LR input, bicubic, model, HR truth, |model - truth|.

    The four field panels of a row share one colour range (the truth's min..max; values beyond it
    saturate), so they compare at a glance; the error has its own scale from 0. Panel titles give
    the RMSE of bicubic and model against the truth. Written atomically; parent folders are created.
    """
    lr_np, bicubic_np, pred_np, hr_np = (
        _as_chw_numpy(t, n) for t, n in ((lr, "lr"), (bicubic, "bicubic"), (pred, "pred"), (hr, "hr"))
    )
    if not (bicubic_np.shape == pred_np.shape == hr_np.shape) or lr_np.shape[0] != hr_np.shape[0]:
        raise ValueError(
            "save_sample_png: bicubic, pred and hr must have one shape and lr the same channels; got "
            f"lr {lr_np.shape}, bicubic {bicubic_np.shape}, pred {pred_np.shape}, hr {hr_np.shape}"
        )
    channels, height, width = hr_np.shape
    names = _channel_labels(channel_names, channels)
    rows = [(names[c], hr_np[c],
             [(lr_np[c], f"LR input {lr_np.shape[1]}×{lr_np.shape[2]}"),
              (bicubic_np[c], f"bicubic  RMSE {_rmse(bicubic_np[c], hr_np[c]):.4g}"),
              (pred_np[c], f"model  RMSE {_rmse(pred_np[c], hr_np[c]):.4g}"),
              (hr_np[c], f"HR truth {height}×{width}")],
             [(np.abs(pred_np[c] - hr_np[c]), "|model − truth|")])
            for c in range(channels)]
    _save_panels(path, rows, height / width, title, panel_width_in, dpi)


def save_forecast_png(
    path,
    inputs: torch.Tensor,
    truth: torch.Tensor,
    forecast: torch.Tensor,
    channel_names: Optional[Sequence[str]] = None,
    channels: Optional[Sequence[int]] = None,
    title: Optional[str] = None,
    panel_width_in: float = 3.0,
    dpi: int = 110,
) -> None:
    """Draw one forecast: a row per channel in ``channels`` (default: the first two); input (time t),
    truth (t + lead), forecast, then the errors of persistence (input − truth) and of the forecast.

    Input, truth and forecast share the truth's colour range; the two error panels share one
    scale, so the forecast's gain over persistence shows at a glance. Written atomically.
    """
    _save_against_baseline(path, inputs, truth, forecast, ("input (t)", "truth (t + lead)", "forecast", "persistence"),
                           channel_names, channels, title, panel_width_in, dpi)


def save_diagnostic_png(path, baseline: Optional[torch.Tensor], truth: torch.Tensor, model: torch.Tensor,
                        channel_names: Optional[Sequence[str]] = None, channels: Optional[Sequence[int]] = None,
                        title: Optional[str] = None, panel_width_in: float = 3.0, dpi: int = 110) -> None:
    """Draw one diagnosed sample as :func:`save_forecast_png` draws a forecast, the linear-regression baseline in
    the place of the input: baseline, truth, model, and the errors of both (without a baseline: truth, model and
    the model's error)."""
    _save_against_baseline(path, baseline, truth, model, ("linear regression", "truth", "model", "linear regression"),
                           channel_names, channels, title, panel_width_in, dpi)


def _save_against_baseline(path, baseline, truth, prediction, labels: tuple[str, str, str, str], channel_names,
                           channels, title, panel_width_in: float, dpi: int) -> None:
    """A row per channel shown: baseline, truth, prediction, |baseline - truth|, |prediction - truth| (no baseline:
    truth, prediction and its error)."""
    y_np, f_np = _as_chw_numpy(truth, "truth"), _as_chw_numpy(prediction, labels[2])
    b_np = y_np if baseline is None else _as_chw_numpy(baseline, labels[0])
    if not b_np.shape == y_np.shape == f_np.shape:
        raise ValueError(f"{labels[0]}, truth and {labels[2]} must have one shape to be drawn; got "
                         f"{b_np.shape}, {y_np.shape}, {f_np.shape}")
    count, height, width = y_np.shape
    names = _channel_labels(channel_names, count)
    shown = list(channels) if channels is not None else list(range(min(2, count)))
    if not shown or any(not 0 <= c < count for c in shown):
        raise ValueError(f"channels {shown} to draw must be indices of the {count} channels")
    with_baseline = baseline is not None
    rows = [(names[c], y_np[c],
             [(b_np[c], labels[0])] * with_baseline + [(y_np[c], labels[1]), (f_np[c], labels[2])],
             [(np.abs(b_np[c] - y_np[c]), f"|{labels[3]} − truth|  RMSE {_rmse(b_np[c], y_np[c]):.4g}")] * with_baseline
             + [(np.abs(f_np[c] - y_np[c]), f"|{labels[2]} − truth|  RMSE {_rmse(f_np[c], y_np[c]):.4g}")])
            for c in shown]
    _save_panels(path, rows, height / width, title, panel_width_in, dpi)


def save_volume_png(
    path,
    inputs: torch.Tensor,
    pred: torch.Tensor,
    truth: torch.Tensor,
    input_names: Optional[Sequence[str]] = None,
    channel_names: Optional[Sequence[str]] = None,
    title: Optional[str] = None,
    panel_width_in: float = 2.4,
    dpi: int = 110,
) -> None:
    """Draw the middle slice (along axis 0) of one 3-D sample: a row per output channel with an input channel
    (row r shows input r, as far as there are inputs), the truth, the model and |model − truth|.

    Truth and model share the truth's colour range; each input has its own. Written atomically.
    """
    x_np, p_np, t_np = (_as_chw_numpy(t[:, t.shape[1] // 2] if t.dim() == 4 else t, n)
                        for t, n in ((inputs, "inputs"), (pred, "pred"), (truth, "truth")))
    if p_np.shape != t_np.shape:
        raise ValueError(f"save_volume_png: pred and truth must have one shape; got {p_np.shape} and {t_np.shape}")
    in_names, out_names = _channel_labels(input_names, x_np.shape[0]), _channel_labels(channel_names, t_np.shape[0])
    # Imported on first use: matplotlib is heavy, and a run that draws no pictures never needs it.
    from matplotlib.figure import Figure

    rows = max(len(in_names), len(out_names))
    fig = Figure(figsize=(4 * panel_width_in + 2.4, rows * (panel_width_in * t_np.shape[1] / t_np.shape[2] + 0.5) + 0.5),
                 layout="constrained")
    axes = fig.subplots(rows, 4, squeeze=False)
    for row in range(rows):
        if row < len(in_names):
            image = axes[row, 0].imshow(x_np[row], cmap="cividis")
            axes[row, 0].set_title(f"input: {in_names[row]}", fontsize=9)
            fig.colorbar(image, ax=axes[row, 0], shrink=0.9, pad=0.01)
        if row < len(out_names):
            vmin, vmax = float(np.nanmin(t_np[row])), float(np.nanmax(t_np[row]))
            for ax, field, label in ((axes[row, 1], t_np[row], f"truth: {out_names[row]}"),
                                     (axes[row, 2], p_np[row], f"model  L1 {np.abs(p_np[row] - t_np[row]).mean():.3g}")):
                image = ax.imshow(field, cmap="viridis", vmin=vmin, vmax=vmax)
                ax.set_title(label, fontsize=9)
            fig.colorbar(image, ax=list(axes[row, 1:3]), shrink=0.9, pad=0.01)
            error = np.abs(p_np[row] - t_np[row])
            image = axes[row, 3].imshow(error, cmap="magma", vmin=0.0, vmax=float(np.nanmax(error)) or 1.0)
            axes[row, 3].set_title("|model − truth|", fontsize=9)
            fig.colorbar(image, ax=axes[row, 3], shrink=0.9, pad=0.01)
        for ax in axes[row]:
            ax.set_xticks([])
            ax.set_yticks([])
            if not ax.images:
                ax.set_axis_off()
    if title:
        fig.suptitle(title, fontsize=11)
    _save_figure(fig, path, dpi)


def _channel_labels(channel_names: Optional[Sequence[str]], channels: int) -> list[str]:
    return list(channel_names) if channel_names else [f"channel {c}" for c in range(channels)]


def _save_panels(path, rows, aspect: float, title: Optional[str], panel_width_in: float, dpi: int) -> None:
    """One figure row per (name, truth, fields, errors): the field panels share the truth's colour range, the
    error panels one scale from 0 (largest error of the row)."""
    # Imported on first use: matplotlib is heavy, and a run that draws no pictures never needs it.
    from matplotlib.figure import Figure  # no pyplot: no global figure state, Agg canvas on save

    columns = len(rows[0][2]) + len(rows[0][3])
    panel_height_in = panel_width_in * aspect
    fig = Figure(figsize=(columns * panel_width_in + 1.6, len(rows) * (panel_height_in + 0.55) + 0.4),
                 layout="constrained")
    axes = fig.subplots(len(rows), columns, squeeze=False)
    for row, (name, truth, fields, errors) in enumerate(rows):
        vmin, vmax = float(np.nanmin(truth)), float(np.nanmax(truth))
        for ax, (field, label) in zip(axes[row], fields):
            image = ax.imshow(field, cmap="viridis", vmin=vmin, vmax=vmax)
            ax.set_title(label, fontsize=9)
        fig.colorbar(image, ax=list(axes[row, :len(fields)]), shrink=0.9, pad=0.01)
        error_max = max(float(np.nanmax(error)) for error, _ in errors) or 1.0
        for ax, (error, label) in zip(axes[row, len(fields):], errors):
            error_image = ax.imshow(error, cmap="magma", vmin=0.0, vmax=error_max)
            ax.set_title(f"{label}  max {float(np.nanmax(error)):.3g}", fontsize=9)
        fig.colorbar(error_image, ax=list(axes[row, len(fields):]), shrink=0.9, pad=0.01)
        axes[row, 0].set_ylabel(name, fontsize=10)
        for ax in axes[row]:
            ax.set_xticks([])
            ax.set_yticks([])
    if title:
        fig.suptitle(title, fontsize=11)
    _save_figure(fig, path, dpi)


def _save_figure(fig, path, dpi: int) -> None:
    """Write a figure as PNG atomically (parent folders created; a failed write is one line)."""
    path = Path(path)
    with reporting_write_failures("picture", path, run_dir=find_run_dir(path)):
        path.parent.mkdir(parents=True, exist_ok=True)
        with replaced_atomically(path) as temporary:
            fig.savefig(temporary, format="png", dpi=dpi)
