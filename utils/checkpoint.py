"""Atomic, resumable single-file checkpoints (``torch.save``) and the RNG state that goes in them.

A checkpoint is ``<ckpt_dir>/step_<step:08d>.pt``. It is written to a hidden temporary file in
the same folder, synced to disk, then renamed over the final name: a rename within one file
system is atomic, so a job killed at any moment leaves either the complete new file or none,
and the previous checkpoint untouched. Only names of the form ``step_<digits>.pt`` count as
checkpoints; leftover temporary files are ignored and removed by the next save.

States hold only tensors, numbers, strings, None and lists/tuples/sets/dicts of them, so they load
with ``torch.load(weights_only=True)``, which cannot run code from the file. ``save_checkpoint``
checks this before writing, so a wrong type fails at the first save, not at resume time.

One process writes a folder (rank 0 for DDP); FSDP runs use ``torch.distributed.checkpoint``.

Every write of a run (checkpoints, metrics, pictures, profiles) goes through :func:`reporting_write_failures`
or :func:`write_failure`: a full, over-quota or failing file system becomes one :class:`StorageError` line
(exit code 4) that names the file, the free space and the last good checkpoint, and says how to resume.
:func:`prepare_run_dir` is the training scripts' start-up check of ``--run_dir``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import os
import pickle
import random
import re
import shutil
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, TypeVar

import numpy as np
import torch
import torch.distributed as dist

CHECKPOINT_NAME = re.compile(r"^step_(\d+)\.pt$")
SHARDED_CHECKPOINT_NAME = re.compile(r"^step_(\d+)$")
"""train_fsdp.py's DCP folders (utils/parallel/fsdp.py); complete once they hold DCP_METADATA, which DCP writes last."""
DCP_METADATA = ".metadata"
METRICS_FILE = "metrics.jsonl"
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO})
"""No space, over quota, I/O error: the file system, not the program, stopped the write."""
# torch.save's zip writer reports a short write as a RuntimeError ("[enforce fail at inline_container.cc]
# unexpected pos ...", "file write failed"); the OSError behind it is its __context__ only when torch
# wrote through a Python file object, so the message itself must be recognised too.
_TORCH_WRITE_FAILED = re.compile(r"unexpected pos|file write failed|failed writing")
TEMP_PREFIX = ".tmp-step_"
DAMAGED_PREFIX = "damaged-"
"""A checkpoint that did not load under --resume auto is renamed to this prefix + its name (kept, not deleted)."""
_UNREADABLE = (OSError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile)
_UNREADABLE_WORDS = re.compile(r"read failed|truncated|Ran out of input|PytorchStreamReader|unexpected EOF|corrupt")
"""What torch.load and DCP's readers say of bytes that are not there or not what was written."""
WRAPPER_COMPONENTS = frozenset({"module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})
"""Key components added by DDP / DataParallel, torch.compile, activation checkpointing and FSDP1."""

# Types torch.load(weights_only=True) rebuilds. Exact types: numpy scalars subclass float but are
# rejected by the weights-only unpickler.
_LEAF_TYPES = (int, float, bool, complex, str, bytes, type(None), torch.dtype, torch.device, torch.Size)
_CONTAINER_TYPES = (dict, collections.OrderedDict, list, tuple, set)


class CheckpointError(RuntimeError):
    """A checkpoint problem, reported as one line that says what to do."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint that cannot be read (truncated, corrupt, a DCP folder missing shards): ``--resume auto`` sets
    it aside and resumes from the one before (:func:`load_newest`)."""

    def __init__(self, path, reason: str):
        previous = [p.name for _, p in checkpoints_by_step(Path(path).parent, sharded=Path(path).is_dir())
                    if p != Path(path)]
        hint = f"resume from the previous one ({previous[-1]})" if previous else "start the run again"
        super().__init__(f"checkpoint {path} is damaged ({reason}): delete it and {hint}, or resume with "
                         "--resume auto, which sets it aside itself")
        self.path, self.reason = Path(path), reason


class StorageError(CheckpointError):
    """A write failed because the file system is full, over quota or failing (utils.training.run_cli: exit 4).

    A CheckpointError, so that code which handles a failed checkpoint write handles this one too."""


@dataclass
class TrainState:
    """Where training is: enough, with the RNG states, to continue exactly."""

    step: int = 0
    """Optimizer steps taken."""
    epoch: int = 0
    """Current epoch."""
    batch_in_epoch: int = 0
    """Batches of the current epoch already consumed."""


def ensure_writable_dir(path) -> Path:
    """Create ``path`` (with parents) and prove it is writable; raise CheckpointError if not.

    Checked at start-up so a read-only or mistyped run directory fails in the first second,
    not at the first checkpoint hours later.
    """
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as error:
        failure = write_failure(error, "run directory", path, hint="free space or choose another --run_dir")
        if failure is not None:
            raise failure from None
        reason = error.strerror or type(error).__name__
        raise CheckpointError(
            f"run directory {path} is not writable ({reason}): choose another with --run_dir"
        ) from None
    return path


# ----------------------------------------------------------------------------- failed writes


def _storage_cause(error: Optional[BaseException]) -> Optional[OSError]:
    """The OSError with a STORAGE_ERRNOS errno in ``error``, its causes, or the per-rank failures of DCP's
    CheckpointException; None if there is none."""
    seen = set()
    pending = [error]
    while pending:
        error = pending.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in STORAGE_ERRNOS:
            return error
        pending += [error.__cause__, error.__context__]
        for failure in (getattr(error, "failures", None) or {}).values():  # {rank: exception or (exception, tb)}
            pending.append(failure[0] if isinstance(failure, tuple) else failure)
    return None


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def format_bytes(size: float) -> str:
    if size < 1000:
        return f"{size:.0f} B"
    for unit in ("kB", "MB", "GB"):
        size /= 1000
        if size < 1000:
            return f"{size:.1f} {unit}"
    return f"{size / 1000:.1f} TB"


def free_space(path) -> str:
    """"1.2 GB free of 500.0 GB" on the file system that holds ``path`` (or its nearest existing parent)."""
    try:
        usage = shutil.disk_usage(_existing(Path(path).absolute()))
    except OSError:
        return "free space unknown"
    return f"{format_bytes(usage.free)} free of {format_bytes(usage.total)}"


def newest_complete_checkpoint(ckpt_dir) -> Optional[Path]:
    """The complete checkpoint with the highest step of either kind: a step_N.pt file (train.py,
    train_ddp.py) or a DCP step_N folder holding its metadata (train_fsdp.py); None if there is none."""
    ckpt_dir = Path(ckpt_dir)
    found = checkpoints_by_step(ckpt_dir) + checkpoints_by_step(ckpt_dir, sharded=True)
    return max(found)[1] if found else None


def find_run_dir(path) -> Optional[Path]:
    """The run folder that ``path`` (e.g. <run_dir>/samples/step_5.png) lies in: the nearest of its parents
    with a checkpoints/ folder or a metrics.jsonl; None outside a run."""
    for folder in list(Path(path).parents)[:3]:
        if (folder / "checkpoints").is_dir() or (folder / METRICS_FILE).is_file():
            return folder
    return None


def write_failure(error: BaseException, what: str, path, *, run_dir=None, ckpt_dir=None,
                  hint: str = "free space and run the command again") -> Optional[StorageError]:
    """A one-line StorageError for ``error`` if it is a failed write of ``what`` to ``path``
    (ENOSPC, EDQUOT, EIO, or torch.save's short write), else None: the caller re-raises ``error`` unchanged.

    With ``run_dir`` (a training run's folder) the line names the newest complete checkpoint in
    ``ckpt_dir`` (default <run_dir>/checkpoints), which the failed write did not touch, and how to
    resume; otherwise it ends with ``hint``.
    """
    cause = _storage_cause(error)
    if cause is None and not (isinstance(error, RuntimeError) and _TORCH_WRITE_FAILED.search(str(error))):
        return None
    path = Path(path)
    if cause is not None:
        reason = cause.strerror or os.strerror(cause.errno)
        if cause.filename and not Path(cause.filename).absolute().is_relative_to(path.absolute().parent):
            reason += f" writing {cause.filename}"  # a temporary file elsewhere, e.g. in /tmp
    else:
        reason = "the write failed"
    line = f"could not write {what} {path}: {reason} ({free_space(path)} on that file system)"
    if run_dir is None:
        return StorageError(f"{line}; {hint}")
    run_dir = Path(run_dir)
    newest = newest_complete_checkpoint(ckpt_dir if ckpt_dir is not None else run_dir / "checkpoints")
    if newest is None:
        return StorageError(f"{line}; no checkpoint was saved yet: free space, then delete {run_dir} and start "
                            "again, or start again with another --run_dir")
    return StorageError(f"{line}; the last good checkpoint {newest} is intact: free space and rerun with "
                        f"--resume, or copy {run_dir} to a file system with room and rerun with --run_dir "
                        "<the copy> --resume")


@contextlib.contextmanager
def reporting_write_failures(what: str, path, **context) -> Iterator[None]:
    """Raise :func:`write_failure`'s StorageError for a failed write inside the block; any other error,
    Ctrl-C included, passes unchanged. ``context``: write_failure's run_dir, ckpt_dir and hint."""
    try:
        yield
    except BaseException as error:  # DCP's CheckpointException is a BaseException
        failure = write_failure(error, what, path, **context)
        if failure is None:
            raise
        raise failure from None


# ----------------------------------------------------------------------------- run folder


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def prepare_run_dir(run_dir, resume: bool) -> Path:
    """The training scripts' start-up check of ``--run_dir``: writable, and not another run's folder.

    A fresh run (no ``--resume``) into a folder that holds a non-empty metrics.jsonl or a complete
    checkpoint would mix two runs' records and checkpoints: CheckpointError (exit 2) before anything
    is written. Under torchrun rank 0 decides and every rank raises its verdict, so none waits for a
    rank that stopped.
    """
    run_dir = Path(run_dir)
    # torchrun restarts the workers of a job with the same arguments: an attempt after one that died before
    # its first checkpoint finds its own outputs here, and starts over.
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0
    verdict: Optional[Exception] = None
    if _rank() == 0:
        try:
            if not resume and not restarted:
                _refuse_another_run(run_dir)
            ensure_writable_dir(run_dir)
        except CheckpointError as error:  # StorageError included
            verdict = error
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        shared = [verdict]
        dist.broadcast_object_list(shared, src=0)
        verdict = shared[0]
    if verdict is not None:
        raise verdict
    return run_dir


def _refuse_another_run(run_dir: Path) -> None:
    metrics = run_dir / METRICS_FILE
    has_metrics = metrics.is_file() and metrics.stat().st_size > 0
    newest = newest_complete_checkpoint(run_dir / "checkpoints")
    if not (has_metrics or newest):
        return
    held = " and ".join(
        ([METRICS_FILE] if has_metrics else []) + ([f"checkpoints up to {newest.name}"] if newest else []))
    ways = "continue it with --resume, choose another --run_dir, or delete it" if newest else (
        "choose another --run_dir, or delete it (it has no checkpoint to --resume from)")
    raise CheckpointError(f"run directory {run_dir} already holds another run ({held}): {ways}")


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


def fsync_dir(path: Path) -> None:
    # Makes the rename itself durable; directories cannot be opened like this on Windows.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def checkpoints_by_step(ckpt_dir: Path, sharded: bool = False) -> list[tuple[int, Path]]:
    """Complete checkpoints in ``ckpt_dir``, oldest step first (numeric order, any digit count): step_N.pt
    files, or (``sharded``) DCP step_N folders that hold their metadata, which DCP writes last."""
    if not ckpt_dir.is_dir():
        return []
    found = []
    for entry in ckpt_dir.iterdir():
        match = (SHARDED_CHECKPOINT_NAME if sharded else CHECKPOINT_NAME).match(entry.name)
        if match and ((entry / DCP_METADATA).is_file() if sharded else entry.is_file()):
            found.append((int(match.group(1)), entry))
    return sorted(found)


@contextlib.contextmanager
def replaced_atomically(path: Path | str, prefix: str = ".tmp-") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it is renamed to ``path``, on any error
    (Ctrl-C included) removed, so a crash never leaves a half-written file under the final name.

    The temporary name ends with the final name (the profiler picks gzip from ``.gz``), and the
    file gets an ordinary new file's permissions (umask), not mkstemp's private 0600, so that
    colleagues in the project group can read a run's outputs.
    """
    path = Path(path)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=prefix, suffix="-" + path.name)
    os.close(fd)
    try:
        yield Path(temporary)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temporary, 0o666 & ~umask)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


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


_last_write_s: Optional[float] = None


def note_write_time(seconds: float) -> None:
    """Record how long this process's last checkpoint took to write (both savers call it)."""
    global _last_write_s
    _last_write_s = seconds


def last_write_seconds() -> Optional[float]:
    """Seconds the last checkpoint of this process took to write, None before the first: a stop request compares
    it with the time left before the job's limit (utils.stopping)."""
    return _last_write_s


def latest_checkpoint(ckpt_dir) -> Optional[Path]:
    """The complete checkpoint with the highest step in ``ckpt_dir``, or None if there is none."""
    found = checkpoints_by_step(Path(ckpt_dir))
    return found[-1][1] if found else None


def check_model_settings(saved: dict, cfg, path) -> None:
    """A resume must build the model that the checkpoint holds: name the model keys whose values differ."""
    differ = [f"{f.name} {getattr(cfg.model, f.name)!r} (checkpoint: {saved[f.name]!r})"
              for f in dataclasses.fields(cfg.model) if f.name in saved and f.name != "model_path"  # where, not what
              and saved[f.name] != getattr(cfg.model, f.name)]
    if differ:
        raise CheckpointError(f"{path} holds a model built with other settings: {', '.join(differ)}; a resumed run "
                              "must use the run's model settings (drop those overrides)")


def checkpoint_to_resume(ckpt_dir, resume, sharded: bool = False) -> Optional[Path]:
    """The checkpoint a run continues from, or None for a fresh start: ``resume`` true needs one, "auto"
    takes the newest if there is one (a requeued or restarted job), false takes none. ``sharded``: the
    script resumes DCP folders (train_fsdp.py, train_mp.py, train_pp.py), else step_N.pt files; a folder
    holding only the other kind is refused in one line that says which scripts write it."""
    if not resume:
        return None
    ckpt_dir = Path(ckpt_dir)
    found = checkpoints_by_step(ckpt_dir, sharded)
    if found:
        return found[-1][1]
    other = checkpoints_by_step(ckpt_dir, not sharded)
    if other and sharded:
        raise CheckpointError(f"{ckpt_dir} holds single-file checkpoints (train.py / train_ddp.py), which this "
                              "script does not resume: resume with the script that wrote them, or choose another "
                              "--run_dir")
    if other:
        folder = other[-1][1]
        raise CheckpointError(f"{ckpt_dir} holds DCP checkpoint folders ({folder.name}), which train_fsdp.py, "
                              "train_mp.py and train_pp.py write: resume with the script that wrote them, or turn "
                              f"the newest into this script's format: python -m utils.parallel.fsdp export {folder} "
                              f"{ckpt_dir}/{folder.name}.pt")
    if resume == "auto":
        return None
    raise CheckpointError(f"--resume: no checkpoint in {ckpt_dir}; run without --resume to start fresh")


Loaded = TypeVar("Loaded")


def load_newest(ckpt_dir, resume, load: Callable[[Path], Loaded], sharded: bool = False
                ) -> tuple[Optional[Path], Optional[Loaded]]:
    """(the checkpoint a run continues from, what ``load(path)`` made of it), or (None, None) for a fresh start.

    The checkpoint is :func:`checkpoint_to_resume`'s. Under ``--resume auto`` (what a self-requeueing job or a
    torchrun restart adds, with no human to read an error) one that does not load (DamagedCheckpointError, on any
    rank) is set aside as ``damaged-<name>`` with a warning, and the one before it is tried; ``--resume true``
    (a human asked for this run's newest) keeps the refusal. A checkpoint of another model is refused either way.
    Collective under torchrun: every rank takes the same decision.
    """
    while True:
        path = checkpoint_to_resume(ckpt_dir, resume, sharded)
        if path is None:
            return None, None
        damage, loaded = None, None
        try:
            loaded = load(path)
        except DamagedCheckpointError as error:
            damage = error
        if not _any_rank(damage is not None):
            return path, loaded
        damage = damage or DamagedCheckpointError(path, "another rank could not read its part")
        if resume != "auto":
            raise damage
        aside = path.with_name(DAMAGED_PREFIX + path.name)
        if _rank() == 0:
            os.replace(path, aside)
            print(f"warning: checkpoint {path} is damaged ({damage.reason}): set aside as {aside.name}; resuming "
                  "from the one before it", flush=True)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()  # the next look at the folder sees it set aside


def _any_rank(flag: bool) -> bool:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flags = [False] * dist.get_world_size()
        dist.all_gather_object(flags, flag)  # objects: the right device for NCCL's group too
        return any(flags)
    return flag


def damage_in(error: BaseException) -> Optional[str]:
    """"Type: message" of the error behind ``error`` that says the bytes are not readable (a missing or
    truncated file, a corrupt pickle or zip), else None (e.g. a checkpoint of another model). Looks through
    the causes, and into DCP's CheckpointException, which carries each rank's error."""
    seen: list[BaseException] = []
    todo = [error]
    while todo:
        current = todo.pop()
        if current is None or any(current is e for e in seen):
            continue
        seen.append(current)
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):  # DCP's CheckpointException: {rank: (exception, traceback)}; its own text
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]  # quotes theirs
        elif isinstance(current, _UNREADABLE) or _UNREADABLE_WORDS.search(str(current)):
            said = str(current).splitlines()[0] if str(current) else ""
            if isinstance(current, OSError) and current.filename:  # the file's name; its folder is the checkpoint
                said = f"{current.strerror}: {Path(current.filename).name}"
            text = f"{type(current).__name__}: {said}"
            return text if len(text) <= 160 else text[:157] + "..."
        todo += [current.__cause__, current.__context__]
    return None


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


