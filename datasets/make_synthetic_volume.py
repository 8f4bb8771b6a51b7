"""Write a synthetic stand-in for SC22's N-body -> hydrodynamics boxes (Part III), in their layout.

    python datasets/make_synthetic_volume.py --out datasets/synthetic_volume --train-side 96 --valid-side 64 --seed 0

writes ``<out>/train.h5`` (a ``train-side``³ box) and ``<out>/valid.h5`` (a ``valid-side``³ box, another
realisation), each with SC22's two float32 datasets over one periodic grid, stored as SC22 stores them —
scaled for a tanh output, densities as log(rho) / 14 (SC22's loss undoes it with exp(14 x)):

    Nbody (4, N, N, N)  dark matter: density, velocity along grid axes 0, 1, 2
    Hydro (5, N, N, N)  gas: density, temperature, velocity along grid axes 0, 1, 2

How the fields are made, so that the mapping is the physics a U-Net has to learn, not noise:
- The dark matter's density contrast is a Gaussian random field with a power-law spectrum
  (P(k) ~ k^-2.5, cut off below two cells), made log-normal: rho_dm = exp(delta - sigma^2 / 2), mean 1,
  with voids and dense filaments and knots. Its velocity is linear theory's: the gradient of the
  potential whose Laplacian is delta (v_k = i k delta_k / k^2), scaled to an rms of 0.25.
- Gas follows the dark matter on large scales but its pressure smooths it below the filtering (Jeans)
  scale: rho_gas and v_gas are rho_dm and v_dm smoothed by a Gaussian of 1.5 cells.
- Gas temperature follows the intergalactic medium's temperature-density relation, T = T0 rho_gas^0.6
  (gamma = 1.6), heated further where the gas is dense (shocks): x (1 + (rho_gas / 10)^2)^0.5; stored as
  log(T / T0) / 14.
So every target is a smoothed, nonlinear function of the inputs in a neighbourhood of a few cells: a
convolutional network can learn it, and predicting each channel's mean (the baseline) is far from it.

The spectrum is set per cell, so a bigger box is more of the same universe at the same resolution (as
SC22's 1024³ training and 512³ validation boxes). Boxes are made in memory (about 50 float64 copies of
the grid: 256³ takes 7 GB). ``Hydro`` records each channel's mean over the box (attribute ``mean``:
the baseline's prediction), both datasets their channel names and vector components. A file is written
to ``<name>.<pid>.partial`` and renamed when complete; its content depends only on (seed, split, side).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

import h5py
import numpy as np
from tqdm import tqdm

try:  # python datasets/make_synthetic_volume.py, or imported as datasets.make_synthetic_volume
    from .compute_stats import OneLineParser, errors_as_one_line
except ImportError:
    from compute_stats import OneLineParser, errors_as_one_line

INPUT_NAMES = ("dm density", "dm vx", "dm vy", "dm vz")
TARGET_NAMES = ("gas density", "temperature", "gas vx", "gas vy", "gas vz")
INPUT_VECTORS, TARGET_VECTORS = [[1, 2, 3]], [[2, 3, 4]]
LOG_SCALE = 14.0  # SC22's: stored density = log(rho) / 14
SLOPE, CUTOFF_CELLS, SIGMA = 2.5, 2.0, 1.0  # spectrum k^-SLOPE, cut off below CUTOFF_CELLS; std of delta
VELOCITY_RMS = 0.25
JEANS_CELLS = 1.5  # gas smoothing
GAMMA, SHOCK_DENSITY = 1.6, 10.0
SPLITS = {"train": 1, "valid": 2}  # seeds the realisation of each split
STEPS = ("dark matter density", "dark matter velocity", "gas", "write")


class GenerationError(ValueError):
    """Arguments that cannot make a box: one line."""


def _wavenumbers(side: int) -> tuple[np.ndarray, ...]:
    """Angular wavenumbers (radians per cell) of an rfftn grid, broadcastable: (k0, k1, k2)."""
    full = 2 * np.pi * np.fft.fftfreq(side)
    half = 2 * np.pi * np.fft.rfftfreq(side)
    return full[:, None, None], full[None, :, None], half[None, None, :]


def _smooth(field: np.ndarray, cells: float, k2: np.ndarray) -> np.ndarray:
    return np.fft.irfftn(np.fft.rfftn(field) * np.exp(-0.5 * k2 * cells ** 2), s=field.shape, axes=(0, 1, 2))


def make_box(side: int, seed: int, split: str, bar=None) -> tuple[np.ndarray, np.ndarray]:
    """(Nbody (4, N, N, N), Hydro (5, N, N, N)) float32 of one split; see the module docstring."""
    rng = np.random.default_rng([seed, SPLITS.get(split, sum(map(ord, split)))])
    k = _wavenumbers(side)
    k2 = k[0] ** 2 + k[1] ** 2 + k[2] ** 2
    kc = 2 * np.pi / CUTOFF_CELLS
    with np.errstate(divide="ignore"):
        amplitude = np.where(k2 > 0, k2 ** (-SLOPE / 4) * np.exp(-0.5 * k2 / kc ** 2), 0.0)  # sqrt of P(k)
    delta_k = np.fft.rfftn(rng.standard_normal((side,) * 3)) * amplitude
    delta = np.fft.irfftn(delta_k, s=(side,) * 3, axes=(0, 1, 2))
    scale = SIGMA / delta.std()
    delta, delta_k = delta * scale, delta_k * scale
    rho_dm = np.exp(delta - SIGMA ** 2 / 2)
    rho_dm /= rho_dm.mean()
    _tick(bar)

    with np.errstate(divide="ignore", invalid="ignore"):
        potential_k = np.where(k2 > 0, delta_k / k2, 0.0)
    v_dm = np.stack([np.fft.irfftn(1j * ki * potential_k, s=(side,) * 3, axes=(0, 1, 2)) for ki in k])
    v_dm *= VELOCITY_RMS / np.sqrt((v_dm ** 2).sum(axis=0).mean() / 3)
    _tick(bar)

    rho_gas = np.maximum(_smooth(rho_dm, JEANS_CELLS, k2), 1e-6)  # > 0 but for rounding
    v_gas = np.stack([_smooth(v, JEANS_CELLS, k2) for v in v_dm])
    log_t = (GAMMA - 1) * np.log(rho_gas) + 0.5 * np.log1p((rho_gas / SHOCK_DENSITY) ** 2)
    _tick(bar)

    nbody = np.concatenate([np.log(rho_dm)[None] / LOG_SCALE, v_dm]).astype(np.float32)
    hydro = np.concatenate([np.log(rho_gas)[None] / LOG_SCALE, log_t[None] / LOG_SCALE, v_gas]).astype(np.float32)
    return nbody, hydro


def _tick(bar) -> None:
    if bar is not None:
        bar.update(1)


def write_box(path: Path, nbody: np.ndarray, hydro: np.ndarray, seed: int, split: str) -> Path:
    """One split's file, atomically: written to ``<name>.<pid>.partial``, renamed once complete."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        with h5py.File(partial, "w") as f:
            chunk = min(32, nbody.shape[1])  # a crop reads the tiles it touches, not whole planes
            for key, data, names, vectors in (("Nbody", nbody, INPUT_NAMES, INPUT_VECTORS),
                                              ("Hydro", hydro, TARGET_NAMES, TARGET_VECTORS)):
                dataset = f.create_dataset(key, data=data, chunks=(1, chunk, chunk, chunk))
                dataset.attrs["channels"] = list(names)
                dataset.attrs["vectors"] = vectors
            f["Hydro"].attrs["mean"] = hydro.astype(np.float64).mean(axis=(1, 2, 3))
            f.attrs.update({"synthetic": True, "seed": seed, "split": split,
                            "generator": "datasets/make_synthetic_volume.py"})
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return path


