"""Measure the training memory of a config on any device, without trusting the estimate (:mod:`utils.memory.estimate`).

* :class:`SavedTensorBytes` counts the bytes autograd saves for backward through
  ``torch.autograd.graph.saved_tensors_hooks``, once per storage (views and repeated saves of one
  tensor share storage), leaving out parameters and buffers. It also sees the inputs that
  non-reentrant activation checkpointing keeps.
* :func:`measure_training_memory` runs a real training step and returns parameters, gradients,
  optimizer state, saved activations and the peak: ``torch.cuda.max_memory_allocated`` on CUDA;
  on CPU the allocation trace of ``torch.profiler`` (``profile_memory=True``: every allocation and
  free, summed in time order), which gives the same peak above the step's start.
* :func:`trace_saved_activations` counts the saved bytes of one forward pass under
  ``FakeTensorMode``: the same operators dispatch and save the same tensors (shapes and dtypes),
  but nothing is computed or allocated, so the whole 720×1440 field in fp32 without checkpointing
  can be "measured" on a laptop. Small sizes check that it equals the real count.
* :func:`build_for_measurement`, :func:`random_batch`, :func:`loss_for` and :func:`measure_config` build
  what train.py would train for a config; :func:`time_training_step` times the same step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
import weakref
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from torch.profiler import ProfilerActivity, profile, record_function

from models import build_model, on_meta
from models.spec import class_spec
from utils.config import Config
from utils.memory.estimate import GB
from utils.memory.shapes import input_size
from utils.parallel.fsdp import apply_fsdp
from utils.parallel.techniques import apply_ac, apply_ddp
from utils.precision import autocast, make_grad_scaler
from utils.training import LOSSES, build_loss, build_optimizer


class SavedTensorBytes:
    """Bytes autograd saves for backward inside this context, each storage counted once.

    ``exclude``: tensors whose storage is not counted (parameters and buffers: they exist anyway).
    ``hold=False`` keeps nothing (the pack hook drops the tensor): the forward pass then runs in
    little memory but cannot be followed by backward — for measuring forward-saved bytes only.
    Storages are tracked through weak references, so a freed storage whose address is reused
    later is still counted as new, and counting never keeps a tensor alive. ``peak_bytes`` is the
    most that was alive at once (a pipeline frees one microbatch's activations after its backward,
    so its peak depends on the schedule, not only on the total saved).
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = (), hold: bool = True):
        exclude = [getattr(t, "_local_tensor", t) for t in exclude]
        self._excluded = {id(t.untyped_storage()): weakref.ref(t.untyped_storage()) for t in exclude}
        self._seen: dict[int, weakref.ref] = {}
        self.hold = hold
        self.bytes = self.live_bytes = self.peak_bytes = 0
        self.bytes_by_dtype: dict[str, int] = {}
        self.count = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, saved: torch.Tensor):
        # A DTensor (tensor parallelism) holds this rank's shard; an FSDP2 parameter gathered for this
        # block is a parameter (or a view of one), not an activation.
        tensor = getattr(saved, "_local_tensor", saved)
        base = tensor if tensor._base is None else tensor._base
        if isinstance(base, nn.Parameter) or isinstance(getattr(saved, "_base", None), nn.Parameter):
            return saved if self.hold else None
        storage = tensor.untyped_storage()
        key = id(storage)
        if not (self._is(self._seen, key, storage) or self._is(self._excluded, key, storage)):
            self._seen[key] = weakref.ref(storage, functools.partial(self._freed, storage.nbytes()))
            self.bytes += storage.nbytes()
            self.live_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            dtype = str(tensor.dtype).removeprefix("torch.")
            self.bytes_by_dtype[dtype] = self.bytes_by_dtype.get(dtype, 0) + storage.nbytes()
            self.count += 1
        return saved if self.hold else None

    def _freed(self, nbytes: int, _ref) -> None:
        self.live_bytes -= nbytes

    @staticmethod
    def _is(refs: dict, key: int, storage) -> bool:
        ref = refs.get(key)
        return ref is not None and ref() is storage

    @staticmethod
    def _unpack(packed):
        if packed is None:
            raise RuntimeError("SavedTensorBytes(hold=False) dropped the saved tensors: backward is impossible")
        return packed

    def counting(self, enabled: bool = True):
        """This counter as a context manager, or one that counts nothing (e.g. on all but the first step)."""
        return self if enabled else contextlib.nullcontext()

    def __enter__(self) -> "SavedTensorBytes":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc_info) -> None:
        self._hooks.__exit__(*exc_info)


