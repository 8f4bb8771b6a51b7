"""The run logger: every record of a training run to ``metrics.jsonl``, TensorBoard and the console.

:class:`MetricsLogger` writes every record to ``metrics.jsonl`` (one JSON object a line), to
TensorBoard and as one line on the console. Records are dicts with ``kind`` and ``step``;
the keys below get a compact console format, any other key prints as ``key value``:

============== ========================= =================================
key            meaning                   console
============== ========================= =================================
loss           training loss             ``loss 1.234``
lr             learning rate             ``lr 8.0e-04``
samples_per_sec  global throughput       ``123.4 samples/s``
mfu            fraction of peak FLOP/s   ``mfu 12.3%``
peak_mem_gb    peak memory (GB, 1e9 B)   ``mem 1.23 GB``
step_time_s    seconds per step          ``0.123 s/step``
============== ========================= =================================

:func:`json_safe` makes a value strict JSON (non-finite numbers become null), as metrics.jsonl is written.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from utils.checkpoint.files import METRICS_FILE, write_failure

_CONSOLE_FORMATS = {
    "loss": "loss {:.4g}",
    "lr": "lr {:.1e}",
    "samples_per_sec": "{:.1f} samples/s",
    "mfu": "mfu {:.1%}",
    "peak_mem_gb": "mem {:.2f} GB",
    "step_time_s": "{:.3f} s/step",
}
_NOT_METRICS = ("kind", "step", "time")


def _to_python(value: Any) -> Any:
    """Tensors and NumPy values -> Python numbers and lists (JSON- and TensorBoard-ready)."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    if isinstance(value, dict):
        return {str(key): _to_python(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_python(item) for item in value]
    return value


def json_safe(value: Any) -> Any:
    # Strict JSON has no NaN/Infinity: write null so every JSON reader (jq, pandas, JS) accepts the file.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, list):
        return [json_safe(item) for item in value]
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _fmt_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class MetricsLogger:
    """Writes records to ``run_dir/metrics.jsonl``, TensorBoard (event files in run_dir) and the console.

    ``enabled=False`` (ranks other than 0) makes every method a no-op that creates nothing.
    ``console`` takes one string per record (``print``, ``tqdm.write``, or None for silence).
    ``channel_names`` name the entries of list values in TensorBoard and on the console;
    ``console_channels`` (names) limit the console to those channels (20 channels x 6 forecast
    metrics would not fit a line); metrics.jsonl and TensorBoard always get every channel.
    A resumed run appends to the existing metrics.jsonl.

    A write that fails for lack of space (or quota, or an I/O error) raises StorageError, one line that
    names the last good checkpoint; metrics.jsonl keeps only whole records, and the logger is closed.
    """

    def __init__(
        self,
        run_dir,
        enabled: bool = True,
        tensorboard: bool = True,
        console: Optional[Callable[[str], Any]] = print,
        channel_names: Optional[Sequence[str]] = None,
        console_channels: Optional[Sequence[str]] = None,
    ):
        self.enabled = enabled
        self.console = console
        self.channel_names = list(channel_names) if channel_names else None
        self.console_channels = list(console_channels) if console_channels else None
        self.run_dir = Path(run_dir)
        self._jsonl = None
        self._writer = None
        self._metrics_path = self.run_dir / METRICS_FILE
        if not enabled:
            return
        with self._reporting("metrics", self._metrics_path):
            self.run_dir.mkdir(parents=True, exist_ok=True)
            # Unbuffered bytes: a failed write raises at once and leaves nothing queued for close() to retry.
            self._jsonl = open(self._metrics_path, "ab", buffering=0)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter  # optional: the run goes on without it
            except ImportError:
                self._say("tensorboard is not installed: metrics go to metrics.jsonl only (pip install tensorboard)")
            else:
                _quiet_tensorboard_write_thread()
                with self._reporting("TensorBoard events in", self.run_dir):
                    # flush_secs: log() flushes every record itself, so the writer thread never needs to.
                    self._writer = SummaryWriter(log_dir=str(self.run_dir), flush_secs=10**9)

    @contextlib.contextmanager
    def _reporting(self, what: str, path: Path):
        """A failed write becomes StorageError; the logger then closes what it holds without writing more."""
        try:
            yield
        except Exception as error:
            failure = write_failure(error, what, path, run_dir=self.run_dir)
            if failure is None:
                raise
            self._abandon()
            raise failure from None

    def _abandon(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()  # unbuffered: closing writes nothing
            self._jsonl = None
        self._writer = None  # its thread has stopped with the error; closing it would flush and fail again

    def _append(self, line: bytes) -> None:
        """Append one record whole: a short write on a full disk is cut off again, so every line stays JSON."""
        fd = self._jsonl.fileno()
        size = os.fstat(fd).st_size
        try:
            written = 0
            while written < len(line):
                written += self._jsonl.write(line[written:])
        except OSError:
            os.ftruncate(fd, size)
            raise

    def _say(self, line: str) -> None:
        if self.console is not None:
            self.console(line)

    def log(self, record: dict) -> None:
        """Write one record: ``{"kind": "train" | "val" | ..., "step": int, key: value, ...}``.

        Values may be numbers, strings, 0-d tensors, lists (per channel) or dicts of numbers.
        Non-finite numbers are written as null in metrics.jsonl.
        """
        if "kind" not in record or "step" not in record:
            raise ValueError(f"a metrics record needs 'kind' and 'step', got keys {sorted(record)}")
        if not self.enabled:
            return
        if self._jsonl is None:
            raise ValueError("MetricsLogger.log called after close()")
        record = {key: _to_python(value) for key, value in record.items()}
        record.setdefault("time", round(time.time(), 3))
        with self._reporting("metrics", self._metrics_path):
            self._append((json.dumps(json_safe(record)) + "\n").encode())  # unbuffered: a killed run keeps it
        if self._writer is not None:
            # The writer thread's error surfaces in these calls.
            with self._reporting("TensorBoard events in", self.run_dir):
                for tag, value in self._scalars(record):
                    self._writer.add_scalar(tag, value, global_step=int(record["step"]))
                self._writer.flush()
        self._say(self.format_line(record))

    def _names_for(self, values: list) -> list[str]:
        if self.channel_names and len(self.channel_names) == len(values):
            return self.channel_names
        return [str(index) for index in range(len(values))]

    def _scalars(self, record: dict):
        """(tag, number) pairs: ``kind/key`` for numbers, ``kind/key/name`` for lists and dicts."""
        kind = record["kind"]
        for key, value in record.items():
            if key in _NOT_METRICS:
                continue
            if isinstance(value, list):
                value = dict(zip(self._names_for(value), value))
            if isinstance(value, dict):
                for name, item in value.items():
                    if _is_number(item):
                        yield f"{kind}/{key}/{name}", float(item)
            elif _is_number(value):
                yield f"{kind}/{key}", float(value)

    def format_line(self, record: dict) -> str:
        """The console line: ``step     50 | loss 1.234 | lr 8.0e-04 | 123.4 samples/s | ...``."""
        head = f"step {record['step']:>6}"
        if record["kind"] != "train":
            head = f"{record['kind']:<5} {head}"
        parts = [head]
        for key, value in record.items():
            if key in _NOT_METRICS or value is None or (isinstance(value, list) and value
                                                         and isinstance(value[0], list)):
                continue  # tables (a pipeline's timeline) are for metrics.jsonl, not the console line
            if key in _CONSOLE_FORMATS and _is_number(value):
                parts.append(_CONSOLE_FORMATS[key].format(value))
            elif isinstance(value, list) and self._names_for(value) != self.channel_names:
                parts.append(f"{key} " + "/".join(_fmt_value(item) for item in value))
            elif isinstance(value, (list, dict)):
                named = value if isinstance(value, dict) else dict(zip(self.channel_names, value))
                if isinstance(value, list) and self.console_channels:
                    named = {name: named[name] for name in self.console_channels if name in named}
                # Commas: channel names may contain spaces ("temperature 2 m").
                parts.append(f"{key}: " + ", ".join(f"{name} {_fmt_value(item)}" for name, item in named.items()))
            else:
                parts.append(f"{key} {_fmt_value(value)}")
        return " | ".join(parts)

    def close(self) -> None:
        if self._writer is not None:
            with self._reporting("TensorBoard events in", self.run_dir):
                self._writer.close()
            self._writer = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _quiet_tensorboard_write_thread() -> None:
    """Keep TensorBoard's writer thread from printing a traceback for a full disk.

    The thread stores its error and ends; SummaryWriter raises it again in the next add_scalar or flush,
    in the training loop, where MetricsLogger reports it as one line. Other errors print as before.
    """
    previous = threading.excepthook
    if getattr(previous, "quiet_tensorboard", False):
        return

    def hook(args) -> None:
        if not (type(args.thread).__name__ == "_AsyncWriterThread" and write_failure(args.exc_value, "", ".")):
            previous(args)

    hook.quiet_tensorboard = True
    threading.excepthook = hook
