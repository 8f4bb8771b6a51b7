"""What each precision costs in skill: the same model from the same seeds, trained under each numeric setting the
scripts offer, then predicted and scored as a user would (train.py, predict.py, evaluate.py, each a subprocess).

    python benchmarks/precision_skill.py                                  # both quickstarts, the laptop's budget
    python benchmarks/precision_skill.py --configs vit_quickstart --seeds 0 1 2 3 4 --steps 300
    python benchmarks/precision_skill.py --settings fp32 bf16 -- --data_dir datasets/synthetic_vit

The settings (a rung that cannot run here is listed as skipped, with why):

- fp32: no autocast, TF32 off (``--amp_dtype none --tf32 false``);
- tf32: no autocast, TF32 matmuls (``--tf32 true``; a GPU's: on a CPU fp32 matmuls stay fp32);
- bf16: bf16 autocast (``--amp_dtype bf16``);
- bf16+keep_fp32: bf16 autocast with the parts the model's spec keeps in fp32 (``--keep_fp32 true``: its
  normalisations and output head, utils/precision.py);
- fp8: FP8 matmuls by torchao's float8 training: needs a GPU with FP8 (compute capability 8.9+) and torchao, and
  a training script that offers it; none does yet, so the rung says which of these is missing.

Each (config, setting, seed) trains --steps steps (fewer than the quickstarts' full runs: the budget), then
predict.py predicts --times of the validation split (forecasts: --leads model steps from each) in fp32, so that the
scores measure what training in the setting cost, and evaluate.py scores them. Per setting it prints speed
(samples/s of the training windows after the first, whose warm-up it leaves out) and peak memory (train.py's
``peak_mem_gb``), then per key channel (the config's key_channels, else all) and lead: RMSE, ACC and the zonal
energy spectrum's ratio to the truth's over the upper half of the zonal wavenumbers (the scales a 2x
super-resolution adds to its input, and the ViT's scales below its 2-cell patches; 1 = as energetic as the truth).
Each figure is the mean over seeds ± their standard deviation; each setting's difference from fp32 is flagged
(``*``) where it exceeds twice the seed-to-seed spread (the two settings' standard deviations, pooled). The tables
are Markdown; <out>/precision_skill.json holds every run's figures. A finished run leaves run.json in its folder and
is read, not trained again, when the same command runs again.

Arguments after ``--`` go to every train.py run; the keys this benchmark sets itself are refused there.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from bench_model import cpu_description, supports_bf16_matmul  # noqa: E402
from utils.cli import OneLineParser  # noqa: E402
from utils.config import parse_config  # noqa: E402
from utils.predict.store import variable_of  # noqa: E402

SETTINGS = {
    "fp32": ["--amp_dtype", "none", "--tf32", "false"],
    "tf32": ["--amp_dtype", "none", "--tf32", "true"],
    "bf16": ["--amp_dtype", "bf16"],
    "bf16+keep_fp32": ["--amp_dtype", "bf16", "--keep_fp32", "true"],
    "fp8": None,  # no training script offers it (why_skipped says what else is missing)
}
SET_HERE = ("config", "seed", "max_steps", "run_dir", "log_every", "amp_dtype", "tf32", "keep_fp32", "val_samples",
            "progress")
HIGH_K = 0.5
"""The spectrum's ratio is taken over wavenumbers above this fraction of the largest."""


def fail(message: str, code: int = 2) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


def why_skipped(setting: str, device) -> str:
    """'' where the setting runs on ``device`` (a torch device), else why not."""
    import torch

    if setting == "tf32" and device.type != "cuda":
        return "TF32 is a GPU's matmul format (Ampere and later): on a CPU fp32 matmuls stay fp32"
    if setting == "fp8":
        missing = []
        if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
            missing.append("a GPU with FP8 (compute capability 8.9+)")
        try:
            import torchao.float8  # noqa: F401
        except ImportError:
            missing.append("torchao (its float8 training)")
        missing.append("a training script that offers it (none does yet)")
        return "needs " + ", ".join(missing)
    return ""


