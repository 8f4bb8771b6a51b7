"""train_fsdp.py and utils/parallel/fsdp.py on CPU (gloo): equals one process, bf16 policy, HSDP, DCP checkpoints.

Few launches (torchrun start-up dominates): the session's train.py reference and one 2-rank FSDP run shared by
several tests; resumes start from copies of the FSDP run's checkpoints. The rest runs in-process on
a one-rank process group.
"""

import re

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tests.conftest import REFERENCE_STEPS as STEPS
from tests.conftest import TINY_MODEL, read_metrics, resume_from, run_script, tiny_args, weights_at
from tests.plan_memory import assert_within
from tests.test_ddp import assert_same_weights, launch_beside_reference, train_losses
from utils.checkpoint.files import CheckpointError
from utils.config import ConfigError, build_config


def ckpt(run_dir, step: int):
    return run_dir / "checkpoints" / f"step_{step:08d}"


def exported(run_dir, step: int) -> dict:
    """The DCP checkpoint of ``step`` as a train.py payload, exported in this (single) process."""
    from utils.checkpoint.sharded import export_full_state_dict

    out = run_dir / "exported" / f"step_{step}.pt"
    if not out.exists():
        export_full_state_dict(ckpt(run_dir, step), out)
    return torch.load(out, map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def runs(tiny_data, reference_run, tmp_path_factory):
    """2-rank train_fsdp.py in fp32 beside train.py, across an epoch boundary."""
    return launch_beside_reference("train_fsdp.py", "fsdp", tiny_data, reference_run, tmp_path_factory)


def test_two_ranks_equal_one_process(runs, tiny_data):
    single, fsdp = runs["single"], runs["fsdp"]
    torch.testing.assert_close(train_losses(fsdp), train_losses(single), rtol=1e-4, atol=1e-5)
    for step in (3, 10):
        assert_same_weights(exported(fsdp, step)["model"], weights_at(single, step))
    val_single, val_fsdp = (next(r for r in read_metrics(run) if r["kind"] == "val") for run in (single, fsdp))
    torch.testing.assert_close(val_fsdp["rmse"], val_single["rmse"], rtol=1e-4, atol=1e-5)
    # Each rank holds half of parameters + gradients + AdamW state; DDP would hold all of it.
    memory = next(r for r in read_metrics(fsdp) if r["kind"] == "memory")
    assert memory["shards"] == 2 and memory["vs_ddp"] == pytest.approx(0.5, abs=0.01)
    assert memory["total_mb"] == pytest.approx(memory["params_mb"] * 4)
    # The estimate plan.py ranks layouts by: the same parameters + gradients + AdamW state per rank.
    assert_within(fsdp, tiny_args(tiny_data, fsdp, *STEPS), 2)
    assert_within(fsdp, tiny_args(tiny_data, fsdp, *STEPS), 2, traced=True)  # the trace, for any model


def test_export_loads_into_the_plain_model_and_train_py_state(runs, tiny_data):
    from models import build_model
    from utils.checkpoint.contents import restore_payload
    from utils.precision import make_grad_scaler
    from utils.training import build_optimizer

    payload = exported(runs["fsdp"], 10)
    reference = torch.load(runs["single"] / "checkpoints" / "step_00000010.pt", weights_only=True)
    assert list(payload) == list(reference)
    cfg = build_config("quickstart", _tiny_overrides(tiny_data))
    model = build_model(cfg.model)
    model.load_state_dict(payload["model"])  # strict
    optimizer, scheduler = build_optimizer(model, cfg, steps_per_epoch=8, device=torch.device("cpu"))
    state = restore_payload(payload, model, optimizer, scheduler, make_grad_scaler(torch.device("cpu"), "none"))
    assert (state.step, state.epoch, state.batch_in_epoch) == (10, 1, 2)
    assert optimizer.state_dict()["param_groups"] == reference["optimizer"]["param_groups"]
    restored = optimizer.state_dict()["state"]
    for index, moments in reference["optimizer"]["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(restored[index][name], moments[name], rtol=1e-4, atol=1e-6)


def test_resume_on_two_ranks_is_exact(runs, tiny_data, tmp_path):
    fsdp = runs["fsdp"]
    resumed = resume_from(fsdp, 3, tmp_path / "resumed")
    proc = run_script("train_fsdp.py", *tiny_args(tiny_data, resumed, "--max_steps", "6", "--log_every", "1",
                                                  "--resume"), ranks=2)
    assert "resumed from" in proc.stdout and "step_00000003" in proc.stdout
    a, b = exported(fsdp, 6), exported(resumed, 6)
    for key in a["model"]:
        torch.testing.assert_close(b["model"][key], a["model"][key], rtol=0, atol=0, msg=key)
    for index, moments in a["optimizer"]["state"].items():
        for name, value in moments.items():
            torch.testing.assert_close(b["optimizer"]["state"][index][name], value, rtol=0, atol=0)
    assert train_losses(resumed) == train_losses(fsdp)[3:6]


def test_hsdp_2x2_with_ac_and_compile_resumes_a_2_rank_checkpoint(runs, tiny_data, tmp_path):
    # 4 ranks as 2 replicas x 2 shards, from the 2-rank FSDP checkpoint (DCP reshards), in the order
    # apply_ac -> apply_compile -> apply_fsdp on the same blocks: still train.py's trajectory. The
    # aot_eager backend traces the same graphs (dynamo and AOT autograd around FSDP2's hooks) without
    # generating kernels, which would double this test's time.
    hsdp = resume_from(runs["fsdp"], 3, tmp_path / "hsdp")
    run_script("train_fsdp.py", *tiny_args(tiny_data, hsdp, "--max_steps", "6", "--log_every", "1",
                                           "--hsdp_replicas", "2", "--ac", "block", "--resume",
                                           "--compile", "true", "--compile_backend", "aot_eager"),
               ranks=4)
    assert_same_weights(exported(hsdp, 6)["model"], weights_at(runs["single"], 6))
    torch.testing.assert_close(train_losses(hsdp), train_losses(runs["single"])[3:6], rtol=1e-4, atol=1e-5)
    memory = next(r for r in read_metrics(hsdp) if r["kind"] == "memory")
    assert (memory["ranks"], memory["shards"]) == (4, 2) and memory["vs_ddp"] == pytest.approx(0.5, abs=0.01)


def test_bf16_policy_trains_and_tracks_fp32(runs, tiny_data, tmp_path):
    # bf16 parameters in forward/backward (fp32 reduce and master weights); also the other options:
    # RSTB units, AC per block inside them, parameters kept gathered between forward and backward.
    bf16 = tmp_path / "bf16"
    run_script("train_fsdp.py", *tiny_args(tiny_data, bf16, "--max_steps", "10", "--log_every", "1",
                                           "--param_dtype", "bf16", "--reduce_dtype", "fp32", "--fsdp_unit", "layer",
                                           "--ac", "block", "--reshard_after_forward", "false"), ranks=2)
    fp32_losses, bf16_losses = train_losses(runs["fsdp"]), train_losses(bf16)
    assert len(bf16_losses) == 10
    torch.testing.assert_close(bf16_losses, fp32_losses, rtol=0.03, atol=0)
    assert bf16_losses != fp32_losses, "bf16 losses equal fp32 bit for bit: the policy was not applied"


def test_hsdp_replicas_must_divide_the_ranks(tiny_data, tmp_path):
    proc = run_script("train_fsdp.py", *tiny_args(tiny_data, tmp_path / "run", "--hsdp_replicas", "2"),
                      check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "hsdp_replicas 2 must be >= 1 and divide the 1 ranks" in proc.stderr.strip().splitlines()[-1]


# ----------------------------------------------------------------------------- in-process, one rank


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _tiny_overrides(data_dir=None, **extra) -> dict:
    """The tests' tiny SwinIR as config overrides (build_config parses the command-line strings)."""
    overrides = {key[2:]: value for key, value in zip(TINY_MODEL[::2], TINY_MODEL[1::2])}
    if data_dir is not None:
        overrides["data_dir"] = str(data_dir)
    return {**overrides, **extra}


def _sharded_model(**overrides):
    from models import build_model
    from utils.parallel.fsdp import apply_fsdp

    cfg = build_config("quickstart", _tiny_overrides(**overrides))
    torch.manual_seed(0)
    return apply_fsdp(build_model(cfg.model), cfg, torch.device("cpu")), cfg


def test_mesh_shape():
    from utils.parallel.fsdp import mesh_shape

    assert mesh_shape(8, 1) == (8,) and mesh_shape(8, 2) == (2, 4)
    for replicas in (0, 3):
        with pytest.raises(ConfigError, match="divide the 8 ranks"):
            mesh_shape(8, replicas)


def test_bf16_policy_computes_in_bf16_but_normalises_in_fp32(one_rank):
    model, _ = _sharded_model(param_dtype="bf16")
    seen = {}

    def record_input_dtype(name):
        def hook(module, args):  # runs after FSDP's own pre-forward (registered later), returns None
            seen[name] = args[0].dtype
        return hook

    model.register_forward_pre_hook(record_input_dtype("root"))
    model.swin_blocks()[0].attn.qkv.register_forward_pre_hook(record_input_dtype("block"))
    lr = torch.full((1, 3, 16, 16), 278.39)
    out = model(lr)
    out.mean().backward()
    # Root input not cast: the physical-unit shift runs in fp32 (bf16 would round 278.39 to 278.0).
    assert seen == {"root": torch.float32, "block": torch.bfloat16}
    assert out.dtype == torch.float32
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())  # fp32 reduce + master weights


@pytest.fixture
def nccl_one_rank():
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    yield device
    dist.destroy_process_group()


def policy_against_autocast(device: torch.device) -> dict:
    """One forward and backward of the tiny SwinIR under FSDP2's bf16 MixedPrecisionPolicy and of the same
    weights under bf16 autocast: the relative differences of loss and gradients, their gradients' cosine."""
    import copy

    import torch.nn.functional as F

    from models import build_model
    from utils.memory.measure import random_batch
    from utils.parallel.fsdp import apply_fsdp
    from utils.precision import autocast

    cfg = build_config("quickstart", _tiny_overrides(param_dtype="bf16", reduce_dtype="fp32"))
    torch.manual_seed(0)
    plain = build_model(cfg.model).to(device)
    sharded = apply_fsdp(copy.deepcopy(plain), cfg, device)
    lr, hr = random_batch(cfg, (16, 24), device=device, batch=2)
    with autocast(device, "bf16"):
        expected = F.l1_loss(plain(lr).float(), hr)
    expected.backward()
    got = F.l1_loss(sharded(lr).float(), hr)
    got.backward()
    full = [getattr(p.grad, "full_tensor", lambda g=p.grad: g)() for p in sharded.parameters()]
    a, b = torch.cat([g.flatten() for g in full]), torch.cat([p.grad.flatten() for p in plain.parameters()])
    return {"loss": abs(got.item() / expected.item() - 1), "grads": ((a - b).norm() / b.norm()).item(),
            "cosine": F.cosine_similarity(a, b, dim=0).item()}


@pytest.mark.cuda
def test_bf16_policy_on_cuda_tracks_bf16_autocast(nccl_one_rank):
    diff = policy_against_autocast(nccl_one_rank)
    assert diff["loss"] < 0.02 and diff["grads"] < 0.1 and diff["cosine"] > 0.99, diff


def test_memory_record_predicts_adamw_state(one_rank):
    from utils.parallel.fsdp import memory_record

    model, _ = _sharded_model()
    optimizer = torch.optim.AdamW(model.parameters())
    before = memory_record(model, optimizer)
    model(torch.rand(1, 3, 16, 16)).mean().backward()
    optimizer.step()
    after = memory_record(model, optimizer, step=1)
    full_mb = sum(p.numel() for p in model.parameters()) * 4 / 1e6
    assert before["params_mb"] == pytest.approx(full_mb) and before["ddp_total_mb"] == pytest.approx(4 * full_mb)
    assert after["optimizer_mb"] == pytest.approx(before["optimizer_mb"]) == pytest.approx(2 * full_mb)
    assert (after["kind"], after["step"], after["ranks"], after["shards"]) == ("memory", 1, 1, 1)


def test_checkpoints_are_complete_or_ignored(one_rank, tmp_path):
    from utils.checkpoint.files import latest_sharded_checkpoint
    from utils.checkpoint.sharded import save_sharded_checkpoint

    ckpt_dir = tmp_path / "checkpoints"
    assert latest_sharded_checkpoint(ckpt_dir) is None
    for step in (1, 2, 3):
        save_sharded_checkpoint(ckpt_dir, step, {"w": torch.full((4,), float(step))}, keep=2)
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["step_00000002", "step_00000003"]
    # What a crash mid-save leaves: a hidden folder, or a step folder without DCP's metadata.
    (ckpt_dir / ".tmp-step_00000009").mkdir()
    (ckpt_dir / "step_00000012").mkdir()
    assert latest_sharded_checkpoint(ckpt_dir).name == "step_00000003"
    save_sharded_checkpoint(ckpt_dir, 4, {"w": torch.zeros(4)}, keep=0)
    assert not (ckpt_dir / ".tmp-step_00000009").exists()
    assert latest_sharded_checkpoint(ckpt_dir).name == "step_00000004"


def test_an_asynchronous_save_holds_the_step_it_names(one_rank, tmp_path):
    from utils.checkpoint.files import latest_sharded_checkpoint
    from utils.checkpoint.sharded import finish_sharded_checkpoint, save_sharded_checkpoint

    ckpt_dir, weights = tmp_path / "checkpoints", torch.arange(100_000, dtype=torch.float32)
    save_sharded_checkpoint(ckpt_dir, 1, {"w": weights}, asynchronous=True)
    weights.mul_(-1)  # the next steps change the parameters in place while the write goes on
    save_sharded_checkpoint(ckpt_dir, 2, {"w": weights}, asynchronous=True)  # waits for step 1, puts it in place
    assert latest_sharded_checkpoint(ckpt_dir).name == "step_00000001"
    weights.add_(1)
    assert finish_sharded_checkpoint() == ckpt_dir / "step_00000002" and finish_sharded_checkpoint() is None
    for step, expected in ((1, torch.arange(100_000.0)), (2, -torch.arange(100_000.0))):
        loaded = {"w": torch.empty(100_000)}
        dcp.load(loaded, checkpoint_id=ckpt_dir / f"step_{step:08d}")
        assert torch.equal(loaded["w"], expected), step


def test_single_file_checkpoints_and_bad_export_are_one_line_errors(tmp_path, capsys):
    from utils.checkpoint.files import latest_sharded_checkpoint
    from utils.checkpoint.sharded import main

    ckpt_dir = tmp_path / "checkpoints"
    ckpt_dir.mkdir()
    (ckpt_dir / "step_00000005.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="single-file checkpoints"):
        latest_sharded_checkpoint(ckpt_dir)
    assert main(["export", str(ckpt_dir), str(tmp_path / "out.pt")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not a complete DCP checkpoint" in err
    assert not list(tmp_path.glob("*.pt")) and not list(tmp_path.glob(".tmp-*"))


def test_resume_auto_steps_over_a_dcp_checkpoint_missing_a_shard(runs, tiny_data, tmp_path):
    # A DCP folder that has its metadata but lost a rank's shard (a file system that failed under one node):
    # --resume auto sets it aside and continues from the one before, to the uninterrupted run's weights.
    run = resume_from(runs["fsdp"], 9, tmp_path / "run")
    newest = resume_from(runs["fsdp"], 10, tmp_path / "copy") / "checkpoints" / "step_00000010"
    newest = newest.rename(run / "checkpoints" / newest.name)
    (newest / "__1_0.distcp").unlink()
    proc = run_script("train_fsdp.py", *tiny_args(tiny_data, run, *STEPS, "--resume", "auto"), ranks=2)
    assert re.search(rf"warning: checkpoint {newest} is damaged \(FileNotFoundError: No such file or directory: "
                     rf"__1_0.distcp\): set aside as damaged-step_00000010; resuming from the one before it\n"
                     rf"resumed from \S+step_00000009 at step 9", proc.stdout), proc.stdout[-3000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["damaged-step_00000010", "step_00000009",
                                                                       "step_00000010"]
    assert_same_weights(exported(run, 10)["model"], weights_at(runs["single"], 10))
