"""The first day on a cluster: docs/quickstart-cluster.md's lines, followed in order for one site, against the
local SLURM cluster (tests/slurm_cluster.py), with a stand-in `nvidia-smi` (driver 550, 580, none, 520), a stand-in
`wget` that hands over a stand-in SuperBench tar (tiny synthetic ERA5 under superbench_v1/era5, beside a decoy data
set), and tiny config overrides appended to the training commands.

What is not run, and why (each such line is named in NOT_RUN, so a new line on the page is noticed):
conda and module lines (network, site software), the install test (its own module), the account and QOS exports
(the local cluster has none). Translated: `torch_build.py --install` gets `--dry-run` (pip would need the
network); `--mem` and `-q shared` are dropped (the emulated nodes have little memory and no QOS); jobs ask for
no GPU; PYTHON_ENV is this test's environment, MODULES empty, SCRATCH a temporary folder.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.conftest import REPO, TINY_MODEL
from tests.slurm_cluster import slurm_cluster  # noqa: F401  (a fixture)
from tests.test_install import BUILD_LINES, CU126, nvidia_smi
from tests.test_slurm import CPU_NODES, job_env

PAGE = REPO / "docs" / "quickstart-cluster.md"
NOT_RUN = (r"module load ", r"conda ", r"python -m pytest -q tests/test_install\.py$",
           r"export SCRATCH=/scratch/\$USER$")
# Train scripts: the page's command, then these (argparse keeps the last value): seconds instead of hours.
TINY_TRAIN = ["--crop_size", "32", "--n_patches", "2", "--batch_size", "4", "--num_workers", "0",
              "--val_samples", "4", "--log_every", "2", "--max_steps", "4", "--progress", "never", *TINY_MODEL]
TINY_CHECK = ["--crop_size", "32", "--n_patches", "2", "--num_workers", "0", "--val_samples", "4"]


def site_lines(site: str) -> list[str]:
    """The page's `bash cluster` lines for ``site``, in order: those under `# <site>...` or `# both`, and those
    before any such comment in a block."""
    lines = []
    for block in re.findall(r"```bash cluster\n(.*?)```", PAGE.read_text(), re.S):
        current = "both"
        for line in block.splitlines():
            marker = re.match(r"# (Perlmutter|Kestrel|both)\b", line)
            if marker:
                current = marker.group(1)
            elif line.strip() and current in ("both", site):
                lines.append(line.split("   # ", 1)[0].rstrip())
    return lines


def shown_block(after: str) -> list[str]:
    """The lines of the first plain fenced block after the text ``after`` on the page."""
    text = PAGE.read_text()
    return re.search(r"\n```\n(.*?)\n```", text[text.index(after):], re.S).group(1).splitlines()


def as_pattern(shown: str) -> re.Pattern:
    """A shown output line as a pattern: placeholders (<id>, <r>) match anything, numbers any number."""
    pattern = re.sub(r"(?:\\? )+", " +", re.escape(shown))  # column padding: any width
    return re.compile(re.sub(r"\d+", r"\\d+", re.sub(r"<[^>]+>", ".+?", pattern)))


@pytest.fixture(scope="module")
def standin_tar(tiny_data, tmp_path_factory) -> Path:
    """SuperBench's tar in miniature: its ERA5 under superbench_v1/era5 (train, valid_1), and a decoy data set
    with a train/ folder of its own, which the page's `find` must not pick."""
    path = tmp_path_factory.mktemp("portal") / "superbench_v1.tar"
    with tarfile.open(path, "w") as tar:
        tar.add(tiny_data / "train", "superbench_v1/era5/train")
        tar.add(tiny_data / "valid", "superbench_v1/era5/valid_1")
        tar.add(tiny_data / "train", "superbench_v1/nskt16000_1024/train")
    return path


def standin_bin(folder: Path, driver: str | None, tar: Path) -> str:
    """`wget -c -P DIR URL` copies the stand-in tar to DIR; `nvidia-smi` prints ``driver`` (None: there is none)."""
    if driver is not None:
        nvidia_smi(folder, driver + "\n")
    folder.mkdir(parents=True, exist_ok=True)
    wget = folder / "wget"
    wget.write_text('#!/bin/sh\nwhile [ $# -gt 1 ]; do [ "$1" = -P ] && dir=$2; shift; done\n'
                    f'cp {shlex.quote(str(tar))} "$dir/$(basename "$1")"\n')
    wget.chmod(0o755)
    return str(folder)