def _model_tensors(model: nn.Module) -> list[torch.Tensor]:
    return list(model.parameters()) + list(model.buffers())


def with_statistics(cfg: Config) -> Config:
    """The config with mean/std 0 and 1 where it leaves them to the data's statistics (a field task's: the ViT's, or
    a model's standardised by the project, models.units_inside): the same tensors are saved whatever the values.
    Task volume's stored fields have no statistics."""
    m, filled = cfg.model, {}
    if not m.mean and cfg.data.task != "volume":
        filled.update(mean=[0.0] * m.in_chans, std=[1.0] * m.in_chans)
    if cfg.data.task == "diagnostic" and not m.out_mean:  # the outputs are other channels: their own statistics
        filled.update(out_mean=[0.0] * cfg.target_chans, out_std=[1.0] * cfg.target_chans)
    return dataclasses.replace(cfg, model=dataclasses.replace(m, **filled)) if filled else cfg


def loss_for(cfg: Config):
    """The loss train.py computes (utils.training.build_loss: train.loss in train.loss_space)."""
    return build_loss(with_statistics(cfg))


def _loss_fn(loss):
    """A loss function, or the name of one (in physical units)."""
    return loss if callable(loss) else LOSSES[loss]


def forward_and_loss(model: nn.Module, lr: torch.Tensor, hr: torch.Tensor, amp_dtype: str, loss="l1") -> torch.Tensor:
    """The forward half of train.py's step: model under autocast, the loss (a name or :func:`loss_for`) in fp32."""
    with autocast(lr.device, amp_dtype):
        pred = model(lr)
    return _loss_fn(loss)(pred.float(), hr)


@contextlib.contextmanager
def fresh_model_caches(model: nn.Module):
    """What the model's module caches (its spec's ``fresh_caches``: SwinIR's shift masks per size) emptied before and
    after: tensors made under FakeTensorMode must not outlive it."""
    cache = class_spec(type(model)).fresh_caches
    if cache:
        cache()
    try:
        yield
    finally:
        if cache:
            cache()


def trace_saved_activations(model: nn.Module, lr_shape: tuple[int, ...], amp_dtype: str = "none",
                            loss="l1", device: str = "cpu") -> SavedTensorBytes:
    """Saved bytes of forward + loss for an input of ``lr_shape``, without computing anything.

    Parameters, buffers and the input become fake tensors (shape, dtype and device only) and the
    forward runs under FakeTensorMode: every operator dispatches as for real — autocast, the
    model's CPU/CUDA branches, checkpoint hooks — so autograd saves the same tensors, with no data.
    """
    model.train()
    with fresh_model_caches(model), FakeTensorMode(allow_non_fake_inputs=True) as mode:
        state = {}
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            fake = mode.from_tensor(tensor)
            state[name] = fake.requires_grad_(tensor.requires_grad) if tensor.is_floating_point() else fake
        lr = torch.empty(lr_shape, device=device)
        counter = SavedTensorBytes(exclude=state.values())
        with counter:
            with autocast(lr.device, amp_dtype):
                pred = functional_call(model, state, (lr,))
            target = torch.empty(pred.shape, device=device)  # the loss takes a target of the prediction's shape
            _loss_fn(loss)(pred.float(), target)
    return counter


