"""Normalisation statistics of one split, streamed: NERSC's ``<data_dir>/stats/`` layout.

    python datasets/compute_stats.py --data_dir ROOT [--split train] [--out DIR]

reads every ``ROOT/<split>/*.h5`` (one dataset ``fields`` of shape (samples, C, H, W)) one sample at
a time and writes, float32:

    ROOT/stats/global_means.npy   (1, C, 1, 1)   per channel, over all samples and grid points
    ROOT/stats/global_stds.npy    (1, C, 1, 1)   population std (ddof 0) over the same points
    ROOT/stats/time_means.npy     (1, C, H, W)   mean over all samples: the climatology for ACC

All grid rows are kept (H as stored, e.g. 361; the loader drops the last one itself). Sums are kept
in float64 and the per-channel variance is merged sample by sample (Chan et al.'s pairwise update),
so a large mean (geopotential at 50 hPa, ~2e5) costs no precision. Memory: one sample and the
float64 time sum (C x H x W), whatever the size and number of files. Each .npy is written under a
temporary name and renamed once all three are computed: an error leaves no half-written file, and
the previous statistics, if any, in place.

Bad input (no such folder, no .h5 files, a file without ``fields`` or unreadable, files with
different grids or channel counts) stops with one line on stderr and exit status 2.

From Python: ``compute_stats(data_dir, split="train", out_dir=None) -> {"global_means": ..., ...}``.
Needs numpy and h5py only.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Optional, Sequence

import h5py
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, for utils/ when run as a script
from utils.cli import OneLineParser  # noqa: E402  (the standard library only: no torch here)

FIELDS_KEY = "fields"
STATS_DIR = "stats"
OUTPUTS = ("global_means", "global_stds", "time_means")


class StatsError(ValueError):
    """Bad input for the statistics, as one line naming the path and what is wrong."""


def _split_files(root: Path, split: str) -> list[Path]:
    if not root.is_dir():
        raise StatsError(f"{root}: no such directory; give the data root that holds {split}/<year>.h5")
    split_dir = root / split
    if not split_dir.is_dir():
        found = sorted(p.name for p in root.iterdir() if p.is_dir())
        raise StatsError(f"{split_dir}: no such directory (folders in {root}: {', '.join(found) or 'none'}); "
                         f"choose one with --split")
    files = sorted(split_dir.glob("*.h5"))
    if not files:
        raise StatsError(f"{split_dir}: no .h5 files; expected <year>.h5 files with a dataset '{FIELDS_KEY}'")
    return files


class _Accumulator:
    """Time sum per grid point, and per channel the running mean and sum of squared deviations."""

    def __init__(self, shape: tuple[int, int, int]):
        self.shape = shape
        self.time_sum = np.zeros(shape, dtype=np.float64)
        self.samples = 0
        self.mean = np.zeros(shape[0], dtype=np.float64)
        self.m2 = np.zeros(shape[0], dtype=np.float64)

    def add(self, sample: np.ndarray) -> None:
        x = sample.astype(np.float64)
        self.time_sum += x
        points = x.shape[1] * x.shape[2]
        mean = x.mean(axis=(1, 2))
        m2 = ((x - mean[:, None, None]) ** 2).sum(axis=(1, 2))
        before = self.samples * points
        total = before + points
        delta = mean - self.mean
        self.mean += delta * (points / total)
        self.m2 += m2 + delta**2 * (before * points / total)
        self.samples += 1

    def result(self) -> dict[str, np.ndarray]:
        c, h, w = self.shape
        std = np.sqrt(self.m2 / (self.samples * h * w))
        return {
            "global_means": self.mean.reshape(1, c, 1, 1).astype(np.float32),
            "global_stds": std.reshape(1, c, 1, 1).astype(np.float32),
            "time_means": (self.time_sum / self.samples).reshape(1, c, h, w).astype(np.float32),
        }


def _accumulate(files: Sequence[Path]) -> _Accumulator:
    acc: Optional[_Accumulator] = None
    first: Optional[Path] = None
    for path in files:
        try:
            f = h5py.File(path, "r")
        except OSError as e:
            raise StatsError(f"{path}: cannot be read as HDF5 ({e}); is it truncated or corrupt?") from None
        with f:
            fields = f.get(FIELDS_KEY)
            if not isinstance(fields, h5py.Dataset):
                raise StatsError(f"{path}: no dataset '{FIELDS_KEY}' (found: {', '.join(f.keys()) or 'nothing'})")
            if fields.ndim != 4:
                raise StatsError(f"{path}: '{FIELDS_KEY}' has {fields.ndim} dimensions, shape {fields.shape}; "
                                 f"expected (samples, channels, lat, lon)")
            shape = tuple(fields.shape[1:])
            if acc is None:
                acc, first = _Accumulator(shape), path
            elif shape != acc.shape:
                c0, h0, w0 = acc.shape
                c1, h1, w1 = shape
                raise StatsError(f"{path.parent}: files have different grids or channel counts: {first.name} is "
                                 f"{c0} channels {h0}x{w0}, {path.name} is {c1} channels {h1}x{w1}")
            buffer = np.empty(shape, dtype=np.float32)
            try:
                for t in range(fields.shape[0]):
                    fields.read_direct(buffer, np.s_[t])
                    acc.add(buffer)
            except OSError as e:
                raise StatsError(f"{path}: reading sample {t} failed ({e}); is the file truncated?") from None
    assert acc is not None  # files is not empty
    return acc


def compute_stats(data_dir, split: str = "train", out_dir=None) -> dict[str, np.ndarray]:
    """Compute and write ``global_means.npy``, ``global_stds.npy`` and ``time_means.npy`` of
    ``<data_dir>/<split>`` into ``out_dir`` (default ``<data_dir>/stats``); returns the arrays."""
    root = Path(data_dir)
    files = _split_files(root, split)
    acc = _accumulate(files)
    if acc.samples == 0:
        raise StatsError(f"{root / split}: the files hold no samples")
    arrays = acc.result()
    bad = [name for name, array in arrays.items() if not np.isfinite(array).all()]
    if bad or (arrays["global_stds"] <= 0).any():
        raise StatsError(f"{root / split}: the data holds non-finite values or a constant channel "
                         f"(std 0); cannot normalise it")
    _write_atomically(Path(out_dir) if out_dir is not None else root / STATS_DIR, arrays)
    return arrays


def _write_atomically(out: Path, arrays: dict[str, np.ndarray]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    pending = []
    try:
        for name in OUTPUTS:
            temporary = out / f".{name}.npy.{os.getpid()}.partial"  # pid: concurrent runs do not collide
            pending.append((temporary, out / f"{name}.npy"))
            with open(temporary, "wb") as f:
                np.save(f, arrays[name])
        for temporary, final in pending:
            os.replace(temporary, final)
    except BaseException:
        for temporary, _ in pending:
            temporary.unlink(missing_ok=True)
        raise


def cannot_write(error: OSError, out: Path) -> str:
    """The one line for a failed write under ``out``: the reason and, for a full disk, the free space.

    h5py reports a failed write as an OSError without errno whose text spans lines ("... errno = 28,
    error message = 'No space left on device' ..."): the errno is read from that text.
    """
    found = re.search(r"errno = (\d+)", str(error))
    number = error.errno or (int(found.group(1)) if found else None)
    reason = os.strerror(number) if number else (str(error).strip().splitlines() or [type(error).__name__])[0]
    line = f"cannot write under {out}: {reason}"
    probe = Path(out).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return line
    return f"{line} ({free / 1e6:.1f} MB free on that file system); free space or choose another output folder"


class DefaultsOnce(argparse.ArgumentDefaultsHelpFormatter):
    """"(default: X)" where an option has a default worth naming, once: not where its help names it already, nor
    for None, an empty list or a flag (as the training scripts' --help)."""

    def _get_help_string(self, action):
        if "default" in (action.help or "") or action.default in (None, [], False, argparse.SUPPRESS):
            return action.help
        return super()._get_help_string(action)


@contextmanager
def errors_as_one_line(parser: argparse.ArgumentParser, known: type[Exception], out: Path, interrupted: str):
    """The datasets/ commands' exits: bad input (``known``: the message is the line) and a failed write under
    ``out`` (``cannot_write``) stop with one line and status 2; Ctrl-C with status 130 and the line
    "interrupted; ``interrupted``", which says what the interrupted command left behind."""
    try:
        yield
    except known as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    except OSError as e:
        parser.exit(2, f"{parser.prog}: error: {cannot_write(e, out)}\n")
    except KeyboardInterrupt:
        parser.exit(130, f"{parser.prog}: interrupted; {interrupted}\n")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = OneLineParser(
        description="Per-channel mean/std and time-mean field of a split, streamed: <data_dir>/stats/*.npy.",
        formatter_class=DefaultsOnce,
    )
    parser.add_argument("--data_dir", "--data-dir", required=True, type=Path, help="data root (holds <split>/)")
    parser.add_argument("--split", default="train", help="split folder to average over")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default <data_dir>/stats)")
    args = parser.parse_args(argv)
    out = args.out if args.out is not None else args.data_dir / STATS_DIR
    with errors_as_one_line(parser, StatsError, out, "nothing written"):
        arrays = compute_stats(args.data_dir, args.split, out)
    _, c, h, w = arrays["time_means"].shape
    print(f"wrote {', '.join(name + '.npy' for name in OUTPUTS)} under {out} ({c} channels, {h}x{w}, "
          f"from {args.data_dir / args.split})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