def capture_rng_state() -> dict:
    """The state of every random generator a training step may draw from.

    Python ``random``, NumPy's global generator, torch's CPU generator and, when CUDA is
    available, the generator of every visible GPU. NumPy's key is stored as an int64 tensor so
    the result loads with weights_only=True.
    """
    numpy_state = np.random.get_state(legacy=False)
    state = {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": numpy_state["bit_generator"],
            "key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
            "pos": int(numpy_state["state"]["pos"]),
            "has_gauss": int(numpy_state["has_gauss"]),
            "gauss": float(numpy_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    """Restore generators captured by :func:`capture_rng_state`.

    CUDA states are restored for as many GPUs as both the checkpoint and this process have
    (none when resuming a GPU run on CPU or the other way round).
    """
    random.setstate(_as_python_random_state(state["python"]))
    numpy_state = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": numpy_state["bit_generator"],
            "state": {"key": numpy_state["key"].cpu().numpy().astype(np.uint32), "pos": numpy_state["pos"]},
            "has_gauss": numpy_state["has_gauss"],
            "gauss": numpy_state["gauss"],
        }
    )
    torch.set_rng_state(state["torch"].cpu())
    cuda_states = state.get("cuda")
    if cuda_states and torch.cuda.is_available():
        for index, cuda_state in enumerate(cuda_states[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state.cpu(), index)


def _as_python_random_state(saved) -> tuple:
    # random.setstate insists on tuples; be lenient if a state went through JSON or lists.
    version, internal, gauss = saved
    return (version, tuple(internal), gauss)


def strip_wrapper_prefixes(state_dict: dict) -> dict:
    """A copy of ``state_dict`` with the key components that wrappers add removed.

    ``module.`` (DDP), ``_orig_mod.`` (torch.compile), ``_checkpoint_wrapped_module.``
    (activation checkpointing) and ``_fsdp_wrapped_module.`` are removed wherever they appear as
    whole dot-separated components, so a state saved from any wrapped model loads into the plain
    one. Keeps the order and the ``_metadata`` (module versions) that ``load_state_dict`` reads.
    """

    def strip(key: str) -> str:
        return ".".join(part for part in key.split(".") if part not in WRAPPER_COMPONENTS)

    stripped = collections.OrderedDict()
    for key, value in state_dict.items():
        new_key = strip(key)
        if new_key in stripped:
            raise ValueError(f"state_dict keys collide after removing wrapper prefixes: {key!r} -> {new_key!r}")
        stripped[new_key] = value
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        stripped._metadata = collections.OrderedDict((strip(key), value) for key, value in metadata.items())
    return stripped