@dataclass
class MeasuredMemory:
    """Measured memory of one training step (bytes)."""

    params: int
    grads: int
    optimizer: int
    activations: int
    """Saved for backward at the end of forward + loss (SavedTensorBytes)."""
    peak: float
    """Peak allocated during the step: params + optimizer state + the rise above the step's start."""
    peak_forward: float
    """Peak allocated up to the end of the forward pass and the loss (same reference)."""
    method: str
    activations_by_dtype: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {k: (round(v / GB, 6) if isinstance(v, (int, float)) else v) for k, v in asdict(self).items()}


def _tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the tensors' storages, each once (FSDP2's gradients are views of one buffer); a DTensor's: this
    rank's."""
    storages = [getattr(t, "_local_tensor", t).untyped_storage() for t in tensors]
    return sum({s.data_ptr() or id(s): s.nbytes() for s in storages}.values())


def _optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return _tensor_bytes(v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v))


def _training_step(model, optimizer, lr, hr, amp_dtype, loss, counter=None, marks=None) -> None:
    optimizer.zero_grad(set_to_none=True)
    with counter or contextlib.nullcontext():
        value = forward_and_loss(model, lr, hr, amp_dtype, loss)
    if marks is not None:
        marks.append("forward")
    scaler = make_grad_scaler(lr.device, amp_dtype)
    scaler.scale(value).backward()
    scaler.step(optimizer)
    scaler.update()


def _cpu_allocation_peaks(run) -> tuple[float, float]:
    """(peak, peak up to the forward mark) of bytes allocated on the CPU while ``run(marks)`` runs.

    The profiler records every allocation and free with its size; summed in time order they give
    the memory allocated at each moment, relative to the start. ``run`` appends "forward" to ``marks`` at the end of
    the forward pass; where it appends "start" first, the peaks are those after it (still counted from the start of
    the run: what was allocated before it and is still alive counts).
    """
    def mark(name):
        with record_function(f"__memory_mark_{name}__"):
            pass

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        marks: list = _MarkList(mark)
        run(marks)
    events = prof.profiler.kineto_results.events()
    times = {name: min((e.start_ns() for e in events if e.name() == f"__memory_mark_{name}__"), default=None)
             for name in ("start", "forward")}
    start = times["start"] if times["start"] is not None else -1
    forward_end = times["forward"] if times["forward"] is not None else float("inf")
    deltas = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    current = peak = peak_forward = 0
    for when, nbytes in deltas:
        current += nbytes
        if when > start:
            peak = max(peak, current)
            if when <= forward_end:
                peak_forward = max(peak_forward, current)
    return float(peak), float(peak_forward)


