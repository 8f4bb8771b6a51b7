"""The training memory of any model, traced: one training step run on fake tensors, nothing allocated.

:func:`estimate_model` (a module, its input and target shapes and its loss) and :func:`estimate_traced` (a config:
what ``estimate_memory.py`` and ``plan.py`` fall back to for a model without a hand-written description in
:mod:`utils.memory.shapes` / :mod:`utils.memory.graphs`) copy the model onto fake tensors (``FakeTensorMode``:
shapes, dtypes and devices, no data), apply what the layout's script applies — activation checkpointing
(``apply_ac``), FSDP2 or HSDP (``apply_fsdp``, over a fake process group of the layout's size), AdamW as
``build_optimizer`` makes it — and run two training steps on a fake batch: a first one that creates AdamW's state
and whatever the model caches, then the one that is measured, as :func:`utils.memory.measure.measure_training_memory`
measures a real one. What runs is PyTorch's own code; what counts the bytes is PyTorch's own tools:

* ``torch.distributed._tools.mem_tracker.MemTracker`` (one device, DDP) and ``fsdp2_mem_tracker.FSDPMemTracker``
  (FSDP2/HSDP), TorchDispatchModes that follow every storage the step creates and frees, by category (parameters,
  gradients, optimizer state, activations, temporaries; FSDP's sharded and all-gathered parameters, its
  reduce-scatter buffers), and keep the peak with its composition. The fake process group
  (``torch.testing._internal.distributed.fake_pg``) lets ``fully_shard`` shard for N ranks in one process: this
  process is rank 0, the largest shard (FSDP2 pads the last ranks' shards);
* :class:`~utils.memory.measure.SavedTensorBytes` counts what autograd saves for backward in the forward pass, and
  ``torch.utils.flop_counter.FlopCounterMode`` the step's FLOPs (those plan.py times: utils/observe/flops.py).

Hand-written, because no tracker does it:

* DDP. ``DistributedDataParallel`` cannot wrap fake tensors (its constructor compares parameter values across
  ranks), so its reducer is stood in for: a bucket per parameter (DDP's flat buckets hold the same bytes), into which
  each gradient is copied as it is accumulated, and which replaces the gradient when ``gradient_as_bucket_view``
  (the default) makes gradients views of the buckets. The buckets live from the wrap on, so DDP adds one copy of the
  gradients to the forward pass's peak (measured: to the byte on CPU).
* gloo's staging buffers (:class:`GlooStaging`): on CPU, FSDP2's reduce-scatters and all-gathers pass through a
  buffer of the unsharded size that the fake process group does not allocate.
* The refusals: tensor, context and pipeline parallelism change what each rank computes in ways a single fake
  rank does not show without the model's own plans (utils/parallel/plans.py) and, for a pipeline, a schedule's
  memory model (estimate.py's ``in_flight``). They are estimated for the models that have a hand-written description
  and refused, in one line, for the others.

The step runs the CPU's kernels (fake CUDA tensors would run without CUDA's autocast and attention kernels):
for ``--device cuda`` the result is the CPU path's, which differs where a CUDA kernel saves other tensors (attention)
or keeps LayerNorm in fp32. Not counted, as in the measurements: the input batch, the CUDA context and the caching
allocator's fragmentation. Not counted, unlike the measurements: workspaces a kernel allocates inside itself, which
no dispatch-level tracker sees — on CPU, a convolution's backward holds 1 to 4 times its input and output gradient
while it runs (oneDNN in bf16, 3-D convolutions in any dtype: measured), which is where the traced peak falls short.

Versions: the trackers and the fake process group are in torch 2.6 to 2.15; torch 2.6 has no fake implementations
of the c10d collectives (``torch.distributed._tools.fake_collectives``, 2.7), so its FSDP/HSDP traces are refused in
one line; torch 2.7.1, 2.11 and 2.15 trace the same bytes (checked on the tiny ViT: one process, DDP, FSDP).

Accuracy — benchmarks/validate_traced_estimate.py, torch 2.15.0+cu132 on the CPU of a 2-core Intel Xeon VM: the peak
of the largest rank of real steps on 1, 2 and 4 gloo processes (utils.memory.measure.measure_layout, counted from the
model's build on), the traced estimate's error against it. Layouts: processes, strategy, precision (bf16: autocast;
bf16p: bf16 parameters, FSDP2's policy), AC (block). Models: the tests' tiny configs (tests/conftest.py), the
quickstart configs, and examples/fno's FNO-2D at fno_quickstart's size (Part IV's model of your own), which the
project has no description of (its row measured a day after the others, its DDP 3 times too). FSDP and HSDP: the
median of 3 runs, which vary (gloo's collectives run on threads of their own: when their buffers meet a backward's
peak varies; the U-Net quickstart's on 4 processes measured 18.8-20.9 MB, in an earlier run 12.5-18.8 MB); every
traced estimate is within 10 % of one of its case's measured runs.

=================  ======  =========  =====  ========  ======  ========  =========  ======  =========  ========
model              1 fp32  1 bf16 AC  DDP 2  DDP 2     FSDP 2  FSDP 2    FSDP 2     DDP 4   FSDP 4     HSDP 2x2
                                      fp32   bf16 AC   fp32    bf16 AC   bf16p AC   bf16    fp32 AC    bf16
=================  ======  =========  =====  ========  ======  ========  =========  ======  =========  ========
SwinIR tiny         -0.0%      -1.2%  -5.1%     -3.2%   +2.7%     +1.4%     +21.7%   -1.9%      +5.5%     +3.8%
ViT tiny            -0.0%      -1.0%  -0.0%     -1.5%   +0.6%     +0.5%      -7.7%   -0.0%      -1.8%     +3.1%
U-Net tiny          +0.0%      -0.9%  -3.0%     -4.9%   +0.0%     -2.3%      -1.2%   +0.0%      -3.1%     +1.7%
FNO quickstart      +0.0%      -0.0%  +0.0%     -1.0%   -0.0%     -0.1%      -3.7%   +1.0%     +21.8%     +6.0%
SwinIR quickstart   -1.0%      -0.5%  -0.7%     -0.5%   +1.6%     +3.4%      +4.6%   -2.1%      +7.3%     +2.6%
ViT quickstart      +0.0%      -1.3%  -0.0%     -2.0%   -1.7%     -3.2%      -7.8%   -1.4%      +1.0%     +1.7%
U-Net quickstart    +0.0%      -0.1%  -0.0%     -0.1%   +0.5%     -8.7%      +0.4%   +0.0%     -10.7%     +1.9%
=================  ======  =========  =====  ========  ======  ========  =========  ======  =========  ========

(SwinIR tiny, FSDP 2 bf16p: measured 0.69-0.87 MB, traced 0.86; U-Net quickstart, FSDP 4: 18.8-20.9 MB, traced
17.7; FNO quickstart, FSDP 4: 19.31-21.41 MB, traced 23.53.) The hand-written estimate's total on the same runs: -25 %
to +39 % (its temporary peak is reasoned, not traced: below the measured peak for the small SwinIRs, above it for the
U-Net under FSDP). It stays the default for the models it describes: activations exact to the byte at any size in no
time, CUDA's kernels modelled, and tensor, context and pipeline parallelism; ``estimate_memory.py --traced`` traces
any model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from models import copy_model
from utils.config import Config, ConfigError
from utils.memory.estimate import GB, MemoryEstimate
from utils.memory.measure import (SavedTensorBytes, batch_shapes, forward_and_loss, fresh_model_caches, loss_for,
                                  model_on_meta)
from utils.memory.shapes import has_description
from utils.parallel.fsdp import HSDP_DIMS, apply_fsdp, mesh_shape
from utils.parallel.techniques import apply_ac
from utils.training import build_optimizer

STRATEGIES = ("none", "ddp", "fsdp")
# The trackers' categories, summed into MemoryEstimate's terms (together: the tracker's total, the peak).
TERMS = {
    "params": ("Parameter", "Buffer", "Sharded Param", "Unsharded Param", "All Gather"),
    "grads": ("Gradient", "Sharded Grad", "Unsharded Grad", "Reduce Scatter", "Other"),  # Other: DDP's buckets
    "optimizer": ("Optstate", "OptState"),
    "activations": ("Activation",),
    "temporary": ("Temp", "Inputs"),
}


# What the scripts' memory records count (utils/parallel/fsdp.py's memory_record): parameters (a rank's shards),
# gradients and AdamW's state; not the buffers.
STATES = ("Parameter", "Sharded Param", "Gradient", "Sharded Grad", "Other", *TERMS["optimizer"])


class CannotTrace(ConfigError):
    """The model's training step does not run on fake tensors: one line that names the model and the operation."""


