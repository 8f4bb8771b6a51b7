"""The files of a run and their safety, for every kind of checkpoint (single.py's files, sharded.py's folders).

- Names: ``step_<step:08d>.pt`` files and DCP ``step_<step:08d>/`` folders (complete once they hold
  DCP_METADATA), the newest complete one of either kind, and the one a run resumes from (:func:`load_newest`,
  which sets a damaged one aside under ``--resume auto``).
- Atomic writes: :func:`replaced_atomically` (a temporary file renamed into place) and :func:`fsync_dir`;
  predict.py, rollout.py and evaluate.py write their outputs the same way.
- Failed writes: every write of a run (checkpoints, metrics, pictures, profiles) goes through
  :func:`reporting_write_failures` or :func:`write_failure`: a full, over-quota or failing file system becomes one
  :class:`StorageError` line (exit code 4) that names the file, the free space and the last good checkpoint, and
  says how to resume.
- :func:`prepare_run_dir`, the training scripts' start-up check of ``--run_dir``, and the two collectives that
  these decisions take under torchrun (rank 0 decides; :func:`barrier`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import re
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Callable, Iterator, Optional, TypeVar

import torch.distributed as dist

CHECKPOINT_NAME = re.compile(r"^step_(\d+)\.pt$")
SHARDED_CHECKPOINT_NAME = re.compile(r"^step_(\d+)$")
"""train_fsdp.py's DCP folders (sharded.py); complete once they hold DCP_METADATA, which DCP writes last."""
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


def barrier() -> None:
    """Wait for every rank (nothing without a process group). Here rather than in utils.parallel, which sits above
    the checkpoints: sharded.py's saves and :func:`load_newest` need it."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


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


def latest_sharded_checkpoint(ckpt_dir) -> Optional[Path]:
    """The complete DCP checkpoint with the highest step, or None; single-file checkpoints are an error."""
    return checkpoint_to_resume(ckpt_dir, "auto", sharded=True)


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
                              "the newest into this script's format: python -m utils.checkpoint.sharded export "
                              f"{folder} {ckpt_dir}/{folder.name}.pt")
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
        barrier()  # the next look at the folder sees it set aside


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
