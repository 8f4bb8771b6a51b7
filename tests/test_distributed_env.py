"""The environment -> rank/device mapping (torchrun and SLURM variables)."""

import pytest
import torch

from utils.parallel.distributed import DistEnv, device_for, read_dist_env


def test_single_process_without_launcher():
    assert read_dist_env({}) == DistEnv()


def test_torchrun_variables_second_node():
    env = read_dist_env({"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
                         "GROUP_RANK": "1"})
    assert (env.rank, env.local_rank, env.world_size, env.node_rank, env.num_nodes) == (5, 1, 8, 1, 2)
    assert env.source == "torchrun"


def test_torchrun_wins_over_slurm_inside_srun():
    # srun starts one torchrun per node: SLURM_PROCID is the node's task id, not the process rank.
    env = read_dist_env({"RANK": "6", "LOCAL_RANK": "2", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
                         "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"})
    assert (env.rank, env.local_rank) == (6, 2)


def test_slurm_one_task_per_gpu():
    env = read_dist_env({"SLURM_PROCID": "7", "SLURM_NTASKS": "8", "SLURM_LOCALID": "3",
                         "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_NODEID": "1"})
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size, env.node_rank) == (7, 3, 8, 4, 1)
    assert env.source == "slurm"


def test_slurm_single_task_is_single_process():
    assert read_dist_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}).world_size == 1


def test_bad_variable_is_a_clear_error():
    with pytest.raises(ValueError, match="RANK='x' is not an integer"):
        read_dist_env({"RANK": "x", "WORLD_SIZE": "2"})


def test_device_uses_local_rank_not_global_rank(monkeypatch):
    # Pretend to be a 4-GPU node: global rank 5 must use GPU 1 (its local rank), not "GPU 5".
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert device_for(DistEnv(rank=5, local_rank=1, world_size=8, local_world_size=4)) == torch.device("cuda", 1)
    with pytest.raises(RuntimeError, match="only 4 GPUs"):
        device_for(DistEnv(rank=5, local_rank=5, world_size=8, local_world_size=8))