def run(script: str, args: list[str], what: str) -> float:
    """``python SCRIPT ARGS`` in the current folder (its datasets/ and runs/, as the user's command would); its
    wall-clock seconds. A failure ends the benchmark with the script's last line."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(REPO / script), *args], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    if proc.returncode:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        fail(f"{script} failed for {what} (exit {proc.returncode}): {last}", proc.returncode)
    return time.perf_counter() - start


def training_figures(run_dir: Path) -> dict:
    """samples/s (mean of the logged windows after the first) and peak memory (GB) of a train.py run."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    windows = train[1:] or train
    return {"samples_per_s": statistics.fmean(r["samples_per_sec"] for r in windows),
            "peak_mem_gb": max(r["peak_mem_gb"] for r in train)}


def skill(scores_path: Path, channels: list[str]) -> dict:
    """{channel: {lead in hours: {rmse, acc, spectrum_ratio}}} of the model in evaluate.py's output."""
    import xarray as xr

    scores = xr.open_dataset(scores_path)
    spectra = xr.open_dataset(scores_path, group="spectra")
    out = {}
    for channel in channels:
        name, level = variable_of(channel)
        if name not in scores:
            continue
        pick = {"level": level} if level is not None else {}
        s, e = scores[name].sel(forecast="model", **pick), spectra[name].sel(**pick)
        k = e["zonal_wavenumber"]
        high = e.where(k > HIGH_K * int(k.max()), drop=True).sum("zonal_wavenumber")
        ratio = high.sel(forecast="model") / high.sel(forecast="truth")
        hours = s["lead_time"].values.astype("timedelta64[h]").astype(int)
        out[channel] = {str(h): {"rmse": float(s.sel(metric="rmse").isel(lead_time=i)),
                                 "acc": float(s.sel(metric="acc").isel(lead_time=i)),
                                 "spectrum_ratio": float(ratio.isel(lead_time=i))} for i, h in enumerate(hours)}
    return out


