"""Every command in README.md and docs/*.md runs, or, where it needs a cluster, parses.

The conventions (README.md, "Tests"), by the info string of a fenced block:

    ```bash            runs on a laptop CPU: every line is run here, in document order, in one scratch
                       copy of the repository layout whose datasets/ holds tiny stand-ins, with the
                       overrides of CPU_RUN below (shrinking steps and models; nothing else), exit 0.
    ```bash cluster    needs SLURM, a GPU or the real data: checked only. `bash -n` and shellcheck; each
                       project script's arguments are parsed into its config (unknown keys and bad values
                       fail), and the global batch must be divisible by the ranks the command starts.
    ```bash setup      installs or builds (make, venv): not run; `make` lines are checked by `make -n`.
    ```text            output, first line `$ command`: the command is run as a `bash` line (or checked
                       as a cluster line under ```text cluster, whose output is not compared) and every
                       line shown must have a line of the same shape in what it prints (SHAPE_RULES).
                       A line `...` stands for lines left out. Output that shows a one-line `error:` is
                       that of bad input: the command must exit 2. Marked `<!-- output: exact -->`, the block is
                       the command's whole output, compared line by line, numbers included
                       (tests/page_outputs.py, which also rewrites such blocks: make docs-outputs).

Blocks without an info string (layouts, maps) are not commands. Any other info string is an error.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import runpy
import shlex
import subprocess
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import pytest

from tests import page_outputs
from tests.conftest import REPO, TINY_MODEL, in_this_process

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "datasets" / "README.md"]

# ------------------------------------------------------------------------------------------------------
# How each runnable command is shrunk to a CPU test. Key: the command as the page writes it (comments
# dropped). Value: "... ARGS" appends ARGS to it (the last value of a key wins); anything else is the
# command run instead. {ws} is the scratch folder the commands run in. Commands not listed run as written;
# a training script (train*.py, torchrun, the benchmarks that train) must be listed.
TINY = shlex.join(TINY_MODEL)  # conftest's 2-block SwinIR
CROPS = "--crop_size 32 --n_patches 2 --num_workers 0"
CPU_RUN = {
    # README.md
    "python train.py --config quickstart":
        "... --max_steps 2 --log_every 1 --val_every 2 --val_samples 2",
    "python train.py --config vit_quickstart --tp 2 --run_dir runs/vit_tp2_refused": "... --max_steps 2",  # refused
    # docs/part1-swinir.md
    "python train.py --config baseline --data_dir datasets/synthetic_small --valid_split valid --batch_size 2 "
    "--max_steps 10 --log_every 2 --val_every 10 --val_samples 4 --num_workers 2 --run_dir runs/try_baseline":
        f"... {TINY} {CROPS}",
    "python train.py --config baseline --data_dir datasets/synthetic_small --valid_split valid --batch_size 2 "
    "--max_steps 20 --log_every 2 --val_every 10 --val_samples 4 --num_workers 2 --run_dir runs/try_baseline "
    "--resume":
        f"... {TINY} {CROPS}",
    "python train_with_profiling.py --config quickstart --max_steps 20 --breakdown_steps 40 "
    "--run_dir runs/quickstart_profile":
        # 8 steps: trace of 3-5, memory timeline of 6, the final validation after it (a validation inside the
        # memory-timeline step is recorded with Python stacks, and exporting that takes minutes)
        "... --max_steps 8 --breakdown_steps 3 --val_samples 2",
    "python benchmarks/validate_memory_estimate.py --device cpu --quick": "... --model swinir",
    "torchrun --standalone --nproc-per-node 2 train_ddp.py --config quickstart --run_dir runs/quickstart_ddp":
        "... --max_steps 2 --val_every 2 --val_samples 2",
    "python benchmarks/bench_ddp_overhead.py --nproc 2 -- --config quickstart --max_steps 60 --log_every 5":
        "python benchmarks/bench_ddp_overhead.py --nproc 2 --repeats 1 -- --config quickstart --max_steps 3 "
        "--log_every 1 --data_dir {ws}/datasets/synthetic_small",
    "torchrun --standalone --nproc-per-node 2 train_fsdp.py --config quickstart --run_dir runs/quickstart_fsdp":
        "... --max_steps 2 --val_every 2 --val_samples 2",
    "python -m utils.checkpoint.sharded export runs/quickstart_fsdp/checkpoints/step_00001200 "
    "runs/quickstart_fsdp/step_1200.pt":
        "python -m utils.checkpoint.sharded export runs/quickstart_fsdp/checkpoints/step_00000002 "
        "runs/quickstart_fsdp/step_2.pt",
    # docs/performance.md: 1 and 2 ranks of the tiny SwinIR, one timed step per variant
    "python benchmarks/scaling.py --sizes 1 2 4 --steps 3 --bucket-caps 0.01 0.05 -- --config quickstart":
        "python benchmarks/scaling.py --sizes 1 2 --steps 1 --rounds 1 --bucket-caps 0.01 0.05 --out {ws}/runs/scaling "
        f"-- --config quickstart --data_dir {{ws}}/datasets/synthetic_small {TINY} {CROPS}",
    # docs/part2-vit.md
    "python train.py --config vit_quickstart":
        "... --max_steps 2 --log_every 1 --val_every 2 --val_samples 4 --batch_size 4",
    "python rollout.py --checkpoint runs/vit_quickstart --steps 8 --samples 32": "... --samples 2",
    # docs/part3-unet3d.md (datasets/synthetic_volume: conftest's 32³ boxes)
    "python train.py --config unet3d_quickstart": "... --max_steps 2 --log_every 1 --val_every 2",
    "python train_with_profiling.py --config unet3d_quickstart --max_steps 4 --val_every 0 --breakdown_steps 20 "
    "--memory_timeline false --profile_active 1 --augment host --run_dir runs/unet3d_profile_host":
        "... --breakdown_steps 2",
    # docs/part4-your-model.md (the FNO of examples/fno on the ViT's stand-in)
    "python train.py --config_file examples/fno/fno.yaml --config fno_quickstart":
        "... --max_steps 2 --log_every 1 --val_every 2 --val_samples 4 --batch_size 4",
    "python train.py --config_file examples/fno/fno.yaml --config fno_quickstart --model_args.depth 3": "... --max_steps 2",
    "python train.py --config vit_tcwv_quickstart": "... --max_steps 2 --log_every 1 --val_every 2 --val_samples 4 "
                                                    "--batch_size 4",
    "python train.py --config_file examples/fno/fno.yaml --config fno_quickstart --model_args.width 0": "... --max_steps 2",
    "python train.py --config vit_tcwv_quickstart --out_chans 3": "... --max_steps 2",  # refused
    "python rollout.py --checkpoint runs/fno_quickstart --steps 8 --samples 32": "... --samples 2",
    "python check_layouts.py --config_file examples/fno/fno.yaml --config fno_quickstart --nproc 2": "... --steps 2",
    "torchrun --standalone --nproc-per-node 2 train_ddp.py --config_file examples/fno/fno.yaml --config fno_quickstart "
    "--run_dir runs/fno_ddp": "... --max_steps 2 --log_every 1 --val_every 2 --val_samples 4 --batch_size 4",
    "torchrun --standalone --nproc-per-node 2 train_fsdp.py --config_file examples/fno/fno.yaml --config fno_quickstart "
    "--ac block --run_dir runs/fno_fsdp": "... --max_steps 2 --log_every 1 --val_every 2 --val_samples 4 --batch_size 4",
    # docs/part5-ensembles.md: torchrun, but no training: it runs as written on the stand-in
    "torchrun --standalone --nproc-per-node 2 predict.py --checkpoint runs/vit_quickstart --out "
    "runs/vit_quickstart/ensemble_2ranks.zarr --steps 4 --times 2015-01-01 --members 8 --perturbation spherical "
    "--correlation_km 1000": "... --progress never",
    "python train.py --config vit_quickstart --ensemble 4 --loss crps --run_dir runs/vit_crps":
        "... --max_steps 2 --log_every 1 --val_every 2 --val_samples 4 --batch_size 4",
    "torchrun --standalone --nproc-per-node 2 train_mp.py --config vit_quickstart --ensemble 4 --loss crps --ens 2 "
    "--run_dir runs/vit_crps_ens2": "... --max_steps 2 --log_every 1 --val_every 2 --val_samples 4 --batch_size 4",
    # docs/beyond-data-parallel.md
    "torchrun --standalone --nproc-per-node 2 train_mp.py --config vit_quickstart --tp 2 --run_dir runs/vit_tp2":
        "... --max_steps 2 --log_every 1 --val_every 2 --val_samples 4 --batch_size 4",
    "torchrun --standalone --nproc-per-node 2 train_pp.py --config quickstart --pp 2 --pp_schedule zbv "
    "--model_args.depths '[1,1,1,1]' --model_args.num_heads '[2,2,2,2]' --batch_size 8 --pp_microbatches 8 --max_steps 100 "
    "--run_dir runs/quickstart_pp2":
        "... --max_steps 2 --log_every 1 --val_every 2 --val_samples 2",
    "torchrun --standalone --nproc-per-node 2 train_mp.py --config quickstart --cp 2 --run_dir runs/quickstart_cp2":
        "... --max_steps 2 --log_every 1 --val_every 2 --val_samples 2",
    "python check_layouts.py --config vit_quickstart --model_args.depths '[4]' --nproc 2 --left_out cp_reduction":
        "... --img_size '[16, 32]' --model_args.patch_size 4 --model_args.embed_dim 32 --steps 2",  # the same rows, a smaller ViT
    # docs/performance.md (the ladder's rungs' own keys may not follow --: no --num_workers here)
    "python benchmarks/ladder.py --config quickstart":
        f"... --steps 2 --breakdown-steps 1 --repeats 1 --rungs baseline -- {TINY} --crop_size 32 --n_patches 2 --val_samples 2",
    # docs/part1-swinir.md Step 2, docs/performance.md Step 0c: two settings, one seed, two steps each (the spread's
    # arithmetic is tests/test_precision_skill.py's)
    "python benchmarks/precision_skill.py":
        f"... --configs quickstart --settings fp32 bf16+keep_fp32 --seeds 0 --steps 2 --times 1 -- {TINY} "
        "--crop_size 32 --n_patches 2",
    # convergence: one run each (the base batch), 2 validations
    "python benchmarks/convergence.py":
        "... --batches 2 --samples 4 --val_every_samples 2 -- --val_samples 2",
    "python benchmarks/convergence.py --config vit_quickstart":
        "python benchmarks/convergence.py --config vit_quickstart --batches 4 --base_batch 4 --samples 8 "
        "--val_every_samples 4 -- --val_samples 4",
    # datasets/README.md (the ws's datasets/era5 is a folder of its own; the quickstarts' stand-ins are the tests'
    # data, linked: their recipes write a small copy elsewhere)
    "python datasets/make_synthetic_era5.py --out datasets/synthetic_small --samples-per-year 64 --height 181 "
    "--width 360 --seed 0 --train-years 2008 2010 --valid-years 2015":
        "python datasets/make_synthetic_era5.py --out runs/synthetic_small --samples-per-year 4 --height 19 "
        "--width 36 --seed 0 --train-years 2008 --valid-years 2015",
    "python datasets/make_synthetic_era5.py --out datasets/synthetic_vit --channels nersc20 --hours-per-step 6 "
    "--height 33 --width 64 --samples-per-year 730 --train-years 2008 2010 --valid-years":
        "python datasets/make_synthetic_era5.py --out runs/synthetic_vit --channels nersc20 --hours-per-step 6 "
        "--height 33 --width 64 --samples-per-year 4 --train-years 2008 --valid-years",
    "python datasets/make_synthetic_era5.py --out datasets/synthetic_vit --channels nersc20 --hours-per-step 6 "
    "--height 33 --width 64 --samples-per-year 128 --train-years --valid-years 2015 --no-stats":
        "python datasets/make_synthetic_era5.py --out runs/synthetic_vit --channels nersc20 --hours-per-step 6 "
        "--height 33 --width 64 --samples-per-year 4 --train-years --valid-years 2015 --no-stats",
    "python datasets/make_synthetic_era5.py --out datasets/era5 --samples-per-year 64 --height 181 --width 360 "
    "--seed 0 --train-years 2008 2010 --valid-years --split valid_1=2015":
        "python datasets/make_synthetic_era5.py --out datasets/era5 --samples-per-year 4 --height 19 --width 36 "
        "--seed 0 --train-years 2008 --valid-years --split valid_1=2015",
    # datasets/README.md, "Your own data": cfgrib's ERA5 sample (make test fetches it: make real-data), converted
    # into the scratch copy's runs/ rather than through its link to the repository's datasets/real
    "python datasets/convert.py datasets/real/era5-levels-members.grib --out datasets/real/era5_sample "
    "--members 0-7":
        "python datasets/convert.py datasets/real/era5-levels-members.grib --out runs/era5_sample --members 0-7 --quiet",
    "python datasets/convert.py datasets/real/era5-levels-members.grib --out datasets/real/era5_sample "
    "--members 8-9 --split valid=2017":
        "python datasets/convert.py datasets/real/era5-levels-members.grib --out runs/era5_sample --members 8-9 "
        "--split valid=2017 --quiet",
    "python datasets/check_data.py --config quickstart --data_dir datasets/real/era5_sample":
        "... --data_dir runs/era5_sample",
    "python train.py --config quickstart --data_dir datasets/real/era5_sample --loss_space normalized --batch_size 4 "
    "--lr_gamma 0.98 --max_steps 600 --val_every 150 --log_every 150 --run_dir runs/era5_sample":
        "... --data_dir runs/era5_sample --max_steps 2 --val_every 2 --log_every 1 --run_dir runs/era5_sample_run",
    # datasets/README.md, "Data from another centre": Debian's ferret-datasets (tests/install_slurm.sh installs it),
    # converted into the scratch copy's runs/ rather than through its link to the repository's datasets/real
    "python datasets/convert.py /usr/share/ferret-vis/data/monthly_navy_winds.cdf --out datasets/real/navy_winds "
    "--channels u10,v10 --rename UWND=u10,VWND=v10 --train-years 1982 1983 1984 1985 1986 1987 1988 1989 1990 "
    "--valid-years 1991 1992 --quiet": "... --out runs/navy_winds",
    "python datasets/check_data.py --config quickstart --data_dir datasets/real/navy_winds --task forecast":
        "... --data_dir runs/navy_winds",
    "python benchmarks/bench_data.py datasets/synthetic_small --num-workers 0 2":
        "... --batches 2 --repeats 1 --crop-size 32 --batch-size 2",
    "python benchmarks/bench_data.py --synthetic 16 --num-workers 4":
        "python benchmarks/bench_data.py --synthetic 2 --num-workers 0 --batches 2 --repeats 1 --crop-size 32 "
        "--batch-size 2",
}
CPU_RUN = {shlex.join(shlex.split(key)): value for key, value in CPU_RUN.items()}  # as the pages' commands
TRAINS = re.compile(r"\btrain\w*\.py\b|\btorchrun\b|bench_ddp_overhead|benchmarks/ladder|convergence\.py|precision_skill")

# Output lines are compared by shape: these rules, in order, replace what differs between runs.
SHAPE_RULES = [
    (re.compile(r" --data_dir [^\s)]+"), ""),                       # the test's data override, echoed back
    (re.compile(r"\b(PASS|FAIL) +[\w.]+"), r"\1 <parameter>"),     # check_layouts.py: which gradient rounds most
    (re.compile(r"^\s*->.*"), "-> <verdict>"),                       # the throughput breakdown's conclusion
    (re.compile(r"aten::\w+"), "<op>"),                              # which ops lead the profile
    (re.compile(r"\b(?:AMD|Intel\(R\)|Apple)(?:[^,;(]|\((?:R|TM)\))*(?:\([^)]*\))?"), "<cpu>"),  # the processor
    (re.compile(r"(?<![\w.])[\w.<>-]*(?:/[\w.<>*-]+)+/?"), "<path>"),  # run folders, files, units like samples/s
    (re.compile(r"\d+x\d+"), "#x#"),                                 # field sizes
    (re.compile(r"(?<![\w.])[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?"), "#"),  # numbers
    (re.compile(r"#(?:[\s,]+#)+"), "#"),                             # a run of numbers: columns of a row
    (re.compile(r"\s+"), " "),
]
# Lines a command prints only in some runs (a shown line of this shape may be missing from the test's run).
OPTIONAL_LINES = [
    "below this machine's noise",  # bench_ddp_overhead.py: only with --repeats > 1 and a difference within noise
]

# Markers of the conventions.
RUN, CLUSTER, SETUP, OUTPUT, OUTPUT_CLUSTER = "bash", "bash cluster", "bash setup", "text", "text cluster"
INFO_STRINGS = {RUN, CLUSTER, SETUP, OUTPUT, OUTPUT_CLUSTER, ""}


@dataclass
class Command:
    page: str
    line: int
    text: str  # the command, comments dropped, as shlex.join of its words
    kind: str  # RUN, CLUSTER or SETUP
    shown: list[str] = field(default_factory=list)  # output lines shown under `$ command`
    has_output: bool = False

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def expected_exit(self) -> int:
        """0, or 2 where the page shows the one line of bad input (the command is shown failing)."""
        return 2 if any(re.match(r"(\S+: )?error: ", line) for line in self.shown) else 0


def canonical(command: str) -> str:
    return shlex.join(shlex.split(command, comments=True))


def fenced_blocks(path: Path) -> list[tuple[str, int, list[str]]]:
    """(info string, line number of the first content line, lines) of every fenced block."""
    blocks, lines, inside = [], path.read_text().splitlines(), None
    for number, line in enumerate(lines, 1):
        if line.startswith("```"):
            if inside is None:
                inside = (line[3:].strip(), number + 1, [])
            else:
                blocks.append(inside)
                inside = None
        elif inside is not None:
            inside[2].append(line)
    assert inside is None, f"{path.name}: unclosed fenced block from line {inside[1] - 1}"
    return blocks


def logical_lines(lines: list[str], first: int) -> list[tuple[int, str]]:
    """Lines joined at trailing backslashes, with the number of their first line."""
    joined, start, parts = [], None, []
    for offset, line in enumerate(lines):
        start = first + offset if start is None else start
        stripped = line.rstrip()
        if stripped.endswith("\\"):
            parts.append(stripped[:-1])
            continue
        parts.append(stripped)
        joined.append((start, " ".join(p.strip() for p in parts)))
        start, parts = None, []
    return joined


def page_commands(path: Path) -> list[Command]:
    name = path.relative_to(REPO).as_posix()
    commands = []
    for info, first, lines in fenced_blocks(path):
        if info in (RUN, CLUSTER, SETUP):
            for number, line in logical_lines(lines, first):
                if shlex.split(line, comments=True):
                    commands.append(Command(name, number, canonical(line), info))
        elif info in (OUTPUT, OUTPUT_CLUSTER):
            current = None
            for number, line in logical_lines_keep_output(lines, first):
                if line.startswith("$ "):
                    current = Command(name, number, canonical(line[2:]), RUN if info == OUTPUT else CLUSTER,
                                      has_output=info == OUTPUT)
                    commands.append(current)
                elif current is not None and line.strip() and line.strip() != "...":
                    current.shown.append(line)
    return commands


def logical_lines_keep_output(lines: list[str], first: int) -> list[tuple[int, str]]:
    """Like logical_lines, but joins backslash continuations only of `$ command` lines."""
    out, k = [], 0
    while k < len(lines):
        if lines[k].startswith("$ "):
            start, parts = k, [lines[k].rstrip()]
            while parts[-1].endswith("\\") and k + 1 < len(lines):
                k += 1
                parts.append(lines[k].strip())
            out.append((first + start, " ".join(p.rstrip("\\").strip() for p in parts)))
        else:
            out.append((first + k, lines[k]))
        k += 1
    return out


COMMANDS = [c for page in PAGES for c in page_commands(page)]


def shape(line: str) -> str:
    for pattern, replacement in SHAPE_RULES:
        line = pattern.sub(replacement, line)
    return line.strip()


# ------------------------------------------------------------------------------------------------------
# Running the laptop commands: in this process where the command is `python` (no interpreter start-up),
# through torch.distributed.run where it is torchrun.
@dataclass
class Result:
    returncode: int
    output: str
    seconds: float
    ran: str


def cpu_variant(command: str, ws: Path) -> str:
    override = CPU_RUN.get(command)
    if override is None:
        return command
    override = override.replace("{ws}", str(ws))
    return f"{command} {override[3:].strip()}" if override.startswith("...") else override


def run_in_process(argv: list[str]) -> tuple[int, str]:
    """`python SCRIPT ARGS` or `python -m MODULE ARGS` as __main__ in this process."""
    buffer = io.StringIO()
    code = 0
    with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer), warnings.catch_warnings(), \
            in_this_process():
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: "found in sys.modules" for -m utils.*
        try:
            if argv[0] == "-m":
                with mock.patch.object(sys, "argv", [argv[1], *argv[2:]]):
                    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:  # as `python SCRIPT` would: the script's folder first on sys.path
                script_dir = str(Path(argv[0]).resolve().parent)
                with mock.patch.object(sys, "argv", argv), mock.patch.object(sys, "path", [script_dir, *sys.path]):
                    runpy.run_path(argv[0], run_name="__main__")
        except SystemExit as exit_:
            if isinstance(exit_.code, str):
                print(exit_.code, file=buffer)
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        except Exception:  # noqa: BLE001 -- a crash, as the interpreter would report it: traceback, exit 1
            traceback.print_exc(file=buffer)
            code = 1
    return code, buffer.getvalue()


def run_command(command: str, ws: Path) -> Result:
    ran = cpu_variant(command, ws)
    argv = shlex.split(ran)
    start = time.perf_counter()
    if argv[0] == "python":
        code, output = run_in_process(argv[1:])
    elif argv[0] == "torchrun":
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", *argv[1:]], cwd=ws, env=env,
                              capture_output=True, text=True, timeout=300)
        code, output = proc.returncode, proc.stdout + proc.stderr
    else:
        code, output = 127, f"tests/test_readme.py does not know how to run {argv[0]!r} on a CPU: mark the block " \
                            "`bash cluster` or `bash setup`, or teach run_command"
    return Result(code, output, time.perf_counter() - start, ran)


def make_vit_stand_in(root: Path) -> Path:
    """vit_quickstart's layout (20 channels, 6-hourly, 33x64: its img_size is fixed), a few samples."""
    from datasets.make_synthetic_era5 import make_synthetic_era5

    make_synthetic_era5(root, samples_per_year=12, height=33, width=64, seed=0, train_years=(2008, 2010),
                        valid_years=(2015,), channels="nersc20", hours_per_step=6, stats=True, progress=False)
    return root


