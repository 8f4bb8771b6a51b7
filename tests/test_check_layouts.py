"""check_layouts.py: every layout of a model against one process, in one command.

- Its runs: the ViT's tensor, context and pipeline layouts, and each cp layout without its gradient reduction,
  which must FAIL naming the gradients (tests/test_mp.py); SwinIR's tensor and pipeline layouts
  (tests/test_pp.py); SwinIR's bands, without the halo or the cp reduction too, through the same harness
  (tests/dp_layouts.py via tests/test_domain_parallel.py); the command as typed, with its launcher, DDP, FSDP and
  HSDP included (docs/beyond-data-parallel.md via tests/test_readme.py).
- Here, in this process: the rows a model's plan gives (a model without plans lists each technique as not in its
  plan), the batches each task feeds, and bad input in one line.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

import psutil
import pytest

import check_layouts
from tests.conftest import REPO, exit_in_one_process
from utils.config import build_config
from utils.parallel.plans import ModelPlan


def labels(rows) -> list[tuple[str, str]]:
    return [(row.label, row.why) for row in rows]


def test_a_model_without_plans_gets_data_parallel_layouts_only():
    cfg = build_config("unet3d_quickstart", {"batch_size": 4})
    assert labels(check_layouts.layouts(ModelPlan(), 4, cfg, left_out="cp_reduction")) == [
        ("dp4 DDP", ""), ("dp4 FSDP", ""), ("dp4 HSDP(2 replicas)", ""),
        ("dp2 x tp2", "not in the model's plan (no tensor-parallel plan)"),
        ("dp2 x cp2", "not in the model's plan (nothing for cp to split)"),
        ("tp2 x cp2", "not in the model's plan (no tensor-parallel plan; nothing for cp to split)"),
        ("pp2 (gpipe, 1f1b, interleaved_1f1b, zbv)", "not in the model's plan (no pipeline cuts)")]


def test_a_full_plan_gets_every_layout_and_the_config_sizes_them():
    cfg = build_config("vit_quickstart", {"batch_size": 8, "tp": 4})
    plan = ModelPlan(tp=object(), cp=object(), stages=object())
    rows = check_layouts.layouts(plan, 8, cfg, left_out="cp_reduction")
    assert [row.label for row in rows] == [
        "dp8 DDP", "dp8 FSDP", "dp8 HSDP(2 replicas)", "dp2 x tp4", "dp4 x cp2", "dp4 x cp2 without cp_reduction",
        "tp4 x cp2", "tp4 x cp2 without cp_reduction", "dp4 x pp2 gpipe m2", "dp4 x pp2 1f1b m2",
        "dp4 x pp2 interleaved_1f1b m2", "dp4 x pp2 zbv m2"]
    only = {row.label for row in rows if row.uses <= check_layouts.techniques("tp,pp")}
    assert only == {"dp2 x tp4", "dp4 x pp2 gpipe m2", "dp4 x pp2 1f1b m2", "dp4 x pp2 interleaved_1f1b m2",
                    "dp4 x pp2 zbv m2"}
    with pytest.raises(argparse.ArgumentTypeError, match="give some of ddp,fsdp,hsdp,tp,cp,ens,pp"):
        check_layouts.techniques("tp,zero3")


@pytest.mark.parametrize("name, shapes", [
    ("quickstart", [(4, 3, 32, 32), (4, 3, 64, 64)]),  # sr: low-res img_size in, x upscale out
    ("vit_quickstart", [(4, 20, 32, 64), (4, 20, 32, 64)]),  # forecast: the same grid
    ("unet3d_quickstart", [(4, 4, 32, 32, 32), (4, 5, 32, 32, 32)]),  # volume: crop_size cubes, out_chans out
])
def test_batches_have_the_shapes_of_the_task(name, shapes):
    args = argparse.Namespace(batch=0, steps=2)
    cfg = check_layouts.checked(build_config(name), args, 4)
    batches = check_layouts.random_batches(cfg, args.steps)
    assert len(batches) == 2 and [tuple(t.shape) for t in batches[0]] == shapes
    # Placeholder statistics where a field task's data would give them; task volume's stored fields have none.
    assert bool(cfg.model.mean) == (cfg.data.task != "volume")
    assert cfg.model.model_args.get("drop_path_rate", 0) == 0 and cfg.dist.warmup_steps == 0
    assert ("drop_path_rate" in cfg.model.model_args) == (name != "unet3d_quickstart")  # the U-Net has none


@pytest.mark.parametrize("extra, message", [
    (("--amp_dtype", "bf16"), "error: check_layouts.py compares in fp32, where rounding is 1e-7 and a missing "
                              "reduction stands out; bf16's 4e-3 would hide it: drop --amp_dtype bf16"),
    (("--nproc", "3"), "error: 3 processes: give an even number, 2 or more (--nproc 4 runs every layout)"),
    (("--batch", "6"), "error: --steps 3, --batch 6: give 1 or more steps, and a batch that the 4 processes divide"),
    (("--only", "tp,zero3"), "check_layouts.py: error: argument --only: 'tp,zero3': give some of ddp,fsdp,hsdp,tp,"
                             "cp,ens,pp, joined by commas"),
])
def test_bad_input_is_one_line(capsys, extra, message):
    code, err = exit_in_one_process(capsys, "check_layouts.py", "--config", "vit_quickstart", *extra)
    assert code == 2 and len(err) == 1 and err[0].startswith(message), err


@pytest.mark.parametrize("frozen", [{"1"}, {"0", "1"}])
def test_a_frozen_rank_ends_the_check_within_twice_the_timeout(frozen):
    # SIGSTOP once the table has begun: rank 1 alone (rank 0's collective times out and names it), or every rank
    # (none can end itself: the launcher's own deadline, from the ranks' step beats). It waited forever before.
    timeout_s = 12  # the ranks' start on a loaded 2-core VM is not counted; the check's end, its exit included, is
    proc = subprocess.Popen([sys.executable, "check_layouts.py", "--config", "unet3d_quickstart", "--crop_size", "16",
                             "--model_args.widths", "[4, 8]", "--nproc", "2", "--only", "ddp", "--steps", "3",
                             "--dist_timeout_s", str(timeout_s)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert proc.stdout.readline().startswith("UNet3D (")  # the ranks have started and built the model
        for rank in psutil.Process(proc.pid).children():
            if rank.environ().get("RANK") in frozen:
                rank.suspend()
        frozen_at = time.monotonic()
        out, err = proc.communicate(timeout=4 * timeout_s)
        took = time.monotonic() - frozen_at
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert proc.returncode != 0 and took < 2 * timeout_s, (took, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and re.search(r"rank 1 did not arrive" if frozen == {"1"} else r"ranks 0, 1 hung",
                                         lines[0]), err
