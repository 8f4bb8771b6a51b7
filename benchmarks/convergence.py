"""Large-batch convergence: does a larger global batch reach the same validation metric in fewer steps?

    python benchmarks/convergence.py                           # SwinIR quickstart: batches 2, 8, 32 x none/sqrt/linear
    python benchmarks/convergence.py --config vit_quickstart   # Part II's ViT: the same batches and rules
    python benchmarks/convergence.py --batches 2 8 --rules sqrt --samples 512 -- --seed 1

For each global batch B of --batches and each lr rule of --rules, train.py trains the config on the same
number of samples (--samples: batch 32 takes 16x fewer steps than batch 2), with the config's lr scaled
from --base_batch by the rule (none: as is, sqrt: x sqrt(B / base), linear: x B / base), a linear warm-up
over the same number of samples for every batch (--warmup_samples), and a validation every
--val_every_samples samples. At the base batch every rule gives the same lr, so that run is made once.
A run whose loss diverges (NaN or infinite: train.py's exit code 3) is a result, reported as such. It
prints a table and writes <out>/convergence.json and <out>/convergence.png: the validation metric
against samples seen, optimizer steps and training time. Each finished run leaves a record in its
folder: the same command run again (after an interruption) trains only the runs still missing.

The metric is the task's validation error relative to its baseline, averaged over channels: RMSE over
bicubic's (super-resolution), RMSE over persistence's (forecast), L1 over the channel mean's (volume);
lower is better, below 1 beats the baseline. Time is the training loop's, summed from the logged windows
of metrics.jsonl (start-up excluded; the validations before each point included, the same number for
every run).

Every run is one train.py process: the global batch, not how it is split, decides the updates (DDP on N
ranks computes the step of one process on the same global batch; tests/test_ddp.py checks it), and on a
CPU the N ranks would share the same cores, so one process is also the fair comparison of time. On a GPU
cluster the time axis is what changes: there a batch N times larger is spread over N GPUs.

Arguments after `--` go to every train.py run (e.g. --data_dir, --seed). The keys this benchmark sets
itself (batch_size, lr_scaling, base_batch_size, max_steps, warmup_steps, val_every, log_every, run_dir)
are refused there.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from utils.cli import OneLineParser  # noqa: E402
from utils.config import lr_scale, parse_config  # noqa: E402  (no torch: this process only runs train.py)

RULES = ("none", "sqrt", "linear")
SET_HERE = ("batch_size", "lr_scaling", "base_batch_size", "max_steps", "warmup_steps", "val_every", "log_every",
            "run_dir")
DIVERGED = 3
"""train.py's exit code for a NaN or infinite loss (utils/training.py, EXIT_CODES)."""
RUN_RECORD = "convergence_run.json"
BASELINES = {"bicubic_rmse": ("rmse", "validation RMSE / bicubic's"),
             "persistence_rmse": ("rmse", "validation RMSE / persistence's"),
             "mean_l1": ("l1", "validation L1 / channel mean's")}
"""Each task's baseline metric in a validation record -> the model's metric it is compared with, and its name."""


def fail(message: str, code: int = 2) -> None:
    """Bad input (or a failed run): one line on stderr, and a non-zero exit."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


def relative_error(record: dict) -> tuple[float, str]:
    """The model's validation error over the baseline's, averaged over channels, and the metric's name."""
    for baseline, (metric, name) in BASELINES.items():
        if baseline in record:
            return statistics.fmean(m / b for m, b in zip(record[metric], record[baseline])), name
    raise KeyError(f"no baseline ({', '.join(BASELINES)}) in the validation record {sorted(record)}")


def read_curve(run_dir: Path, batch: int) -> tuple[list[dict], list[dict], str]:
    """(validation points, train records, metric name) of one run: each point with step, samples, time_s and metric.

    The time of a step is the sum of the logged windows up to it (steps x batch / samples_per_sec each):
    with log_every = val_every, every validation step has a train record just before it.
    """
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    elapsed, last_step, time_at, train = 0.0, 0, {}, []
    for record in records:
        if record["kind"] == "train":
            elapsed += (record["step"] - last_step) * batch / record["samples_per_sec"]
            last_step, time_at[record["step"]] = record["step"], elapsed
            train.append({"step": record["step"], "lr": record["lr"], "loss": record["loss"]})
    vals = [r for r in records if r["kind"] == "val"]
    points = [{"step": r["step"], "samples": r["step"] * batch, "time_s": time_at[r["step"]],
               "metric": relative_error(r)[0]} for r in vals]
    return points, train, relative_error(vals[-1])[1] if vals else ""


def plan_runs(batches: list[int], rules: list[str], base: int) -> list[tuple[int, str]]:
    """(batch, rule) pairs to train; at the base batch every rule gives the same lr: one run, rule 'base'."""
    pairs = []
    for batch in batches:
        pairs += [(batch, "base")] if batch == base else [(batch, rule) for rule in rules]
    return pairs


def run_train(args: list[str]) -> subprocess.CompletedProcess:
    """``python train.py ARGS`` in a fresh interpreter, from the current folder (its datasets/ and runs/)."""
    return subprocess.run([sys.executable, str(REPO / "train.py"), *args], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)


