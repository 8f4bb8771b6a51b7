"""Step 5b — how DDP scales: weak and strong scaling, DDP's knobs, and a performance model, in one table.

    python benchmarks/scaling.py --sizes 1 2 -- --config quickstart            # laptop: 1 and 2 CPU processes
    python benchmarks/scaling.py --extrapolate baseline vit_base --compute-ms 120 400   # 4-GPU nodes, modelled

Each world size N is one torchrun launch of this script with --worker; it measures, in the same
processes and alternating (so that a machine that speeds up or slows down affects every variant):

* weak scaling: each rank trains --batch samples per step (default: the config's batch_size), so
  the global batch grows as N x batch; efficiency = samples/s(N) / (N x samples/s(1));
* strong scaling: the global batch stays --global-batch (default: batch x the largest size), each
  rank trains global-batch / N; efficiency = speedup / N;
* each of the above with ``no_ddp`` as well: the same step without the gradient all-reduce, whose time
  is the compute; 1 - no_ddp time / DDP time is the share of the step that communication adds;
* with --knobs (the driver sets it at the largest size): DDP's bucket_cap_mb (--bucket-caps),
  broadcast_buffers, gradient_as_bucket_view and static_graph one at a time against the config's
  setting, with the all-reduce (and broadcast) calls of one step counted by torch.profiler (the
  dispatcher's ``c10d::allreduce_`` events, the same for gloo and nccl) and DDP's own bucket sizes;
* comm_check.py's all-reduce at the gradient's size: the bus bandwidth the performance model uses.

A step is forward, loss, backward (DDP's all-reduce) and the optimizer on one fixed batch of real
samples per rank (the data pipeline is left out: Step 0b and the ladder measure it). Each variant's
figure is the median over --rounds of the slowest rank's mean step time over --steps steps, after
--warmup steps (DDP builds its buckets in the first ones). torchrun gives each CPU process one thread,
as each GPU rank has one GPU. The driver then prints the tables, and writes scaling.json and
scaling.png to --out. On a cluster, submit one job per world size with --worker (each writes
<out>/world_<N>.json), then run --collect <out>; docs/performance.md, Step 5b, has the commands.

The performance model (ring all-reduce, nccl-tests' definitions: algbw = bytes / time and busbw =
algbw x 2(N-1)/N, so time = bytes x 2(N-1)/N / busbw): step(N) = compute + exposed communication,
where compute is the no_ddp step at N (or, extrapolated, --compute-ms), the all-reduce of each DDP
bucket takes bytes x 2(N-1)/N / busbw, and communication overlaps the backward pass except that the
last bucket (ready only when backward ends) is always exposed:
exposed = max(last bucket, all buckets - backward), at most all buckets.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from utils.plan.clusters import cpu_name  # noqa: E402
from utils.plan.comm import ddp_buckets, efficiency, node_busbw, predict_step  # noqa: E402

MiB = 2**20
GB = 1e9  # bandwidths in GB/s = 1e9 bytes/s, as nccl-tests and comm_check.py print them
# DDP's four knobs (utils/config.py DistConfig), each changed alone against the config's setting in the sweep.
KNOBS = ("bucket_cap_mb", "broadcast_buffers", "gradient_as_bucket_view", "static_graph")
# Perlmutter GPU node, peak figures per GPU and direction (docs/performance.md, Step 5b, cites them):
# A100 NVLink-3: 12 links x 25 GB/s; Slingshot-11: 4 NICs of 200 Gb/s per node = 100 GB/s, which a ring
# across nodes crosses once per node, so its bus bandwidth is at most the node's injection bandwidth.
PERLMUTTER_NVLINK_GBPS = 300.0
PERLMUTTER_SLINGSHOT_GBPS = 100.0


# --- the performance model: pure functions, in utils/plan/comm.py (plan.py uses them too) ----------------------

# --- the worker: one world size, under torchrun ---------------------------------------------------------

def knob_variants(dist_cfg, bucket_caps: list[float]) -> list[tuple[str, dict]]:
    """(name, DistConfig overrides) of the knobs sweep: the config's setting, then one change at a time."""
    rows = [("config's setting", {})]
    rows += [(f"bucket_cap_mb {cap:g}", {"bucket_cap_mb": cap}) for cap in bucket_caps if cap != dist_cfg.bucket_cap_mb]
    for knob in KNOBS[1:]:
        value = not getattr(dist_cfg, knob)
        rows.append((f"{knob} {str(value).lower()}", {knob: value}))
    return rows


