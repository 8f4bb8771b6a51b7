"""comm_check.py: the nccl-tests-style table, its bandwidth factors, and that wrong data fails the run."""

import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import comm_check
from comm_check import ALL_GATHER, ALL_REDUCE, message_sizes, parse_args, parse_bytes
from tests.conftest import REPO, run_script

TORCHRUN_2 = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "2"]
ROW = re.compile(r"^\s+(all_reduce|all_gather)\s+(\d+)\s+(\d+)\s+float\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)\s*$",
                 re.MULTILINE)


@dataclass
class Row:
    op: str
    size: int
    count: int
    time_us: float
    algbw: float
    busbw: float
    wrong: int


def parse_table(text: str) -> list[Row]:
    return [Row(m[0], int(m[1]), int(m[2]), float(m[3]), float(m[4]), float(m[5]), int(m[6]))
            for m in ROW.findall(text)]


def assert_complete_correct_table(text: str, max_bytes: int, world_size: int) -> None:
    """Every size from 1 KiB to max_bytes for both collectives, no wrong element, consistent bandwidths."""
    rows = parse_table(text)
    sizes = [1024 * 2**k for k in range(max_bytes.bit_length() - 10)]
    for op, factor in (("all_reduce", 2 * (world_size - 1) / world_size),
                       ("all_gather", (world_size - 1) / world_size)):
        mine = [r for r in rows if r.op == op]
        assert [r.size for r in mine] == sizes, text
        for r in mine:
            assert r.wrong == 0 and r.count == r.size // 4 and r.time_us > 0, r
            # Printed with 3 decimals: compare within rounding.
            assert r.algbw == pytest.approx(r.size / r.time_us / 1e3, abs=1.5e-3), r
            assert r.busbw == pytest.approx(r.algbw * factor, abs=2e-3), r
    assert "# all results correct" in text


def test_two_processes_print_a_complete_correct_table():
    proc = run_script("comm_check.py", "--max-bytes", "4MiB", "--seconds-per-size", "0.1", ranks=2, timeout=120)
    assert "world_size=2 nodes=1" in proc.stdout
    assert_complete_correct_table(proc.stdout, 4 * 2**20, world_size=2)
    assert "average bus bandwidth" in proc.stdout


def test_wrong_data_fails_the_run(tmp_path):
    # Rank 1 sees one corrupted element in every all-gather: the check must count it and fail the run.
    corrupting = tmp_path / "corrupting_comm_check.py"
    corrupting.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "import torch.distributed as dist\n"
        "import comm_check\n"
        "real_all_gather = dist.all_gather_into_tensor\n"
        "def corrupted(output, tensor, *args, **kwargs):\n"
        "    work = real_all_gather(output, tensor, *args, **kwargs)\n"
        "    if dist.get_rank() == 1:\n"
        "        output[-1] += 1\n"
        "    return work\n"
        "dist.all_gather_into_tensor = corrupted\n"
        "sys.exit(comm_check.main())\n")
    proc = run_script(str(corrupting), "--max-bytes", "4KiB", "--seconds-per-size", "0.05",
                      launcher=TORCHRUN_2, timeout=120, check=False)
    assert proc.returncode != 0
    gathers = [r for r in parse_table(proc.stdout) if r.op == "all_gather"]
    assert [r.wrong for r in gathers] == [1, 1, 1], proc.stdout
    assert all(r.wrong == 0 for r in parse_table(proc.stdout) if r.op == "all_reduce")
    assert "FAILED: 3 wrong elements" in proc.stderr


def test_one_process_is_a_clear_error(monkeypatch, capsys):
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    assert comm_check.main(["--max-bytes", "4KiB"]) == 2
    assert "needs at least 2 processes" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--max-bytes", "4XB"], "'4XB' is not a size"),
    (["--min-bytes", "1MiB", "--max-bytes", "1KiB"], "is larger than --max-bytes"),
    (["--factor", "1"], "--factor must be at least 2"),
])
def test_bad_arguments_are_clear_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        comm_check.main(args)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("text, value", [("1024", 1024), ("1K", 1024), ("1KiB", 1024), ("4mb", 4 * 2**20),
                                         ("1GiB", 2**30), ("0.5M", 2**19)])
def test_sizes_use_binary_units(text, value):
    assert parse_bytes(text) == value


def test_sizes_double_and_round_to_whole_elements_per_rank():
    args = parse_args(["--min-bytes", "1KiB", "--max-bytes", "8KiB"])
    assert message_sizes(args, world_size=2) == [1024, 2048, 4096, 8192]
    # 3 ranks x 4-byte floats: sizes round down to multiples of 12 bytes.
    assert message_sizes(args, world_size=3) == [1020, 2040, 4092, 8184]


def test_bus_bandwidth_factors_are_those_of_nccl_tests():
    assert ALL_REDUCE.bus_factor(8) == pytest.approx(2 * 7 / 8)
    assert ALL_GATHER.bus_factor(8) == pytest.approx(7 / 8)
