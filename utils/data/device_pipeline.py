"""The input pipeline's last stage on the training device (Step 0c): copy, prefetch, transform.

NERSC's tutorials move the input pipeline to the GPU with NVIDIA DALI. This project does the same
two things with PyTorch alone, so that it installs from PyPI on any machine, runs on a laptop CPU,
and keeps the data sets' own readers (DALI would need its own HDF5 reader and its own sampler,
and with them a second place where order and resumption are decided):

- ``device_transforms``: the work done per sample in the loader moves after the copy, done once per
  batch: SwinIR's bicubic downsampling (the loader then hands out the high-res field only: half
  the bytes to copy with upscale 2), and Part III's 48 symmetries (utils/data/volume.py).
- ``prefetch_to_device``: batch k+1 is copied on a side CUDA stream while step k computes. PyTorch
  has no such prefetcher (DataLoader's ``pin_memory`` only pins; its copies are issued by the
  training loop on the compute stream, right before the step needs them), hence this one.

Only training loaders are wrapped: validation reads (input, target) pairs on the host, as before,
so its figures do not depend on these keys. The wrapper keeps everything but iteration of the loader
it wraps (``sampler``, ``dataset``, ``len``, ``num_workers``), so the training scripts, their
``sampler.set_epoch`` and the throughput breakdown use it as any loader; their ``.to(device)`` leaves
batches that are already there as they are.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch

from utils.parallel.distributed import device_for, read_dist_env


def training_device(cfg) -> torch.device:
    """The device the training script picks (utils.training.pick_device): where device-side work happens."""
    if cfg.train.device == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return device_for(read_dist_env())


class DeviceLoader:
    """A training loader whose batches arrive on ``device``, optionally prefetched, then transformed there.

    ``transform(on_device, on_host)`` turns the moved tensors (all but the last ``host_fields`` of each
    batch) and the ones left on the host into the (inputs, target) the training step takes; ``None``
    yields the moved batch itself. Host fields are small descriptors (the volume's symmetry codes):
    reading them on the host needs no device synchronisation.
    """

    def __init__(self, loader, device: torch.device, transform: Optional[Callable] = None, prefetch: bool = False,
                 host_fields: int = 0):
        self.loader, self.device, self.transform, self.host_fields = loader, device, transform, host_fields
        self.prefetch = prefetch
        # The copies go to a side stream only where they are asynchronous (CUDA); elsewhere the look-ahead stays.
        self.stream = torch.cuda.Stream(device) if prefetch and device.type == "cuda" else None

    def _next(self, batches: Iterator) -> Optional[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """The next batch, its copies queued (on the side stream when prefetching on CUDA); None at the end."""
        batch = next(batches, None)
        if batch is None:
            return None
        split = len(batch) - self.host_fields
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            moved = [tensor.to(self.device, non_blocking=True) for tensor in batch[:split]]
        return moved, list(batch[split:])

    def _ready(self, moved: list[torch.Tensor]) -> None:
        """Make the compute stream wait for the side stream's copies, and keep their memory from being reused by
        the side stream's next batch while the compute stream still reads them."""
        if self.stream is None:
            return
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self.stream)
        for tensor in moved:
            tensor.record_stream(current)

    def __iter__(self) -> Iterator:
        batches = iter(self.loader)
        upcoming = self._next(batches)
        while upcoming is not None:
            moved, host = upcoming
            self._ready(moved)
            if self.prefetch:
                upcoming = self._next(batches)  # batch k+1's copy is queued before step k's kernels
            yield self.transform(moved, host) if self.transform else moved
            if not self.prefetch:
                upcoming = self._next(batches)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str):
        return getattr(self.loader, name)



def on_device(loader, cfg, transform: Optional[Callable] = None, host_fields: int = 0):
    """The training loader wrapped in a DeviceLoader when there is device-side work (a transform, or
    ``prefetch_to_device``); else the loader itself, so the default pipeline is plain DataLoader."""
    if transform is None and not cfg.data.prefetch_to_device:
        return loader
    return DeviceLoader(loader, training_device(cfg), transform, cfg.data.prefetch_to_device, host_fields)
