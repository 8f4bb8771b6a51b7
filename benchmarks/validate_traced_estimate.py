"""The traced memory estimate (utils/memory/traced.py) against the measured peak of real steps on CPU processes.

For each model and layout, every rank runs utils.memory.measure.measure_layout — the model built as train.py builds
it, wrapped as train_ddp.py / train_fsdp.py wrap it (gloo), AdamW as build_optimizer makes it; the second of two steps
measured by the profiler's allocation trace, from the model's build on — and the largest rank's peak is compared
with the traced estimate of that rank (and, for the models that have one, with the hand-written estimate's total,
estimate.py's upper bound). Models: the tests' tiny SwinIR, ViT and U-Net (tests/conftest.py), the quickstart
configs, and the FNO-2D of examples/fno (Part IV's model of your own: fno.yaml's fno_quickstart), which the project
has no description of. DDP, FSDP and HSDP are measured --repeats times, and the median is compared: their gloo
collectives run on threads of their own, and whether a full-size staging buffer meets a backward's peak varies from
run to run (the U-Net quickstart's, with 4 MB units: 12.5 to 20.9 MB on 4 processes; the FNO's under DDP, one
4.2 MB bucket: 34.48 or 38.71 MB on 2 processes).

    python benchmarks/validate_traced_estimate.py                 # the table (about 20 minutes on 2 cores)
    python benchmarks/validate_traced_estimate.py --quick         # the tiny models and the FNO only
    python benchmarks/validate_traced_estimate.py --model "FNO quickstart"   # one model's rows (repeatable)
    python benchmarks/validate_traced_estimate.py --markdown      # the table as benchmarks/README.md shows it
    python benchmarks/validate_traced_estimate.py --config_file my.yaml --config mine --layout 2,fsdp,ac=block
                                                                  # your model, in the layouts you name

--config NAME (with --config_file PATH: your named configs) measures a model of yours instead, as the config builds it;
--layout PROCESSES,STRATEGY[,KEY=VALUE...] (repeatable) a layout of your own instead of the grid, e.g. 1,none,ac=block
or 2,fsdp,ac=block,amp_dtype=bf16 (make test-libraries measures the libraries' models so, tests/libraries.py).

Exit status 1 if a traced estimate is off by more than --tolerance (default 10 %) from every measured run of its case.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from utils.config import build_config  # noqa: E402
from utils.memory.estimate import estimate_memory  # noqa: E402
from utils.memory.measure import measure_layout  # noqa: E402
from utils.memory.shapes import has_description  # noqa: E402
from utils.memory.traced import estimate_traced  # noqa: E402
from utils.training import exit_process  # noqa: E402

# Part IV's FNO is a model of your own: its named configs lie beside it, read with the project's.
EXAMPLE_CONFIGS = Path(__file__).resolve().parent.parent / "examples" / "fno" / "fno.yaml"

# The models: (name, base config, overrides); batches are global (4 and 8 divide over 2 and 4 processes).
SWINIR_TINY = {"model_args": {"depths": [2], "num_heads": [2], "embed_dim": 16, "drop_path_rate": 0.0,
                              "window_size": 8}, "img_size": 16, "crop_size": 32, "batch_size": 4}
VIT_TINY = {"img_size": [16, 32], "model_args": {"patch_size": 4, "embed_dim": 16, "depths": [2], "num_heads": [2]},
            "batch_size": 4}
UNET_TINY = {"crop_size": 16, "model_args": {"widths": [4, 8]}, "batch_size": 4}
MODELS = {
    "SwinIR tiny": ("quickstart", SWINIR_TINY),
    "ViT tiny": ("vit_quickstart", VIT_TINY),
    "U-Net tiny": ("unet3d_quickstart", UNET_TINY),
    "FNO quickstart": ("fno_quickstart", dict(batch_size=8)),
    "SwinIR quickstart": ("quickstart", dict(batch_size=4)),
    "ViT quickstart": ("vit_quickstart", dict(batch_size=8)),
    "U-Net quickstart": ("unet3d_quickstart", dict(batch_size=8)),
}
QUICK = ("SwinIR tiny", "ViT tiny", "U-Net tiny", "FNO quickstart")
# Layouts plan.py offers on 2-4 CPU processes, with a data-parallel strategy: (processes, strategy, keys).
LAYOUTS = [
    (1, "none", dict()),
    (1, "none", dict(amp_dtype="bf16", ac="block")),
    (2, "ddp", dict()),
    (2, "ddp", dict(amp_dtype="bf16", ac="block")),
    (2, "fsdp", dict()),
    (2, "fsdp", dict(amp_dtype="bf16", ac="block")),
    (2, "fsdp", dict(amp_dtype="bf16", param_dtype="bf16", ac="block")),
    (4, "ddp", dict(amp_dtype="bf16")),
    (4, "fsdp", dict(ac="block")),
    (4, "fsdp", dict(amp_dtype="bf16", hsdp_replicas=2)),
]


def case_config(model: str, keys: dict, config_file: Path = EXAMPLE_CONFIGS):
    base, overrides = MODELS.get(model, (model, {}))  # not one of MODELS: a named config of config_file
    cfg = build_config(base, {**overrides, **keys, "device": "cpu"}, config_file)
    if model.startswith("ViT"):  # the data's statistics: any values save the same tensors
        m = cfg.model
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(m, mean=[0.0] * m.in_chans, std=[1.0] * m.in_chans))
    return cfg


def layout(text: str) -> tuple[int, str, dict]:
    """--layout's PROCESSES,STRATEGY[,KEY=VALUE...]: (processes, strategy, config keys; values read as YAML)."""
    processes, strategy, *pairs = text.split(",")
    if not processes.isdigit() or strategy not in ("none", "ddp", "fsdp") or not all("=" in p for p in pairs):
        raise argparse.ArgumentTypeError(f"{text!r} is not PROCESSES,STRATEGY[,KEY=VALUE...] (strategy none, ddp or "
                                         "fsdp), e.g. 2,fsdp,ac=block")
    return int(processes), strategy, {k: yaml.safe_load(v) for k, v in (p.split("=", 1) for p in pairs)}