@pytest.fixture(scope="module")
def executed(tiny_data, volume_data, tmp_path_factory) -> dict[str, Result]:
    """Every runnable command of every page, in order, in one scratch copy of the repository: its own
    runs/ and a datasets/ whose quickstart stand-ins are the tests' tiny ones. A command shown twice
    (a `bash` line and its `$` output block) runs once."""
    ws = tmp_path_factory.mktemp("readme") / "repo"
    ws.mkdir()
    for entry in REPO.iterdir():
        if entry.name not in ("runs", "datasets", ".git"):
            (ws / entry.name).symlink_to(entry)
    (ws / "datasets").mkdir()
    for entry in (REPO / "datasets").iterdir():
        if not entry.name.startswith("synthetic") and entry.name != "era5":
            (ws / "datasets" / entry.name).symlink_to(entry)
    (ws / "datasets" / "synthetic_small").symlink_to(tiny_data)
    make_vit_stand_in(ws / "datasets" / "synthetic_vit")
    (ws / "datasets" / "synthetic_volume").symlink_to(volume_data)
    results: dict[str, Result] = {}
    cwd = os.getcwd()
    os.chdir(ws)
    try:
        for command in COMMANDS:
            if command.kind == RUN and command.text not in results:
                results[command.text] = run_command(command.text, ws)
    finally:
        os.chdir(cwd)
    total = sum(r.seconds for r in results.values())
    slowest = ", ".join(f"{r.seconds:.0f} s {cmd[:60]}" for cmd, r in sorted(results.items(), key=lambda kv: -kv[1].seconds)[:4])
    print(f"\nREADME commands: {len(results)} run in {total:.0f} s; slowest: {slowest}", file=sys.__stderr__)
    return results


