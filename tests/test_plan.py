"""plan.py: every layout the scripts accept, its memory and speed on a cluster, ranked, and the command that runs it.

- Clusters: the shipped entries load with their datasheet peaks; a user's file adds one; bad input (an unknown
  cluster, an entry missing a field, a nonsense override) is one line and exit code 2. this-machine is measured
  once and cached.
- Enumeration respects every constraint the scripts check (heads divisible by tp, microbatches dividing the
  batch, stages no more than units, the batch over dp, FSDP2's bf16 parameters only where applied, SwinIR's
  RSTB unit only for SwinIR).
- The step model: DDP's exposed all-reduce is benchmarks/scaling.py's, a pipeline's bubble stretches the
  compute, tp's collectives grow with tp; the ranking puts what fits first.
- The printed command for the best CPU layout runs (tiny, 2 steps); nothing fits: one line.
(The memory prediction against measured records: tests/test_mp.py, test_pp.py, test_fsdp.py.)
"""

from __future__ import annotations

import dataclasses
import json
import shlex

import pytest
import yaml

import plan as plan_script
from tests.conftest import VIT_MODEL, read_metrics, run_script
from utils.config import ConfigError, build_config
from utils.memory.estimate import estimate_memory
from utils.memory.shapes import Traffic, model_shape
from utils.parallel.pipeline_parallel import STAGES_PER_RANK
from utils.plan import clusters
from utils.plan.clusters import load_cluster
from utils.plan.comm import ddp_buckets, predict_step, traffic_seconds
from utils.layouts.accepted import Layout, enumerate_layouts
from utils.plan.planner import calibrated, model_facts, plan, plan_layout
from utils.plan.speed import BACKWARD_SHARE, MiB, predict_speed
from utils.training import run_cli

TINY_VIT = dict(zip(VIT_MODEL[::2], VIT_MODEL[1::2]))  # --img_size "[16, 32]" ... as overrides
CPU_CLUSTER = """
two-cpus:
  device: cpu
  gpu: a test CPU
  gpus_per_node: 2
  memory_gb: 4
  peak_bf16_tflops: 0.1
  peak_tf32_tflops: 0.05
  nvlink_gbps: 1
  network_gbps: 1
  latency_us: 50
  efficiency: {vit: {bf16: 0.2, fp32: 0.3}, swinir: {bf16: 0.2, fp32: 0.3}, unet3d: {bf16: 0.2, fp32: 0.3}}
tiny-gpus:
  gpu: NVIDIA A100-SXM4-40GB
  gpus_per_node: 4
  memory_gb: 0.000001
  nvlink_gbps: 300
  network_gbps: 100
  latency_us: 5
  efficiency: {vit: {bf16: 0.25, fp32: 0.11}}
"""


def tiny_vit(**extra):
    overrides = {key.removeprefix("--"): yaml.safe_load(value) for key, value in TINY_VIT.items()}
    return build_config("vit_quickstart", {**overrides, "batch_size": 8, **extra})