def follow_the_page(site: str, driver: str | None, tar: Path, tmp: Path) -> tuple[subprocess.CompletedProcess,
                                                                                    list[str], dict]:
    """Runs the site's shell lines (environment, data, exports) as one bash script in a stand-in checkout; returns
    how it ended, the sbatch lines to submit, and the job settings the exports set."""
    checkout = tmp / "checkout"
    (checkout / "datasets").mkdir(parents=True)
    (checkout / "tools").symlink_to(REPO / "tools")
    (checkout / "datasets" / "check_data.py").symlink_to(REPO / "datasets" / "check_data.py")
    script, jobs, settings = ["set -euo pipefail"], [], {}
    for line in site_lines(site):
        if any(re.match(rule, line) for rule in NOT_RUN):
            continue
        if " sbatch " in f" {line} ":
            jobs.append(line)
        elif line.startswith("export SBATCH_"):  # the job settings; the local cluster has no accounts or QOS
            settings.update(word.split("=", 1) for word in shlex.split(line)[1:] if not word.startswith("SBATCH_"))
        elif line.startswith("python tools/torch_build.py --install"):
            script.append(f"{line} --dry-run")
        elif line.startswith("python datasets/check_data.py"):
            script.append(f"{line} {shlex.join(TINY_CHECK)}")
        elif re.match(r"(mkdir|wget|tar|ln|export) ", line):
            script.append(line)
        else:
            raise AssertionError(f"{PAGE.name}: no rule for the line {line!r}: run it here, or add it to NOT_RUN")
    smi = None if driver is None and not shutil.which("nvidia-smi") else (driver or "")
    path = f"{standin_bin(tmp / 'bin', smi, tar)}:{Path(sys.executable).parent}:/usr/bin:/bin"
    env = {**os.environ, "PATH": path, "SCRATCH": str(tmp / "scratch"), "USER": "me"}
    env.pop("HDF5_USE_FILE_LOCKING", None)
    proc = subprocess.run(["bash", "-c", "\n".join(script)], cwd=checkout, env=env, capture_output=True, text=True,
                          timeout=120)
    return proc, jobs, settings


def submit(cluster, line: str, settings: dict, data: Path, run_dir: Path):
    """One of the page's sbatch lines on the local cluster, translated as the module docstring says."""
    words = shlex.split(line)
    env = {**job_env(), **settings, "MODULES": "", "PYTHON_ENV": job_env()["PYTHON_ENV"]}
    while "=" in words[0]:  # NCCL_DEBUG=INFO sbatch ...
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    assert words[0] == "sbatch", line
    script_at = next(i for i, word in enumerate(words) if word.endswith(".sh"))
    options, script, args = words[1:script_at], words[script_at], words[script_at + 1:]
    for flag in ("--mem", "-q"):
        while flag in options:
            del options[options.index(flag): options.index(flag) + 2]
    options += CPU_NODES + (["--cpus-per-task=1"] if script == "submit_singlegpu.sh" else [])
    assert args[0].startswith("train"), line  # comm_check.py's own job: tests/test_slurm.py
    args += ["--data_dir", str(data), "--run_dir", str(run_dir), *TINY_TRAIN]
    return cluster.sbatch(script, *args, options=options, env=env, timeout=300), args


ONE_GPU = "submit_singlegpu.sh train.py"
TWO_NODES = "--nodes 2 --mem 300G submit_multinode.sh train_ddp.py"  # Kestrel's: the memory flag translated too