@dataclass(frozen=True)
class TracedStep:
    """What one traced training step held, per rank (bytes): the peak with its composition by tracker category, the
    forward pass's own peak, what stays after the step, and what autograd saved for backward."""

    peak: dict[str, int]
    forward_peak: int
    after_step: dict[str, int]
    saved_activations: int
    flops: float
    """FLOPs of the step (FlopCounterMode: matmuls, convolutions, attention; AC's recomputed forward included)."""
    seconds: float

    def terms(self) -> dict[str, float]:
        """The peak as MemoryEstimate's five terms (they add up to it)."""
        return {term: float(sum(self.peak.get(c, 0) for c in categories)) for term, categories in TERMS.items()}


@contextlib.contextmanager
def fake_process_group(world_size: int, hsdp_replicas: int = 1):
    """A DeviceMesh of ``world_size`` ranks in this process, over a process group that sends nothing (``fake``):
    what ``fully_shard`` needs to shard as on rank 0 of a real job. Refused where a real group already runs."""
    # A private torch module (the fake backend registers itself on import): imported here, where it is used.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise ConfigError("the traced FSDP estimate needs a process group of its own: estimate outside a "
                          "distributed job (python estimate_memory.py ..., not under torchrun)")
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        shape = mesh_shape(world_size, hsdp_replicas)
        yield dist.init_device_mesh("cpu", shape, mesh_dim_names=HSDP_DIMS[-len(shape):])
    finally:
        dist.destroy_process_group()