class Variant:
    """One model, optimizer and fixed batch trained under one DDP setting (or none: no_ddp)."""

    def __init__(self, cfg, overrides: dict, batch: tuple, device, steps_per_epoch: int):
        from models import build_model
        from utils.parallel.techniques import apply_ac, apply_compile, apply_ddp
        from utils.precision import make_grad_scaler
        from utils.training import build_loss, build_optimizer

        self.cfg = copy.deepcopy(cfg)
        for key, value in overrides.items():
            setattr(self.cfg.dist, key, value)
        self.device, self.batch = device, batch
        self.per_rank = batch[0].shape[0]
        t = self.cfg.train
        self.raw = build_model(self.cfg.model).to(device)
        model = apply_compile(apply_ac(self.raw, t.ac), t.compile, t.compile_backend)
        self.model = apply_ddp(model, self.cfg, device)
        self.optimizer, self.scheduler = build_optimizer(self.model, self.cfg, steps_per_epoch, device)
        self.scaler = make_grad_scaler(device, t.amp_dtype)
        self.loss_fn = build_loss(self.cfg)
        self.rounds: list[dict] = []

    def step(self) -> tuple[float, float, float]:
        """One training step; seconds of forward + loss, backward (with DDP's all-reduce), optimizer."""
        from comm_check import synchronize
        from utils.precision import autocast

        inputs, target = self.batch
        self.optimizer.zero_grad(set_to_none=True)
        start = time.perf_counter()
        with autocast(self.device, self.cfg.train.amp_dtype):
            pred = self.model(inputs)
        loss = self.loss_fn(pred.float(), target)
        synchronize(self.device)
        forward = time.perf_counter()
        self.scaler.scale(loss).backward()  # DDP waits for its last bucket's all-reduce before returning
        synchronize(self.device)
        backward = time.perf_counter()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        synchronize(self.device)
        return forward - start, backward - forward, time.perf_counter() - backward

    def count_collectives(self) -> dict:
        """All-reduce and broadcast calls of one profiled step, and DDP's bucket sizes."""
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            self.step()
        names = [event.name for event in prof.events()]
        counts = {"allreduce_per_step": names.count("c10d::allreduce_"),
                  "broadcast_per_step": names.count("c10d::broadcast_")}
        if self.model is not self.raw and hasattr(self.model, "_get_ddp_logging_data"):
            logged = self.model._get_ddp_logging_data()
            sizes = logged.get("rebuilt_bucket_sizes") or logged.get("bucket_sizes") or ""
            counts["bucket_bytes"] = [int(s) for s in str(sizes).split(",") if s.strip()]
        return counts


def agree_max(value: float, device) -> float:
    import torch
    import torch.distributed as dist

    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def training_set(cfg):
    """The config's training samples; fills the config from the data (channels, statistics) as train_ddp.py does."""
    from utils.data import build_loaders

    batch_size, cfg.train.batch_size = cfg.train.batch_size, 1  # one process reads; each rank picks its samples
    train_loader, _ = build_loaders(cfg)
    cfg.train.batch_size = batch_size
    return train_loader.dataset


def fixed_batch(dataset, per_rank: int, rank: int, device) -> tuple:
    """``per_rank`` samples, different on every rank (as a DistributedSampler would give)."""
    import torch

    samples = [dataset[(rank * per_rank + k) % len(dataset)] for k in range(per_rank)]
    return tuple(torch.stack([s[i] for s in samples]).to(device) for i in (0, 1))


