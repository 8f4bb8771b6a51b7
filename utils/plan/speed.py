"""The step time of a layout: compute, plus the communication the compute does not hide, plus the pipeline bubble.

    step = compute + exposed communication (+ the bubble of a pipeline)

* compute, on a cluster that gives its GPUs' memory bandwidth: the per-kernel-class model of utils/plan/compute.py
  for the rank's share (its replica's samples, its tp x cp x pp part of each; without sequence parallelism every
  tp rank does the norms whole), x 4/3 with activation checkpointing, which runs each forward twice; elsewhere
  (this-machine, a cluster without hbm_gbps): FLOPs per sample (forward + backward, utils/observe/flops.py) x global
  batch / GPUs / (peak x efficiency), the cluster's efficiency for the model and precision;
* each layout's collectives with their bytes, timed by the ring model of utils/plan/comm.py at the bandwidth of the
  links they cross (tensor parallelism stays in a node; the dp groups cross the network when there are several
  nodes, sharing each node's NICs with the other dp groups of that node);
* the overlap rules (what is hidden behind what):
  - DDP: each gradient bucket's all-reduce runs during the rest of backward; the last bucket, and whatever
    exceeds backward (2/3 of the compute), is exposed (benchmarks/scaling.py's model, 2-12 % from measurements);
  - FSDP / HSDP: the parameter all-gathers (forward, and again in backward when resharded) and the gradient
    reduce-scatters (and HSDP's all-reduce across replicas) run one unit ahead of the compute: exposed are the
    first unit's all-gather and the last unit's reduce-scatter, or all that exceeds the compute;
  - tensor parallelism (all-gathers and reduce-scatters around every attention and MLP, or SwinIR's all-reduces),
    context parallelism (the keys and values gathered in every block, their gradients reduce-scattered; SwinIR's
    halo rows), the ensemble's gather of the members' predictions over ens (and its reduce-scatter in backward)
    and the pipeline's sends between stages sit between dependent operations: never hidden;
  - pipeline: the bubble (p - 1) / (v m + p - 1) of utils/parallel/pipeline_parallel.py stretches the compute
    (ZB-V's counted as interleaved 1F1B's);
    the gradients are all-reduced across pipelines after the last microbatch: exposed.
"""

from __future__ import annotations

from dataclasses import dataclass

from utils.config import ConfigError
from utils.memory.measure import model_on_meta
from utils.memory.shapes import has_description, model_shape
from utils.parallel.plans import ac_units
from utils.parallel.pipeline_parallel import bubble_theory
from utils.plan.clusters import Cluster
from utils.plan.comm import (ddp_buckets, node_busbw, predict_step, ring_allgather_seconds, ring_allreduce_seconds,
                             traffic_seconds)
from utils.plan.compute import step_seconds
from utils.layouts.accepted import PRECISIONS, Layout

MiB = 2**20
AC_RECOMPUTE = 4 / 3  # a step is ~3 forwards of FLOPs (forward + backward twice its size); AC adds one forward
BACKWARD_SHARE = 2 / 3


@dataclass
class Speed:
    """Predicted step of one layout (seconds), and what bounds it."""

    compute_s: float
    comm_s: float  # all the communication of a step
    exposed_s: float  # the part the compute does not hide
    bubble_s: float
    step_s: float
    samples_per_sec: float
    efficiency: float  # ideal step (perfect scaling of one GPU's compute, no recomputation) / step
    terms: dict  # seconds per collective kind

    def limited_by(self, ac_extra_s: float) -> str:
        overheads = {"network": self.exposed_s, "bubble": self.bubble_s, "recompute": ac_extra_s}
        name, seconds = max(overheads.items(), key=lambda kv: kv[1])
        return name if seconds > 0.15 * self.step_s else "compute"


def precision_key(layout: Layout) -> str:
    return "bf16" if PRECISIONS[layout.precision][0] == "bf16" else "fp32"


