"""Part II — autoregressive rollout: how a forecaster's skill decays with lead time.

Rolls a checkpoint of the forecaster forward K steps from start times of the validation split,
feeding each forecast back as the next input (x_k = model(x_{k-1})), and scores every lead against
the truth beside the two baselines a forecaster must beat: persistence (the initial state) and
climatology (``<data_dir>/stats/time_means.npy``). Latitude-weighted RMSE and ACC per channel come
from the validation's own code (utils/tasks.py), so lead 1 equals train.py's validation metrics on
the same samples.

    python rollout.py --checkpoint runs/vit_quickstart                      # the run's latest checkpoint, 8 steps
    python rollout.py --checkpoint runs/vit_quickstart --steps 20 --samples 64
    python rollout.py --checkpoint runs/vit_base/checkpoints/step_00030000.pt --device cuda
    python rollout.py --checkpoint runs/vit_fsdp/checkpoints/step_00001000  # a train_fsdp.py (DCP) folder
    python rollout.py --checkpoint runs/vit_quickstart --data_dir /data/era5_nersc --split valid --out results/

Initial conditions: --samples start times evenly spaced over the split (0 = all), each with its K
steps inside one file. Writes ``<out>/rollout.json`` (every metric per lead and channel) and
``<out>/rollout.png`` (RMSE and ACC against lead time for the key channels); ``<out>`` defaults to
``<run_dir>/rollout/``. Lead times are counts of the data's own step, in its unit ("6 h", "1 month": the
``time_step`` that datasets/convert.py records, or ``hours_per_step``); 6 h, NERSC's spacing, where the files
record none, said in the output.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.utils.data import Subset

from models import fixed_input_size
from utils.checkpoint.files import ensure_writable_dir, replaced_atomically, reporting_write_failures
from utils.checkpoint.reading import read_checkpoint
from utils.cli import OneLineParser
from utils.config import Config, ConfigError
from utils.data.common import DataError, evenly_spaced
from utils.data.era5 import ERA5Dataset
from utils.data.files import scan_split, split_step
from utils.observe.logger import json_safe
from utils.precision import autocast
from utils.predict.model import config_from_checkpoint, load_model
from utils.tasks import Forecast, build_task
from utils.training import configure_backends, pick_device, run_cli

FORECASTER = "rollout needs a forecaster (task forecast, Part II's ViT)"
METRICS = ("rmse", "acc", "persistence_rmse", "persistence_acc", "climatology_rmse", "climatology_acc")
CURVES = (("", "model", "o-"), ("persistence_", "persistence", "s--"), ("climatology_", "climatology", "^:"))


def parse_args(argv=None) -> argparse.Namespace:
    parser = OneLineParser(prog="rollout.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True,
                        help="a run folder (its latest checkpoint), a step_N.pt file or a train_fsdp.py step_N folder")
    parser.add_argument("--steps", type=int, default=8, help="model steps K to roll forward (default: 8)")
    parser.add_argument("--samples", type=int, default=16, help="initial conditions, evenly spaced (0 = all usable; default: 16)")
    parser.add_argument("--split", default=None, help="split folder under data_dir (default: the config's valid_split)")
    parser.add_argument("--data_dir", default=None, help="data root (default: the checkpoint's data_dir)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: CUDA if available")
    parser.add_argument("--out", default=None, help="output folder (default: <run_dir>/rollout)")
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------------------- data


def open_split(cfg: Config, split_dir: Path, steps: int) -> ERA5Dataset:
    """Pairs (start, start + steps * lead) of one file: its indices are the usable start times."""
    horizon = steps * cfg.data.lead
    longest = max(f.days for f in scan_split(split_dir))
    if longest <= horizon:
        most = (longest - 1) // cfg.data.lead
        fix = f"use --steps {most} or less" if most else "use files with more samples"
        raise DataError(f"{split_dir}: {steps} steps of lead {cfg.data.lead} need more than {horizon} samples in a "
                        f"file, the longest holds {longest}; {fix}")
    dataset = ERA5Dataset(split_dir, task="forecast", crop_size=0, lead=horizon, train=False,
                          channels=cfg.model.in_chans)
    fixed = fixed_input_size(cfg.model)
    if fixed is not None and fixed != (dataset.height, dataset.width):
        raise DataError(f"{split_dir}: {dataset.height}x{dataset.width} fields, but the checkpoint's model takes "
                        f"{fixed[0]}x{fixed[1]} (img_size); use the data it was trained on")
    return dataset


# -------------------------------------------------------------------------------------- rollout


@torch.no_grad()
def roll_out(model, task: Forecast, dataset: ERA5Dataset, starts: list[int], steps: int, lead: int,
             device: torch.device, amp_dtype: str, batch_size: int) -> list[dict[str, list[float]]]:
    """Per lead 1..steps, the task's metrics {name: per-channel list} over the start times."""
    per_lead = [task.new_accumulators(dataset.channels, device) for _ in range(steps)]
    for first in range(0, len(starts), batch_size):
        places = [dataset.locate(index) for index in starts[first:first + batch_size]]

        def state(offset: int) -> torch.Tensor:
            return torch.stack([dataset.read_field(file, day + offset) for file, day in places]).to(device)

        initial = forecast = state(0)
        for k in range(1, steps + 1):
            with autocast(device, amp_dtype):
                forecast = model(forecast)
            forecast = forecast.float()  # scored as validation does, and fed back in the data's precision
            task.update(per_lead[k - 1], initial, forecast, state(k * lead))  # persistence = the initial state
    return [{key: accumulator.compute() for key, accumulator in accumulators.items()} for accumulators in per_lead]