def label(strategy: str, keys: dict) -> str:
    precision = "bf16 params" if keys.get("param_dtype") == "bf16" else keys.get("amp_dtype", "fp32")
    name = {"none": "one process", "ddp": "DDP", "fsdp": "FSDP"}[strategy]
    if keys.get("hsdp_replicas", 1) > 1:
        name = f"HSDP ({keys['hsdp_replicas']} replicas)"
    return f"{name}, {precision.replace('none', 'fp32')}, AC {keys.get('ac', 'none')}"


def _worker(rank: int, ranks: int, port: int, cases: list, repeats: int, out: str, config_file: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # as torchrun runs each process
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    results = []
    for model, strategy, keys in cases:
        cfg = case_config(model, keys, config_file)
        peaks = []
        for _ in range(repeats if strategy != "none" else 1):  # (one process: the same peak every time)
            measured = measure_layout(cfg, strategy)
            local = torch.tensor([measured.peak], dtype=torch.float64)
            gathered = [torch.zeros_like(local) for _ in range(ranks)]
            dist.all_gather(gathered, local)
            peaks.append(max(t.item() for t in gathered))  # the largest rank's
        results.append(peaks)
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()
    exit_process(0, joined=True)  # gloo's threads outlive destroy_process_group: no interpreter shutdown


def measure_all(cases: list, repeats: int, config_file: Path = EXAMPLE_CONFIGS) -> list:
    """The measured peaks (the largest rank's, ``repeats`` times for DDP, FSDP and HSDP, whose gloo collectives run on
    threads of their own: when their staging buffers meet a backward's peak varies from run to run) of each
    (processes, model, strategy, keys), run on its number of processes."""
    results = {}
    for ranks in sorted({c[0] for c in cases}):
        group = [c[1:] for c in cases if c[0] == ranks]
        with tempfile.TemporaryDirectory() as tmp, socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            sock.close()
            mp.spawn(_worker, args=(ranks, port, group, repeats, f"{tmp}/out.json", config_file), nprocs=ranks)
            for case, values in zip(group, json.loads(Path(f"{tmp}/out.json").read_text())):
                results[(ranks, *case[:2], json.dumps(case[2]))] = values
    return [results[(c[0], c[1], c[2], json.dumps(c[3]))] for c in cases]


def estimate(model: str, ranks: int, strategy: str, keys: dict,
             config_file: Path = EXAMPLE_CONFIGS) -> tuple[float, float | None]:
    """(traced, hand-written) estimate of the largest rank's peak; hand-written None where the model has none."""
    cfg = case_config(model, keys, config_file)
    hand = estimate_memory(cfg, ranks, strategy, device_type="cpu").total if has_description(cfg.model) else None
    return estimate_traced(cfg, ranks, strategy, "cpu").total, hand


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--model", action="append", choices=tuple(MODELS), help="only this model (repeatable)")
    parser.add_argument("--config", action="append", default=[], help="a named config of yours instead (repeatable)")
    parser.add_argument("--config_file", type=Path, default=EXAMPLE_CONFIGS, help="where --config's names are")
    parser.add_argument("--layout", action="append", type=layout, default=[],
                        help="PROCESSES,STRATEGY[,KEY=VALUE...] instead of the grid (repeatable), e.g. 2,fsdp,ac=block")
    parser.add_argument("--markdown", action="store_true", help="a Markdown table")
    parser.add_argument("--tolerance", type=float, default=0.10, help="largest accepted relative error of the peak")
    parser.add_argument("--repeats", type=int, default=3, help="measurements of each DDP/FSDP/HSDP case (the median)")
    parser.add_argument("--measured", type=Path, default=None,
                        help="a JSON file of the measurements: read if it exists (estimates only), else written")
    args = parser.parse_args(argv)
    models = args.config or args.model or (QUICK if args.quick else tuple(MODELS))
    cases = [(ranks, model, strategy, keys) for model in models for ranks, strategy, keys in args.layout or LAYOUTS]
    if args.measured and args.measured.exists():
        measured = json.loads(args.measured.read_text())
    else:
        measured = measure_all(cases, args.repeats, args.config_file)
        if args.measured:
            args.measured.write_text(json.dumps(measured))
    if args.markdown:
        print("| model | layout | processes | measured peak MB: median (range) | traced MB | vs median | "
              "hand-written MB | vs median |\n| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    else:
        print(f"{'model':18s} {'layout':36s} {'n':>2s} {'measured MB (range)':>22s} {'traced':>8s} {'error':>7s} "
              f"{'hand':>8s} {'error':>7s}")
    worst, outside = 0.0, []
    for (ranks, model, strategy, keys), peaks in zip(cases, measured):
        peak = statistics.median(peaks)
        spread = f" ({min(peaks) / 1e6:.2f}-{max(peaks) / 1e6:.2f})" if len(peaks) > 1 else ""
        traced, hand = estimate(model, ranks, strategy, keys, args.config_file)
        error = traced / peak - 1
        worst = max(worst, abs(error))
        # Within tolerance of some measured run (DDP's and FSDP's vary from run to run: see the module docstring).
        if not (1 - args.tolerance) * min(peaks) <= traced <= (1 + args.tolerance) * max(peaks):
            outside.append(f"{model}, {label(strategy, keys)}, {ranks}")
        hand_text = (f"{hand / 1e6:.2f}", f"{hand / peak - 1:+.1%}") if hand else ("-", "-")
        if args.markdown:
            print(f"| {model} | {label(strategy, keys)} | {ranks} | {peak / 1e6:.2f}{spread} | {traced / 1e6:.2f} | "
                  f"{error:+.1%} | {hand_text[0]} | {hand_text[1]} |", flush=True)
        else:
            print(f"{model:18s} {label(strategy, keys):36s} {ranks:>2d} {f'{peak / 1e6:.2f}{spread}':>22s} "
                  f"{traced / 1e6:8.2f} {error:+7.1%} {hand_text[0]:>8s} {hand_text[1]:>7s}", flush=True)
    ok = not outside
    print(f"worst traced error against the median {worst:.1%}; outside the measured range +-{args.tolerance:.0%}: "
          f"{'; '.join(outside) or 'none'}: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