def predict_speed(layout: Layout, cfg, cluster: Cluster, flops_per_sample: float, grad_bytes: list[int]) -> Speed:
    """The step of ``layout`` (its config ``cfg``) on ``cluster``: see the module docstring for each term.
    ``grad_bytes``: fp32 gradient bytes per parameter tensor, in the order backward produces them."""
    key = precision_key(layout)
    world, batch = layout.world, layout.batch_size
    if cluster.hbm_bandwidth:  # per kernel class (utils/plan/compute.py): each rank its replica's share of the work
        step = lambda samples, split, norms: step_seconds(  # noqa: E731
            cfg, samples, key, cluster.peak_flops[key], cluster.hbm_bandwidth, split, norms)
        model_parallel = layout.tp * layout.cp * layout.pp
        ideal = step(batch, 1, 1) / world
        share = step(batch / layout.dp, model_parallel, model_parallel if layout.sequence_parallel
                     else model_parallel / layout.tp)
    else:
        ideal = share = flops_per_sample * batch / world / (cluster.peak_flops[key]
                                                            * cluster.efficiency_of(cfg.model.model, key))
    compute = share * (AC_RECOMPUTE if layout.ac != "none" else 1.0)
    g = cluster.gpus_per_node
    nodes = max(1, world // g)
    lat = cluster.latency_s
    model_parallel = layout.tp * layout.cp * layout.pp
    # The dp groups: one ring over all GPUs (DDP, FSDP), or one per model-parallel position, sharing the NICs.
    dp_bw = node_busbw(nodes, g, cluster.intra_bw, cluster.inter_bw / min(model_parallel, g))
    inner = cluster.intra_bw if layout.tp * layout.cp <= g else cluster.inter_bw / g  # tp x cp groups
    act_bytes = 2 if key == "bf16" else 4
    param_bytes = 2 if PRECISIONS[layout.precision][1] == "bf16" else 4
    shape = model_shape(cfg.model, cfg.target_chans) if has_description(cfg.model) else None  # (tp, cp, pp need one)
    grads = sum(grad_bytes)
    terms: dict[str, float] = {}

    if layout.strategy == "ddp" or layout.ddp_beside_mp:  # (beside tp: each tp rank's share, over the dp ranks)
        buckets = ddp_buckets([b / layout.tp for b in grad_bytes], cfg.dist.bucket_cap_mb * MiB)
        p = predict_step(compute, BACKWARD_SHARE * compute, buckets, layout.dp, dp_bw, lat)
        terms["gradient all-reduce"] = p["comm_s"]
        exposed_dp = p["exposed_s"]
    elif layout.strategy in ("fsdp", "hsdp", "mp"):
        shard = world // layout.tp if layout.strategy != "hsdp" else g
        units = max(1, fsdp_unit_count(cfg, shape))
        params = grads / 4 / layout.tp  # parameters per tp rank (an upper bound: some stay whole)
        bw = dp_bw if layout.strategy != "hsdp" else cluster.intra_bw
        gathers = 2 if cfg.dist.reshard_after_forward else 1
        ag = gathers * ring_allgather_seconds(params * param_bytes, shard, bw, lat * units)
        rs = ring_allgather_seconds(params * 4, shard, bw, lat * units)  # reduce-scatter: the same ring steps
        terms["parameter all-gather"], terms["gradient reduce-scatter"] = ag, rs
        comm = ag + rs
        if layout.strategy == "hsdp":
            terms["replica all-reduce"] = ring_allreduce_seconds(params * 4 / shard, layout.hsdp_replicas,
                                                                 node_busbw(nodes, g, cluster.intra_bw,
                                                                            cluster.inter_bw / g), lat)
            comm += terms["replica all-reduce"]
        exposed_dp = max((ag / gathers + rs) / units, comm - compute)
    else:  # one device, or a pipeline (below)
        exposed_dp = 0.0

    exposed = exposed_dp
    replica_batch = batch // layout.dp
    if shape is not None and (layout.tp > 1 or layout.cp > 1):
        traffic = shape.model_parallel_traffic(layout.tp, layout.cp, cfg, replica_batch, act_bytes)
        exposed += traffic_seconds(traffic, {"tp": layout.tp, "cp": layout.cp}, inner, lat, terms)
    if layout.ens > 1:  # the CRPS's members: gathered in forward, their gradients reduce-scattered in backward (fp32)
        members = cfg.train.ensemble * replica_batch * output_elements(cfg) * 4
        near = cluster.intra_bw if layout.tp * layout.cp * layout.ens <= g else cluster.inter_bw / g
        terms["ensemble gather"] = 2 * ring_allgather_seconds(members, layout.ens, near, lat)
        exposed += terms["ensemble gather"]
    bubble = 0.0
    if layout.pp > 1:
        # ZB-V's zero bubble assumes equal forward, input- and weight-gradient times (bench_pp.py measured 5-18 % idle
        # at pp 2): counted as interleaved 1F1B's, the other two-stages-per-rank schedule.
        schedule = "interleaved_1f1b" if layout.pp_schedule == "zbv" else layout.pp_schedule
        b = bubble_theory(schedule, layout.pp, layout.pp_microbatches)
        bubble = compute * b / (1 - b)
        boundary = shape.boundary_bytes(cfg, layout.micro_batch, act_bytes) if shape is not None else 0.0
        sends = 2 * (layout.pp - 1) * (boundary / cluster.intra_bw + lat)  # fill and drain, forward and backward
        reduce = ring_allreduce_seconds(grads / layout.pp, layout.dp, dp_bw, lat)
        terms["stage sends"], terms["pipeline gradient all-reduce"] = sends, reduce
        exposed += sends + reduce
    comm = sum(terms.values())
    step = compute + bubble + exposed
    return Speed(compute, comm, exposed, bubble, step, batch / step, ideal / step, terms)


def output_elements(cfg) -> int:
    """Values of one sample's prediction: its channels on the model's grid (super-resolution: the enlarged one)."""
    (h, w), scale = cfg.model.img_hw, cfg.model.upscale if cfg.data.task == "sr" else 1
    return cfg.target_chans * h * w * scale * scale


def fsdp_unit_count(cfg, shape) -> int:
    """FSDP units: the hand-written description's, else the model's own (its plan, in its spec: models/spec.py)."""
    if shape is not None:
        return len(shape.fsdp_units(cfg.dist.fsdp_unit))
    try:
        return len(ac_units(model_on_meta(cfg), cfg.dist.fsdp_unit))
    except ConfigError:  # no units: the root alone
        return 1
