"""comm_check.py: the nccl-tests-style table, its bandwidth factors, and that wrong data fails the run."""

import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import comm_check
from comm_check import (ALL_GATHER, ALL_REDUCE, compare_busbw, expectation_lines, expected_busbw, message_sizes,
                        parse_args, parse_bytes)
from tests.conftest import REPO, exit_in_one_process, run_script
from utils.plan.clusters import load_cluster
from utils.plan.comm import node_busbw

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
    assert "expected" not in proc.stdout  # gloo on CPUs: the links of no cluster, unless --cluster asks


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
    code, err = exit_in_one_process(capsys, "comm_check.py", "--max-bytes", "4KiB")
    assert code == 2 and len(err) == 1 and "needs at least 2 processes" in err[0], err


@pytest.mark.parametrize("args, message", [
    (["--max-bytes", "4XB"], "'4XB' is not a size"),
    (["--min-bytes", "1MiB", "--max-bytes", "1KiB"], "is larger than --max-bytes"),
    (["--factor", "1"], "--factor must be at least 2"),
])
def test_bad_arguments_are_clear_errors(args, message, capsys):
    # One line through run_cli, as the training scripts say bad input: no usage block.
    code, err = exit_in_one_process(capsys, "comm_check.py", *args)
    assert code == 2 and len(err) == 1 and message in err[0], err


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


# --- the expected bus bandwidth (pure functions: no process group) ------------------------------------------

@pytest.mark.parametrize("name, nodes, gbps", [("kestrel-h100", 1, 450), ("kestrel-h100", 2, 50),
                                               ("kestrel-h100", 4, 50), ("perlmutter-a100-40", 1, 300),
                                               ("perlmutter-a100-40", 2, 100)])
def test_expected_busbw_is_the_planners_ring_bound(name, nodes, gbps):
    cluster = load_cluster(name)
    # NVLink inside a node; between nodes the slower of NVLink and the node's whole network (not its share per GPU)
    formula = cluster.intra_bw if nodes == 1 else min(cluster.intra_bw, cluster.inter_bw)
    assert expected_busbw(cluster, nodes) == formula == gbps * 1e9
    assert expected_busbw(cluster, nodes) == node_busbw(nodes, cluster.gpus_per_node, cluster.intra_bw,
                                                        cluster.inter_bw)


@pytest.mark.parametrize("site, cluster", [("kestrel", "kestrel-h100"), ("perlmutter", "perlmutter-a100-40"),
                                           ("generic", None), (None, None)])
def test_site_picks_the_cluster(monkeypatch, site, cluster):
    if site is None:
        monkeypatch.delenv("SITE", raising=False)
    else:
        monkeypatch.setenv("SITE", site)
    args = parse_args([])
    assert (args.expected_from.name if args.expected_from else None) == cluster
    assert not args.cluster_given
    chosen = parse_args(["--cluster", "perlmutter-a100-80"])  # the option wins over SITE
    assert chosen.expected_from.name == "perlmutter-a100-80" and chosen.cluster_given


@pytest.mark.parametrize("args, message", [(["--cluster", "nope"], "unknown cluster 'nope'"),
                                           (["--cluster", "this-machine"], "is measured by this script")])
def test_bad_cluster_is_a_clear_error(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(args)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_busbw_below_half_the_expected_warns():
    kestrel = load_cluster("kestrel-h100")  # 2 nodes: 50 GB/s expected
    low = compare_busbw("all_reduce", 2**30, 24.9, kestrel, nodes=2)
    assert low[0] == ("# all_reduce: busbw at 1 GiB: 24.900 GB/s measured, 50 GB/s expected for 2 nodes of "
                      "kestrel-h100 (config/clusters/clusters.yaml: the links' datasheet bandwidth)")
    assert len(low) == 2 and low[1].startswith("# WARNING all_reduce: below half the expected bus bandwidth")
    assert "The network plugin for NCCL" in low[1]
    assert compare_busbw("all_gather", 2**30, 25.1, kestrel, nodes=2) == [low[0].replace("all_reduce", "all_gather")
                                                                         .replace("24.900", "25.100")]
    assert compare_busbw("all_reduce", 2**30, 80.0, kestrel, nodes=2)[1:] == []  # above the ring bound: fine
    small = compare_busbw("all_reduce", 2**20, 1.0, kestrel, nodes=2)  # latency-bound: no verdict
    assert len(small) == 2 and "latency-bound" in small[1] and "WARNING" not in small[1]


def test_cpu_runs_print_an_expected_busbw_only_when_asked(monkeypatch):
    monkeypatch.setenv("SITE", "kestrel")
    busbw, largest = {"all_reduce": [0.1, 0.6], "all_gather": [0.4]}, {"all_reduce": 2**24, "all_gather": 2**24}
    cpu, gpu = torch.device("cpu"), torch.device("cuda")  # a device object only: no GPU needed
    assert expectation_lines(parse_args([]), busbw, largest, 2, cpu) == []
    asked = expectation_lines(parse_args(["--cluster", "kestrel-h100"]), busbw, largest, 2, cpu)
    assert len(asked) == 2 and all("not comparable" in line and "50 GB/s expected" in line for line in asked)
    on_gpu = expectation_lines(parse_args([]), busbw, largest, 2, gpu)
    assert [line.split(":")[0] for line in on_gpu] == ["# all_reduce", "# all_reduce", "# all_gather",
                                                       "# all_gather"]  # each: summary, then latency-bound
    monkeypatch.setenv("SITE", "generic")
    hint = expectation_lines(parse_args([]), busbw, largest, 2, gpu)
    assert len(hint) == 1 and "--cluster NAME" in hint[0]
