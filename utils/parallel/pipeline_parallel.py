"""Pipeline parallelism for train_pp.py: cut a plain model into stages, run them with a
``torch.distributed.pipelining`` schedule, and measure the pipeline bubble.

- Cutting. Both models' forward is ``stem`` -> ``run_block`` for each unit -> ``tail``; a "carry" of
  tensors flows between units. SwinIR: the units are its RSTBs and the carry is (tokens, shallow
  features = the long skip, input), so middle stages pass the skip on untouched and the last stage
  adds ``conv_after_body(features) + skip``, upsamples and crops to the input's size; the ViT: the
  units are its transformer blocks and the carry is (tokens,). Stage s holds a contiguous run of
  units, plus the stem if it is the first and the tail if it is the last (its plan, in its spec: models/spec.py names them).
- A stage is a copy of the model object that keeps only its own parts, under the model's parameter
  names (``layers.3.…``): the ranks' checkpoint shards together are the whole model's, so DCP
  reshards them into any layout and ``python -m utils.checkpoint.sharded export`` makes a train.py file.
- Balance: units are split into contiguous runs minimising the largest stage's parameter count (the
  stem counted with the first stage, the tail with the last): parameters set a stage's memory for
  weights, gradients and AdamW state, and for transformer blocks of one width also its FLOPs.
  ``--pp_split`` (units per stage) overrides it.
- Placement: gpipe and 1f1b run one stage per rank; interleaved_1f1b two per rank, in a loop
  (rank r: stages r and r + pp); zbv two per rank in a V (rank r: stages r and 2 pp - 1 - r), so
  rank 0 holds the first and the last stage.
- Bubble: the time each rank spends in its stages' forward and backward chunks, against the step's
  wall time; the rest is waiting for other stages (and, on 2 CPU cores, for the CPU).
"""

from __future__ import annotations

import contextlib
import functools
import time
import types
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                                    ScheduleZBVZeroBubble)

from utils.config import ConfigError
from utils.parallel.fsdp import apply_fsdp
from utils.parallel.plans import StagePlan, missing_plan, model_plan
from utils.parallel.versions import check_schedule, keep_every_p2p_work
from utils.precision import autocast

# The config keys this file applies, and the scripts that apply them: any other script refuses them set away
# from their defaults (utils/config.py reads every file's APPLIED_BY as a literal, without importing the file).
APPLIED_BY = {
    ("pp", "pp_schedule", "pp_microbatches"): ("train_pp.py", "estimate_memory.py"),
    ("pp_split", "pp_dp"): ("train_pp.py",),
}

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B,
             "zbv": ScheduleZBVZeroBubble}
STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zbv": 2}
# The chunk methods of a PipelineStage that are timed, and their letters on the timeline: forward, backward
# (under ZB-V the input-gradient half only), and ZB-V's deferred weight-gradient half.
TIMED = {"forward_one_chunk": "F", "backward_one_chunk": "B", "backward_weight_one_chunk": "W"}


def plan_for(model: nn.Module) -> StagePlan:
    """The model's stage plan (its plan, in its spec: models/spec.py); refused in one line without one."""
    plan = model_plan(model).stages
    if plan is None:
        raise missing_plan(model, "pipeline (stages)", "--pp 1")
    return plan


def bubble_theory(schedule: str, pp: int, microbatches: int) -> float:
    """Idle fraction of a rank with equal stages and free communication: (p - 1) / (v m + p - 1) for v
    stages per rank (GPipe, 1F1B: v = 1; interleaved 1F1B: v = 2); ZB-V's is 0 when a forward, an
    input-gradient and a weight-gradient pass take equal times (Qi et al. 2024, arXiv:2401.10241)."""
    if schedule == "zbv":
        return 0.0
    v = STAGES_PER_RANK[schedule]
    return (pp - 1) / (v * microbatches + pp - 1)