def fake_copy(model: nn.Module, device: Union[str, torch.device] = "cpu") -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are fake tensors on ``device`` (call under FakeTensorMode):
    the original, real or on the meta device, is left as it is and nothing of its size is allocated."""
    memo = {}
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        fake = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
        memo[id(tensor)] = nn.Parameter(fake, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else fake
    return copy_model(model, memo)  # (its complex parameters' views made afresh: models/adapt.py)


def _stand_in_for_ddp(model: nn.Module, bucket_view: bool) -> list[torch.Tensor]:
    """DDP's reducer, as far as memory goes (see the module docstring): the buckets, and the copy into them."""
    buckets = {}
    for param in model.parameters():
        if not param.requires_grad:
            continue
        buckets[param] = torch.empty_like(param)

        def into_bucket(p: torch.Tensor) -> None:
            buckets[p].copy_(p.grad)
            if bucket_view:
                p.grad = buckets[p]

        param.register_post_accumulate_grad_hook(into_bucket)
    return list(buckets.values())


class GlooStaging(TorchDispatchMode):
    """gloo's buffers, which the fake process group does not allocate (see the module docstring).

    ProcessGroupGloo has no native reduce-scatter or all-gather into one tensor: it stages each through a buffer of
    the unsharded size (measured with the profiler: one buffer of the reduce-scatter's input, of the all-gather's
    output), on a thread of its own while the step goes on. A reduce-scatter's lives until FSDP2 waits for it, at the
    next unit's reduce-scatter or the end of backward, while the next unit's backward runs; an all-gather's here
    until the next collective (FSDP2 prefetches the next unit's in backward, while this unit computes). When the
    buffers really meet the step's peak varies from run to run (benchmarks/validate_traced_estimate.py measures the
    median): this is the case of their meeting it. Stood in for by fake buffers, inside the tracker so that it
    counts them. NCCL (CUDA) reduces in place: nothing to stand in for.
    """

    def __init__(self):
        super().__init__()
        self.reduce_scatter: Optional[torch.Tensor] = None
        self.all_gather: Optional[torch.Tensor] = None

    def release(self) -> None:
        self.reduce_scatter = self.all_gather = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor unwrap itself first, as the trackers do
        if func is torch.ops.c10d._reduce_scatter_base_.default:
            self.reduce_scatter = self.all_gather = None  # the previous ones are waited for by now
            self.reduce_scatter = torch.empty_like(args[1])
        elif func is torch.ops.c10d._allgather_base_.default:
            self.all_gather = None
            self.all_gather = torch.empty_like(args[0])
        return func(*args, **kwargs)


