"""Atomic, resumable single-file checkpoints (``torch.save``) of train.py and train_ddp.py.

A checkpoint is ``<ckpt_dir>/step_<step:08d>.pt``. It is written to a hidden temporary file in
the same folder, synced to disk, then renamed over the final name: a rename within one file
system is atomic, so a job killed at any moment leaves either the complete new file or none,
and the previous checkpoint untouched. Only names of the form ``step_<digits>.pt`` count as
checkpoints; leftover temporary files are ignored and removed by the next save.

States hold only tensors, numbers, strings, None and lists/tuples/sets/dicts of them, so they load
with ``torch.load(weights_only=True)``, which cannot run code from the file. ``save_checkpoint``
checks this before writing, so a wrong type fails at the first save, not at resume time.

One process writes a folder (rank 0 for DDP); train_fsdp.py's DCP folders: sharded.py.
"""

from __future__ import annotations

import collections
import os
import re
import time
from pathlib import Path
from typing import Any

import torch

from utils.checkpoint.files import (TEMP_PREFIX, CheckpointError, DamagedCheckpointError, checkpoints_by_step,
                                    ensure_writable_dir, fsync_dir, note_write_time, replaced_atomically,
                                    write_failure)

# Types torch.load(weights_only=True) rebuilds. Exact types: numpy scalars subclass float but are
# rejected by the weights-only unpickler.
_LEAF_TYPES = (int, float, bool, complex, str, bytes, type(None), torch.dtype, torch.device, torch.Size)
_CONTAINER_TYPES = (dict, collections.OrderedDict, list, tuple, set)


def _check_weights_only_types(value: Any, where: str) -> None:
    if isinstance(value, torch.Tensor) or type(value) in _LEAF_TYPES:
        return
    if type(value) not in _CONTAINER_TYPES:
        raise CheckpointError(
            f"checkpoint state {where} is a {type(value).__module__}.{type(value).__qualname__}: store only "
            "tensors, numbers, strings, None and lists/tuples/dicts of them (e.g. float(x), "
            "dataclasses.asdict(c)) so the file loads with torch.load(weights_only=True)"
        )
    if isinstance(value, dict):
        for key, item in value.items():
            _check_weights_only_types(key, f"{where} key {key!r}")
            _check_weights_only_types(item, f"{where}[{key!r}]")
    else:
        for index, item in enumerate(value):
            _check_weights_only_types(item, f"{where}[{index}]")


def _remove_stale_temp_files(ckpt_dir: Path) -> None:
    for entry in ckpt_dir.glob(TEMP_PREFIX + "*"):
        entry.unlink(missing_ok=True)


def save_checkpoint(ckpt_dir, step: int, state: dict, keep: int = 2) -> Path:
    """Write ``state`` to ``ckpt_dir/step_{step:08d}.pt`` atomically; keep the ``keep`` newest.

    ``keep < 1`` keeps every checkpoint. The file just written is never pruned, even when the
    folder holds checkpoints of higher steps (e.g. from an earlier run).
    Raises CheckpointError for a state that would not load with weights_only=True and for
    other write failures (permissions), StorageError for a full, over-quota or failing disk;
    nothing half-written is left behind.
    """
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    started = time.monotonic()
    _check_weights_only_types(state, "state")
    ckpt_dir = ensure_writable_dir(ckpt_dir)
    _remove_stale_temp_files(ckpt_dir)
    final_path = ckpt_dir / f"step_{step:08d}.pt"
    try:
        # torch.save writes through this Python file, so a full disk's OSError stays attached to its RuntimeError.
        with replaced_atomically(final_path, prefix=TEMP_PREFIX) as temporary, open(temporary, "wb") as stream:
            torch.save(state, stream)
            stream.flush()
            os.fsync(stream.fileno())
    except (OSError, RuntimeError) as error:  # the temporary file is gone already; a Ctrl-C propagates unchanged
        failure = write_failure(error, "checkpoint", final_path, run_dir=ckpt_dir.parent, ckpt_dir=ckpt_dir)
        if failure is not None:
            raise failure from None
        if not isinstance(error, OSError):
            raise
        raise CheckpointError(
            f"could not write checkpoint {final_path} ({error.strerror or error}): "
            "choose another --run_dir; the previous checkpoint is intact"
        ) from None
    fsync_dir(ckpt_dir)

    if keep >= 1:
        older = [path for _, path in checkpoints_by_step(ckpt_dir) if path != final_path]
        for path in older[: max(0, len(older) - (keep - 1))]:
            path.unlink(missing_ok=True)
    note_write_time(time.monotonic() - started)
    return final_path


def load_checkpoint(path, map_location="cpu", weights_only: bool = True) -> dict:
    """Load a checkpoint written by :func:`save_checkpoint`; CheckpointError if missing or corrupt."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist: check --run_dir, or start without --resume")
    try:
        return torch.load(path, map_location=map_location, weights_only=weights_only)
    except MemoryError:
        raise
    except Exception as error:  # torch raises many types for damaged files (OSError, KeyError, EOFError, ...)
        # The weights-only unpickler also rejects garbage bytes; only "Unsupported global" means a real object.
        foreign = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
        if foreign:
            raise CheckpointError(
                f"checkpoint {path} holds a {foreign.group(1)}, which torch.load(weights_only=True) refuses; "
                "if you trust the file, load it with weights_only=False"
            ) from None
        raise DamagedCheckpointError(path, f"corrupt or truncated: {type(error).__name__}") from None