def measure_peak(run: Callable[[], object], device: torch.device) -> int:
    """Peak bytes allocated on ``device`` while ``run()`` runs, above what was allocated when it started
    (``torch.cuda.max_memory_allocated`` on CUDA; the profiler's allocation trace on the CPU, as above)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - start)
    return int(_cpu_allocation_peaks(lambda marks: run())[0])


class _MarkList(list):
    """A list whose append also drops a profiler mark (the end of the forward pass)."""

    def __init__(self, mark):
        super().__init__()
        self._mark = mark

    def append(self, item) -> None:
        self._mark(item)
        super().append(item)


def measure_training_memory(model: nn.Module, lr: torch.Tensor, hr: torch.Tensor, amp_dtype: str = "none",
                            loss="l1", optimizer: Optional[torch.optim.Optimizer] = None) -> MeasuredMemory:
    """Measure one training step of ``model`` (already on lr's device, AC already applied).

    A first step allocates AdamW's state; the second, with gradients set to None as in train.py,
    is measured: saved activations by :class:`SavedTensorBytes`, the peak by CUDA's allocator
    statistics or by the CPU allocation trace. The model's weights change (two AdamW steps).
    """
    device = lr.device
    model.train()
    if optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device.type == "cuda")
    _training_step(model, optimizer, lr, hr, amp_dtype, loss)
    params = _tensor_bytes(model.parameters())
    static = params + _optimizer_state_bytes(optimizer)
    counter = SavedTensorBytes(exclude=_model_tensors(model))
    if device.type == "cuda":
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        peaks = []

        class _CudaMarks(list):
            def append(self, item):
                torch.cuda.synchronize(device)
                peaks.append(torch.cuda.max_memory_allocated(device) - start)

        _training_step(model, optimizer, lr, hr, amp_dtype, loss, counter, _CudaMarks())
        torch.cuda.synchronize(device)
        rise, rise_forward = torch.cuda.max_memory_allocated(device) - start, peaks[0]
        method = "torch.cuda.max_memory_allocated"
    else:
        rise, rise_forward = _cpu_allocation_peaks(
            lambda marks: _training_step(model, optimizer, lr, hr, amp_dtype, loss, counter, marks))
        method = "torch.profiler CPU allocation trace"
    grads = _tensor_bytes(p.grad for p in model.parameters() if p.grad is not None)
    return MeasuredMemory(params, grads, _optimizer_state_bytes(optimizer), counter.bytes, static + rise,
                          static + rise_forward, method, dict(counter.bytes_by_dtype))


def measure_saved_activations(model: nn.Module, lr: torch.Tensor, hr: torch.Tensor, amp_dtype: str = "none",
                              loss="l1", hold: bool = False) -> SavedTensorBytes:
    """Saved bytes of one real forward + loss; ``hold=False`` frees them at once (no backward)."""
    model.train()
    counter = SavedTensorBytes(exclude=_model_tensors(model), hold=hold)
    with counter:
        forward_and_loss(model, lr, hr, amp_dtype, loss)
    return counter


def batch_shapes(cfg: Config, lr_size: Optional[tuple[int, ...]] = None,
                 batch: Optional[int] = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the (input, target) batch train.py feeds for the config (``batch``: default the global batch;
    ``lr_size``: default the model's input size, :func:`input_size`): task volume maps crop³ cubes of in_chans to
    out_chans, super-resolution enlarges the field by upscale, the others keep it."""
    m = cfg.model
    batch = batch or cfg.train.batch_size
    lr_size = tuple(lr_size or input_size(cfg))
    if cfg.data.task == "volume":
        side = (lr_size[0],) * 3
        return (batch, m.in_chans, *side), (batch, m.out_chans, *side)
    scale = m.upscale if cfg.data.task == "sr" else 1  # a forecast or a box: the same grid
    return (batch, m.in_chans, *lr_size), (batch, cfg.target_chans, lr_size[0] * scale, lr_size[1] * scale)


def random_batch(cfg: Config, lr_size: Optional[tuple[int, int]] = None, device="cpu", batch: Optional[int] = None):
    """(input, target) of the config's shapes (:func:`batch_shapes`), in physical units around the config's mean and
    std (0 and 1 where the config leaves them to the data); a volume's stored fields, already in tanh's range."""
    inputs, target = batch_shapes(cfg, lr_size, batch)
    g = torch.Generator().manual_seed(0)
    if cfg.data.task == "volume":
        return tuple((0.3 * torch.randn(shape, generator=g)).to(device) for shape in (inputs, target))
    m = with_statistics(cfg).model
    mean, std, out_mean, out_std = (torch.tensor(v).view(1, -1, 1, 1) for v in (m.mean, m.std, m.out_mean or m.mean,
                                                                                m.out_std or m.std))
    lr = torch.randn(inputs, generator=g) * std + mean
    hr = torch.randn(target, generator=g) * out_std + out_mean
    return lr.to(device), hr.to(device)


def build_for_measurement(cfg: Config, device="cpu") -> nn.Module:
    """The config's model on ``device`` with its activation checkpointing applied, as train.py builds it."""
    torch.manual_seed(cfg.train.seed)
    return apply_ac(build_model(with_statistics(cfg).model).to(device), cfg.train.ac)


def model_on_meta(cfg: Config) -> nn.Module:
    """The config's model on the meta device (no memory, no time), with placeholder statistics where the data
    would give them; a constructor that reads tensor values (SwinIR's drop-path rates) is built on the CPU first."""
    model_cfg = with_statistics(cfg).model
    return on_meta(lambda: build_model(model_cfg))


def measure_config(cfg: Config, lr_size: Optional[tuple[int, int]] = None, device="cpu") -> MeasuredMemory:
    """:func:`measure_training_memory` of the config's model, AC, amp_dtype and loss at one input size
    (default: the model's input size, :func:`input_size`)."""
    lr, hr = random_batch(cfg, lr_size, device)
    model = build_for_measurement(cfg, device)
    return measure_training_memory(model, lr, hr, cfg.train.amp_dtype, loss_for(cfg))


def measure_layout(cfg: Config, strategy: str = "none", model_fn: Optional[Callable[[], nn.Module]] = None,
                   batch: Optional[tuple[torch.Tensor, torch.Tensor]] = None, loss=None) -> MeasuredMemory:
    """One rank's training step on the CPU as train.py, train_ddp.py or train_fsdp.py runs it (``strategy`` none, ddp
    or fsdp; HSDP: the config's hsdp_replicas), in a process group the caller started: the model built with its AC,
    wrapped, AdamW as build_optimizer makes it, this rank's share of the global batch; the second of two steps
    measured. ``peak`` counts from the model's build on: whatever stays allocated before the step (parameters, FSDP's
    shards, DDP's buckets, AdamW's state, buffers, the model's caches) and the step's own; not the batch.
    ``model_fn``, ``batch`` (this rank's) and ``loss``: another model than the config's (AC applied here)."""
    device = torch.device("cpu")
    world = dist.get_world_size() if strategy != "none" else 1
    lr, hr = batch or random_batch(cfg, batch=cfg.train.batch_size // world)
    loss, amp = loss or loss_for(cfg), cfg.train.amp_dtype
    held = {}

    def build() -> nn.Module:
        if model_fn is None:
            return build_for_measurement(cfg)
        torch.manual_seed(cfg.train.seed)
        return apply_ac(model_fn(), cfg.train.ac)

    def run(marks):
        model = {"ddp": apply_ddp, "fsdp": apply_fsdp}.get(strategy, lambda m, *_: m)(build(), cfg, device)
        optimizer = build_optimizer(model, cfg, 1, device)[0]
        _training_step(model, optimizer, lr, hr, amp, loss)
        marks.append("start")
        counter = SavedTensorBytes(exclude=_model_tensors(model))
        _training_step(model, optimizer, lr, hr, amp, loss, counter, marks)
        held.update(params=_tensor_bytes(model.parameters()), optimizer=_optimizer_state_bytes(optimizer),
                    grads=_tensor_bytes(p.grad for p in model.parameters() if p.grad is not None),
                    activations=counter.bytes, by_dtype=dict(counter.bytes_by_dtype))

    peak, peak_forward = _cpu_allocation_peaks(run)
    return MeasuredMemory(held["params"], held["grads"], held["optimizer"], held["activations"], peak, peak_forward,
                          "torch.profiler CPU allocation trace from the build on", held["by_dtype"])


def time_training_step(model: nn.Module, lr: torch.Tensor, hr: torch.Tensor, amp_dtype: str = "none",
                       loss="l1", steps: int = 3, warmup: int = 1) -> list[float]:
    """Seconds of each timed training step (forward, backward, AdamW), after ``warmup`` steps."""
    device = lr.device
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device.type == "cuda")
    model.train()
    times = []
    for i in range(warmup + steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        _training_step(model, optimizer, lr, hr, amp_dtype, loss)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times