def check_pipeline(cfg, pp: int, replica_batch: int, n_units: int, units_name: str = "units") -> int:
    """The number of stages of ``cfg``'s pipeline over ``pp`` ranks, or ConfigError for a layout train_pp.py cannot run
    (Pipeline checks with it; plan.py enumerates only what it accepts). ``n_units``: the model's units to cut."""
    d = cfg.dist
    if replica_batch % d.pp_microbatches:
        raise ConfigError(f"pp_microbatches {d.pp_microbatches} does not divide the {replica_batch} samples each "
                          f"pipeline takes per step (batch_size / dp): choose a divisor, or another batch_size")
    if d.pp_schedule == "zbv" and cfg.train.compile:
        raise ConfigError("zbv splits each backward into an input and a weight half (retain_graph), which "
                          "torch.compile's backward does not allow in torch 2.15: use --compile false with "
                          "zbv, or another schedule")
    if d.pp_schedule == "zbv" and cfg.train.ac != "none":  # found by check_layouts.py
        raise ConfigError("zbv splits each backward into an input and a weight half, and activation checkpointing "
                          "cannot recompute a unit for the second half in torch 2.15 (AttributeError in "
                          "torch.utils.checkpoint): use --ac none with zbv, or another schedule")
    if cfg.train.amp_dtype == "fp16":
        raise ConfigError("train_pp.py: fp16 needs a loss scale inside the pipeline schedule; use --amp_dtype bf16 "
                          "(no scaling needed) or none")
    n_stages = pp * STAGES_PER_RANK[d.pp_schedule]
    if n_stages > n_units:
        raise ConfigError(f"{n_stages} pipeline stages (pp {pp} x {STAGES_PER_RANK[d.pp_schedule]} for "
                          f"{d.pp_schedule}) but the {units_name} are only {n_units} units to cut: "
                          "use a smaller pp, or a model of more units (its --model_args)")
    if d.pp_split and (len(d.pp_split) != n_stages or sum(d.pp_split) != n_units):
        raise ConfigError(f"pp_split {d.pp_split} must give units for each of the {n_stages} stages, {n_units} in all")
    return n_stages