def train(cfg_name: str, batch: int, rule: str, base: int, steps: int, warmup: int, val_every: int,
          run_dir: Path, extra: list[str]) -> tuple[float, bool]:
    """One train.py run: its wall-clock seconds (start-up included) and whether its loss diverged.

    A run that ends with a NaN or infinite loss (train.py's exit code 3) is a result: too high an lr. Any
    other failure ends the benchmark with its error. A finished run leaves RUN_RECORD in its folder, and a
    later benchmark with the same settings reads it instead of training again (an interrupted benchmark
    goes on where it stopped).
    """
    args = ["--config", cfg_name, *extra, "--batch_size", str(batch),
           "--lr_scaling", "none" if rule == "base" else rule, "--base_batch_size", str(base),
           "--max_steps", str(steps), "--warmup_steps", str(warmup), "--val_every", str(val_every),
           "--log_every", str(val_every), "--keep_checkpoints", "1", "--progress", "never", "--run_dir", str(run_dir)]
    record = run_dir / RUN_RECORD
    if record.exists():
        done = json.loads(record.read_text())
        if done["args"] != args:
            fail(f"{run_dir} holds a run with other settings: delete it or choose another --out")
        return done["wall_s"], done["diverged"]
    start = time.perf_counter()
    proc = run_train(args)
    diverged = proc.returncode == DIVERGED
    if proc.returncode not in (0, DIVERGED):
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        fail(f"train.py failed for batch {batch}, rule {rule} (exit {proc.returncode}): {last}", proc.returncode)
    wall = time.perf_counter() - start
    record.write_text(json.dumps({"args": args, "wall_s": wall, "diverged": diverged}))
    return wall, diverged


def first_reaching(points: list[dict], target: float) -> int | None:
    """Steps at which a run's validation metric first reaches ``target`` (None if it never does)."""
    return next((p["step"] for p in points if p["metric"] <= target), None)