def _snapshot(tracker, kind: str, device: Optional[torch.device] = None) -> dict[str, int]:
    """The tracker's figures of one device (``device``; default: the first it saw)."""
    by_device = tracker.get_tracker_snapshot(kind)
    if device is not None:
        return next((v for d, v in by_device.items() if d.type == device.type), {"Total": 0})
    return next(iter(by_device.values()), {"Total": 0})


def trace_step(model: nn.Module, input_shape: Sequence[int], target_shape: Sequence[int], loss, cfg: Config,
               world_size: int = 1, strategy: str = "none", device_type: str = "cpu") -> TracedStep:
    """One rank's training step of ``model`` on fake tensors (see the module docstring), for a batch of
    ``input_shape`` (this rank's: its share of the global batch) and ``loss`` (a callable or a name of
    utils.training.LOSSES); ``cfg`` gives what the scripts read: ac, amp_dtype, fused_optimizer and the DDP/FSDP keys;
    ``device_type`` the backend (cpu: gloo, whose staging buffers are stood in for; cuda: NCCL).
    Raises :class:`CannotTrace` (one line) where the step does not run on fake tensors."""
    # Private torch modules (torch.distributed._tools): imported where used, so that a torch without them fails
    # this estimate in one line, not every import of utils.memory.
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker  # (private: see above)
    from torch.distributed._tools.mem_tracker import MemTracker  # (private: see above)

    if strategy not in STRATEGIES:
        raise ConfigError(f"strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
    d = cfg.dist
    started = time.perf_counter()
    world = fake_process_group(world_size, d.hsdp_replicas) if strategy == "fsdp" else contextlib.nullcontext()
    try:
        with world as mesh, fresh_model_caches(model), FakeTensorMode(allow_non_fake_inputs=True):
            fake = apply_ac(fake_copy(model), cfg.train.ac)
            if strategy == "fsdp":  # HSDP: the 2-D mesh itself (apply_fsdp takes hsdp_replicas from a mesh it builds)
                apply_fsdp(fake, dataclasses.replace(cfg, dist=dataclasses.replace(d, hsdp_replicas=1)),
                           torch.device("cpu"), mesh=mesh)
            buckets = _stand_in_for_ddp(fake, d.gradient_as_bucket_view) if strategy == "ddp" else []
            optimizer = build_optimizer(fake, cfg, 1, torch.device("cpu"))[0]
            inputs, target = torch.empty(tuple(input_shape)), torch.empty(tuple(target_shape))

            def step(counter=contextlib.nullcontext()):
                optimizer.zero_grad(set_to_none=True)
                with counter:
                    value = forward_and_loss(fake, inputs, target, cfg.train.amp_dtype, loss)
                forward = _snapshot(tracker, "peak")["Total"] if tracker is not None else 0
                value.backward()  # (no GradScaler: its inf check reads values; its unscaling is in place)
                staging.release()
                optimizer.step()
                return forward

            tracker, staging = None, GlooStaging()
            # (FlopCounterMode wraps each module's output to see backward: it changes what is held, so it counts the
            # first, untracked step.)
            with FlopCounterMode(display=False) as flops:
                step()  # AdamW's state, FSDP's lazy initialisation, the model's caches: as a real first step
            if strategy == "fsdp":
                tracker = FSDPMemTracker(fake, optimizer)
            else:
                tracker = MemTracker()
                tracker.track_external(fake, optimizer, *buckets)
            saved = SavedTensorBytes(exclude=list(fake.parameters()) + list(fake.buffers()))
            gloo = staging if strategy == "fsdp" and device_type == "cpu" else contextlib.nullcontext()
            with tracker, gloo:
                forward = step(saved)
                peak, after = _snapshot(tracker, "peak"), _snapshot(tracker, "current")
    except ConfigError:
        raise
    except Exception as error:  # whatever the model does that fake tensors cannot: one line, never a traceback
        what = (str(error).strip().splitlines() or [""])[0][:200]
        values = "DataDependent" in type(error).__name__ or "DynamicOutputShape" in type(error).__name__
        hint = (" (it reads a tensor's values: .item(), .tolist(), a shape that depends on the data; fake tensors "
                "have shapes only)") if values else ""
        if "c10d" in what:  # torch.distributed._tools.fake_collectives: from torch 2.7 on
            hint = f" (FSDP2's collectives on fake tensors need torch >= 2.7; this is {torch.__version__})"
        raise CannotTrace(f"cannot trace {type(model).__name__}'s training step on fake tensors: "
                          f"{type(error).__name__}: {what}{hint}") from None
    return TracedStep(peak, forward, after, saved.bytes, float(flops.get_total_flops()),
                      time.perf_counter() - started)


def trace_inference(model: nn.Module, forward: Callable[[Callable, torch.Tensor], torch.Tensor],
                    input_shape: Sequence[int], device: Union[str, torch.device] = "cpu") -> int:
    """Peak bytes of ``forward(model_call, x)`` for an input of ``input_shape`` under ``torch.no_grad()`` (inference:
    no activation is kept for a backward), traced on fake tensors as :func:`trace_step` traces training: parameters,
    buffers, the input and everything ``forward`` allocates (tiles and their blend, autocast's copies) at the
    moment of the peak. ``model_call(x)`` runs the model; ``forward`` may call it many times (tiles, steps).
    Raises :class:`CannotTrace` (one line) where the forward does not run on fake tensors.

    ``device``: where the real forward runs. Unlike a training step (see the module docstring), inference on a GPU
    is traced with fake CUDA tensors there: CUDA's autocast (LayerNorm in fp32) and attention kernels then shape the
    trace. Traced with the CPU's kernels, SwinIR's whole field in bf16 came to 37 % of the peak measured on an H200
    (tests/gpu_check.py, benchmarks/README.md); cuDNN's convolution workspaces stay unseen on either path."""
    from torch.distributed._tools.mem_tracker import MemTracker  # (private: see trace_step)

    device = torch.device(device)
    try:
        with fresh_model_caches(model), FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
            fake = fake_copy(model, device).eval()
            tracker = MemTracker()
            tracker.track_external(fake)
            def model_call(x: torch.Tensor) -> torch.Tensor:
                tracker.reset_mod_stats()  # per-module figures of the last call: MemTracker refuses repeated calls
                return fake(x)

            with tracker:
                forward(model_call, torch.empty(tuple(input_shape), device=device))
                peak = _snapshot(tracker, "peak", device)["Total"]
    except Exception as error:  # as trace_step: one line, never a traceback
        what = (str(error).strip().splitlines() or [""])[0][:200]
        raise CannotTrace(f"cannot trace {type(model).__name__}'s forward on fake tensors: {type(error).__name__}: "
                          f"{what}") from None
    return int(peak)


def _estimate(traced: TracedStep, setting: dict) -> MemoryEstimate:
    """MemoryEstimate's terms at the moment of the peak (so that they add up to it), and what stays per rank."""
    terms = traced.terms()
    params_detail = {c.lower().replace(" ", "_"): float(traced.peak[c]) for c in TERMS["params"]
                     if traced.peak.get(c)}
    after = traced.after_step
    states = sum(after.get(c, 0) for c in STATES)
    phase = "forward" if traced.forward_peak >= traced.peak["Total"] else "backward or optimizer step"
    setting = {**setting, "peak_phase": phase, "states_gb": round(states / GB, 9),  # (9: to the byte)
               "saved_activations_gb": round(traced.saved_activations / GB, 9), "flops_per_step": traced.flops,
               "traced_s": round(traced.seconds, 2)}
    return MemoryEstimate(terms["params"], terms["grads"], terms["optimizer"], terms["activations"],
                          terms["temporary"], {"activations_at_peak": terms["activations"]},
                          {"at_peak": terms["temporary"]}, params_detail, setting)


def estimate_model(model: Union[nn.Module, Callable[[], nn.Module]], input_shape: Sequence[int],
                   target_shape: Sequence[int], loss, cfg: Optional[Config] = None, world_size: int = 1,
                   strategy: str = "none", device_type: str = "cpu") -> MemoryEstimate:
    """Predicted peak training memory of one rank for any model (a module, or a function that builds it), from one
    traced step on fake tensors. ``input_shape``/``target_shape``: the global batch's (split over the data-parallel
    ranks: batch / world_size each); ``loss``: a callable (prediction, target) -> scalar or a loss name; ``cfg``:
    the layout keys (ac, amp_dtype, param_dtype, hsdp_replicas, ...; default: the config defaults)."""
    cfg = cfg or Config()
    if strategy == "none" and world_size != 1:
        raise ConfigError(f"world_size {world_size} needs strategy ddp or fsdp")
    if input_shape[0] % world_size:
        raise ConfigError(f"batch {input_shape[0]} is the global batch and must be divisible by the {world_size} "
                          f"data-parallel ranks; use a multiple of {world_size}")
    module = model if isinstance(model, nn.Module) else model()
    per_rank = input_shape[0] // world_size
    traced = trace_step(module, (per_rank, *input_shape[1:]), (per_rank, *target_shape[1:]), loss, cfg, world_size,
                        strategy, device_type)
    return _estimate(traced, {
        "model": type(module).__name__, "config": cfg.name, "strategy": strategy, "world_size": world_size,
        "batch_per_rank": per_rank, "input_shape": [per_rank, *input_shape[1:]], "amp_dtype": cfg.train.amp_dtype,
        "ac": cfg.train.ac, "param_dtype": cfg.dist.param_dtype if strategy == "fsdp" else "fp32",
        "num_params": sum(p.numel() for p in module.parameters() if p.requires_grad), "method": "traced",
        "device_type": device_type})


def refuse_untraceable_layout(cfg: Config, model_name: str, described: bool = False) -> None:
    """tp, cp and pp are estimated from hand-written descriptions only (see the module docstring): one line."""
    d = cfg.dist
    used = [f"{name} {n}" for name, n in (("tp", d.tp), ("cp", d.cp), ("ens", d.ens), ("pp", d.pp)) if n > 1]
    if used:
        fix = ("the hand-written estimate has them: drop --traced" if described else
               f"{model_name} has no hand-written memory description (a spec's memory: models/spec.py) for tensor, "
               "context or pipeline parallelism: use --tp 1 --cp 1 --pp 1")
        raise ConfigError(f"{' and '.join(used)}: the traced estimate covers one device, DDP, FSDP and HSDP; {fix}")


def estimate_traced(cfg: Config, world_size: int = 1, strategy: str = "none", device_type: Optional[str] = None,
                    model: Optional[nn.Module] = None) -> MemoryEstimate:
    """:func:`estimate_model` for a config: its model (``models.build_model`` on the meta device, unless ``model`` is
    given), the batch and the loss train.py would use (utils.memory.measure), the config's layout keys."""
    model = model if model is not None else model_on_meta(cfg)
    name = type(model).__name__
    refuse_untraceable_layout(cfg, name, has_description(cfg.model))
    # --ensemble M: every member one more input of the batch (the CRPS then takes the batch's rows as its members)
    inputs, target = batch_shapes(cfg, batch=cfg.train.batch_size * cfg.train.ensemble)
    device_type = device_type or ("cuda" if cfg.train.device == "auto" and torch.cuda.is_available()
                                  else cfg.train.device if cfg.train.device != "auto" else "cpu")
    estimate = estimate_model(model, inputs, target, loss_for(cfg), cfg, world_size, strategy, device_type)
    if strategy == "fsdp":
        estimate.setting.update(shard_group=world_size // cfg.dist.hsdp_replicas, fsdp_unit=cfg.dist.fsdp_unit)
    if device_type == "cuda":
        estimate.setting["notes"] = ["traced with the CPU's kernels: CUDA's attention kernels and autocast may save "
                                     "other tensors (utils/memory/traced.py)"]
    return estimate
