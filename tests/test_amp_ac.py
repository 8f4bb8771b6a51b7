"""Steps 1-2: mixed precision (amp_dtype) and activation checkpointing (ac), as the training scripts use them."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from models import build_model
from tests.conftest import TINY_MODEL, run_script
from utils.config import build_config
from utils.memory.measure import SavedTensorBytes, random_batch
from utils.parallel.plans import ac_units
from utils.parallel.techniques import apply_ac
from utils.precision import autocast, make_grad_scaler
from utils.training import configure_backends

CPU = torch.device("cpu")


def small_setup(**overrides):
    """A small SwinIR (stochastic depth on) and a batch in physical units."""
    cfg = build_config("quickstart", {"model_args": {"embed_dim": 24, "depths": [2, 2], "num_heads": [2, 3],
                                                     "drop_path_rate": 0.1}, "img_size": 16, "crop_size": 0,
                                      **overrides})
    torch.manual_seed(0)
    model = build_model(cfg.model)
    lr, hr = random_batch(cfg, (16, 24), batch=2)
    return model, lr, hr


def loss_and_grads(model, lr, hr, amp_dtype="none", seed=1):
    """train.py's step up to the gradients: autocast forward, fp32 L1 loss, (scaled) backward, unscale."""
    model.zero_grad(set_to_none=True)
    scaler = make_grad_scaler(lr.device, amp_dtype)
    torch.manual_seed(seed)  # same stochastic-depth draws in every variant
    with autocast(lr.device, amp_dtype):
        pred = model(lr)
    loss = F.l1_loss(pred.float(), hr)
    scaler.scale(loss).backward()
    grads = [p.grad / scaler.get_scale() if scaler.is_enabled() else p.grad for p in model.parameters()]
    return loss.detach(), torch.cat([g.flatten() for g in grads])


# ------------------------------------------------------------------ mixed precision

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def on(device, model, *tensors):
    return model.to(device), *(t.to(device) for t in tensors)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("amp_dtype", ["bf16", "fp16"])
def test_mixed_precision_matches_the_fp32_reference(amp_dtype, device):
    model, lr, hr = on(device, *small_setup())
    loss, grads = loss_and_grads(model, lr, hr)
    loss_amp, grads_amp = loss_and_grads(model, lr, hr, amp_dtype)
    assert torch.isfinite(grads_amp).all()
    assert loss_amp.item() == pytest.approx(loss.item(), rel=2e-2)
    assert (grads_amp - grads).norm() / grads.norm() < 0.05
    assert F.cosine_similarity(grads_amp, grads, dim=0) > 0.995


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("amp_dtype", ["bf16", "fp16"])
def test_mixed_precision_training_steps_move_the_weights_and_stay_finite(amp_dtype, device):
    """Whole steps as train.py takes them: autocast, scaled backward, scaler.step (fused AdamW on CUDA), update."""
    model, lr, hr = on(device, *small_setup())
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=lr.device.type == "cuda")
    scaler = make_grad_scaler(lr.device, amp_dtype)
    for _ in range(3):
        optimizer.zero_grad(set_to_none=True)
        with autocast(lr.device, amp_dtype):
            pred = model(lr)
        scaler.scale(F.l1_loss(pred.float(), hr)).backward()
        scaler.step(optimizer)
        scaler.update()
    assert scaler.is_enabled() is (amp_dtype == "fp16")
    if scaler.is_enabled():  # an overflow halves the scale and skips that step; it never grows this early
        assert 0 < scaler.get_scale() <= 2.0 ** 16
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert sum(not torch.equal(p, b) for p, b in zip(model.parameters(), before)) > 10


def test_fp16_uses_a_grad_scaler_and_bf16_does_not():
    assert make_grad_scaler(CPU, "fp16").is_enabled()
    assert not make_grad_scaler(CPU, "bf16").is_enabled() and not make_grad_scaler(CPU, "none").is_enabled()
    loss = torch.tensor(0.5, requires_grad=True)
    assert make_grad_scaler(CPU, "fp16").scale(loss).item() == 0.5 * 2.0 ** 16  # fp16 gradients are lifted
    assert make_grad_scaler(CPU, "bf16").scale(loss) is loss  # bf16 has fp32's exponent range


