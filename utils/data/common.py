"""What every dataset of the project shares: the one-line data error, HDF5 handles opened lazily per
process, a stable hash for crop positions and random streams, and the resumable distributed
sampler and DataLoader that every script uses.
"""

from __future__ import annotations

import itertools
import os
import signal
from pathlib import Path

import h5py
import torch
from torch.utils.data import DataLoader, DistributedSampler, Subset


class DataError(ValueError):
    """A data problem, as one line naming the path, what is wrong and what to do.

    Raised in a DataLoader worker, it reaches the main process re-wrapped with the worker's
    traceback; the constructor keeps only the original message so the one-line promise holds.
    """

    def __init__(self, message: str):
        super().__init__(_original_message(str(message)))


def _original_message(message: str) -> str:
    if "Original Traceback" not in message:
        return message
    last = [line for line in message.splitlines() if line.strip()][-1]
    _, sep, rest = last.partition("DataError: ")
    return rest if sep else last


def h5_reason(error: Exception) -> str:
    """h5py's first line, without its errno prefix: "truncated file: eof = ...", "file signature not found"."""
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    return text.split("(", 1)[-1].rstrip(")") if text.startswith("Unable to") else text


def open_h5(path: Path) -> h5py.File:
    # Default locking on purpose: HDF5 refuses a second open of one file in a process with other
    # flags. Where the file system has no flock (some Lustre mounts), export HDF5_USE_FILE_LOCKING=FALSE.
    try:
        return h5py.File(path, "r")
    except PermissionError:
        raise DataError(f"{path}: permission denied; make the file readable (chmod a+r) or copy it") from None
    except OSError as e:
        raise DataError(
            f"{path}: cannot be read as HDF5 ({h5_reason(e)}); the file is truncated or corrupt: "
            "download or generate it again"
        ) from None


class LazyH5:
    """HDF5 datasets opened lazily in the process that reads them, for a Dataset class to inherit.

    Each DataLoader worker opens its own handles: HDF5 handles must not cross fork, so a forked worker
    drops those it inherited, and pickling (into spawned workers) leaves them behind. ``_handles`` maps
    the caller's key to (file, dataset); ``close()`` closes them (a later read reopens).
    """

    _handles: dict = {}
    _pid: int = -1

    def h5_dataset(self, key, path: Path, name: str) -> h5py.Dataset:
        if self._pid != os.getpid():
            self._handles, self._pid = {}, os.getpid()
        if key not in self._handles:
            opened = [h5 for h5, _ in self._handles.values() if h5.id.valid and Path(h5.filename) == Path(path)]
            h5 = opened[0] if opened else open_h5(path)
            if not isinstance(h5.get(name), h5py.Dataset):
                h5.close()
                raise DataError(f"{path}: no dataset '{name}' any more; was the file replaced while training?")
            self._handles[key] = (h5, h5[name])
        return self._handles[key][1]

    def close(self) -> None:
        """Close the HDF5 files this process opened (a later read reopens them)."""
        if self._pid == os.getpid():
            for h5, _ in self._handles.values():
                h5.close()
        self._handles = {}

    def __getstate__(self):
        # Pickled into spawned workers: handles stay behind, the rest (e.g. a shared epoch) travels.
        state = self.__dict__.copy()
        state["_handles"] = {}
        return state

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: h5py may already be gone
            pass