def balanced_split(costs: list[int], n_stages: int, first_extra: int = 0, last_extra: int = 0) -> list[int]:
    """Units per stage: contiguous runs of ``costs`` minimising the largest stage's total (the first
    stage also carries ``first_extra``, the last ``last_extra``); ties go to the earliest cut."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    @functools.lru_cache(maxsize=None)
    def best(stage: int, start: int) -> tuple[int, tuple[int, ...]]:
        if stage == n_stages:
            return (0, ()) if start == n else (float("inf"), ())
        options = []
        for end in range(start + 1, n - (n_stages - stage - 1) + 1):
            cost = prefix[end] - prefix[start] + (first_extra if stage == 0 else 0)
            cost += last_extra if stage == n_stages - 1 else 0
            rest, sizes = best(stage + 1, end)
            options.append((max(cost, rest), (end - start, *sizes)))
        return min(options, key=lambda option: option[0]) if options else (float("inf"), ())

    return list(best(0, 0)[1])


def stage_ids(schedule: str, pp: int, pp_rank: int) -> list[int]:
    """The stages rank ``pp_rank`` of a pipeline holds (see Placement above)."""
    if schedule == "zbv":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return list(range(pp_rank, pp * STAGES_PER_RANK[schedule], pp))


class _Units(nn.ModuleDict):
    """The units a stage keeps, keyed by their index in the whole model (so parameter names match it),
    iterated like the ModuleList they come from (the techniques' ``model.blocks()`` loops over it)."""

    def __iter__(self):
        return iter(self.values())


class _DenseGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient dense: a stage sends its input's gradient back to the
    previous stage as is, and gloo/NCCL send only dense tensors (SwinIR's convolutions return
    channels-last ones). PyTorch has no such op; a tensor hook would pile up on the reused receive buffers."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _stage_forward(stage: nn.Module, *carry, units: str, first: bool, last: bool, amp: Callable):
    with amp():  # AMP per stage: the schedule calls the stage itself
        if first:
            carry = stage.stem(*carry)
        else:
            carry = tuple(_DenseGrad.apply(t) if t.requires_grad else t for t in carry)
        for unit in getattr(stage, units):
            carry = stage.run_block(unit, carry)
        if last:
            return stage.tail(*carry)
        # Sent as they are: dense (gloo/NCCL), and not views (zero-bubble schedules detach outputs in place),
        # which costs one copy of a tensor passed through untouched (SwinIR's long skip).
        return tuple(t.clone(memory_format=torch.contiguous_format) if t._is_view() or not t.is_contiguous() else t
                     for t in carry)


def cut_stage(model: nn.Module, plan: StagePlan, index: int, n_stages: int, units: range,
              amp: Callable = contextlib.nullcontext) -> nn.Module:
    """Stage ``index`` of ``n_stages``: a copy of ``model`` that shares, and keeps, only its units (and
    the stem or tail), and whose forward runs only those."""
    stage = nn.Module.__new__(type(model))
    for key, value in vars(model).items():  # own parameter/module/hook tables, shared tensors
        stage.__dict__[key] = type(value)(value) if isinstance(value, (dict, set)) else value
    first, last = index == 0, index == n_stages - 1
    keep = set(plan.stem if first else ()) | set(plan.tail if last else ())
    for table in (stage._modules, stage._parameters):
        for name in [name for name in table if name not in keep]:
            del table[name]
    stage._modules[plan.units] = _Units({str(i): getattr(model, plan.units)[i] for i in units})
    stage.forward = types.MethodType(functools.partial(_stage_forward, units=plan.units, first=first, last=last,
                                                       amp=amp), stage)
    return stage


def apply_data_parallel(stage: nn.Module, cfg, device: torch.device, mesh) -> nn.Module:
    """FSDP2 across pipelines: sharded over the dp ranks ("fsdp"), or replicated with gradients
    all-reduced ("ddp": a (dp, 1) mesh). DDP itself is not used: its reducer fails under pipeline
    schedules in torch 2.15 (an internal assert when rebuilding buckets), while the schedules drive
    FSDP2's gradient reduction once per step. Parameters stay gathered from forward to backward, since
    a pipeline runs several microbatches' forwards before their backwards (torchtitan does the same)."""
    dp_mesh = mesh["dp", "dp_shard"] if cfg.dist.pp_dp == "ddp" else mesh["dp"]
    return apply_fsdp(stage, cfg, device, dp_mesh, reshard_after_forward=False)


def _timed(fn: Callable, pipeline: "Pipeline", kind: str, stage: int) -> Callable:
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if pipeline.device.type == "cuda":  # host timestamps mean GPU time only once the kernels finished
                torch.cuda.synchronize(pipeline.device)
            end = time.perf_counter()
            pipeline._busy += end - start
            pipeline._chunks.append((kind, stage, start - pipeline._step_start, end - pipeline._step_start))
    return timed


class Pipeline:
    """This rank's stages of one model replica, and the schedules that run them (one to train, one per
    input shape to evaluate, since a schedule's buffers are sized by its first microbatch).

    ``step(inputs, target)`` trains one batch (every microbatch's forward and backward, gradients
    averaged over microbatches); calling the pipeline evaluates a batch and returns the prediction
    on every rank of the pipeline (the last stage broadcasts it), so the task's metrics run unchanged.
    """

    def __init__(self, model: nn.Module, cfg, pp_mesh, device: torch.device, loss_fn: Callable, replica_batch: int):
        d = cfg.dist
        plan = plan_for(model)
        units = getattr(model, plan.units)
        self.device, self.schedule_name, self.microbatches = device, d.pp_schedule, d.pp_microbatches
        self.pp, self.pp_rank, self.group = pp_mesh.size(), pp_mesh.get_local_rank(), pp_mesh.get_group()
        check_schedule(d.pp_schedule, self.group)
        keep_every_p2p_work(self.group)  # torch < 2.8 on gloo: else a stage boundary of several tensors hangs
        self.n_stages = check_pipeline(cfg, self.pp, replica_batch, len(units), f"{type(model).__name__}'s {plan.units}")
        if d.pp_split:
            self.split = list(d.pp_split)
        else:
            count = lambda names: sum(p.numel() for name in names if hasattr(model, name)  # noqa: E731
                                      for p in _parameters_of(getattr(model, name)))
            self.split = balanced_split([sum(p.numel() for p in unit.parameters()) for unit in units],
                                        self.n_stages, count(plan.stem), count(plan.tail))
        bounds = [sum(self.split[:s]) for s in range(self.n_stages + 1)]
        self.param_names = [name for name, _ in model.named_parameters()]  # the whole model's, in order
        self.param_count = sum(p.numel() for p in model.parameters())
        self.param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.stage_ids = stage_ids(d.pp_schedule, self.pp, self.pp_rank)
        amp = functools.partial(autocast, device, cfg.train.amp_dtype)
        self.stages = [cut_stage(model, plan, s, self.n_stages, range(bounds[s], bounds[s + 1]), amp)
                       for s in self.stage_ids]
        placement = [stage_ids(d.pp_schedule, self.pp, r) for r in range(self.pp)]
        self.owner = {s: r for r, ids in enumerate(placement) for s in ids}  # stage -> pp rank
        self.last_rank = self.owner[self.n_stages - 1]
        self.holds_first, self.holds_last = 0 in self.stage_ids, self.n_stages - 1 in self.stage_ids
        self.loss_fn = loss_fn
        # Fewer microbatches than 2 x stages leaves much of each rank idle while the pipeline fills and drains;
        # ZB-V's theoretical 0 % assumes equal forward, input- and weight-gradient times, so it is not quoted.
        theory = bubble_theory(d.pp_schedule, self.pp, d.pp_microbatches)
        self.warning = (f"warning: {d.pp_microbatches} microbatches for {self.n_stages} stages leave the ranks idle "
                        f"while the pipeline fills and drains{f' ({theory:.0%} in theory)' if theory else ''}; use >= "
                        f"{2 * self.n_stages} microbatches" if d.pp_microbatches < 2 * self.n_stages else None)
        self.training = True
        self._schedules: dict = {}
        self._busy = self._busy_measured = self._wall_measured = self._step_start = 0.0
        self._chunks: list[tuple[str, int, float, float]] = []  # the current step's (kind, stage, start, end)
        self._steps = 0

    def describe(self) -> str:
        return (f"{self.n_stages} stages of {self.split} units, {self.schedule_name}, {self.microbatches} "
                f"microbatches; this rank: stages {self.stage_ids}")

    # ------------------------------------------------------------------ techniques, optimizer, checkpoints

    def parallelize(self, technique: Callable[[nn.Module], nn.Module]) -> None:
        """Apply a technique (AC, compile, FSDP2) to each of this rank's stages, as to a model."""
        self.stages = [technique(stage) for stage in self.stages]

    def local_model(self) -> nn.Module:
        """One module holding this rank's parameters under the whole model's names (for the optimizer,
        the memory report and DCP). Built from the stages as they are now: call it again after sharding.
        FSDP2 parameters are resharded first: a schedule may leave them gathered after a step, and the
        optimizer and DCP hold the sharded ones."""
        for stage in self.stages:
            for module in stage.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
        view = nn.Module()
        units = {}
        for stage in self.stages:
            for name, child in stage._modules.items():
                if isinstance(child, _Units):
                    units[name] = {**units.get(name, {}), **child._modules}
                else:
                    view._modules[name] = child
            view._parameters.update(stage._parameters)
            view._buffers.update(stage._buffers)
            view._non_persistent_buffers_set.update(stage._non_persistent_buffers_set)
        for name, children in units.items():
            view._modules[name] = _Units(sorted(children.items(), key=lambda item: int(item[0])))
        return view

    # ------------------------------------------------------------------ running

    def _schedule(self, key, microbatches: int, loss_fn: Optional[Callable]):
        if key not in self._schedules:
            stages = [PipelineStage(stage, s, self.n_stages, self.device, group=self.group)
                      for stage, s in zip(self.stages, self.stage_ids)]
            if loss_fn is not None:  # training: time the compute of every chunk
                for stage in stages:
                    for name, kind in TIMED.items():
                        setattr(stage, name, _timed(getattr(stage, name), self, kind, stage.stage_index))
            schedule_cls = SCHEDULES[self.schedule_name]
            try:
                self._schedules[key] = schedule_cls(stages if len(stages) > 1 else stages[0],
                                                    n_microbatches=microbatches, loss_fn=loss_fn)
            except ValueError as error:
                raise ConfigError(f"{self.schedule_name} with {microbatches} microbatches on {self.pp} ranks: "
                                  f"{error}") from None
        return self._schedules[key]

    def step(self, inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Forward and backward of every microbatch; returns the batch's loss on every rank of the pipeline."""
        schedule = self._schedule("train", self.microbatches, lambda pred, tgt: self.loss_fn(pred.float(), tgt))
        losses: list[torch.Tensor] = []
        busy, start = self._busy, time.perf_counter()
        self._chunks, self._step_start = [], start
        schedule.step(*([inputs] if self.holds_first else []), target=target if self.holds_last else None,
                      losses=losses)
        self._steps += 1
        if self._steps > 1:  # the first step also infers shapes and builds buffers
            self._busy_measured += self._busy - busy
            self._wall_measured += time.perf_counter() - start
        loss = torch.stack(losses).mean() if losses else torch.zeros((), device=self.device)
        dist.all_reduce(loss, group=self.group)  # only the last stage's rank has it: a sum shares it
        return loss.detach()

    def timeline(self) -> list[list]:
        """The last training step's chunks on this rank: [kind (F, B, W), stage, start ms, end ms], from the
        step's start."""
        return [[kind, stage, round(start * 1e3, 2), round(end * 1e3, 2)] for kind, stage, start, end in self._chunks]

    def bubble(self) -> Optional[float]:
        """This rank's measured idle fraction over the training steps after the first (None before)."""
        return 1.0 - self._busy_measured / self._wall_measured if self._wall_measured else None

    @torch.no_grad()
    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        # A batch that the microbatches do not divide (a validation set's last) is padded with copies of
        # its last sample, whose predictions are dropped: the schedule keeps its microbatch count.
        batch = len(inputs)
        padding = -batch % self.microbatches
        if padding:
            inputs = torch.cat([inputs, inputs[-1:].expand(padding, *inputs.shape[1:])])
        if self.schedule_name == "zbv" or not hasattr(SCHEDULES[self.schedule_name], "eval"):  # eval: torch >= 2.9
            pred = self._stages_in_order(inputs)
        else:
            schedule = self._schedule(("eval", tuple(inputs.shape)), self.microbatches, None)
            pred = schedule.eval(*([inputs] if self.holds_first else []))
        shape = [tuple(pred.shape) if self.holds_last else None]
        dist.broadcast_object_list(shape, group=self.group, group_src=self.last_rank)
        if not self.holds_last:
            pred = torch.empty(shape[0], device=self.device)
        dist.broadcast(pred, group=self.group, group_src=self.last_rank)
        return pred[:batch]

    def _stages_in_order(self, inputs: torch.Tensor) -> Optional[torch.Tensor]:
        """The whole batch through the stages one after the other: ZB-V's evaluation, because torch 2.15's
        ZB-V ``eval`` still runs backward actions and fails where the V turns (two stages on one rank); and every
        schedule's before torch 2.9, whose schedules have no ``eval`` (pytorch/pytorch#157795)."""
        carry = (inputs,)
        for s in range(self.n_stages):
            owner, previous = self.owner[s], self.owner.get(s - 1)
            if owner != self.pp_rank:
                if previous == self.pp_rank:
                    self._send(carry, owner)
                continue
            if s and previous != self.pp_rank:
                carry = self._receive(previous)
            out = self.stages[self.stage_ids.index(s)](*carry)
            carry = out if isinstance(out, tuple) else (out,)
        return carry[0] if self.holds_last else None

    def _send(self, tensors: tuple, pp_rank: int) -> None:
        peer = dist.get_global_rank(self.group, pp_rank)
        dist.send_object_list([[(t.shape, t.dtype) for t in tensors]], dst=peer, group=self.group)
        for t in tensors:
            dist.send(t.contiguous(), dst=peer, group=self.group)

    def _receive(self, pp_rank: int) -> tuple:
        peer, meta = dist.get_global_rank(self.group, pp_rank), [None]
        dist.recv_object_list(meta, src=peer, group=self.group)
        tensors = tuple(torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in meta[0])
        for t in tensors:
            dist.recv(t, src=peer, group=self.group)
        return tensors

    def train(self, mode: bool = True) -> "Pipeline":
        self.training = mode
        for stage in self.stages:
            stage.train(mode)
        return self

    def eval(self) -> "Pipeline":
        return self.train(False)


def bubble_report(pipeline: Pipeline, step: int) -> Optional[dict]:
    """Metrics record (kind "pipeline"): every rank's measured idle fraction next to the theory, and the last
    step's timeline: per rank, [kind (F, B, W), stage, start ms, end ms] of each chunk from the rank's own start
    of the step (the ranks start a step together: the previous one ended with a collective). Collective; None
    when fewer than two training steps ran (the first is not timed)."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (pipeline.bubble(), pipeline.timeline()))
    if any(bubble is None for bubble, _ in gathered):
        return None
    return {"kind": "pipeline", "step": step, "schedule": pipeline.schedule_name, "stages": pipeline.n_stages,
            "microbatches": pipeline.microbatches, "bubble_per_rank": [round(bubble, 4) for bubble, _ in gathered],
            "bubble_theory": round(bubble_theory(pipeline.schedule_name, pipeline.pp, pipeline.microbatches), 4),
            "timeline_ms": [chunks for _, chunks in gathered]}


def _parameters_of(value) -> list[torch.Tensor]:
    return [value] if isinstance(value, nn.Parameter) else list(value.parameters()) if value is not None else []