def plot(result: dict, path: Path) -> None:
    """Metric against samples, steps (log) and training time: one column per rule, the base run in each."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rules = [r for r in result["rules"] if any(run["rule"] == r for run in result["runs"])] or ["base"]
    batches = sorted({run["batch"] for run in result["runs"]})
    shades = [0.85 * i / max(len(batches) - 1, 1) for i in range(len(batches))]
    colors = dict(zip(batches, plt.get_cmap("viridis")(shades)))
    axes_x = (("samples", "samples seen"), ("step", "optimizer steps"), ("time_s", "training time (s)"))
    drawn = any(run["points"] for run in result["runs"])  # log axes need points (a run can diverge before any)
    fig, axes = plt.subplots(3, len(rules), figsize=(3.6 * len(rules) + 0.6, 8.4), sharey=True, squeeze=False)
    for col, rule in enumerate(rules):
        for run in result["runs"]:
            if run["rule"] not in (rule, "base"):
                continue
            label = f"batch {run['batch']}" + (" (base)" if run["rule"] == "base" else f", lr {run['lr']:.2g}")
            for row, (key, _) in enumerate(axes_x):
                axes[row, col].plot([p[key] for p in run["points"]], [p["metric"] for p in run["points"]],
                                    marker="o", ms=3, color=colors[run["batch"]],
                                    ls="--" if run["rule"] == "base" else "-",
                                    label=label + (" (diverged)" if run["diverged"] else ""))
        axes[0, col].set_title(f"lr rule: {rule}")
        axes[0, col].legend(fontsize=7)
        for row, (key, label) in enumerate(axes_x):
            axes[row, col].axhline(1.0, color="gray", lw=0.8, ls=":")  # the baseline's error
            if drawn:
                axes[row, col].set_yscale("log")  # a diverging run is orders of magnitude off
            axes[row, col].set_xlabel(label, fontsize=8)
            axes[row, col].grid(alpha=0.3)
        if drawn:
            axes[1, col].set_xscale("log")
            axes[1, col].xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    for row in range(3):
        axes[row, 0].set_ylabel(result["metric"], fontsize=8)
    fig.suptitle(f"{result['config']}: {result['samples']} samples per run, base batch {result['base_batch']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="quickstart", help="named config (quickstart, vit_quickstart, ...)")
    parser.add_argument("--batches", type=int, nargs="+", default=[2, 8, 32], help="global batch sizes")
    parser.add_argument("--rules", nargs="+", choices=RULES, default=list(RULES), help="lr scaling rules")
    parser.add_argument("--base_batch", type=int, default=0,
                        help="batch the config's lr was tuned at (0: the config's base_batch_size)")
    parser.add_argument("--samples", type=int, default=0,
                        help="training samples per run, a multiple of every batch (0: 16 x their l.c.m.)")
    parser.add_argument("--val_every_samples", type=int, default=0,
                        help="samples between validations, a multiple of every batch (0: about --samples / 8)")
    parser.add_argument("--warmup_samples", type=int, default=-1,
                        help="linear warm-up, in samples, for every batch (-1: the config's warmup_steps x base batch, "
                             "at most a quarter of --samples)")
    parser.add_argument("--out", default="", help="output folder (default: runs/convergence_<config>)")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then train.py arguments for every run")
    args = parser.parse_args(argv)
    extra = [a for a in args.train_args if a != "--"]
    for arg in extra:
        if arg.startswith("--") and arg[2:].split("=")[0] in SET_HERE:
            parser.error(f"{arg} is set by this benchmark: use --batches, --rules, --base_batch, --samples, "
                         "--val_every_samples, --warmup_samples or --out")
    if min(args.batches) < 1 or len(set(args.batches)) != len(args.batches):
        parser.error(f"--batches must be distinct positive sizes, got {args.batches}")
    return args, extra


def main(argv: list[str] | None = None) -> dict:
    args, extra = parse_args(argv)
    cfg = parse_config(__doc__, argv=["--config", args.config, *extra])  # bad keys and values stop here, in one line
    base = args.base_batch or cfg.dist.base_batch_size
    multiple = math.lcm(*args.batches)  # of every batch: the runs validate at the same sample counts
    samples = args.samples or 16 * multiple
    val_every = args.val_every_samples or max(multiple, samples // 8 // multiple * multiple)
    # A warm-up tuned for a long run would fill a short one: the default keeps it to a quarter of the budget.
    default_warmup = min(cfg.dist.warmup_steps * base, samples // 4)
    warmup_samples = args.warmup_samples if args.warmup_samples >= 0 else default_warmup
    for name, value in (("--samples", samples), ("--val_every_samples", val_every)):
        if value <= 0 or any(value % b for b in args.batches):
            fail(f"{name} {value} must be a positive multiple of every batch {args.batches}: "
                 f"choose e.g. {16 * multiple}")
    out = Path(args.out or f"runs/convergence_{args.config}")  # like train.py's run_dir: from the current folder
    out.mkdir(parents=True, exist_ok=True)

    print(f"{args.config}: {samples} samples per run, base batch {base} at lr {cfg.train.lr:.3g}, warm-up over "
          f"{warmup_samples} samples, validation every {val_every} samples | {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    runs, metric = [], ""
    for batch, rule in plan_runs(args.batches, args.rules, base):
        steps = samples // batch
        warmup = round(warmup_samples / batch) if warmup_samples else 0
        run_dir = out / f"bs{batch}_{rule}"
        wall, diverged = train(args.config, batch, rule, base, steps, warmup, val_every // batch, run_dir, extra)
        points, logged, run_metric = read_curve(run_dir, batch)
        metric = metric or run_metric
        lr = cfg.train.lr * lr_scale("none" if rule == "base" else rule, batch, base)
        final = None if diverged else points[-1]["metric"]
        runs.append({"batch": batch, "rule": rule, "lr": lr, "steps": steps, "warmup_steps": warmup,
                     "diverged": diverged, "points": points, "logged": logged, "final_metric": final,
                     "train_s": points[-1]["time_s"] if points else None, "wall_s": wall})
        print(f"  batch {batch:>4} {rule:<6} lr {lr:.3g}: {steps} steps, "
              f"{'diverged' if diverged else f'final {final:.4f}'}, {wall:.0f} s", flush=True)

    base_final = next((run["final_metric"] for run in runs if run["rule"] == "base"), None)
    for run in runs:
        run["relative_to_base"] = run["final_metric"] / base_final if base_final and run["final_metric"] else None
        run["steps_to_base_final"] = first_reaching(run["points"], base_final) if base_final else None
    result = {"config": args.config, "samples": samples, "base_batch": base, "base_lr": cfg.train.lr,
              "warmup_samples": warmup_samples, "val_every_samples": val_every, "rules": args.rules, "metric": metric,
              "train_args": extra, "machine": {"cpus": os.cpu_count(), "processor": platform.processor(),
                                               "load_average_end": os.getloadavg()[0]}, "runs": runs}
    print(f"\nmetric: {metric}, mean over channels (lower is better; < 1 beats the baseline)")
    print(f"{'batch':>5}  {'rule':<6} {'lr':>8} {'steps':>6} {'warmup':>6} {'final':>8} {'x base':>7} "
          f"{'base final at':>13} {'train s':>8}")
    for run in runs:
        reached, final, relative = run["steps_to_base_final"], run["final_metric"], run["relative_to_base"]
        final_text = "diverged" if final is None else f"{final:.4f}"
        relative_text = "-" if relative is None else f"{relative:.3f}"
        print(f"{run['batch']:>5}  {run['rule']:<6} {run['lr']:>8.2e} {run['steps']:>6} {run['warmup_steps']:>6} "
              f"{final_text:>8} {relative_text:>7} {'-' if reached is None else f'step {reached}':>13} "
              f"{run['train_s'] or 0:>8.1f}")
    (out / "convergence.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "convergence.png")
    print(f"'base final at': the first validation at which a run reached the base run's final metric\n"
          f"wrote {out / 'convergence.json'} and {out / 'convergence.png'}")
    return result


if __name__ == "__main__":
    main()