def shown_channels(cfg: Config) -> list[int]:
    names = cfg.data.channel_names
    return [names.index(n) for n in cfg.data.key_channels] or list(range(min(3, len(names))))


def save_rollout_png(path: Path, result: dict, shown: list[int], dpi: int = 110) -> None:
    """RMSE (top) and ACC (bottom) against lead time, one column per channel in ``shown``."""
    from matplotlib.figure import Figure  # no pyplot: no global figure state, Agg canvas on save

    leads, names = result["lead_times"], result["channel_names"]
    fig = Figure(figsize=(3.6 * len(shown) + 0.4, 5.8), layout="constrained")
    axes = fig.subplots(2, len(shown), squeeze=False, sharex=True)
    for column, channel in enumerate(shown):
        for row, metric in enumerate(("rmse", "acc")):
            ax = axes[row, column]
            for prefix, label, style in CURVES:
                ax.plot(leads, [lead[channel] for lead in result["metrics"][prefix + metric]], style, label=label)
            ax.grid(alpha=0.3)
            ax.set_title(f"{names[channel]} {metric.upper()}", fontsize=10)
        axes[1, column].set_xlabel(f"lead time ({result['lead_unit']})")
    axes[0, 0].set_ylabel("RMSE (physical units)")
    axes[1, 0].set_ylabel("ACC")
    axes[0, 0].legend(fontsize=8)
    assumed = f" ({result['time_step']} per step assumed)" if result["time_step_assumed"] else ""
    fig.suptitle(f"{result['config']} step {result['step']}: {result['initial_conditions']} initial conditions, "
                 f"{result['split']}{assumed}", fontsize=10)
    with replaced_atomically(path) as temporary:
        fig.savefig(temporary, format="png", dpi=dpi)


