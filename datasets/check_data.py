"""Check a data folder against what a config reads, before a long job: the training scripts' own loaders
open it (every check of a real run), then every file is listed with its datasets' shapes and its size.

    python datasets/check_data.py --config vit_base --data_dir $SCRATCH/sc23_data         # Part II: NERSC's ERA5
    python datasets/check_data.py --config unet3d_base --data_dir $SCRATCH/sc22_data      # Part III: SC22's boxes
    python datasets/check_data.py --config baseline                     # Part I: SuperBench's, linked to datasets/era5

Any config key can be given as in the training scripts (--train_split, --valid_split, ...). Exit status 0:
the folder holds what the config reads; 2: one line that says what is wrong (a missing split, file, dataset
or statistics file, the wrong channel count or grid, a truncated file). A data_dir without the training split but
with folders below it that hold one (an unpacked tar: $SCRATCH/superbench) names those folders.
"""

from __future__ import annotations

import sys
from pathlib import Path

import h5py
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, for utils/

from utils.config import ConfigError, parse_config  # noqa: E402
from utils.data import build_loaders  # noqa: E402
from utils.data.common import DataError  # noqa: E402
from utils.data.files import lead_time, scan_split  # noqa: E402


def data_files(cfg) -> list[Path]:
    """The files the config reads: the splits' HDF5 files and, for forecasting, the statistics."""
    root, d = Path(cfg.data.data_dir), cfg.data
    if d.task == "volume":
        return [root / f"{d.train_split}.h5", root / f"{d.valid_split}.h5"]
    files = [f for split in (d.train_split, d.valid_split) for f in sorted((root / split).glob("*.h5"))]
    return files + (sorted((root / "stats").glob("*.npy")) if d.task == "forecast" else [])


def folders_holding(root: Path, split: str, depth: int = 3) -> list[Path]:
    """Folders at most ``depth`` levels below ``root`` that hold a ``split`` folder of .h5 files."""
    found, level = [], [root]
    for _ in range(depth):
        level = [child for folder in level for child in sorted(folder.iterdir()) if child.is_dir()]
        found += [folder for folder in level if any((folder / split).glob("*.h5"))]
    return found


def describe(path: Path) -> str:
    if path.suffix == ".npy":
        array = np.load(path, mmap_mode="r")
        return f"{path}: {tuple(array.shape)} {array.dtype}"
    with h5py.File(path, "r") as f:
        datasets = [f"{key} {tuple(f[key].shape)} {f[key].dtype}" for key in f if isinstance(f[key], h5py.Dataset)]
    return f"{path}: {', '.join(datasets)}; {path.stat().st_size / 1e9:.2f} GB"


def main() -> int:
    cfg = parse_config(__doc__)
    root, split = Path(cfg.data.data_dir), cfg.data.train_split
    if cfg.data.task != "volume" and root.is_dir() and not (root / split).exists():
        below = folders_holding(root, split)
        if below:
            print(f"check_data.py: error: {root} has no {split}/ folder; these below it have one: "
                  f"{', '.join(map(str, below))}: pass the one of your data as --data_dir, or link it where the "
                  f"config looks (ln -sfn FOLDER datasets/era5)", file=sys.stderr)
            return 2
    try:
        train, valid = build_loaders(cfg)
        files = data_files(cfg)
        lines = [describe(path) for path in files]
    except (DataError, ConfigError, OSError) as error:
        print(f"check_data.py: error: {error}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    total = sum(path.stat().st_size for path in files) / 1e9
    lead = ""
    if cfg.data.task == "forecast":  # the lead in the data's own unit ("6 h", "1 month")
        step = scan_split(Path(cfg.data.data_dir) / cfg.data.train_split)[0].step
        lead = f" (forecast lead {lead_time(step, cfg.data.lead)})"
    print(f"ok: {cfg.data.data_dir} holds what --config {cfg.name} reads: {len(train.dataset)} training and "
          f"{len(valid.dataset)} validation samples{lead}, {len(files)} files, {total:.2f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