_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """One step of splitmix64: a cheap, well-mixed 64-bit hash, the same in every process."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def stable_hash(*values: int) -> int:
    """A 64-bit hash of integers, the same in every process and run (unlike Python's hash)."""
    h = 0
    for v in values:
        h = splitmix64(h ^ (v & _MASK64))
    return h


STEP_STREAM = 3  # the model's random draws of a step (utils.training.seed_step), unrelated to the crops' streams


class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler (same permutation of seed + epoch) that can start mid-epoch.

    Rank r takes positions r, r + N, r + 2N, ... of the epoch's permutation, so the k-th local
    batches of N ranks together are exactly the k-th global batch of one process that uses
    ``num_replicas=1`` and a batch N times larger (with ``drop_last`` on both). ``set_epoch`` also
    sets the dataset's epoch (its crops) when the dataset has ``set_epoch``.
    """

    def __init__(self, dataset, num_replicas: int = 1, rank: int = 0, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, batch_size: int = 1):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.batch_size = batch_size
        self.start_index = 0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Select the epoch and skip this rank's first ``start_batch`` batches of it (resume)."""
        if start_batch < 0:
            raise ValueError(f"start_batch must be >= 0, got {start_batch}")
        super().set_epoch(epoch)
        self.start_index = min(start_batch * self.batch_size, self.num_samples)
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __iter__(self):
        return itertools.islice(super().__iter__(), self.start_index, None)

    def padding_mask(self, start: int, count: int) -> torch.Tensor:
        """True for the real samples among this rank's samples ``start .. start + count - 1`` (of this epoch).

        Without drop_last, DistributedSampler repeats samples so every rank gets as many: the repeats
        sit at global positions >= len(dataset). Evaluation leaves them out, so its metrics do not
        depend on the number of ranks, while every rank still runs the same number of batches.
        """
        positions = self.rank + (self.start_index + start + torch.arange(count)) * self.num_replicas
        return positions < len(self.dataset)

    def __len__(self) -> int:
        return self.num_samples - self.start_index


def ignore_stop_signals(_worker_id: int = 0) -> None:
    """In a DataLoader worker: leave SIGTERM and SIGUSR1 to the training process. A job's stop signal reaches
    every process of the job step; a worker that died of it would fail the training process's next batch
    before it could checkpoint (utils.training.StopRequest). The loader still stops its workers itself."""
    for signum in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, signal.SIG_IGN)


def build_dataloader(dataset, batch_size: int, *, shuffle: bool, seed: int = 0, rank: int = 0, world_size: int = 1,
                     num_workers: int = 0, pin_memory: bool = False, persistent_workers: bool = False,
                     prefetch_factor: int = 2, drop_last: bool = False) -> DataLoader:
    """DataLoader over a ResumableDistributedSampler (``loader.sampler``) of the global rank.

    The loader has its own torch.Generator: by default every ``iter(loader)`` draws a worker seed
    from the global RNG, which would shift the model's random stream (dropout, drop path) by when
    epochs start, and break bit-exact resumption.

    ``batch_size`` is per rank. Call ``loader.sampler.set_epoch(epoch[, start_batch])`` before each
    epoch. Worker options apply only with ``num_workers > 0``; pinning only when CUDA is present.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    sampler = ResumableDistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed,
                                          drop_last=drop_last, batch_size=batch_size)
    workers = {}
    if num_workers > 0:
        workers = dict(persistent_workers=persistent_workers, prefetch_factor=prefetch_factor,
                       worker_init_fn=ignore_stop_signals)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                      pin_memory=pin_memory and torch.cuda.is_available(), drop_last=drop_last,
                      generator=torch.Generator().manual_seed(seed), **workers)


def relative_note(path: Path) -> str:
    """For a relative path that does not exist: where it was looked for, and whether the repository has it."""
    repo = Path(__file__).resolve().parents[2]
    if path.is_absolute() or Path.cwd().resolve() == repo:
        return ""
    in_repo = repo / path
    there = "exists there: run from the repository" if in_repo.exists() else "is not there either"
    return f" (relative to the current directory {Path.cwd()}; from the repository root {in_repo} {there})"


def evenly_spaced(dataset, samples: int, subset: type[Subset] = Subset):
    """``samples`` samples spread over the whole dataset (all of it when 0 or larger), so a short run still
    spans the seasons."""
    if not samples or samples >= len(dataset):
        return dataset
    stride = len(dataset) / samples
    return subset(dataset, [int(i * stride) for i in range(samples)])


class SubsetWithEpoch(Subset):
    """A Subset of an ERA5Dataset that still takes ``set_epoch`` (new training crops each epoch)."""

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)