def test_autocast_runs_matmuls_in_the_low_precision_and_none_is_plain_fp32():
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    for amp_dtype, dtype in (("none", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        with autocast(CPU, amp_dtype):
            assert layer(x).dtype == dtype


def test_tf32_and_cudnn_benchmark_switches_follow_the_config_on_cuda(monkeypatch):
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    try:
        for tf32 in (False, True):
            configure_backends(build_config("quickstart", {"tf32": tf32, "cudnn_benchmark": not tf32}))
            assert torch.backends.cuda.matmul.allow_tf32 is tf32 and torch.backends.cudnn.allow_tf32 is tf32
            assert torch.backends.cudnn.benchmark is (not tf32)
        assert build_config("unet3d_base").train.cudnn_benchmark and not build_config("quickstart").train.cudnn_benchmark
    finally:
        (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
         torch.backends.cudnn.benchmark) = saved


# ------------------------------------------------------------------ activation checkpointing

def backward_flops(model, lr, hr) -> int:
    loss = F.l1_loss(model(lr), hr)
    with FlopCounterMode(display=False) as counter:
        loss.backward()
    return counter.get_total_flops()


def saved_bytes(model, lr, hr) -> int:
    with SavedTensorBytes(exclude=[*model.parameters(), *model.buffers()], hold=False) as counter:
        F.l1_loss(model(lr), hr)
    return counter.bytes


def test_checkpointing_same_gradients_recomputes_and_saves_less():
    model, lr, hr = small_setup()
    loss, grads = loss_and_grads(model, lr, hr)
    with FlopCounterMode(display=False) as forward_counter:
        model(lr)
    forward_by_module = {name: sum(counts.values()) for name, counts in forward_counter.get_flop_counts().items()}
    names = {id(module): f"SwinIR.{name}" for name, module in model.named_modules()}
    plain_backward, plain_saved = backward_flops(model, lr, hr), saved_bytes(model, lr, hr)
    results = {}
    for mode in ("block", "layer"):
        variant = apply_ac(copy.deepcopy(model), mode)
        assert variant.state_dict().keys() == model.state_dict().keys()  # checkpoints stay interchangeable
        loss_ac, grads_ac = loss_and_grads(variant, lr, hr)  # stochastic depth replayed in the recomputation
        assert torch.equal(loss_ac, loss), mode
        torch.testing.assert_close(grads_ac, grads, rtol=1e-5, atol=1e-7)
        # Backward re-runs the forward of every unit, up to the last tensor it needs (early stop).
        units_forward = sum(forward_by_module[names[id(unit)]] for unit in ac_units(model, mode))
        extra = backward_flops(variant, lr, hr) - plain_backward
        assert 0.7 * units_forward < extra <= units_forward, mode
        results[mode] = extra, saved_bytes(variant, lr, hr)
    assert results["layer"][0] > results["block"][0]  # "layer" also recomputes the RSTB convolutions
    assert results["layer"][1] < results["block"][1] < plain_saved / 3


def test_apply_ac_none_is_a_no_op_and_bad_unit_is_an_error():
    model, lr, hr = small_setup()
    before = saved_bytes(model, lr, hr)
    assert apply_ac(model, "none") is model and saved_bytes(model, lr, hr) == before
    with pytest.raises(ValueError, match="'block' or 'layer'"):
        apply_ac(model, "rstb")


# ------------------------------------------------------------------ the training script, from config

def final_checkpoint(run_dir):
    path = sorted((run_dir / "checkpoints").glob("step_*.pt"))[-1]
    return torch.load(path, map_location="cpu", weights_only=False)


def test_train_full_size_config_on_cpu_with_fp16_and_checkpointing(tiny_data, tmp_path):
    # full_size trains on whole fields (crop_size 0): here the 64 x 128 fields of the tiny data set.
    run = tmp_path / "full"
    run_script("train.py", "--config", "full_size", "--data_dir", str(tiny_data), "--valid_split", "valid",
               "--run_dir", str(run), "--num_workers", "0", "--val_samples", "1", "--max_steps", "2",
               "--log_every", "1", "--progress", "never", "--amp_dtype", "fp16", "--ac", "block", *TINY_MODEL, in_process=True)
    payload = final_checkpoint(run)
    assert payload["config"]["crop_size"] == 0 and payload["config"]["ac"] == "block"
    assert payload["scaler"]["scale"] > 0  # fp16 trains through the GradScaler (bf16's is disabled: {})
    assert all(torch.isfinite(v).all() for v in payload["model"].values() if v.is_floating_point())


def test_compile_gives_every_block_a_graph_and_matches_eager():
    """36 blocks with distinct drop-path rates exceed dynamo's default recompile limit (8);
    apply_compile must raise it, or later blocks silently run eagerly."""
    from torch._dynamo.utils import counters

    from utils.parallel.techniques import apply_compile

    torch._dynamo.reset()
    cfg = build_config("quickstart", {"model_args.depths": [6, 6], "model_args.num_heads": [2, 2],
                                      "model_args.drop_path_rate": 0.1})
    eager = build_model(cfg.model)  # training mode: dynamo guards on every drop-path rate
    compiled = apply_compile(copy.deepcopy(eager), True, backend="eager")
    blocks = list(compiled.swin_blocks())
    distinct = {(b.shift_size, getattr(b.drop_path, "drop_prob", 0.0)) for b in blocks}
    assert len(distinct) > 8
    x = torch.randn(1, 3, 16, 24)
    counters.clear()
    outputs = []
    for model in (compiled, eager):
        torch.manual_seed(0)  # same stochastic-depth draws
        outputs.append(model(x))
    torch.testing.assert_close(*outputs)
    assert counters["stats"]["unique_graphs"] == len(distinct)
    # Under autocast too, no block breaks into several graphs (torch 2.11 could not trace SwinIR's autocast check:
    # a block in two CUDA graphs, slower, and a validation that failed under cuda_graphs on a GPU).
    with torch.autocast("cpu", torch.bfloat16):
        compiled(x)
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch._dynamo.reset()