RUNNABLE = [c for c in COMMANDS if c.kind == RUN]
EXACT = {f"{b.page.relative_to(REPO).as_posix()}:{b.line}": b for page in PAGES for b in page_outputs.exact_blocks(page)}


@pytest.mark.parametrize("command", RUNNABLE, ids=[c.id for c in RUNNABLE])
def test_laptop_command_runs(command, executed):
    result = executed[command.text]
    assert result.returncode == command.expected_exit, (f"{command.id}: `{result.ran}` exited {result.returncode}\n"
                                                        f"{result.output[-4000:]}")


SHOWN = [c for c in COMMANDS if c.has_output]


@pytest.mark.parametrize("command", SHOWN, ids=[c.id for c in SHOWN])
def test_shown_output_has_the_shape_of_the_real_one(command, executed):
    result = executed[command.text]
    assert result.returncode == command.expected_exit, (f"{command.id}: `{result.ran}` exited {result.returncode}\n"
                                                        f"{result.output[-3000:]}")
    if command.id in EXACT:
        diff = page_outputs.differences(EXACT[command.id], result.output)
        assert not diff, (f"{command.id}: the page's output differs from what `{result.ran}` prints now "
                          f"(`make docs-outputs` rewrites it):\n{diff}")
        return
    printed = {shape(line) for line in result.output.splitlines()}
    missing = [line for line in command.shown
               if shape(line) not in printed and not any(o in line for o in OPTIONAL_LINES)]
    assert not missing, (f"{command.id}: the page shows lines that `{result.ran}` no longer prints in this shape:\n"
                         + "\n".join(f"  {shape(m)!r}   from: {m.strip()[:100]}" for m in missing)
                         + "\nprinted shapes:\n" + "\n".join(f"  {s!r}" for s in sorted(printed)))


