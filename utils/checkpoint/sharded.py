"""Sharded checkpoints: one ``torch.distributed.checkpoint`` (DCP) folder per step, of train_fsdp.py, train_mp.py and
train_pp.py.

- ``save_sharded_checkpoint``: every rank writes its own shards into ``step_<step:08d>/``. DCP reshards on load, so
  a run resumes on any number of ranks and under any layout. The folder is written under a hidden name and renamed
  when complete, so ``--resume`` never picks a half-written one; ``asynchronous`` writes it in the background.
- ``load_sharded_checkpoint``: into an already sharded model and its optimizer (collective).
- What a folder holds: contents.py (``sharded_payload``), as for every kind of checkpoint.
- ``python -m utils.checkpoint.sharded export CKPT_DIR OUT.pt`` turns such a folder into one file with the layout of
  train.py's checkpoints (``{"model": state_dict, "optimizer": ...}``), on one process and without a
  process group: ``build_model(cfg).load_state_dict(torch.load(OUT.pt)["model"])`` and
  ``train.py --resume`` read it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from utils.checkpoint.contents import restore_sharded_payload, sharded_payload
from utils.checkpoint.files import (DCP_METADATA, TEMP_PREFIX, CheckpointError, DamagedCheckpointError, StorageError,
                                    barrier, checkpoints_by_step, damage_in, ensure_writable_dir, fsync_dir,
                                    note_write_time, replaced_atomically, write_failure)
from utils.checkpoint.state import TrainState, check_model_settings

# The config keys this file applies, and the scripts that apply them: any other script refuses them set away
# from their defaults (utils/config.py reads every file's APPLIED_BY as a literal, without importing the file).
APPLIED_BY = {
    "ckpt_async": ("train_fsdp.py", "train_mp.py", "train_pp.py"),
}


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def save_sharded_checkpoint(ckpt_dir, step: int, payload: dict, keep: int = 2, asynchronous: bool = False) -> Path:
    """Every rank writes its shards of ``payload`` to ``ckpt_dir/step_{step:08d}/``; keep the ``keep`` newest.

    Collective. DCP writes into a hidden folder, which rank 0 renames once all ranks have finished:
    a job killed mid-save leaves the previous checkpoint as the latest (and a hidden folder that the
    next save removes). ``keep < 1`` keeps every checkpoint.

    ``asynchronous``: ``dcp.async_save`` copies the shards to CPU memory now (so the checkpoint holds this
    step's values, whatever the next steps do to the parameters) and writes them in a background thread
    while training goes on; rank 0 renames the folder as soon as the write is complete (DCP writes the metadata
    after every rank's shards), so a run that dies later resumes from it. The next save, or
    :func:`finish_sharded_checkpoint` (which the scripts call before they report the run's end), waits for that.
    At most one save is in flight.
    """
    global _pending
    finish_sharded_checkpoint()
    started = time.monotonic()
    ckpt_dir = Path(ckpt_dir)
    final = ckpt_dir / f"step_{step:08d}"
    temp = ckpt_dir / f"{TEMP_PREFIX}{step:08d}"
    if _is_main():
        ensure_writable_dir(ckpt_dir)
        for stale in ckpt_dir.glob(TEMP_PREFIX + "*"):
            shutil.rmtree(stale, ignore_errors=True)
    barrier()  # nobody writes into a folder that rank 0 is still clearing
    try:
        if asynchronous:
            future = dcp.async_save(payload, checkpoint_id=temp, process_group=_background_group())
            written = _Written(temp, final, keep)
            future.add_done_callback(written)
            _pending = (future, written, started)
            return final
        dcp.save(payload, checkpoint_id=temp)
    except (OSError, CheckpointException) as error:
        raise _write_failure(error, temp, final) from None
    _publish(temp, final, keep)
    note_write_time(time.monotonic() - started)
    return final


_pending: Optional[tuple] = None  # (future, its _Written, start time) of the save in flight


class _Written:
    """The done-callback of an asynchronous save (it runs in DCP's background thread): the time the write ended,
    and on rank 0 the folder put in place at once (the error, if that fails, is raised by finish)."""

    def __init__(self, temp: Path, final: Path, keep: int):
        self.temp, self.final, self.keep = temp, final, keep
        self.ended, self.error, self.done = None, None, threading.Event()

    def __call__(self, future) -> None:
        self.ended = time.monotonic()
        try:
            if future.exception() is None and _is_main():
                _put_in_place(self.temp, self.final, self.keep)
        except OSError as error:
            self.error = error
        finally:
            self.done.set()


_checkpoint_groups: dict = {}  # default process group -> the gloo group its asynchronous saves use


def _background_group():
    """A gloo group of its own for DCP's background collectives: sharing the training's group with a second
    thread would interleave two streams of collectives (and DCP needs a CPU backend beside NCCL anyway)."""
    if not dist.is_initialized():
        return None
    world = dist.group.WORLD  # a new default group (a test's, a restarted worker's) gets a new twin
    if world not in _checkpoint_groups:
        _checkpoint_groups.clear()
        _checkpoint_groups[world] = dist.new_group(backend="gloo")
    return _checkpoint_groups[world]


def finish_sharded_checkpoint() -> Optional[Path]:
    """Wait for the asynchronous save in flight, if any, and put its folder in place (collective); its path."""
    global _pending
    if _pending is None:
        return None
    (future, written, started), _pending = _pending, None
    try:
        future.result()
        if not written.done.wait(timeout=600):  # result() may return before the callback has run (a rename)
            raise OSError(f"putting {written.final.name} in place took over 600 s")
        if written.error is not None:
            raise written.error
    except (OSError, CheckpointException) as error:
        raise _write_failure(error, written.temp, written.final) from None
    note_write_time(written.ended - started)  # the write's own time, without the steps beside it
    barrier()  # nobody runs ahead (or exits) before the checkpoint is in place
    return written.final


def _write_failure(error: BaseException, temp: Path, final: Path) -> CheckpointError:
    """The one line for a failed write (DCP raises on every rank if any rank failed); the hidden folder removed."""
    if _is_main():
        shutil.rmtree(temp, ignore_errors=True)
    # Every rank raises the same line; utils.training.run_cli prints rank 0's.
    failure = write_failure(error, "checkpoint", final, run_dir=final.parent.parent, ckpt_dir=final.parent)
    if failure is not None:
        return failure
    return CheckpointError(f"could not write checkpoint {final} ({_first_line(error)}): choose another "
                           "--run_dir; the previous checkpoint is intact")


def _publish(temp: Path, final: Path, keep: int) -> None:
    """Rank 0 puts the hidden folder in place once every rank's shards are on disk."""
    barrier()  # every rank's shards are on disk
    if _is_main():
        _put_in_place(temp, final, keep)
    barrier()  # nobody runs ahead (or exits) before the checkpoint is in place


def _put_in_place(temp: Path, final: Path, keep: int) -> None:
    """Rename the complete hidden folder to its final name, and prune older checkpoints (rank 0)."""
    if final.exists():  # a step saved by an earlier run in the same folder
        shutil.rmtree(final)
    os.replace(temp, final)
    fsync_dir(final.parent)
    if keep >= 1:
        older = [path for _, path in checkpoints_by_step(final.parent, sharded=True) if path != final]
        for path in older[: max(0, len(older) - (keep - 1))]:
            shutil.rmtree(path, ignore_errors=True)


def load_sharded_checkpoint(path, model, optimizer, scheduler, scaler, cfg=None) -> TrainState:
    """Load a DCP checkpoint into the already sharded model and its optimizer (any rank count); collective.
    With ``cfg``, first check that it builds the same model (one line naming the keys that differ)."""
    payload = sharded_payload(model, optimizer, scheduler, scaler, TrainState())
    try:
        if cfg is not None:
            saved = {"config": ""}
            dcp.load(saved, checkpoint_id=path)  # the config alone: one small entry
            check_model_settings(json.loads(saved["config"] or "{}"), cfg, path)
        dcp.load(payload, checkpoint_id=path)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as error:  # DCP's is a BaseException
        damage = damage_in(error)
        if damage:
            raise DamagedCheckpointError(path, damage) from None
        if not isinstance(error, CheckpointException):
            raise
        raise CheckpointError(f"checkpoint {path} does not fit this model ({_first_line(error)}): "
                              "resume with the config that wrote it, or start without --resume") from None
    return restore_sharded_payload(payload, model, optimizer, scheduler, scaler)


def _first_line(error: BaseException) -> str:
    """A short reason; for DCP's CheckpointException, that of the first failing rank."""
    if isinstance(error, CheckpointException) and error.failures:
        rank, (cause, _) = min(error.failures.items(), key=lambda item: item[0])
        return f"rank {rank}: {type(cause).__name__}: {_first_line(cause)}"
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:300]


# ----------------------------------------------------------------------------- export to one file


def _optimizer_by_index(optimizer_state: dict) -> dict:
    """get_state_dict's optimizer state (keyed by parameter name) -> ``optimizer.state_dict()``'s (by index).

    Indices count parameters group by group in order, as ``Optimizer.state_dict`` does, and the
    groups list parameters in ``model.parameters()`` order, so they match a plain model's optimizer.
    """
    index: dict[str, int] = {}
    for group in optimizer_state["param_groups"]:
        for name in group["params"]:
            index.setdefault(name, len(index))
    return {"state": {index[name]: state for name, state in optimizer_state["state"].items()},
            "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                             for group in optimizer_state["param_groups"]]}


def export_full_state_dict(checkpoint, out) -> Path:
    """Write DCP checkpoint folder ``checkpoint`` as one file ``out`` in train.py's layout (one process).

    Full (unsharded) tensors on the CPU; needs memory for the whole model and optimizer state.
    """
    checkpoint, out = Path(checkpoint), Path(out)
    if not (checkpoint / DCP_METADATA).is_file():
        raise CheckpointError(f"{checkpoint} is not a complete DCP checkpoint folder (no {DCP_METADATA}): "
                              "pass a step_<N> folder from <run_dir>/checkpoints")
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with replaced_atomically(out) as temp:
            dcp_to_torch_save(checkpoint, temp)
            saved = torch.load(temp, map_location="cpu", weights_only=True)
            rng = saved["rng"]
            cuda_rng = rng.pop("cuda")
            if cuda_rng:  # as capture_rng_state: a list, and only where CUDA was available
                rng["cuda"] = list(cuda_rng)
            torch.save({"model": saved["model"], "optimizer": _optimizer_by_index(saved["optimizer"]),
                        "scheduler": saved["scheduler"],
                        "scaler": saved.get("scaler", {}),  # DCP stores no empty dict (a disabled GradScaler's)
                        "train_state": saved["train_state"], "rng": rng, "config": json.loads(saved["config"])},
                       temp)
    except (OSError, RuntimeError, CheckpointException, KeyError) as error:
        # dcp_to_torch_save writes by path: torch.save's short write arrives as a RuntimeError without errno.
        failure = write_failure(error, "exported checkpoint", out,
                                hint=f"{checkpoint} is unchanged: free space or choose another output file")
        if failure is not None:
            raise failure from None
        if isinstance(error, RuntimeError):
            raise
        raise CheckpointError(f"could not export {checkpoint} to {out} ({_first_line(error)})") from None
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m utils.checkpoint.sharded",
                                     description="Tools for train_fsdp.py's sharded (DCP) checkpoints.")
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export", help="write a DCP checkpoint folder as one train.py-style .pt file")
    export.add_argument("checkpoint", help="a <run_dir>/checkpoints/step_<N> folder")
    export.add_argument("out", help="the .pt file to write")
    args = parser.parse_args(argv)
    try:
        path = export_full_state_dict(args.checkpoint, args.out)
    except StorageError as error:  # before CheckpointError, which it is
        print(f"error: {error}", file=sys.stderr)
        return 4  # as utils.training.run_cli
    except CheckpointError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
