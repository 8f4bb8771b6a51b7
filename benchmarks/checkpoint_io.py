"""Checkpoint write time against the disk's limit: how long before the time limit to ask a run to stop.

    python benchmarks/checkpoint_io.py                         # full_size and vit_mp, 3 writes each
    python benchmarks/checkpoint_io.py --sizes full_size --repeats 5 --dir /scratch/$USER/ckpt_bench
    python benchmarks/checkpoint_io.py --json checkpoint_io.json

For each model size the model (fp32, on the CPU) and an AdamW optimizer with its state (one step on
random gradients, so exp_avg/exp_avg_sq hold data, as in training) are written --repeats times as
  single: the one-file checkpoint of train.py / train_ddp.py (utils.checkpoint.single.save_checkpoint), and
  dcp:    the DCP folder of train_fsdp.py / train_mp.py / train_pp.py (save_sharded_checkpoint, one rank),
  dcp async: the same with --ckpt_async (dcp.async_save): only the time until the training step may go on,
and the single-file checkpoint is written once more by ``dd if=CHECKPOINT ... conv=fsync``: the same bytes
plainly copied from the page cache, the disk's physical limit. Every write ends with an fsync, so the times
are what the run waits for before it can exit. The kinds take turns (single, its dd copy, dcp, dcp async,
single, ...), so that a disk that speeds up or slows down favours none.
--dir defaults to a temporary folder in the current directory (its file system), removed afterwards;
point it at the file system your runs write their checkpoints to.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from models import build_model  # noqa: E402
from utils.checkpoint.contents import checkpoint_payload, sharded_payload  # noqa: E402
from utils.checkpoint.sharded import finish_sharded_checkpoint, save_sharded_checkpoint  # noqa: E402
from utils.checkpoint.single import save_checkpoint  # noqa: E402
from utils.checkpoint.state import TrainState  # noqa: E402
from utils.config import build_config  # noqa: E402
from utils.precision import make_grad_scaler  # noqa: E402
from utils.training import exit_process  # noqa: E402

SIZES = ("full_size", "vit_mp")
SINGLE, ASYNC, DD = "single (train.py)", "dcp async: step waits", "dd conv=fsync (same)"
DD_BLOCK = 16 * 2**20


def cpu_model() -> str:
    """The model name, with family and model: this project's VM calls every CPU it gets "AMD EPYC"."""
    info = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.processor() or "unknown CPU"
    return f"{info.get('model name', 'unknown CPU')} (family {info.get('cpu family', '?')}, model {info.get('model', '?')})"


def fs_type(path: Path) -> str:
    try:
        out = subprocess.run(["df", "-T", str(path)], capture_output=True, text=True, check=True).stdout
        fields = out.splitlines()[-1].split()
        return f"{fields[1]} ({fields[0]}, {fields[-1]})"
    except (OSError, subprocess.CalledProcessError, IndexError):
        return "unknown"