def make_synthetic_volume(out, train_side: int = 96, valid_side: int = 64, seed: int = 0,
                          splits: Sequence[str] = ("train", "valid"), progress: Optional[bool] = None) -> list[Path]:
    """Write ``<out>/<split>.h5`` for each split (train: ``train_side``³, the others ``valid_side``³)."""
    sides = {split: train_side if split == "train" else valid_side for split in splits}
    bad = {split: side for split, side in sides.items() if side < 4}
    if bad:
        raise GenerationError(f"box sides must be >= 4 cells, got {bad}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    show = sys.stderr.isatty() if progress is None else progress
    files = []
    with tqdm(total=len(sides) * len(STEPS), unit="step", disable=not show, desc="synthetic volume") as bar:
        for split, side in sides.items():
            bar.set_postfix(split=split, side=side)
            nbody, hydro = make_box(side, seed, split, bar)
            files.append(write_box(out / f"{split}.h5", nbody, hydro, seed, split))
            bar.update(1)
    return files


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = OneLineParser(description="Write a synthetic stand-in for SC22's N-body -> hydro boxes "
                                       "(<out>/train.h5, <out>/valid.h5; datasets Nbody and Hydro).",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="output folder (one file per split)")
    parser.add_argument("--train-side", type=int, default=96, help="side of the training box in cells (SC22: 1024)")
    parser.add_argument("--valid-side", type=int, default=64, help="side of the validation box in cells (SC22: 512)")
    parser.add_argument("--seed", type=int, default=0, help="same seed, same bytes")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    with errors_as_one_line(parser, GenerationError, args.out, "completed files were kept, the partial one removed"):
        try:
            files = make_synthetic_volume(args.out, args.train_side, args.valid_side, args.seed,
                                          progress=False if args.quiet else None)
        except MemoryError:  # this command alone builds whole boxes in memory: its own line
            parser.exit(2, f"{parser.prog}: error: not enough memory for these boxes (about 50 float64 copies of "
                           "the grid); use smaller --train-side/--valid-side\n")
    size_mb = sum(f.stat().st_size for f in files) / 1e6
    print(f"wrote {len(files)} files ({size_mb:.0f} MB) under {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