@pytest.mark.parametrize("site, driver, jobs_run", [
    ("Kestrel", "550.54.15", (ONE_GPU, TWO_NODES)),
    ("Perlmutter", "580.82.07", (ONE_GPU,)),
    ("Kestrel", None, (ONE_GPU,)),
], ids=["kestrel-550", "perlmutter-580", "no-gpu"])
def test_the_page_followed_in_order_gives_a_working_job(slurm_cluster, standin_tar, site, driver, jobs_run, tmp_path):
    proc, jobs, settings = follow_the_page(site, driver, standin_tar, tmp_path)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said
    # The torch build for this driver (the pip commands printed, not run).
    if driver == "550.54.15":
        assert BUILD_LINES[driver] in said and re.search(r"would run: \S+ -m pip uninstall -y torch torchvision", said)
        assert f"install torch==2.15.0+cu126 torchvision==0.29.2+cu126 --index-url {CU126}\n" in said, said
    elif driver == "580.82.07":
        assert BUILD_LINES[driver] in said and "cu126" not in said, said
    else:
        assert said.startswith("warning: torch build: PyPI's default wheel"), said
    # The data: the tar's ERA5 folder linked (not the decoy), h5py told not to lock, the check passed.
    link = tmp_path / "checkout" / "datasets" / "era5"
    assert link.resolve() == (tmp_path / "scratch" / "superbench" / "superbench_v1" / "era5").resolve(), said
    assert re.search(r"^ok: datasets/era5 holds what --config baseline reads", said, re.M), said
    assert settings["SITE"] == site.lower()
    # The jobs: the one-GPU job first; it prints what the page shows (the job script appends --resume auto).
    single = [line for line in jobs if "submit_singlegpu.sh" in line]
    assert len(single) == 1
    chosen = [line for line in jobs if any(part in line for part in jobs_run)]
    assert len(chosen) == len(jobs_run), jobs  # each chosen line is on the page
    for n, line in enumerate(chosen):
        run_dir = tmp_path / f"run{n}"
        job, args = submit(slurm_cluster, line, settings, link, run_dir)
        assert job.returncode == 0, job.report
        if "submit_singlegpu.sh" in line:
            page_args = shlex.split(line)[shlex.split(line).index("submit_singlegpu.sh") + 1:]
            head, tail = shown_block("begins so"), shown_block("at the end, exit status 0")
            assert head[1] == f"running: python {shlex.join(page_args)} --resume auto"  # the page's own command
            assert f"running: python {' '.join(args)} --resume auto\n" in job.output, job.report  # echo "$*"
            assert as_pattern(head[0].replace("site kestrel", f"site {site.lower()}")).search(job.output), job.report
            last = job.output.rstrip("\n").splitlines()[-2:]
            assert [bool(as_pattern(shown.replace("runs/baseline", str(run_dir))).fullmatch(got))
                    for shown, got in zip(tail, last)] == [True, True], (tail, last)
        else:
            nodes = int(shlex.split(line)[shlex.split(line).index("--nodes") + 1])
            assert f"world_size={2 * nodes} nodes={nodes} backend=gloo" in job.output, job.report
            # (torchrun's agents may warn after it, shutting down the rendezvous: Part I, Step 4)
            assert f"\ndone: 4 steps; outputs in {run_dir}\n" in job.output, job.report


def test_a_driver_below_525_stops_the_page_at_the_torch_build(standin_tar, tmp_path):
    proc, _, _ = follow_the_page("Kestrel", "520.61.05", standin_tar, tmp_path)
    assert proc.returncode == 1 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr == BUILD_LINES["470.256.02"].replace("470.256.02", "520.61.05") + "\n"
    assert not (tmp_path / "scratch").exists()  # nothing after it ran


def test_check_data_given_the_unpacked_tar_names_the_folders_holding_train(standin_tar, tmp_path):
    with tarfile.open(standin_tar) as tar:
        tar.extractall(tmp_path, filter="data")
    proc = subprocess.run([sys.executable, str(REPO / "datasets" / "check_data.py"), "--config", "baseline",
                           "--data_dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    era5, decoy = tmp_path / "superbench_v1" / "era5", tmp_path / "superbench_v1" / "nskt16000_1024"
    assert (proc.returncode, proc.stdout) == (2, ""), proc.stderr
    assert proc.stderr == (f"check_data.py: error: {tmp_path} has no train/ folder; these below it have one: {era5}, "
                           f"{decoy}: pass the one of your data as --data_dir, or link it where the config looks "
                           "(ln -sfn FOLDER datasets/era5)\n")