def disk_bytes(path: Path) -> int:
    """Bytes on disk of a file or of all files under a folder (allocated blocks, not apparent size)."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_blocks * 512 for p in files)


def build(name: str):
    cfg = build_config(name)
    if not cfg.model.mean:
        c = cfg.model.in_chans
        cfg = build_config(name, {"mean": [0.0] * c, "std": [1.0] * c})
    torch.manual_seed(0)
    model = build_model(cfg.model).float()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p)  # seeded above; zeros would make 2/3 of the bytes zeros
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    scaler = make_grad_scaler(torch.device("cpu"), "none")
    return cfg, model, optimizer, scheduler, scaler


def dd_copy(source: Path, target: Path) -> None:
    """The same bytes again, written by dd: the single-file checkpoint just written, read back from the page
    cache. Not /dev/zero: this VM's virtual disk writes zeros 2-3 times faster than real data (2 GB: 1.2-1.4 s
    of zeros, 2.6-4.2 s of random bytes), which would set the limit too high."""
    target.unlink(missing_ok=True)
    subprocess.run(["dd", f"if={source}", f"of={target}", f"bs={DD_BLOCK}", "conv=fsync"], check=True,
                   capture_output=True)


def row(size: str, kind: str, nbytes: int, times: list[float], params: int) -> dict:
    median = statistics.median(times)
    return {"size": size, "kind": kind, "params": params, "bytes": nbytes, "seconds": times,
            "median_s": median, "min_s": min(times), "max_s": max(times), "gb_per_s": nbytes / 1e9 / median}


def measure(size: str, root: Path, repeats: int) -> list[dict]:
    cfg, model, optimizer, scheduler, scaler = build(size)
    params = sum(p.numel() for p in model.parameters())
    print(f"{size}: {params / 1e6:.1f}M parameters, {repeats} writes of each kind ...", flush=True)
    single_dir, dcp_dir, dd_file = root / f"{size}_single", root / f"{size}_dcp", root / f"{size}.dd"
    writes = {  # each previous write is removed before the next one starts (outside the timing), as dd's is
        SINGLE: lambda step: save_checkpoint(single_dir, step, checkpoint_payload(
            model, optimizer, scheduler, scaler, TrainState(), cfg), keep=0),
        "dcp (train_fsdp.py)": lambda step: save_sharded_checkpoint(dcp_dir, step, sharded_payload(
            model, optimizer, scheduler, scaler, TrainState(), cfg), keep=0),
        # --ckpt_async: the time until the call returns is what the training step waits for (the copy to CPU
        # memory); the write goes on behind it and is waited for right away here (the dcp row's write again).
        ASYNC: lambda step: save_sharded_checkpoint(dcp_dir, step, sharded_payload(
            model, optimizer, scheduler, scaler, TrainState(), cfg), keep=0, asynchronous=True),
    }
    times: dict[str, list[float]] = {kind: [] for kind in [*writes, DD]}
    nbytes = {}
    for step in range(repeats):  # the kinds take turns
        for kind, write in writes.items():
            start = time.perf_counter()
            path = write(step)
            times[kind].append(time.perf_counter() - start)
            if kind == ASYNC:
                finish_sharded_checkpoint()
            nbytes[kind] = disk_bytes(path)
            if kind == SINGLE:
                start = time.perf_counter()
                dd_copy(path, dd_file)
                times[DD].append(time.perf_counter() - start)
                nbytes[DD] = disk_bytes(dd_file)
                dd_file.unlink()
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    rows = [row(size, kind, nbytes[kind], times[kind], params) for kind in times]
    for r in rows:
        r["vs_dd"] = r["gb_per_s"] / rows[-1]["gb_per_s"]
    shutil.rmtree(single_dir)
    shutil.rmtree(dcp_dir)
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'size':<10} {'kind':<21} {'GB':>6} {'s median':>9} {'min-max':>13} {'GB/s':>6} {'/ dd':>5}")
    for r in rows:
        spread = f"{r['min_s']:.2f}-{r['max_s']:.2f}"
        print(f"{r['size']:<10} {r['kind']:<21} {r['bytes'] / 1e9:>6.2f} {r['median_s']:>9.2f} {spread:>13} "
              f"{r['gb_per_s']:>6.2f} {r['vs_dd']:>5.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", choices=SIZES, default=list(SIZES))
    parser.add_argument("--repeats", type=int, default=3, help="writes per size and kind; the median is reported")
    parser.add_argument("--dir", type=Path, default=None,
                        help="where to write (default: a temporary folder in the current directory, removed)")
    parser.add_argument("--json", type=Path, default=None, help="also save the rows to this JSON file")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")

    if args.dir is None:
        root, remove = Path(tempfile.mkdtemp(prefix=".checkpoint_io_", dir=Path.cwd())), True
    else:
        root, remove = args.dir, False
        root.mkdir(parents=True, exist_ok=True)
    machine = {"cpu": cpu_model(), "cores": torch.get_num_threads(), "fs": fs_type(root),
               "torch": torch.__version__, "python": platform.python_version(), "dir": str(root)}
    print(f"machine: {machine['cpu']}, {machine['cores']} threads; file system {machine['fs']}; "
          f"torch {machine['torch']}, Python {machine['python']}", flush=True)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    rows = []
    try:
        for size in args.sizes:
            rows += measure(size, root, args.repeats)
    finally:
        dist.destroy_process_group()
        if remove:
            shutil.rmtree(root, ignore_errors=True)

    print()
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "repeats": args.repeats, "rows": rows}, indent=2) + "\n")
        print(f"saved {args.json}")
    return 0


if __name__ == "__main__":
    exit_process(main(), joined=True)  # its gloo group's threads outlive destroy_process_group: no interpreter shutdown
