"""The training memory of one rank, predicted from the config: :func:`estimate_memory` (what ``estimate_memory.py``
prints) adds up

* parameters, gradients and AdamW state (two fp32 moments, a step count per tensor) — exact counts from the
  config (:mod:`utils.memory.shapes`), sharded by FSDP2/HSDP (plus its all-gathered units and the root's
  parameters), doubled by DDP's buckets unless ``gradient_as_bucket_view``;
* activations: the bytes autograd holds for backward at the end of the forward pass (and the loss), per layer
  (:mod:`utils.memory.graphs`), for the rank's share of the batch and, with SwinIR's ``cp``, its band of the field;
* temporary: the extra memory of the worst moment of the step on top of the held activations
  (:func:`~utils.memory.graphs.simulate_peak`).

Model parallelism (train_mp.py, train_pp.py; plan.py ranks layouts by it): ``tp`` splits what the model's spec
splits (the activations as each graph says: models/<name>/memory.py), the ViT's ``cp`` gives
each rank a band of tokens with the keys and values of all bands, and ``pp`` gives each rank its stages' parameters
and the activations of the microbatches its schedule keeps in flight (:func:`in_flight`). Checked against the
``memory`` records of small runs (tests/test_mp.py, test_pp.py, test_fsdp.py: within 10 %; tp 2 -6 % (SwinIR -5 %),
cp 2 -2 %, 1F1B +0.4 %, ZB-V -7 %, FSDP exact) and of benchmarks/bench_mp.py and bench_pp.py (3 % and 5 %).

``total = params + grads + optimizer + activations + temporary``: meant as a slight upper bound on the peak,
since gradients fill up while activations are freed during backward; on an H200 the measured peaks came up to 1.9 %
above it (SwinIR's whole field, SC22's U-Net in fp32), so the printout calls it the estimated peak.

Which terms are exact and which approximate, for the models and PyTorch 2.14/2.15 this was written for:

* exact (equal to the byte on CPU in benchmarks/validate_memory_estimate.py; tests/test_memory.py
  asserts the issue's ±15 %): parameters, gradients, optimizer state, and every activation term on
  the CPU path — fp32 and bf16/fp16 autocast, AC none/block/layer, any batch and padding, all
  upsamplers, 1conv/3conv, L1/MSE, stochastic depth. On CPU the model computes window attention
  explicitly (softmax(q kᵀ + bias) v, because the fused CPU kernel cannot return the bias gradient),
  which saves the attention probabilities: ``heads × window²`` values per pixel and block.
  The ViT's activations are exact on CPU to the byte (tests/test_memory.py asserts equality, and
  benchmarks/full_size_memory.py --model vit equality with a FakeTensor trace of vit_base and
  vit_mp at full size): fp32, bf16/fp16 autocast, bf16 parameters, AC none/block, relative L2 / L1
  / MSE in physical or normalised units, stochastic depth, any size and patch. On CPU SDPA runs its
  flash kernel for every dtype (measured), saving q, k, v, the output and an fp32 log-sum-exp
  per head and token. Under autocast the residual stream stays fp32 (the fp32 position embedding
  and residual adds promote the bf16 outputs back), so LayerNorm saves fp32 inputs and q, k and v
  each save their own bf16 cast of its output: three copies (autocast caches only leaf weights).
  The U-Net's activations are exact to the byte on CPU (fp32, bf16/fp16 autocast, AC none/block,
  ``lambda_rho``; tests/test_memory.py).
* modelled, and measured on an H200 (torch 2.11, tests/gpu_check.py): the CUDA attention path. There the
  model calls ``scaled_dot_product_attention`` with the relative-position bias (+ shift mask) as a float mask
  that needs a gradient, contiguous, so that the memory-efficient kernel takes it (a permuted view sent SDPA to
  its math fallback): it saves q, k, v and its output (padded to the model's head width), the log-sum-exp and
  the bias where it is per window; CUDA autocast runs LayerNorm in fp32, so the residual stream stays fp32.
  The whole field at batch 1 measured within 0.1 % of these activations in fp32, bf16 and bf16 + AC block
  (totals −0.5 to −0.3 %); 10 small configs at batch 1–3 within 1.5 %. For the ViT (measured on the H200:
  vit_mp at batch 16, activations within 192 bytes, totals +2.5 % in bf16 and +9 % with AC):
  flash attention for fp16/bf16 (the same saved tensors as the CPU kernel, and two RNG-state
  scalars, not counted), the memory-efficient kernel for fp32 (log-sum-exp padded to 32 rows),
  the math fallback (which saves the tokens × tokens probabilities) only for head_dim % 8 != 0;
  CUDA autocast's fp32 LayerNorm changes nothing there, the stream being fp32 already.
* approximate: the temporary peak (which transients coexist is reasoned, not traced; on CPU the
  predicted total was within a few % of the measured peak for fp32/bf16), and the FSDP
  all-gather buffers (two units in flight plus the root's parameters). The total is an upper
  bound because it counts all gradients; on small inputs, where gradients weigh more, it
  over-predicts by up to ~15 %. The ViT's total over-predicted the measured CPU peak by +10 to
  +24 % on the small models of validate_memory_estimate.py and bench_vit.py (22M parameters on a
  96x192 field) and by +4 to +11 % where activations weigh more: without AC its peak is at the end
  of forward, before any gradient exists, so the excess is about the gradients (vit_mp's 1.4 GB
  are ~3 % of its 56 GB per GPU). Not modelled: kernel workspaces — e.g. fp16 on CPU, where
  convolutions fall back to an im2col kernel whose buffers add ~20 % to the peak (fp16 is for GPUs;
  use bf16 on CPU).

:mod:`utils.memory.measure` measures the same quantities, without trusting the estimate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from utils.config import Config, ConfigError
from utils.memory.graphs import Layer, held_after_forward, simulate_peak
from utils.memory.shapes import model_shape
from utils.parallel.pipeline_parallel import STAGES_PER_RANK, balanced_split, stage_ids
from utils.parallel.plans import FieldPlan, config_plan
from utils.precision import dtype_bytes

GB = 1e9  # decimal gigabytes, as utils.observe.flops.peak_memory_gb and nvidia-smi's "GB"
ADAMW_STATE_BYTES = 8  # exp_avg + exp_avg_sq in fp32 per parameter
ADAMW_STEP_BYTES = 4  # and one fp32 step count per parameter tensor


@dataclass
class MemoryEstimate:
    """Predicted training memory of one rank, in bytes (``to_json`` gives GB)."""

    params: float
    grads: float
    optimizer: float
    activations: float
    temporary: float
    activations_by_part: dict[str, float]
    temporary_by_phase: dict[str, float]
    params_detail: dict[str, float]
    setting: dict = field(default_factory=dict)

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.temporary

    def to_json(self) -> dict:
        gb = lambda value: round(value / GB, 6)  # noqa: E731
        return {
            "params_gb": gb(self.params), "grads_gb": gb(self.grads), "optimizer_gb": gb(self.optimizer),
            "activations_gb": gb(self.activations), "temporary_gb": gb(self.temporary), "total_gb": gb(self.total),
            "activations_by_part_gb": {k: gb(v) for k, v in self.activations_by_part.items()},
            "temporary_by_phase_gb": {k: gb(v) for k, v in self.temporary_by_phase.items()},
            "params_detail_gb": {k: gb(v) for k, v in self.params_detail.items()},
            **self.setting,
        }


def estimate_memory(cfg: Config, world_size: int = 1, strategy: str = "none", device_type: Optional[str] = None,
                    field: Optional[tuple[int, int]] = None, lr_size: Optional[tuple[int, int]] = None,
                    sequence_parallel: bool = True, ddp_beside_mp: bool = False) -> MemoryEstimate:
    """Predicted peak training memory of one rank for a config (see the module docstring).

    ``strategy``: "none" (one device, train.py), "ddp" or "fsdp" over ``world_size`` ranks; the
    config's batch_size is global, so each rank holds the activations of batch_size / dp, where dp =
    world_size / (tp x cp x ens x pp) for the config's tp, cp (train_mp.py: FSDP2 over dp x ens x cp), ens and pp
    (train_pp.py: parameters replicated over dp, each rank its stages'), times its ensemble / ens members (a member
    costs a forward's activations; the CRPS's gathered members, one prediction per member, are left out).
    ``device_type`` picks the attention path (default: cfg.train.device, "auto" = CUDA if present).
    ``lr_size`` overrides SwinIR's input size (else it follows crop_size, or the whole ``field``);
    the ViT's input is always its img_size (its position embedding is made for it).
    Layouts the scripts do not run, which published runs used (plan.py models them when given in full):
    ``ddp_beside_mp`` with strategy "ddp": tp/cp with DDP over dp (every dp rank holds the tp rank's whole
    parameters, gradients and AdamW state); ``sequence_parallel`` False: tp that keeps the residual stream and the
    norms whole on every tp rank (the description's :meth:`~MemoryDescription.without_sequence_parallelism`).
    """
    d = cfg.dist
    tp, cp, pp, ens = d.tp, d.cp, d.pp, d.ens
    if strategy not in ("none", "ddp", "fsdp"):
        raise ConfigError(f"strategy {strategy!r} is not one of none, ddp, fsdp")
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    if strategy == "none" and world_size != 1:
        raise ConfigError(f"world_size {world_size} needs --strategy ddp or fsdp")
    if (tp > 1 or cp > 1) and strategy != "fsdp" and not (ddp_beside_mp and strategy == "ddp"):
        what = "domain parallelism" if cp > 1 and isinstance(config_plan(cfg.model).cp, FieldPlan) else "model parallelism"
        raise ConfigError(f"{'cp' if cp > 1 else 'tp'} > 1 is train_mp.py's {what}, sharded with FSDP2 over dp x cp: "
                          "use --strategy fsdp with --world_size a multiple of tp x cp")
    if ens > 1 and strategy != "fsdp":
        raise ConfigError("ens > 1 is train_mp.py's, sharded with FSDP2 over dp x ens x cp: use --strategy fsdp with "
                          "--world_size a multiple of ens")
    if pp > 1 and (tp > 1 or cp > 1):
        raise ConfigError("train_pp.py combines pp with data parallelism only: use tp 1 and cp 1 with pp")
    if world_size % (tp * cp * pp * ens):
        sizes = " x ".join(f"{name} {n}" for name, n in (("tp", tp), ("cp", cp), ("ens", ens), ("pp", pp)) if n > 1)
        raise ConfigError(f"world_size {world_size} is not a multiple of {sizes}: each model replica spans those ranks")
    dp = world_size // (tp * cp * pp * ens)
    if cfg.train.batch_size % dp:
        raise ConfigError(f"batch_size {cfg.train.batch_size} is the global batch and must be divisible by the "
                          f"{dp} data-parallel ranks; use a multiple of {dp}")
    if device_type is None:
        device_type = cfg.train.device if cfg.train.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    shape = model_shape(cfg.model, cfg.target_chans)
    if not sequence_parallel:
        shape = shape.without_sequence_parallelism()
    ac = cfg.train.ac
    shape.check_supported(ac, d.fsdp_unit if strategy == "fsdp" else "block")
    param_dtype = d.param_dtype if strategy == "fsdp" else "fp32"
    # --ensemble M: each of a rank's members is one more input in its batch (a forward's activations each)
    members = cfg.train.ensemble // ens
    batch = cfg.train.batch_size // dp * members
    notes = []
    graph_batch = batch // d.pp_microbatches if pp > 1 else batch  # a pipeline's graph is one microbatch's

    # ---------------------------------------------------------------------- activations
    g = shape.activation_graph(cfg, device_type, param_dtype, batch, graph_batch, field, lr_size, tp, cp)
    graph, kernel = g.graph, g.kernel
    num_params = shape.num_params()
    if pp > 1:
        ranks = pipeline_ranks(cfg, shape, graph, pp)
        stage = max(ranks, key=lambda r: r.params * 16 + r.held)  # 16: fp32 parameter, gradient, 2 AdamW moments
        graph, num_params, param_tensors = stage.graph, stage.params, stage.param_tensors
        notes.append(f"pipeline rank {stage.rank} of {pp}: {stage.in_flight:g} microbatches of {graph_batch} in flight")
    else:
        param_tensors = shape.num_param_tensors()
    parts = held_after_forward(graph)
    if pp > 1:  # the microbatches in flight, and on the first stage what torch's shape inference keeps
        parts = {k: v * stage.in_flight for k, v in parts.items()}
        parts["pipeline_shape_inference"] = stage.held - sum(parts.values())
    shape.adjust_held(parts, g, cp)
    # Autocast saves a low-precision copy of each linear/conv weight used outside checkpointed units.
    # (Under tp each rank casts its shards; a pipeline rank its stages': in proportion to their parameters.)
    share = (num_params / shape.num_params() if pp > 1 else 1.0) / tp
    parts["autocast_weight_copies"] = 2.0 * shape.cast_weights(ac) * share if g.weight_copies else 0.0
    activations = sum(parts.values())

    # ---------------------------------------------------------------------- temporary peak
    held = activations - parts["autocast_weight_copies"]
    peak_forward, peak_backward = simulate_peak(graph)
    if pp > 1:  # the other microbatches in flight stay held while one runs
        extra = held - held * (1 / stage.in_flight)
        peak_forward, peak_backward = peak_forward + extra, peak_backward + extra
    phases = {"forward": max(peak_forward - held, 0.0), "backward": max(peak_backward - held, 0.0)}
    temporary = max(phases.values())

    # ---------------------------------------------------------------------- parameters, optimizer
    params_detail = {"model_fp32": num_params * 4.0}
    units = shape.fsdp_units(d.fsdp_unit) if strategy == "fsdp" else []
    if tp > 1:  # each rank holds 1/tp of what tensor parallelism splits (the blocks' matrices, the ViT's head)
        split = shape.tp_split_params() * (1 - 1 / tp)
        units = [u * (1 - split / sum(units)) for u in units]  # (the head's share is the root's: a slight error)
        num_params -= split
    shard = 1
    # FSDP2 splits each tensor along its first dimension: the ViT's position embedding (1, tokens, D) stays whole
    # on the first rank of each shard group, the largest rank.
    per_rank = lambda n: n if shard == 1 else (n - shape.unsplit_params()) / shard + shape.unsplit_params()  # noqa: E731
    if strategy == "fsdp" and pp == 1:
        if d.hsdp_replicas < 1 or world_size % d.hsdp_replicas:
            raise ConfigError(f"hsdp_replicas {d.hsdp_replicas} must divide world_size {world_size}")
        shard = world_size // tp // d.hsdp_replicas
        params_detail, largest_unit = _fsdp_params(units, num_params, per_rank(num_params), dtype_bytes(param_dtype),
                                                   d.reshard_after_forward)
    params = sum(params_detail.values())
    grads = per_rank(num_params) * 4.0
    states = per_rank(num_params) * (4.0 + 4.0 + ADAMW_STATE_BYTES) + param_tensors * ADAMW_STEP_BYTES
    if strategy == "ddp" and not d.gradient_as_bucket_view:
        grads *= 2  # DDP's communication buckets are a second copy of the gradients
    if strategy == "fsdp" and pp == 1:  # one unit's unsharded gradients, and their copy for the reduce-scatter
        grads += largest_unit * (dtype_bytes(param_dtype) + dtype_bytes(d.reduce_dtype))
    optimizer = per_rank(num_params) * ADAMW_STATE_BYTES + param_tensors * ADAMW_STEP_BYTES

    setting = {
        "model": shape.name, "config": cfg.name, "strategy": strategy, "world_size": world_size,
        "batch_per_rank": batch // members, "lr_input": list(g.input_size), "padded_input": list(g.padded),
        "tokens_per_rank": g.tokens,
        "amp_dtype": cfg.train.amp_dtype, "ac": ac, "device_type": device_type, "attention": kernel,
        "precision": g.precision, "num_params": shape.num_params(), "states_gb": round(states / GB, 6),
    }
    setting.update(g.setting)
    if strategy == "fsdp" and pp == 1:
        setting.update(shard_group=shard, fsdp_unit=d.fsdp_unit, param_dtype=param_dtype)
    for key, value in (("tp", tp), ("cp", cp), ("ens", ens), ("pp", pp), ("members_per_rank", members)):
        if value > 1:
            setting[key] = value
    if pp > 1:  # every rank's: train_pp.py's memory record reports the largest of each
        setting.update(pp_schedule=d.pp_schedule, pp_microbatches=d.pp_microbatches, pp_ranks=[
            {"states_gb": round((r.params * 16 + r.param_tensors * ADAMW_STEP_BYTES) / GB, 6),
             "activations_gb": round(r.held / GB, 6)} for r in ranks])
    if notes:
        setting["notes"] = notes
    return MemoryEstimate(params, grads, optimizer, activations, temporary, parts, phases, params_detail, setting)


@dataclass
class PipelineRank:
    """The pipeline rank whose parameters, gradients, AdamW state and in-flight activations weigh most."""

    rank: int
    graph: list[Layer]  # its stages' layers, for one microbatch
    params: int
    param_tensors: int
    in_flight: float  # microbatches whose activations are held at once, at its peak
    held: float  # bytes of those activations


# torch 2.15's PipelineStage runs a real forward and backward of the first microbatch to infer its shapes (its
# "dynamic metadata inference"); on the first stage part of that forward's graph stays alive for the whole run
# (measured with SavedTensorBytes: 107,520 of the tiny ViT's 148,992 bytes per microbatch, 72 %; SwinIR's stage
# in benchmarks/bench_pp.py's runs: 74 %, for every schedule and microbatch count). An empirical constant.
FIRST_STAGE_KEEPS = 0.73


def in_flight(schedule: str, pp: int, rank: int, microbatches: int) -> float:
    """Microbatches a pipeline rank holds the activations of at once, per schedule (its stages together).

    GPipe runs every forward before any backward: all m. 1F1B starts pp - rank forwards before its first
    backward and then alternates: min(m, pp - rank). Interleaved 1F1B (two stages per rank, each half the
    rank's units): Megatron's warm-up, 2 (pp - rank - 1) + pp chunk forwards, plus the one in steady state,
    counted in chunks of half the rank's activations. ZB-V (two stages per rank in a V): torch computes the
    input gradient with retain_graph and keeps each microbatch's graph until its deferred weight-gradient step,
    so the count grows with m; not derived but fitted to benchmarks/bench_pp.py's pp 2 runs (1.55, 2.2 and 3.6
    of the rank's microbatches at m = 2, 4, 8): 0.75 min(m, pp) + (m - min(m, pp)) / 3, approximate.
    Hand-written: torch.distributed.pipelining has no memory model of its schedules.
    """
    if schedule == "gpipe":
        return float(microbatches)
    if schedule == "1f1b":
        return float(min(microbatches, pp - rank))
    if schedule == "interleaved_1f1b":
        return min(2 * microbatches, 2 * (pp - rank - 1) + pp + 1) / 2
    filled = min(microbatches, pp)
    return 0.75 * filled + (microbatches - filled) / 3  # zbv


def pipeline_ranks(cfg: Config, shape, graph: list[Layer], pp: int) -> list[PipelineRank]:
    """Cut one microbatch's ``graph`` into train_pp.py's stages (its balanced split, or pp_split), one entry per
    pipeline rank: the stem's layers go with stage 0, the tail's with the last stage."""
    d = cfg.dist
    costs, stem, tail = shape.pipeline_units()
    n_stages = pp * STAGES_PER_RANK[d.pp_schedule]
    split = list(d.pp_split) or balanced_split(costs, n_stages, stem, tail)
    bounds = [sum(split[:s]) for s in range(n_stages + 1)]
    total, tensors = shape.num_params(), shape.num_param_tensors()
    first_unit_layer = next(i for i, op in enumerate(graph) if op.stage_unit is not None)
    ranks = []
    for rank in range(pp):
        ids = stage_ids(d.pp_schedule, pp, rank)
        units = {u for s in ids for u in range(bounds[s], bounds[s + 1])}
        first, last = 0 in ids, n_stages - 1 in ids
        layers = [op for i, op in enumerate(graph) if (op.stage_unit in units if op.stage_unit is not None else
                                                       (first if i < first_unit_layer else last))]
        params = sum(costs[u] for u in units) + (stem if first else 0) + (tail if last else 0)
        flight = in_flight(d.pp_schedule, pp, rank, d.pp_microbatches)
        held = sum(held_after_forward(layers).values()) * flight
        if first:  # + what the first stage keeps of its metadata inference (see FIRST_STAGE_KEEPS)
            stage0 = [op for i, op in enumerate(graph) if i < first_unit_layer or op.stage_unit in range(split[0])]
            held += FIRST_STAGE_KEEPS * sum(held_after_forward(stage0).values())
        ranks.append(PipelineRank(rank, layers, params, round(tensors * params / total), flight, held))
    return ranks


def _fsdp_params(units: list[float], num_params: float, sharded: float, param_bytes: int,
                 reshard_after_forward: bool) -> tuple[dict[str, float], float]:
    """FSDP2 parameters per rank: fp32 shards, plus the unsharded (all-gathered, param_dtype) copies of
    the root's parameters and of the units in flight; and the parameter count of the largest unit."""
    # The root: what no unit holds (a model's stem, embeddings, body convolutions, final norm, head).
    root = num_params - sum(units)
    # The current unit and the prefetched next one; without resharding, every unit stays gathered.
    in_flight = 2 * max(units) if reshard_after_forward else sum(units)
    detail = {"sharded_fp32": sharded * 4.0, "gathered_root": root * float(param_bytes),
              "gathered_units": in_flight * float(param_bytes)}
    return detail, max(units)
