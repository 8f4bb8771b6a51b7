"""benchmarks/ladder.py end to end in miniature: each chosen rung runs as a real train_with_profiling.py run
(in this process: the ladder's runner is its one seam), CUDA-only rungs are listed as skipped, the keys add up
rung by rung, and the table, JSON and PNG agree."""

import json

import pytest
import torch

from benchmarks import ladder
from benchmarks.bench_model import supports_bf16_matmul
from conftest import TINY_MODEL, run_script


def test_the_ladder_climbs_the_chosen_rungs_with_every_key_below_them(tiny_data, tmp_path, capsys):
    calls = []

    def runner(args):  # the real script, in this process (saves importing torch once per rung)
        calls.append(args)
        run_script("train_with_profiling.py", *args, in_process=True)
        return ladder.read_records(args)

    extra = ["--data_dir", str(tiny_data), "--crop_size", "32", "--n_patches", "2", "--batch_size", "4",
             "--val_samples", "4", *TINY_MODEL]
    assert ladder.main(["--config", "quickstart", "--steps", "2", "--breakdown-steps", "2", "--workers", "1",
                        "--repeats", "1", "--rungs", "device pipeline", "tf32", "fused adamw", "cuda graphs",
                        "--out", str(tmp_path / "out"), "--", *extra], runner) == 0
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "out" / "ladder.json").read_text())
    assert (tmp_path / "out" / "ladder.png").stat().st_size > 10_000
    rungs = {r["rung"]: r for r in report["rungs"]}
    assert list(rungs) == ["baseline", "device pipeline", "tf32", "fused adamw", "cuda graphs"]  # as --rungs asked
    assert rungs["tf32"]["skipped"].startswith("needs CUDA") and rungs["cuda graphs"]["skipped"]
    native_bf16 = supports_bf16_matmul(torch.device("cpu"))
    assert ladder.missing(cuda=False) == {"cuda": True, "bf16": not native_bf16}  # emulated bf16 would slow every rung
    measured = [r for r in report["rungs"] if not r["skipped"]]
    assert [r["rung"] for r in measured] == ["baseline", "device pipeline", "fused adamw"] and len(calls) == 3
    for r in measured:
        assert r["samples_per_sec"] > 0 and r["synthetic_samples_per_sec"] > 0 and r["peak_mem_gb"] > 0
        assert 0 <= r["loader_share"] < 1
        assert f"{r['rung']:<16}{r['samples_per_sec']:>10.2f}" in out
    # Cumulative: the fused-AdamW run still has the workers and bf16 (where it applies), measured or not, and the
    # device pipeline; the skipped tf32 stays off. (compile's rung: the same keys plus --compile true.)
    last = dict(zip(calls[-1][::2], calls[-1][1::2]))
    assert (last["--num_workers"], last["--device_transforms"], last["--amp_dtype"], last["--fused_optimizer"],
            last["--compile"], last["--tf32"], last["--cuda_graphs"]) == ("1", "true", "bf16" if native_bf16 else "none",
                                                                          "true", "false", "false", "false")
    assert dict(zip(calls[0][::2], calls[0][1::2]))["--fused_optimizer"] == "false"


def test_repeated_climbs_combine_into_medians_and_a_spread():
    def climb(full, synthetic, peak):
        return [ladder.Result("baseline", "", {}, samples_per_sec=full, synthetic_samples_per_sec=synthetic,
                              peak_mem_gb=peak, extra={"io_samples_per_sec": 2 * full}),
                ladder.Result("tf32", "", {}, skipped="needs CUDA")]

    combined = ladder.combine([climb(10.0, 12.0, 1.0), climb(8.0, 10.0, 1.5), climb(9.0, 20.0, 1.2)])
    base, tf32 = combined
    assert (base.samples_per_sec, base.synthetic_samples_per_sec, base.peak_mem_gb) == (9.0, 12.0, 1.5)
    assert base.extra == {"io_samples_per_sec": 18.0, "runs": [10.0, 8.0, 9.0], "spread": pytest.approx(2 / 9)}
    assert base.loader_share == pytest.approx(0.25) and tf32.skipped == "needs CUDA"
    table = ladder.format_table(combined)
    assert "baseline" in table and "    1.00" in table and "     22%" in table and "skipped: needs CUDA" in table


@pytest.mark.parametrize("argv, message", [
    (["--rungs", "warp"], "unknown rung(s) warp"),
    (["--", "--amp_dtype", "bf16"], "--amp_dtype belong to the ladder's rungs"),
    (["--", "--batchsize", "4"], "unknown config key(s) after --: --batchsize"),
    (["--steps", "1"], "--steps must be >= 2"),
    (["--repeats", "0"], "--repeats >= 1"),
])
def test_bad_ladder_arguments_say_what_to_do(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        ladder.main(["--out", str(tmp_path), *argv], runner=None)
    assert exit_.value.code == 2 and message in capsys.readouterr().err
