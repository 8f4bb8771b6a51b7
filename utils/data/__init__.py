"""The data layer: files on disk -> (input, target) batches on the device.

- ``common.py``: what every dataset shares: the one-line ``DataError``, HDF5 handles opened lazily per
  process, a stable hash for crops and random streams, the resumable distributed sampler and loader.
- ``files.py``: the files of a split, read without their fields: grid, channel names, the record of time.
- ``era5.py``: gridded fields (Part I's super-resolution, Part II's forecasting, Part IV's diagnostic task) and what
  the config takes from them (channel names, normalisation statistics).
- ``volume.py``: Part III's simulation boxes (3-D crops and their symmetries).
- ``device_pipeline.py``: transforms on the device and a look-ahead copy of the next batch.
- ``foreign.py``: the reading rules for other centres' files (netCDF, GRIB, Zarr): datasets/convert.py's
  library, and predict.py's for inputs it was not trained on. No torch: the converter runs without it.

:func:`build_loaders` is what the training scripts call: it picks the dataset from the config's task.
"""

from __future__ import annotations


def build_loaders(cfg, rank: int = 0, world_size: int = 1, bands=None):
    """(train, validation) loaders of this rank for ``cfg.data.task``; ``bands``: this rank's band of each
    sample (SwinIR's domain parallelism; the gridded tasks only)."""
    from utils.data.era5 import build_era5_loaders  # here, not above: importing the package (for foreign.py) must
    from utils.data.volume import build_volume_loaders  # not import torch, which the datasets import

    if cfg.data.task == "volume":  # Part III: crops of one simulation box
        return build_volume_loaders(cfg, rank, world_size)
    return build_era5_loaders(cfg, rank, world_size, bands)