# ------------------------------------------------------------------------------------------------------
# Blocks: the conventions, bash -n, shellcheck, make -n.
BLOCKS = [(page, info, first, lines) for page in PAGES for info, first, lines in fenced_blocks(page)]
SCRIPT_BLOCKS = [b for b in BLOCKS if b[1] in (RUN, CLUSTER, SETUP)]


def test_every_block_follows_the_conventions():
    problems = []
    for page, info, first, lines in BLOCKS:
        where = f"{page.relative_to(REPO)}:{first - 1}"
        if info not in INFO_STRINGS:
            problems.append(f"{where}: info string {info!r} is none of {sorted(INFO_STRINGS)}")
        if info in (OUTPUT, OUTPUT_CLUSTER) and not (lines and lines[0].startswith("$ ")):
            problems.append(f"{where}: an output block starts with `$ command`")
    for command in COMMANDS:
        program = shlex.split(command.text)[0]
        if command.kind == RUN and program not in ("python", "torchrun"):
            problems.append(f"{command.id}: `{program}` is not run on a laptop here: mark it cluster or setup")
        if command.kind == RUN and TRAINS.search(command.text) and command.text not in CPU_RUN:
            problems.append(f"{command.id}: a training command needs its CPU-sized overrides in CPU_RUN: "
                            f"{command.text!r}")
    problems += [f"{key}: an exact output block's command runs as written, not shrunk by CPU_RUN"
                 for key, block in EXACT.items() if canonical(block.command) in CPU_RUN]
    stale = set(CPU_RUN) - {c.text for c in COMMANDS if c.kind == RUN}
    problems += [f"CPU_RUN entry no page has any more: {key!r}" for key in sorted(stale)]
    assert not problems, "\n".join(problems)


