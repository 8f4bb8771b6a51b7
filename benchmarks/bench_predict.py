"""predict.py's throughput against the model's forward pass alone on the same inputs (its limit), in one run.

    python benchmarks/bench_predict.py --checkpoint runs/quickstart --items 32
    python benchmarks/bench_predict.py --checkpoint runs/vit_quickstart --items 32 -- --steps 4 --batch_size 4

First predict.py itself (``main``, in this process) writes ``--items`` items of the checkpoint's validation split to
a temporary Zarr store: reading, prediction and writing, as a user runs it (its own items/s, from the first batch
to the last write). Then the same items, read into memory beforehand, go through the same forward (tiles, autocast,
a forecast's steps) with nothing else: the forward's items/s. The ratio of the two is the share of the time the
model computes; the rest is reading, the store's region writes and the bookkeeping of a resumable run. The two
alternate ``--repeats`` times and the best of each is kept: a machine shared with other jobs slows either at random.
Options after ``--`` go to predict.py (``--tile``, ``--batch_size``, ``--amp_dtype``, ``--steps``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model import cpu_description  # noqa: E402

import predict  # noqa: E402
from utils.checkpoint.reading import read_checkpoint  # noqa: E402
from utils.predict.model import config_from_checkpoint, load_model  # noqa: E402
from utils.training import pick_device, run_cli  # noqa: E402


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--items", type=int, default=32, help="items (times or boxes) to predict")
    parser.add_argument("--repeats", type=int, default=3, help="alternations of the two measurements (best kept)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    return parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv), extra


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None) -> int:
    args, extra = parse_args(argv)
    device = pick_device(args.device)
    options = predict.parse_args(["--checkpoint", args.checkpoint, "--out", "unused.zarr", *extra])
    saved = read_checkpoint(args.checkpoint)
    cfg = config_from_checkpoint(saved, {}, predict.TASKS, "")
    steps = (options.steps or predict.DEFAULT_STEPS) if cfg.data.task == "forecast" else None
    inputs = predict.open_inputs(cfg, options)
    chosen = list(range(min(args.items, len(inputs))))
    batches = [torch.stack([inputs.read(i) for i in chosen[b:b + options.batch_size]])
               for b in range(0, len(chosen), options.batch_size)]
    forward = predict.Predictor(load_model(cfg, saved, device), device, options, steps)
    forward(batches[0])  # warm-up: first-call allocations, autotuning
    written, alone = [], []
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="bench_predict-") as folder:
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                predict.main(["--checkpoint", args.checkpoint, "--out", f"{folder}/out.zarr", "--times",
                              f"0:{len(chosen)}", "--picture", "none", "--progress", "never", "--device", device.type,
                              *extra])
        rate = re.search(r"\(([\d.]+) (\w+)/s\)", printed.getvalue())
        if rate is None:
            raise RuntimeError(f"predict.py printed no rate:\n{printed.getvalue()}")
        written.append(float(rate.group(1)))
        unit = rate.group(2)
        synchronize(device)
        started = time.perf_counter()
        for batch in batches:
            forward(batch)
        synchronize(device)
        alone.append(len(chosen) / (time.perf_counter() - started))
    written_best, alone_best = max(written), max(alone)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_description()
    load = f", load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores" if device.type == "cpu" else ""
    print(f"device: {where}; torch {torch.__version__}, python {platform.python_version()}{load}")
    print(f"predict.py {' '.join(extra) or '(defaults)'}: {len(chosen)} {unit} of {saved.path}")
    print(f"  predict.py (read, predict, write): {written_best:8.2f} {unit}/s (best of {args.repeats}: "
          f"{', '.join(f'{w:.2f}' for w in written)})")
    print(f"  forward alone, same inputs:        {alone_best:8.2f} {unit}/s (best of {args.repeats}: "
          f"{', '.join(f'{a:.2f}' for a in alone)})")
    print(f"  ratio: {written_best / alone_best:.2f}")
    return 0


if __name__ == "__main__":
    run_cli(main)