def format_table(result: dict, channel: int) -> str:
    name = result["channel_names"][channel]
    lines = [f"{name}: RMSE of model, persistence and climatology; model ACC",
             f"{'lead (' + result['lead_unit'] + ')':>9s} {'model':>11s} {'persistence':>11s} {'climatology':>11s} {'ACC':>7s}"]
    m = result["metrics"]
    for k, lead in enumerate(result["lead_times"]):
        lines.append(f"{lead:9g} {m['rmse'][k][channel]:11.4g} {m['persistence_rmse'][k][channel]:11.4g} "
                     f"{m['climatology_rmse'][k][channel]:11.4g} {m['acc'][k][channel]:7.3f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {args.steps}")
    if args.samples < 0:
        raise ConfigError(f"--samples must be >= 0 (0 = every usable start time), got {args.samples}")
    saved = read_checkpoint(args.checkpoint)
    checkpoint, run_dir = saved.path, saved.run_dir
    overrides = {"data_dir": args.data_dir} if args.data_dir else {}
    cfg = config_from_checkpoint(saved, overrides, ("forecast",), FORECASTER)
    if args.split:
        cfg.data.valid_split = args.split  # build_task reads the latitudes and the climatology's grid from it
    split_dir = Path(cfg.data.data_dir) / cfg.data.valid_split
    dataset = open_split(cfg, split_dir, args.steps)
    device = pick_device(args.device)
    task = build_task(cfg, device)  # also reads (and checks) stats/time_means.npy, before any heavy work
    # One float64 climatology, which every ACC accumulator then shares instead of copying (K x 3 of them).
    task.climatology = task.climatology.double()
    chosen = evenly_spaced(dataset, args.samples)
    starts = list(chosen.indices) if isinstance(chosen, Subset) else list(range(len(dataset)))
    configure_backends(cfg)
    model = load_model(cfg, saved, device)
    step = saved.step
    data_step = split_step(dataset.files, split_dir)  # "6 h", "1 month": leads in the data's own unit
    lead = cfg.data.lead
    note = f"; the data records no time step: assumed {data_step}" if data_step.assumed else ""
    print(f"rollout of {checkpoint} (step {step}) on {split_dir}: {len(starts)} of {len(dataset)} usable start "
          f"times, {args.steps} step{'s' if args.steps > 1 else ''} of {data_step.times(lead)}{note}")

    leads = roll_out(model, task, dataset, starts, args.steps, lead, device, cfg.train.amp_dtype,
                     cfg.data.val_batch_size or cfg.train.batch_size)
    result = {
        "checkpoint": str(checkpoint), "step": step, "config": cfg.name, "data_dir": str(cfg.data.data_dir),
        "split": cfg.data.valid_split, "channel_names": list(cfg.data.channel_names),
        "lead_steps": list(range(1, args.steps + 1)), "samples_per_step": lead,
        "lead_times": [k * lead * data_step.count for k in range(1, args.steps + 1)], "lead_unit": data_step.unit,
        "time_step": str(data_step), "time_step_assumed": data_step.assumed,
        "initial_conditions": len(starts), "usable_initial_conditions": len(dataset),
        "start_times": [[dataset.files[f].path.name, day] for f, day in map(dataset.locate, starts)],
        "metrics": {key: [lead_metrics[key] for lead_metrics in leads] for key in METRICS},
    }
    if data_step.assumed:
        result["note"] = f"the data records no time step; assumed {data_step} (NERSC's ERA5)"

    out = ensure_writable_dir(args.out or run_dir / "rollout")
    shown = shown_channels(cfg)
    # A full disk: one line (exit 4); the atomic writes leave no partial file.
    with reporting_write_failures("rollout results in", out, hint="free space or choose another --out, and run "
                                  "rollout.py again"):
        with replaced_atomically(out / "rollout.json") as temporary:
            # One line per key: readable, yet the per-lead lists stay compact.
            lines = (f" {json.dumps(key)}: {json.dumps(value)}" for key, value in json_safe(result).items())
            temporary.write_text("{\n" + ",\n".join(lines) + "\n}\n")
        save_rollout_png(out / "rollout.png", result, shown)
    print(format_table(result, shown[0]))
    print(f"wrote {out / 'rollout.json'} and {out / 'rollout.png'}")
    return 0


if __name__ == "__main__":
    run_cli(main)