def measure_busbw(grad_bytes: int, env, device) -> dict:
    """comm_check.py's all-reduce at the gradient's size: time, algorithm and bus bandwidth."""
    from comm_check import ALL_REDUCE, ELEMENT_BYTES, run_collective

    granule = ELEMENT_BYTES * env.world_size
    size = max(granule, grad_bytes // granule * granule)
    settings = argparse.Namespace(iters=10, warmup=2, seconds_per_size=1.0)
    seconds, wrong = run_collective(ALL_REDUCE, size, env, device, settings)
    if wrong:
        raise RuntimeError(f"the all-reduce check returned {wrong} wrong elements: run comm_check.py")
    algbw = size / seconds
    return {"bytes": size, "seconds": seconds, "algbw": algbw, "busbw": algbw * ALL_REDUCE.bus_factor(env.world_size)}


def worker(args: argparse.Namespace) -> int:
    from utils.config import parse_config
    from utils.parallel.distributed import cleanup_distributed, init_distributed

    cfg = parse_config("", args.train_args)
    env, device = init_distributed(cfg.dist.dist_timeout_s)
    try:
        return run_worker(args, cfg, env, device)
    finally:
        cleanup_distributed()


def run_worker(args, cfg, env, device) -> int:
    import torch
    import torch.distributed as dist

    n = env.world_size
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    per_rank = args.batch or cfg.train.batch_size
    out = Path(args.out)
    result_file = out / f"world_{n}.json"
    if result_file.exists():  # every rank stops: one alone would leave the others waiting
        raise SystemExit(f"error: {result_file} exists from an earlier run: remove it or choose another --out")
    if args.global_batch and args.global_batch % n:
        raise SystemExit(f"error: --global-batch {args.global_batch} is not divisible by {n} ranks: "
                         "use a multiple of every size")
    dataset = training_set(cfg)
    weak_batch = fixed_batch(dataset, per_rank, env.rank, device)
    plans = [("weak", {}, weak_batch), ("weak no_ddp", {"no_ddp": True}, weak_batch)]
    if args.global_batch:
        strong_batch = fixed_batch(dataset, args.global_batch // n, env.rank, device)
        plans += [("strong", {}, strong_batch), ("strong no_ddp", {"no_ddp": True}, strong_batch)]
    if args.knobs:
        plans += [(f"knob: {name}", overrides, weak_batch)
                  for name, overrides in knob_variants(cfg.dist, args.bucket_caps) if overrides]
    variants = {}
    for name, overrides, batch in plans:
        torch.manual_seed(cfg.train.seed)  # every variant starts from the same weights
        variants[name] = Variant(cfg, overrides, batch, device, steps_per_epoch=10**6)
        for _ in range(args.warmup):
            variants[name].step()
    for _ in range(args.rounds):
        for variant in variants.values():
            dist.barrier()  # every rank starts together: one rank's lag would count as the next variant's wait
            parts = [variant.step() for _ in range(args.steps)]
            means = [statistics.fmean(p[k] for p in parts) for k in range(3)]
            variant.rounds.append({key: agree_max(value, device) for key, value in
                                   zip(("step_s", "forward_s", "backward_s", "optimizer_s"), (sum(means), *means))})
    params = [p for p in variants["weak"].raw.parameters() if p.requires_grad]
    grad_bytes = [p.numel() * p.element_size() for p in params]
    record = {"world_size": n, "nodes": env.num_nodes, "backend": dist.get_backend(), "device": str(device),
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
              "torch": torch.__version__, "config": cfg.name, "parameters": sum(p.numel() for p in params),
              "grad_bytes": sum(grad_bytes), "grad_bytes_ready_order": grad_bytes[::-1], "per_rank_batch": per_rank,
              "global_batch": args.global_batch, "dist": {k: getattr(cfg.dist, k) for k in KNOBS},
              "load_average": os.getloadavg()[0], "variants": {}}
    for name, variant in variants.items():
        summary = {key: statistics.median(r[key] for r in variant.rounds) for key in variant.rounds[0]}
        summary.update(per_rank_batch=variant.per_rank, rounds=[r["step_s"] for r in variant.rounds],
                       **{k: getattr(variant.cfg.dist, k) for k in (*KNOBS, "no_ddp")})
        summary.update(variant.count_collectives())
        record["variants"][name] = summary
    if n > 1:
        record["allreduce"] = measure_busbw(record["grad_bytes"], env, device)
    if env.is_main:
        out.mkdir(parents=True, exist_ok=True)
        result_file.write_text(json.dumps(record, indent=1) + "\n")
    return 0


# --- the driver: launches, then tables, JSON and plot -----------------------------------------------------

def launch(size: int, args: argparse.Namespace, knobs: bool) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(size),
           str(Path(__file__).resolve()), "--worker", "--out", str(args.out.resolve()), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--rounds", str(args.rounds), "--batch", str(args.batch),
           "--threads", str(args.threads),
           "--global-batch", str(args.global_batch), "--bucket-caps", *map(str, args.bucket_caps),
           *(["--knobs"] if knobs else []), "--", *args.train_args]
    # In the caller's folder: relative paths (data_dir, --out) mean what the user meant.
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode:
        errors = [line for line in proc.stdout.splitlines() if "error" in line.lower()] or proc.stdout.splitlines()
        sys.exit(f"error: the {size}-process run failed (exit {proc.returncode}): {errors[-1] if errors else ''}")


def load_results(out: Path) -> list[dict]:
    records = sorted((json.loads(p.read_text()) for p in out.glob("world_*.json")), key=lambda r: r["world_size"])
    if not records:
        sys.exit(f"error: no world_<N>.json in {out}: run the --worker jobs first (docs/performance.md, Step 5b)")
    if records[0]["world_size"] != 1:
        sys.exit(f"error: {out} has no 1-rank run (world_1.json): scaling is measured against one rank; run it too")
    return records


def model_point(record: dict, mode: str) -> dict:
    """Measured and predicted step of one world size and mode (weak or strong)."""
    ddp, compute = record["variants"][mode], record["variants"][f"{mode} no_ddp"]
    n = record["world_size"]
    busbw = record["allreduce"]["busbw"] if n > 1 else float("inf")
    buckets = ddp.get("bucket_bytes") or ddp_buckets(record["grad_bytes_ready_order"], ddp["bucket_cap_mb"] * MiB)
    prediction = predict_step(compute["step_s"], compute["backward_s"], buckets, n, busbw)
    global_batch = ddp["per_rank_batch"] * n
    return {"ranks": n, "per_rank_batch": ddp["per_rank_batch"], "global_batch": global_batch,
            "step_s": ddp["step_s"], "samples_per_sec": global_batch / ddp["step_s"],
            "no_ddp_step_s": compute["step_s"], "no_ddp_samples_per_sec": global_batch / compute["step_s"],
            "comm_share": 1 - compute["step_s"] / ddp["step_s"], "buckets": len(buckets),
            "spread": (max(ddp["rounds"]) - min(ddp["rounds"])) / ddp["step_s"],
            "predicted_step_s": prediction["step_s"], "predicted_no_overlap_s": prediction["no_overlap_s"],
            "predicted_comm_s": prediction["comm_s"], "busbw": None if n == 1 else busbw}


def scaling_table(records: list[dict], mode: str) -> list[dict]:
    points = [model_point(r, mode) for r in records if mode in r["variants"]]
    one = points[0]
    for p in points:
        p["efficiency"] = efficiency(p["samples_per_sec"], p["ranks"], one["samples_per_sec"])
        p["predicted_efficiency"] = efficiency(p["global_batch"] / p["predicted_step_s"], p["ranks"],
                                               one["global_batch"] / one["predicted_step_s"])
        p["no_ddp_efficiency"] = efficiency(p["no_ddp_samples_per_sec"], p["ranks"], one["no_ddp_samples_per_sec"])
    return points


def print_scaling(points: list[dict], mode: str) -> None:
    if not points:
        return
    what = (f"per-rank batch {points[0]['per_rank_batch']}" if mode == "weak"
            else f"global batch {points[0]['global_batch']}")
    print(f"\n{mode} scaling ({what}): measured, and predicted by the model (compute = the no_ddp step)")
    print(f"{'ranks':>5} {'batch/rank':>10} {'step ms':>9} {'samples/s':>10} {'ideal':>9} {'efficiency':>10} "
          f"{'no_ddp ms':>10} {'comm share':>10} {'predicted ms':>12} {'no overlap':>10} {'pred. eff.':>10} "
          f"{'spread':>7}")
    ideal = points[0]["samples_per_sec"]
    for p in points:
        print(f"{p['ranks']:>5} {p['per_rank_batch']:>10} {1e3 * p['step_s']:>9.1f} {p['samples_per_sec']:>10.2f} "
              f"{ideal * p['ranks']:>9.2f} {p['efficiency']:>10.2f} {1e3 * p['no_ddp_step_s']:>10.1f} "
              f"{100 * p['comm_share']:>9.0f}% {1e3 * p['predicted_step_s']:>12.1f} "
              f"{1e3 * p['predicted_no_overlap_s']:>10.1f} {p['predicted_efficiency']:>10.2f} "
              f"{100 * p['spread']:>6.0f}%")


def knobs_table(record: dict) -> list[dict]:
    rows = []
    default = record["variants"]["weak"]
    knobs = [(name[len("knob: "):], v) for name, v in record["variants"].items() if name.startswith("knob: ")]
    for name, variant in [("config's setting", default), *knobs]:
        rows.append({"setting": name, "step_s": variant["step_s"], "vs_config": variant["step_s"] / default["step_s"],
                     "spread": (max(variant["rounds"]) - min(variant["rounds"])) / variant["step_s"],
                     "allreduce_per_step": variant["allreduce_per_step"],
                     "broadcast_per_step": variant["broadcast_per_step"],
                     "bucket_mib": [round(b / MiB, 3) for b in variant.get("bucket_bytes", [])]})
    return rows


def print_knobs(rows: list[dict], record: dict) -> None:
    dist_cfg = ", ".join(f"{k} {v}" for k, v in record["dist"].items())
    print(f"\nDDP knobs at {record['world_size']} ranks, per-rank batch {record['per_rank_batch']} "
          f"(config's setting: {dist_cfg}); collectives counted by torch.profiler over one step")
    print(f"{'setting':<32} {'step ms':>9} {'vs config':>9} {'spread':>7} {'all-reduces':>11} {'broadcasts':>10}   "
          "buckets (MiB)")
    for r in rows:
        buckets = " ".join(f"{b:g}" for b in r["bucket_mib"]) or "-"
        print(f"{r['setting']:<32} {1e3 * r['step_s']:>9.1f} {r['vs_config']:>9.2f} {100 * r['spread']:>6.0f}% "
              f"{r['allreduce_per_step']:>11} "
              f"{r['broadcast_per_step']:>10}   {buckets}")


def scaling_figure(weak: list[dict], strong: list[dict], title: str):
    from matplotlib.figure import Figure

    panels = [(points, mode) for points, mode in ((weak, "weak"), (strong, "strong")) if points]
    fig = Figure(figsize=(5.2 * len(panels), 7.0), layout="constrained")
    axes = fig.subplots(2, len(panels), squeeze=False)
    for column, (points, mode) in enumerate(panels):
        ranks = [p["ranks"] for p in points]
        top, bottom = axes[0][column], axes[1][column]
        top.plot(ranks, [points[0]["samples_per_sec"] * n for n in ranks], "--", color="#777777", label="ideal")
        top.plot(ranks, [p["samples_per_sec"] for p in points], "o-", color="#C44E52", label="DDP, measured")
        top.plot(ranks, [p["no_ddp_samples_per_sec"] for p in points], "s:", color="#4C72B0",
                 label="no_ddp (compute only)")
        top.plot(ranks, [p["global_batch"] / p["predicted_step_s"] for p in points], "x-.", color="#55A868",
                 label="DDP, model")
        top.set_ylabel("samples/s")
        top.set_title(f"{mode} scaling: " + (f"{points[0]['per_rank_batch']} samples per rank" if mode == "weak"
                                             else f"global batch {points[0]['global_batch']}"), fontsize=10.5)
        bottom.axhline(1.0, ls="--", color="#777777")
        bottom.plot(ranks, [p["efficiency"] for p in points], "o-", color="#C44E52", label="DDP, measured")
        bottom.plot(ranks, [p["no_ddp_efficiency"] for p in points], "s:", color="#4C72B0", label="no_ddp")
        bottom.plot(ranks, [p["predicted_efficiency"] for p in points], "x-.", color="#55A868", label="DDP, model")
        bottom.set_ylabel("efficiency (throughput / N x 1 rank)")
        # Never clip a measured point: above 1 is super-linear (two processes on two cores can beat one
        # process's two threads), and the page explains it.
        highest = max(max(p["efficiency"], p["no_ddp_efficiency"], p["predicted_efficiency"]) for p in points)
        bottom.set_ylim(0, max(1.1, 1.05 * highest))
        for ax in (top, bottom):
            ax.set_xlabel("ranks")
            ax.set_xticks(ranks)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    return fig


def collect(out: Path, load: list[float] | None = None) -> int:
    records = load_results(out)
    first = records[0]
    loads = (load or []) + [r["load_average"] for r in records]  # the driver's, before and after, and each size's
    title = (f"{first['config']}: {first['parameters']:,} parameters, {first['grad_bytes'] / MiB:.2f} MiB of "
             f"gradients; {first['device_name']} ({first['device']}, {records[-1]['backend']}), torch {first['torch']}")
    print(title)
    print(f"load average (1 min) during the runs: {min(loads):.2f}-{max(loads):.2f}")
    for r in records[1:]:
        a = r["allreduce"]
        print(f"all-reduce of {a['bytes'] / MiB:.2f} MiB over {r['world_size']} ranks (comm_check.py): "
              f"{1e3 * a['seconds']:.2f} ms, algbw {a['algbw'] / GB:.3f} GB/s, busbw {a['busbw'] / GB:.3f} GB/s")
    weak, strong = scaling_table(records, "weak"), scaling_table(records, "strong")
    print_scaling(weak, "weak")
    print_scaling(strong, "strong")
    knob_record = next((r for r in reversed(records) if any(k.startswith("knob: ") for k in r["variants"])), None)
    knobs = knobs_table(knob_record) if knob_record else []
    if knobs:
        print_knobs(knobs, knob_record)
    summary = {"config": first["config"], "parameters": first["parameters"], "grad_bytes": first["grad_bytes"],
               "device": first["device_name"], "backend": records[-1]["backend"], "torch": first["torch"],
               "load_average": loads, "weak": weak, "strong": strong, "knobs": knobs,
               "knobs_world_size": knob_record["world_size"] if knob_record else None}
    (out / "scaling.json").write_text(json.dumps(summary, indent=1) + "\n")
    scaling_figure(weak, strong, title).savefig(out / "scaling.png", dpi=100)
    print(f"wrote {out / 'scaling.json'} and {out / 'scaling.png'}")
    return 0


# --- extrapolation to 4-GPU nodes ---------------------------------------------------------------------------

def config_gradients(name: str) -> tuple[int, list[int]]:
    """Parameters and gradient bytes (fp32, in the order DDP's buckets take them) of a named config's model."""
    from utils.config import build_config
    from utils.memory.measure import build_for_measurement

    model = build_for_measurement(build_config(name))
    params = [p for p in model.parameters() if p.requires_grad]
    return sum(p.numel() for p in params), [4 * p.numel() for p in params][::-1]


def extrapolate(args: argparse.Namespace) -> int:
    print(f"ring all-reduce of the fp32 gradients in DDP buckets of {args.bucket_cap_mb:g} MiB; busbw "
          f"{args.intra_busbw:g} GB/s within a node (NVLink), {args.inter_busbw:g} GB/s between nodes (network), "
          f"{args.latency_us:g} us per ring step; backward = {args.backward_share:.2f} of the compute; compute per GPU "
          "step given by --compute-ms")
    for name, compute_ms in zip(args.extrapolate, args.compute_ms):
        params, grads = config_gradients(name)
        buckets = ddp_buckets(grads, args.bucket_cap_mb * MiB)
        compute = compute_ms / 1e3
        print(f"\n{name}: {params:,} parameters, {sum(grads) / MiB:.1f} MiB of gradients in {len(buckets)} buckets "
              f"(last {buckets[-1] / MiB:.1f} MiB); compute {compute_ms:g} ms per step")
        print(f"{'nodes':>5} {'GPUs':>5} {'busbw GB/s':>10} {'all-reduce ms':>13} {'exposed ms':>10} {'step ms':>8} "
              f"{'efficiency':>10} {'no overlap':>10}")
        for nodes in args.nodes:
            for gpus in ([1, args.gpus_per_node] if nodes == 1 else [args.gpus_per_node]):
                busbw = node_busbw(nodes, gpus, args.intra_busbw * GB, args.inter_busbw * GB)
                p = predict_step(compute, args.backward_share * compute, buckets, nodes * gpus, busbw,
                                 args.latency_us / 1e6)
                print(f"{nodes:>5} {nodes * gpus:>5} {busbw / GB:>10g} {1e3 * p['comm_s']:>13.2f} "
                      f"{1e3 * p['exposed_s']:>10.2f} {1e3 * p['step_s']:>8.1f} {compute / p['step_s']:>10.2f} "
                      f"{compute / p['no_overlap_s']:>10.2f}")
    return 0


# --- command line -------------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2], help="world sizes to launch (laptop)")
    parser.add_argument("--out", type=Path, default=Path("runs", "scaling"), help="folder for the results")
    parser.add_argument("--batch", type=int, default=0,
                        help="weak scaling: samples per rank (0: the config's batch_size)")
    parser.add_argument("--global-batch", type=int, default=None,
                        help="strong scaling: the fixed global batch (driver's default: batch x the largest size; "
                             "a --worker measures strong scaling only when given; 0: none)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over the variants (the median is reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant (DDP builds its buckets)")
    parser.add_argument("--bucket-caps", type=float, nargs="+", default=[1.0, 100.0],
                        help="bucket_cap_mb values of the knobs sweep (MiB)")
    parser.add_argument("--no-knobs", action="store_true", help="skip the knobs sweep")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU ranks: threads per rank (1, as torchrun sets for several processes: each rank is one "
                             "device, and one rank alone does not get the cores the others would use)")
    parser.add_argument("--worker", action="store_true", help="measure this world size (under torchrun or srun)")
    parser.add_argument("--knobs", action="store_true",
                        help="with --worker: also sweep DDP's knobs (the driver sets it for the largest size)")
    parser.add_argument("--collect", type=Path, metavar="DIR",
                        help="tables, JSON and plot of the world_<N>.json in DIR")
    parser.add_argument("--extrapolate", nargs="+", metavar="CONFIG", help="model DDP on 4-GPU nodes for these configs")
    parser.add_argument("--compute-ms", type=float, nargs="+", default=[],
                        help="with --extrapolate: one GPU's training step (ms) for each config, measured or quoted")
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--gpus-per-node", type=int, default=4)
    parser.add_argument("--intra-busbw", type=float, default=PERLMUTTER_NVLINK_GBPS, help="GB/s within a node")
    parser.add_argument("--inter-busbw", type=float, default=PERLMUTTER_SLINGSHOT_GBPS, help="GB/s between nodes")
    parser.add_argument("--latency-us", type=float, default=0.0,
                        help="with --extrapolate: latency of one ring step in microseconds (0: bandwidth only)")
    parser.add_argument("--backward-share", type=float, default=2 / 3,
                        help="share of the compute that backward takes (about 2/3: twice the forward's FLOPs)")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="with --extrapolate: DDP's bucket size")
    parser.add_argument("train_args", nargs=argparse.REMAINDER,
                        help="-- then train_ddp.py arguments (config, overrides)")
    args = parser.parse_args(argv)
    args.train_args = [a for a in args.train_args if a != "--"] or ["--config", "quickstart"]
    if args.extrapolate and len(args.compute_ms) != len(args.extrapolate):
        parser.error(f"--extrapolate needs one --compute-ms per config (a GPU's step time, measured or quoted): got "
                     f"{len(args.compute_ms)} for {len(args.extrapolate)} configs")
    if min(args.sizes) < 1 or args.sizes != sorted(set(args.sizes)) or args.sizes[0] != 1:
        parser.error(f"--sizes must start at 1 and increase (scaling is measured against one rank), got {args.sizes}")
    if min(args.steps, args.rounds, args.threads) < 1 or args.warmup < 2:
        parser.error("--steps, --rounds and --threads must be >= 1, --warmup >= 2 (DDP rebuilds its buckets "
                     "after the first step)")
    if args.batch < 0 or (args.global_batch or 0) < 0:
        parser.error("--batch and --global-batch must be >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.extrapolate:
        return extrapolate(args)
    if args.collect:
        return collect(args.collect)
    if args.worker:
        return worker(args)
    if args.batch == 0:  # the driver fixes both batches, so that every launch agrees on them
        from utils.config import parse_config

        args.batch = parse_config("", args.train_args).train.batch_size
    if args.global_batch is None:
        args.global_batch = args.batch * args.sizes[-1]
    uneven = [n for n in args.sizes if args.global_batch % n]
    if uneven:
        sys.exit(f"error: --global-batch {args.global_batch} is not divisible by {uneven}: "
                 "use a multiple of every size")
    if list(args.out.glob("world_*.json")):
        sys.exit(f"error: {args.out} holds the results of an earlier run: remove it or choose another --out")
    loads = [os.getloadavg()[0]]
    for size in args.sizes:
        start = time.perf_counter()
        launch(size, args, knobs=not args.no_knobs and size == args.sizes[-1])
        print(f"{size} rank{'s' if size > 1 else ''}: measured in {time.perf_counter() - start:.0f} s", flush=True)
    loads.append(os.getloadavg()[0])
    return collect(args.out, loads)


if __name__ == "__main__":
    from utils.training import exit_process

    exit_process(main())  # a worker (a rank) skips the interpreter's shutdown, as the training scripts do