def main_exit(argv, capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        run_cli(lambda: plan_script.main(argv))
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


# ------------------------------------------------------------------ clusters


def test_shipped_clusters_load_with_datasheet_peaks():
    a100 = load_cluster("perlmutter-a100-40")
    assert (a100.gpus_per_node, a100.memory_bytes, a100.device) == (4, 40e9, "cuda")
    assert a100.peak_flops == {"bf16": 312e12, "fp32": 156e12}  # NVIDIA A100 datasheet, dense; fp32 = TF32
    h100 = load_cluster("kestrel-h100")
    assert h100.peak_flops["bf16"] == pytest.approx(989.4e12) and h100.inter_bw == 50e9
    assert load_cluster("generic-8gpu").gpus_per_node == 8
    assert "SITE=kestrel" in h100.submit
    # Kestrel gives a job 1 GB per core unless it asks: every job there starts with --mem (clusters.yaml's
    # sbatch_options), the other sites' with nothing more.
    assert h100.submit_line(2) == "SITE=kestrel sbatch --nodes 2 --mem 300G"
    assert a100.submit_line(2) == "SITE=perlmutter sbatch --nodes 2"


def test_a_users_cluster_file_adds_entries(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(CPU_CLUSTER)
    mine = load_cluster("two-cpus", path)
    assert mine.device == "cpu" and mine.peak_flops == {"bf16": 0.1e12, "fp32": 0.05e12}
    assert mine.source == str(path)


@pytest.mark.parametrize("argv, message", [
    (["--cluster", "nowhere"], "unknown cluster 'nowhere'; valid: perlmutter-a100-40"),
    (["--cluster", "broken", "--cluster_file", "{file}"], "cluster 'broken' lacks memory_gb, latency_us"),
    (["--cluster", "kestrel-h100", "--batch_size", "banana"], "batch_size: expected an integer"),
    (["--cluster", "kestrel-h100", "--crop_sise", "64"], "unrecognized arguments: --crop_sise"),
    (["--cluster", "kestrel-h100", "--nodes", "0"], "--nodes must be >= 1"),
])
def test_bad_input_is_one_line_and_exit_code_2(argv, message, tmp_path, capsys):
    file = tmp_path / "broken.yaml"
    file.write_text("broken: {gpu: NVIDIA H100 80GB HBM3, gpus_per_node: 4, nvlink_gbps: 450, network_gbps: 50, "
                    "efficiency: {}}\n")
    argv = [a.replace("{file}", str(file)) for a in argv]
    code, out, err = main_exit(["--config", "vit_quickstart", *argv], capsys)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1 and not out, err


def test_this_machine_is_measured_once_then_read_from_its_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(clusters, "CACHE", tmp_path / "this_machine.json")
    calls = []
    monkeypatch.setattr(clusters, "measure_matmul_flops", lambda *a, **k: calls.append(a) or 5e10)
    monkeypatch.setattr(clusters, "_measure_gloo_busbw", lambda: (2e9, 1e-4))
    machine = load_cluster("this-machine")
    assert machine.device == "cpu" and machine.peak_flops == {"fp32": 5e10, "bf16": 5e10}
    assert machine.intra_bw == 2e9 and machine.latency_s == 1e-4 and len(calls) == 2
    assert load_cluster("this-machine") == machine and len(calls) == 2  # from the cache
    assert json.loads((tmp_path / "this_machine.json").read_text())["gpu"] == clusters.cpu_name()


def test_this_machines_efficiency_is_the_configs_own_step(tmp_path, monkeypatch):
    monkeypatch.setattr(clusters, "CACHE", tmp_path / "this_machine.json")
    monkeypatch.setattr(clusters, "measure_matmul_flops", lambda *a, **k: 5e10)
    monkeypatch.setattr(clusters, "_measure_gloo_busbw", lambda: (2e9, 1e-4))
    cfg = tiny_vit()
    flops, _, _ = model_facts(cfg)
    machine = calibrated(load_cluster("this-machine"), cfg, flops, 2)
    timed = machine.efficiency["vit"]
    assert 0 < timed["fp32"] < 1 and 0 < timed["bf16"] < 1  # a step of 4 samples, timed, against 50 GFLOP/s
    cached = json.loads((tmp_path / "this_machine.json").read_text())["measured_efficiency"]
    assert sorted(cached.values()) == sorted(timed.values())
    assert calibrated(load_cluster("this-machine"), cfg, flops, 2).efficiency == machine.efficiency  # from the cache


# ------------------------------------------------------------------ enumeration


@pytest.mark.parametrize("name, overrides", [
    ("vit_quickstart", {"model_args.num_heads": [2], "model_args.depths": [4]}),
    ("quickstart", {"model_args.depths": [1, 1, 1, 1], "model_args.num_heads": [2, 2, 2, 2], "batch_size": 8}),
    ("unet3d_quickstart", {}),
])
def test_every_layout_respects_what_the_scripts_check(name, overrides):
    cfg = build_config(name, overrides)
    shape = model_shape(cfg.model)
    units = len(shape.pipeline_units()[0]) if hasattr(shape, "pipeline_units") else 0
    layouts = [layout for layout, _ in enumerate_layouts(cfg, 4, 4, units)]
    assert layouts
    for layout in layouts:
        assert layout.dp * layout.tp * layout.cp * layout.pp == 4
        assert all(h % layout.tp == 0 for h in cfg.model.model_args.get("num_heads", []))
        if layout.pp > 1:
            assert (layout.batch_size // layout.dp) % layout.pp_microbatches == 0
            assert layout.pp * STAGES_PER_RANK[layout.pp_schedule] <= units
            assert layout.tp == layout.cp == 1 and layout.script == "train_pp.py"
        if layout.precision == "bf16 params":  # FSDP2's MixedPrecisionPolicy: not train.py's, not DDP's
            assert layout.script not in ("train.py", "train_ddp.py")
        assert layout.ac != "layer" or cfg.model.model == "swinir"
        assert (layout.tp == layout.cp == 1) or layout.script == "train_mp.py"
    seen = {(layout.tp, layout.cp, layout.pp) for layout in layouts}
    if cfg.model.model == "unet3d":  # no tensor, context or pipeline plan in its row of plans.py
        assert seen == {(1, 1, 1)}
    else:
        assert (2, 1, 1) in seen and (4, 1, 1) not in seen  # 2 heads: tp 2, never tp 4
        assert (1, 2, 1) in seen and (1, 1, 2) in seen


def test_the_batch_must_divide_over_dp_as_the_data_loader_demands():
    rows = plan(tiny_vit(batch_size=2), load_cluster("perlmutter-a100-40"), 1)
    assert rows and all(row.layout.batch_size % row.layout.dp == 0 for row in rows)
    assert not any(row.layout.dp == 4 for row in rows)  # 2 samples over 4 data-parallel ranks: refused


# ------------------------------------------------------------------ memory of the layouts, against records

# The memory records of benchmarks/bench_pp.py's and bench_mp.py's runs (benchmarks/README.md; torch 2.15.0, CPU):
# byte counts, the same on every run of the same versions. (Fresh runs: tests/test_mp.py, test_pp.py, test_fsdp.py.)
PP_RECORDS = {("gpipe", 2): 878.68, ("gpipe", 4): 759.55, ("gpipe", 8): 699.99, ("1f1b", 2): 878.68,
              ("1f1b", 4): 439.34, ("1f1b", 8): 219.67, ("interleaved_1f1b", 2): 723.80,
              ("interleaved_1f1b", 4): 449.80, ("interleaved_1f1b", 8): 224.90, ("zbv", 2): 663.04,
              ("zbv", 4): 445.84, ("zbv", 8): 344.80}
MP_RECORDS = {(): (7.72, 72.91), ("fsdp",): (4.39, 36.45), ("tp",): (4.48, 42.40), ("cp",): (4.39, 42.35)}


@pytest.mark.parametrize("schedule, microbatches", list(PP_RECORDS))
def test_pipeline_activations_per_schedule_as_recorded(schedule, microbatches):
    cfg = build_config("quickstart", {"model_args": {"depths": [1, 1, 1, 1], "num_heads": [2, 2, 2, 2]},
                                      "batch_size": 8, "pp": 2, "pp_schedule": schedule,
                                      "pp_microbatches": microbatches, "device": "cpu"})
    estimate = estimate_memory(cfg, 2, "fsdp", field=(180, 360))
    largest = max(r["activations_gb"] for r in estimate.setting["pp_ranks"]) * 1e3
    assert largest == pytest.approx(PP_RECORDS[schedule, microbatches], rel=0.10)
    states = 0.80 if schedule == "zbv" else 0.79  # (MB/rank: rank 0 holds the first and the last stage under ZB-V)
    assert max(r["states_gb"] for r in estimate.setting["pp_ranks"]) * 1e3 == pytest.approx(states, abs=0.006)


@pytest.mark.parametrize("layout", list(MP_RECORDS))
def test_model_parallel_memory_as_recorded(layout):
    overrides = {"tp": {"tp": 2}, "cp": {"cp": 2}}.get(layout[0] if layout else "", {})
    cfg = build_config("vit_quickstart", {**overrides, "device": "cpu"})
    estimate = estimate_memory(cfg, 2 if layout else 1, "fsdp" if layout else "none")
    states, activations = MP_RECORDS[layout]
    assert estimate.setting["states_gb"] * 1e3 == pytest.approx(states, rel=0.03)
    # (train_mp.py counts the model's forward: its loss runs outside the counter)
    forward = estimate.activations - estimate.activations_by_part["loss"]
    assert forward / 1e6 == pytest.approx(activations, rel=0.03)


# ------------------------------------------------------------------ the step model


def test_ddp_exposure_is_the_scaling_benchmarks_model():
    cluster = load_cluster("perlmutter-a100-40")
    cfg = build_config("vit_base")
    rows = {row.layout.name(): row for row in plan(cfg, cluster, 2) if row.layout.precision == "fp32"
            and row.layout.ac == "none"}
    ddp = rows["dp8 DDP"]
    flops, grad_bytes, _ = model_facts(cfg)
    speed = predict_speed(ddp.layout, cfg, cluster, flops, grad_bytes)
    expected = predict_step(speed.compute_s, BACKWARD_SHARE * speed.compute_s,
                            ddp_buckets(grad_bytes, cfg.dist.bucket_cap_mb * MiB), 8,
                            min(cluster.intra_bw, cluster.inter_bw), cluster.latency_s)
    assert speed.exposed_s == pytest.approx(expected["exposed_s"])
    assert speed.step_s == pytest.approx(speed.compute_s + expected["exposed_s"])


def test_bubble_and_tensor_parallel_traffic():
    cluster = load_cluster("perlmutter-a100-40")
    rows = plan(build_config("vit_mp"), cluster, 1)
    one_f = {row.layout.pp_microbatches: row for row in rows if row.layout.pp == 4
             and row.layout.pp_schedule == "1f1b" and row.layout.precision == "bf16" and row.layout.ac == "none"}
    assert one_f[4].speed.bubble_s / one_f[4].speed.compute_s == pytest.approx(3 / 4)  # (p-1)/m at m = p = 4
    assert one_f[16].speed.bubble_s < one_f[4].speed.bubble_s
    tp = {row.layout.tp: row for row in rows if row.layout.cp == 1 and row.layout.strategy == "mp"
          and row.layout.precision == "bf16" and row.layout.ac == "none"}
    assert tp[4].speed.terms["tp all-gather/reduce-scatter"] > tp[2].speed.terms["tp all-gather/reduce-scatter"]
    fits = [row.fits for row in rows]
    assert fits == sorted(fits, reverse=True)  # what fits comes first


def test_a_description_says_bytes_and_the_planner_times_them():
    # The description names what is sent over which group; the planner alone knows links. By hand: a ring all-reduce
    # of 1000 B over 4 ranks carries 2 x 3/4 x 1000 B per link, 1.5 s at 1000 B/s, plus 2 x 3 steps of 0.1 s; an
    # exchange of 3 messages, 500 B in all: 3 latencies and 0.5 s.
    terms = {"gradient all-reduce": 9.0}
    traffic = [Traffic("tp all-reduce", "tp", "all-reduce", 1000, count=2),
               Traffic("cp halo exchange", "cp", "exchange", 500, count=3)]
    seconds = traffic_seconds(traffic, {"tp": 4, "cp": 2}, 1000.0, 0.1, terms)
    assert terms == pytest.approx({"gradient all-reduce": 9.0, "tp all-reduce": 2 * (1.5 + 0.6),
                                   "cp halo exchange": 0.3 + 0.5})
    assert seconds == pytest.approx(4.2 + 0.8)
    vit = model_shape(build_config("vit_mp").model)
    said = vit.model_parallel_traffic(2, 2, build_config("vit_mp"), 4, 2)
    assert {(t.term, t.group) for t in said} == {("tp all-gather/reduce-scatter", "tp"), ("cp key/value gather", "cp")}


# ------------------------------------------------------------------ end to end


def test_json_lists_every_layout_with_its_keys(capsys):
    assert plan_script.main(["--config", "vit_mp", "--cluster", "perlmutter-a100-40", "--nodes", "4", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) > 50
    for key in ("strategy", "tp", "cp", "pp", "ac", "amp_dtype", "param_dtype", "fits", "gb_per_gpu",
                "samples_per_sec", "limited_by", "command"):
        assert key in rows[0], key
    assert rows[0]["fits"] and rows[0]["command"].startswith("SITE=perlmutter sbatch --nodes 4 submit_multinode.sh")
    no_fit = [r for r in rows if not r["fits"]]
    assert no_fit and all(r["limited_by"] == "memory" for r in no_fit)


def test_a_layout_key_on_the_command_line_keeps_its_layouts(capsys):
    argv = ["--config", "vit_mp", "--cluster", "perlmutter-a100-40", "--nodes", "4", "--json"]
    assert plan_script.main([*argv, "--tp", "4", "--ac", "block"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and all(r["tp"] == 4 and r["ac"] == "block" for r in rows)
    assert all("--tp 4 --ac block" in r["command"] for r in rows)


def test_nothing_fits_is_one_line(tmp_path, capsys):
    path = tmp_path / "tiny.yaml"
    path.write_text(CPU_CLUSTER)
    assert plan_script.main(["--config", "vit_quickstart", "--cluster", "tiny-gpus", "--cluster_file", str(path)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("nothing fits 0 GB per GPU on 1 node(s): the smallest footprint is ")
    assert "it would fit with" in out[-1]


def test_the_best_cpu_layouts_command_runs(vit_data, tmp_path, capsys):
    path = tmp_path / "cpus.yaml"
    path.write_text(CPU_CLUSTER)
    argv = ["--config", "vit_quickstart", *VIT_MODEL, "--batch_size", "4", "--cluster", "two-cpus",
            "--cluster_file", str(path)]
    assert plan_script.main(argv) == 0
    out = capsys.readouterr().out
    command = next(line for line in out.splitlines() if line.startswith("run: "))[len("run: "):]
    words = shlex.split(command)
    assert words[:4] == ["torchrun", "--standalone", "--nproc-per-node", "2"], command
    script, args = words[4], words[5:]
    run_dir = tmp_path / "run"
    run_script(script, *args, "--data_dir", str(vit_data), "--run_dir", str(run_dir), "--max_steps", "2",
               "--log_every", "1", "--val_every", "0", "--ckpt_every", "0", "--num_workers", "0",
               "--progress", "never", ranks=2)
    assert [r["step"] for r in read_metrics(run_dir) if r["kind"] == "train"] == [1, 2]


def test_a_config_error_in_a_layout_is_never_printed_as_a_plan():
    with pytest.raises(ConfigError, match="--nodes must be >= 1"):
        plan(tiny_vit(), load_cluster("kestrel-h100"), 0)


def test_a_published_layout_is_modelled_as_it_ran():
    """NERSC's tp: DDP over dp (whole AdamW state per tp rank) and no sequence parallelism (the stream and the
    LayerNorms whole on every tp rank): more memory than train_mp.py's FSDP2 with SP, and not a command to run."""
    cfg = build_config("vit_mp", {"model_args.embed_dim": 1024})
    ours = Layout("train_mp.py", "mp", 16, tp=4, precision="bf16", batch_size=64)
    theirs = dataclasses.replace(ours, ddp_beside_mp=True, sequence_parallel=False)
    mine, published = (plan_layout(cfg, load_cluster("perlmutter-a100-80"), 4, lay) for lay in (ours, theirs))
    assert published.estimate.optimizer > 3 * mine.estimate.optimizer  # not sharded over dp 4
    assert published.estimate.activations > 1.3 * mine.estimate.activations  # the stream whole on every tp rank
    assert "not run by this project's scripts" in published.command and "train_mp.py" in mine.command
    assert published.layout.name() == "dp4 x tp4 DDP no SP"