def one_run(cfg, setting: str, seed: int, args, run_dir: Path) -> dict:
    """Train, predict and score one (config, setting, seed); its figures (read from run.json if done before)."""
    done = run_dir / "run.json"
    train_args = ["--config", cfg.name, "--seed", str(seed), "--max_steps", str(args.steps), "--run_dir",
                  str(run_dir), "--log_every", str(max(1, args.steps // 5)), "--val_samples", "2",
                  "--progress", "never", *SETTINGS[setting], *args.extra]
    if done.exists():
        record = json.loads(done.read_text())
        if record["train_args"] == train_args:
            return record
        fail(f"{run_dir} holds a run with other settings: delete it or choose another --out")
    shutil.rmtree(run_dir, ignore_errors=True)  # an interrupted run's outputs: train.py would refuse the folder
    what = f"{cfg.name} {setting} seed {seed}"
    print(f"  {what}: train.py", flush=True)
    wall = {"train": run("train.py", train_args, what)}
    forecast = cfg.data.task == "forecast"
    predicted = run_dir / "predicted.zarr"
    wall["predict"] = run("predict.py", ["--checkpoint", str(run_dir), "--out", str(predicted), "--times",
                                         f"0:{args.times}", "--batch_size", "4", "--picture", "none",
                                         "--progress", "never", *(["--steps", str(args.leads)] if forecast else [])],
                          what)
    scores = run_dir / "scores.nc"
    wall["evaluate"] = run("evaluate.py", ["--forecast", str(predicted), "--truth", cfg.data.data_dir,
                                           "--out", str(scores), "--baselines", "climatology"], what)
    channels = cfg.data.key_channels or cfg.data.channel_names
    record = {"train_args": train_args, "wall_s": wall, **training_figures(run_dir), "skill": skill(scores, channels)}
    done.write_text(json.dumps(record, indent=1))
    return record


def mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def fmt(value: float) -> str:
    return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"


def cell(values: list[float], reference: list[float] | None) -> str:
    """'mean ± sd', and beside it the difference from the reference's mean, '*' where it exceeds twice the pooled
    seed-to-seed standard deviation."""
    mean, sd = mean_sd(values)
    text = f"{fmt(mean)} ± {fmt(sd)}"
    if reference is None:
        return text
    ref_mean, ref_sd = mean_sd(reference)
    delta, pooled = mean - ref_mean, math.sqrt((sd ** 2 + ref_sd ** 2) / 2)
    return f"{text} ({delta:+.2g}{' *' if abs(delta) > 2 * pooled else ''})"


def tables(name: str, runs: dict[str, list[dict]], skipped: dict[str, str]) -> str:
    """The Markdown tables of one config: speed and memory per setting, then skill per channel, lead and metric."""
    settings = list(runs)
    ref = runs.get("fp32")
    lines = [f"**{name}**", "", "| setting | samples/s | peak memory (GB) |", "|---|---|---|"]
    for setting, records in runs.items():
        lines.append(f"| {setting} | {cell([r['samples_per_s'] for r in records], None)} | "
                     f"{cell([r['peak_mem_gb'] for r in records], None)} |")
    lines += [f"| {setting} | skipped: {why} | |" for setting, why in skipped.items()]
    lines += ["", "| channel | lead (h) | metric | " + " | ".join(settings) + " |", "|---" * (3 + len(settings)) + "|"]
    first = runs[settings[0]][0]["skill"]
    for channel, leads in first.items():
        for lead in leads:
            for metric in ("rmse", "acc", "spectrum_ratio"):
                def of(records):
                    return [r["skill"][channel][lead][metric] for r in records]
                cells = [cell(of(runs[s]), None if s == "fp32" or ref is None else of(ref)) for s in settings]
                lines.append(f"| {channel} | {lead} | {metric} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = OneLineParser(prog="precision_skill.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["vit_quickstart", "quickstart"])
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS),
                        help="default: all (those that cannot run here are listed as skipped)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=40,
                        help="training steps per run (default 40: the laptop's budget, against the quickstarts' 1000 "
                             "and 1200; early training, where the seeds still differ most)")
    parser.add_argument("--times", type=int, default=4, help="validation items predicted (default 4)")
    parser.add_argument("--leads", type=int, default=2, help="forecasts: model steps predicted from each (default 2)")
    parser.add_argument("--out", type=Path, default=Path("runs/precision_skill"))
    args = parser.parse_args(own)
    refused = [a for a in extra if a.startswith("--") and a[2:].split("=")[0] in SET_HERE]
    if refused:
        fail(f"{', '.join(refused)} is set by this benchmark: drop it after --")
    args.extra = extra

    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_description()
    bf16_note = "" if supports_bf16_matmul(device) else " (no AVX512-BF16/AMX: bf16 is emulated, and slow)"
    print(f"device: {where}{bf16_note} | torch {torch.__version__} | {platform.node()}", flush=True)
    start, results = time.perf_counter(), {}
    for name in args.configs:
        cfg = parse_config(argv=["--config", name, *extra])
        skipped = {s: why for s in args.settings if (why := why_skipped(s, device))}
        runs = {s: [one_run(cfg, s, seed, args, args.out / name / s / f"seed{seed}") for seed in args.seeds]
                for s in args.settings if s not in skipped}
        results[name] = {"steps": args.steps, "runs": runs, "skipped": skipped}
        print("\n" + tables(f"{name}: {args.steps} steps, seeds {args.seeds}", runs, skipped) + "\n", flush=True)
    wall = time.perf_counter() - start
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "precision_skill.json").write_text(json.dumps(
        {"device": where + bf16_note, "torch": torch.__version__, "seeds": args.seeds, "times": args.times,
         "leads": args.leads, "wall_s": wall, "configs": results}, indent=1))
    print(f"{wall / 60:.1f} min; wrote {args.out / 'precision_skill.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