def block_script(lines: list[str]) -> str:
    return "#!/bin/bash\n" + "\n".join(lines) + "\n"


@pytest.mark.parametrize("page, info, first, lines", SCRIPT_BLOCKS,
                         ids=[f"{p.relative_to(REPO)}:{f - 1}" for p, _, f, _ in SCRIPT_BLOCKS])
def test_block_is_valid_bash(page, info, first, lines, tmp_path):
    script = tmp_path / "block.sh"
    script.write_text(block_script(lines))
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"{page.name}:{first - 1}: bash -n\n{proc.stderr}"
    shellcheck = subprocess.run(["which", "shellcheck"], capture_output=True, text=True, timeout=60).stdout.strip()
    if shellcheck:
        # Warnings and errors (not style notes such as "cannot follow a sourced file"); SC2034: variables
        # exported for the commands after the block are "unused" in the block itself.
        proc = subprocess.run([shellcheck, "-s", "bash", "-S", "warning", "-e", "SC2034", str(script)],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"{page.name}:{first - 1}: shellcheck\n{proc.stdout}"


SETUP_COMMANDS = [c for c in COMMANDS if c.kind == SETUP]


@pytest.mark.parametrize("command", SETUP_COMMANDS, ids=[c.id for c in SETUP_COMMANDS])
def test_setup_command_is_known(command):
    words = shlex.split(command.text)
    if words[0] == "make":
        proc = subprocess.run(["make", "-n", *words[1:]], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"{command.id}: make -n {' '.join(words[1:])}\n{proc.stderr}"
    elif words[0] == "source":
        assert words[1] == ".venv/bin/activate", f"{command.id}: source what?"
    else:
        pytest.fail(f"{command.id}: setup lines are make targets or `source .venv/bin/activate`, not {words[0]!r}")


# ------------------------------------------------------------------------------------------------------
# Cluster lines: parse the arguments of the project script they start, count the ranks they start.
@dataclass
class Launch:
    script: str  # train.py, comm_check.py, -m utils.checkpoint.sharded, ...
    args: list[str]
    ranks: int


def _option(words: list[str], *names: str, default: str | None = None) -> str | None:
    for k, word in enumerate(words):
        for name in names:
            if word == name and k + 1 < len(words):
                return words[k + 1]
            if word.startswith(name + "="):
                return word.split("=", 1)[1]
    return default


def _sbatch_default(script: str, option: str) -> str | None:
    match = re.search(rf"^#SBATCH --{option}=(\S+)", (REPO / script).read_text(), re.M)
    return match.group(1) if match else None


def _script_default(script: str, variable: str) -> str | None:
    match = re.search(rf"^{variable}=\$\{{{variable}:?-([^}}]*)\}}", (REPO / script).read_text(), re.M)
    return match.group(1) if match else None


def launch_of(command: str) -> Launch | None:
    """The project script a command line starts, its arguments and the number of ranks, or None for lines
    that start none (export, sudo bash tests/install_slurm.sh, ...)."""
    words = shlex.split(command)
    env = {}
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    if words and words[0] == "sudo":
        words = words[1:]
    if not words:
        return None
    program = Path(words[0]).name
    if program == "sbatch":
        k = next(i for i, w in enumerate(words) if w.endswith(".sh"))
        options, job, rest = words[1:k], words[k], words[k + 1:]
        if job == "submit_singlegpu.sh":
            return Launch(rest[0], rest[1:], 1)
        nodes = int(_option(options, "--nodes", "-N", default=_sbatch_default(job, "nodes")))
        gpus = int(_option(options, "--gpus-per-node", default=_sbatch_default(job, "gpus-per-node")))
        per_node = env.get("NPROC_PER_NODE") or (gpus if gpus else int(env.get(
            "CPU_NPROC_PER_NODE", _script_default(job, "CPU_NPROC_PER_NODE"))))
        return Launch(rest[0], rest[1:], nodes * int(per_node))
    if program == "torchrun":
        k = next(i for i, w in enumerate(words) if w.endswith(".py"))
        per_node = int(_option(words[1:k], "--nproc-per-node", "--nproc_per_node", default="1"))
        nodes = int(_option(words[1:k], "--nnodes", default="1"))
        return Launch(words[k], words[k + 1:], per_node * nodes)
    if program == "nsys":
        k = next(i for i, w in enumerate(words) if Path(w).name == "python")
        return launch_of(shlex.join(words[k:]))
    if program in ("python", "python3"):
        if words[1] == "-m":
            return Launch(f"-m {words[2]}", words[3:], 1)
        return Launch(words[1], words[2:], 1)
    return None


class _Parsed(Exception):
    """Raised by the patched ArgumentParser.parse_known_args with what it parsed: the script stops there."""


def parsed_arguments(launch: Launch):
    """Run the script as __main__ up to its argument parsing, and return the namespace it parsed."""
    real = argparse.ArgumentParser.parse_known_args

    def parse_and_stop(self, args=None, namespace=None):
        # parse_args calls parse_known_args: patching the latter catches scripts that use either. What is left
        # over is an error, as parse_args would say, but for one argument of a model (utils.config reads it).
        parsed, rest = real(self, args, namespace)
        if rest and not rest[0].startswith("--model_args."):
            self.error(f"unrecognized arguments: {' '.join(rest)}")
        raise _Parsed(parsed)

    argv0 = launch.script.removeprefix("-m ")
    with mock.patch.object(argparse.ArgumentParser, "parse_known_args", parse_and_stop), \
            mock.patch.object(sys, "argv", [argv0, *launch.args]), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: "found in sys.modules" for -m utils.*
        try:
            if launch.script.startswith("-m "):
                runpy.run_module(argv0, run_name="__main__", alter_sys=True)
            else:  # as `python SCRIPT` would: the script's folder first on sys.path
                script = REPO / launch.script
                with mock.patch.object(sys, "path", [str(script.parent), *sys.path]):
                    runpy.run_path(str(script), run_name="__main__")
        except _Parsed as parsed:
            return parsed.args[0]
    raise AssertionError(f"{launch.script} ran to its end without parsing arguments")


CONFIG_SCRIPTS = ("train.py", "train_ddp.py", "train_fsdp.py", "train_mp.py", "train_pp.py", "train_with_profiling.py")


def parse_project_arguments(launch: Launch):
    """The script's own argument parser, without running the script: the config for training scripts and
    estimate_memory.py (so unknown keys and bad values fail), the parsed arguments for the others."""
    from utils.config import parse_config

    if launch.script in CONFIG_SCRIPTS:
        return parse_config("", launch.args)
    if launch.script == "estimate_memory.py":
        import estimate_memory

        return parse_config("", launch.args, extra_args=estimate_memory.add_arguments)[0]
    if launch.script == "-m tests.slurm_cluster":  # brings up daemons: only check that it exists
        import importlib.util

        assert importlib.util.find_spec("tests.slurm_cluster") is not None
        return None
    args = parsed_arguments(launch)
    if launch.script == "benchmarks/bench_ddp_overhead.py":  # its arguments after -- are train_ddp.py's
        cfg = parse_config("", [a for a in args.train_args if a != "--"])
        launch.ranks = args.nproc
        return cfg
    if launch.script == "benchmarks/ladder.py":  # its config and the arguments after -- make every rung's run
        return parse_config("", ["--config", args.config, *(a for a in args.train_args if a != "--")])
    return args


CLUSTER_COMMANDS = [c for c in COMMANDS if c.kind == CLUSTER]


@pytest.mark.parametrize("command", CLUSTER_COMMANDS, ids=[c.id for c in CLUSTER_COMMANDS])
def test_cluster_command_parses(command):
    launch = launch_of(command.text)
    if launch is None:
        return
    if launch.script.endswith(".py"):
        assert (REPO / launch.script).is_file(), f"{command.id}: no {launch.script} in the repository"
    try:
        cfg = parse_project_arguments(launch)
    except SystemExit as exit_:
        pytest.fail(f"{command.id}: {launch.script} rejects {launch.args} (exit {exit_.code})")
    if hasattr(cfg, "train"):
        # The tp x cp x pp ranks of a model replica share its batch.
        batch, split = cfg.train.batch_size, cfg.dist.tp * cfg.dist.cp * cfg.dist.pp
        assert launch.ranks % split == 0, (f"{command.id}: tp x cp x pp = {split} does not divide the "
                                           f"{launch.ranks} ranks this command starts")
        assert batch % (launch.ranks // split) == 0, (f"{command.id}: batch_size {batch} is not divisible by the "
                                                      f"{launch.ranks // split} data-parallel ranks this command starts")
        assert cfg.dist.pp == 1 or (batch // (launch.ranks // split)) % cfg.dist.pp_microbatches == 0, (
            f"{command.id}: pp_microbatches {cfg.dist.pp_microbatches} does not divide each pipeline's batch")
        assert launch.ranks % cfg.dist.hsdp_replicas == 0, (
            f"{command.id}: hsdp_replicas {cfg.dist.hsdp_replicas} does not divide {launch.ranks} ranks")


def test_local_cluster_counts_ranks_as_the_job_script_does():
    # The local test cluster: 2 emulated nodes without GPUs, CPU_NPROC_PER_NODE processes each.
    launch = launch_of("PYTHON_ENV=$PWD/.venv sbatch --wait --gpus-per-node=0 submit_multinode.sh train_ddp.py "
                       "--config quickstart")
    assert launch.ranks == 4 and launch.script == "train_ddp.py"
    assert launch_of("sbatch --nodes 2 submit_multinode.sh train_ddp.py --config baseline").ranks == 8
    assert launch_of("torchrun --standalone --nproc-per-node 2 train_ddp.py").ranks == 2


# ------------------------------------------------------------------------------------------------------
# What a newcomer runs into: run folders, the stand-in recipe, the environment, activation, the pages.
def _run_dir(launch: Launch) -> tuple[str, bool]:
    cfg = parse_project_arguments(launch)
    return cfg.train.run_dir, cfg.train.resume


def test_every_training_command_has_its_own_run_dir():
    """A fresh run into a folder that holds another run stops (unless --resume): so every training command
    of the pages writes its own run_dir, and a --resume line comes after the line that wrote that run."""
    written: dict[str, tuple[str, tuple]] = {}
    problems = []
    for command in COMMANDS:
        launch = launch_of(command.text)
        if launch is None or not launch.script.startswith("train") or command.expected_exit:
            continue  # a command the page shows refused writes nothing (the run_dir is made after the model)
        run_dir, resume = _run_dir(launch)
        run = (launch.script, tuple(launch.args))  # the same run, whatever each site's sbatch options
        if resume:
            if run_dir not in written:
                problems.append(f"{command.id}: resumes {run_dir}, which no earlier command writes")
        elif run_dir in written and written[run_dir] != run:
            problems.append(f"{command.id}: writes {run_dir}, as {' '.join(written[run_dir][:1] + written[run_dir][1])!r} "
                            "does already")
        else:
            written[run_dir] = run
    assert not problems, "\n".join(problems)


def _generator_args(command: str) -> dict:
    """make_synthetic_era5.py's parsed arguments for a command line (all but --out), generating nothing."""
    words = shlex.split(command)
    k = next(i for i, w in enumerate(words) if w.endswith("make_synthetic_era5.py"))
    args = vars(parsed_arguments(Launch("datasets/make_synthetic_era5.py", words[k + 1:], 1)))
    args.pop("out")
    return args


def test_one_stand_in_recipe():
    """The Makefile's `data`, datasets/README.md's laptop recipe and the missing-data hint agree."""
    from utils.config import build_config
    from utils.data.era5 import stand_in_command

    makefile = (REPO / "Makefile").read_text()
    recipe = re.search(r"^\$\(QUICKSTART_DATA\)/valid:.*\n((?:\t.*\n)+)", makefile, re.M).group(1)
    make_line = " ".join(part.strip().rstrip("\\") for part in recipe.splitlines())
    make_line = make_line.replace("$(PY)", "python").replace("$(QUICKSTART_DATA)", "datasets/synthetic_small")
    documented = [line for info, first, lines in fenced_blocks(REPO / "datasets" / "README.md") if info == "bash"
                  for _, line in logical_lines(lines, first) if "--out datasets/synthetic_small " in line]
    assert len(documented) == 1, f"datasets/README.md: one laptop recipe for datasets/synthetic_small, not {documented}"
    reference = _generator_args(make_line)
    assert _generator_args(documented[0]) == reference, "datasets/README.md's laptop recipe differs from `make data`"
    hint = stand_in_command(build_config("quickstart"))
    assert _generator_args(hint) == reference, f"the missing-data hint {hint!r} differs from `make data`"
    # A config whose validation split is valid_1 (baseline): the same files, valid_1/ instead of valid/.
    valid_1 = {**reference, "valid_years": [], "split": [("valid_1", [2015])]}
    assert _generator_args(stand_in_command(build_config("baseline"))) == valid_1
    documented_valid_1 = [line for info, first, lines in fenced_blocks(REPO / "datasets" / "README.md")
                          if info == "bash" for _, line in logical_lines(lines, first) if "--out datasets/era5 " in line]
    assert [_generator_args(line) for line in documented_valid_1] == [valid_1]


def test_cluster_environment_name_is_one():
    """The README's PYTHON_ENV default, the job script's and conda-env.yml's environment name agree."""
    script = _script_default("submit_multinode.sh", "PYTHON_ENV")
    if script is None:  # PYTHON_ENV=${PYTHON_ENV-name}: set but empty means "the python on PATH"
        script = re.search(r"^PYTHON_ENV=\$\{PYTHON_ENV-([^}]*)\}", (REPO / "submit_multinode.sh").read_text(),
                           re.M).group(1)
    conda = re.search(r"^name:\s*(\S+)", (REPO / "conda-env.yml").read_text(), re.M).group(1)
    readme = "\n".join(page.read_text() for page in PAGES)
    row = re.search(r"^\| `PYTHON_ENV` \| `([^`]*)` \|", readme, re.M)
    assert row, "no `PYTHON_ENV` row in the pages' table of job-script settings"
    assert script == conda == row.group(1), (script, conda, row.group(1))
    assert "docs/setup.md" in (REPO / "README.md").read_text(), "the README links the cluster set-up page"


def test_activation_comes_before_the_first_bare_command():
    """After the quickstart every command is a bare python/torchrun: each page says to activate .venv first."""
    for page in PAGES:
        text = page.read_text()
        bare = [c for c in COMMANDS if c.page == page.relative_to(REPO).as_posix()
                and shlex.split(c.text)[0] in ("python", "torchrun")]
        if not bare:
            continue
        first_bare = min(c.line for c in bare)
        found = [i for i in (text.find("source .venv/bin/activate"), text.find("conda activate")) if i >= 0]
        activate = min(found, default=-1)  # the laptop's .venv, or a cluster's conda environment
        assert activate >= 0 and text[:activate].count("\n") + 1 < first_bare, (
            f"{page.name}: `source .venv/bin/activate` (or `conda activate`) must come before line {first_bare}")


def github_anchor(heading: str) -> str:
    """GitHub's anchor of a heading: its text (links and code marks dropped), lower case, punctuation other
    than - and _ removed, spaces as -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower()).replace("`", "").replace("*", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def headings(path: Path) -> list[str]:
    """The Markdown headings of a file, outside fenced blocks (where `# ...` is a shell comment)."""
    found, inside = [], False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            inside = not inside
        elif not inside and re.match(r"#{1,4} ", line):
            found.append(line.lstrip("#").strip())
    return found


def test_pages_are_short_with_unique_headings_and_working_links():
    problems = []
    readme_lines = (REPO / "README.md").read_text().count("\n")
    if readme_lines > 200:
        problems.append(f"README.md has {readme_lines} lines: 200 at most, for users; steps belong on their part's page, maintainer material in docs/development.md")
    anchors = {}
    for page in PAGES:
        titles = headings(page)
        slugs = [github_anchor(h) for h in titles]
        duplicates = sorted({h for h, s in zip(titles, slugs) if slugs.count(s) > 1})
        problems += [f"{page.name}: heading {d!r} appears twice" for d in duplicates]
        anchors[page.resolve()] = set(slugs)
        steps = [h for h in titles if re.match(r"Step \d", h)]
        text = page.read_text()
        for step, following in zip(steps, steps[1:] + [None]):
            body = text.split(f"# {step}\n", 1)[1]
            body = body.split(f"# {following}\n", 1)[0] if following else body
            if "What you learned" not in body:
                problems.append(f"{page.name}: {step!r} has no 'What you learned' lines")
    for page in [*PAGES, REPO / "benchmarks" / "README.md", REPO / "datasets" / "README.md"]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page.resolve()
            if not resolved.exists():
                problems.append(f"{page.name}: link to {target}: no such file")
            elif anchor and resolved.suffix == ".md":
                if resolved not in anchors:
                    anchors[resolved] = {github_anchor(h) for h in headings(resolved)}
                if anchor not in anchors[resolved]:
                    problems.append(f"{page.name}: link to {target}: no heading with that anchor")
    assert not problems, "\n".join(problems)


def _part1_path() -> dict[str, str]:
    """Part I's table of steps: anchor -> "minimum" or "depth"."""
    text = (REPO / "docs" / "part1-swinir.md").read_text()
    return dict(re.findall(r"^\| \[[^\]]+\]\(#([^)]+)\) \| (minimum|depth) \|", text, re.M))


def test_a_newcomer_reaches_a_two_node_job_in_one_short_route():
    """The reader's path: the README's first screen points at the cluster quickstart, which fits one screen per
    site; every page opens with what it needs, runs and takes; Part I marks its minimum path; and the core path
    (README + cluster quickstart + Part I's introduction and minimum steps) stays under 12,000 words."""
    readme = (REPO / "README.md").read_text()
    quickstart = (REPO / "docs" / "quickstart-cluster.md").read_text()
    assert "docs/quickstart-cluster.md" in "\n".join(readme.splitlines()[:30]), "README's first screen: the quickstart"
    assert quickstart.count("\n") <= 150, "docs/quickstart-cluster.md: one screen per site, 150 lines at most"
    assert "sbatch --nodes 2 " in quickstart and "Kestrel" in quickstart and "Perlmutter" in quickstart
    for name in ("part1-swinir", "part2-vit", "part3-unet3d", "part4-your-model", "part5-ensembles",
                 "beyond-data-parallel", "performance", "quickstart-cluster"):
        opening = "\n".join((REPO / "docs" / f"{name}.md").read_text().splitlines()[:25])
        for cue in ("**You need**", "**You will run**", "**It takes**"):
            assert cue in opening, f"docs/{name}.md: its first 25 lines say {cue}"
    path = _part1_path()
    minimum = [anchor for anchor, kind in path.items() if kind == "minimum"]
    assert minimum == ["step-0a-the-baseline", "step-3a-ddp-on-one-node", "step-4-jobs-on-a-slurm-cluster",
                       "step-5-ddp-on-several-nodes"], minimum
    part1 = (REPO / "docs" / "part1-swinir.md").read_text()
    sections = {github_anchor(s.split("\n", 1)[0]): s for s in re.split(r"(?m)^## ", part1)[1:]}
    core = readme + quickstart + part1.split("\n## ", 1)[0] + "".join(sections[a] for a in minimum)
    words = len(core.split())
    assert words <= 12_000, f"the core path is {words} words: move depth out of it"
