"""The one place that maps the launch environment (torchrun or SLURM) to ranks and devices.

Rules that earlier tutorials got wrong and this module gets right:
- the device comes from the *local* rank (``torch.cuda.set_device(local_rank)``), never the
  global rank, which exceeds the GPU count on every node but the first;
- samplers take the *global* rank and world size, so ranks on different nodes read different data.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from utils.config import ConfigError

# The config keys this file applies, and the scripts that apply them: any other script refuses them set away
# from their defaults (utils/config.py reads every file's APPLIED_BY as a literal, without importing the file).
APPLIED_BY = {
    "parallel_order": ("train_mp.py",),
    "dist_timeout_s": ("train_ddp.py", "train_fsdp.py", "train_mp.py", "train_pp.py"),
}


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job."""

    rank: int = 0
    """Global rank, 0 .. world_size-1: use it for samplers and for "only rank 0 writes"."""
    local_rank: int = 0
    """Rank within the node: use it to pick the GPU."""
    world_size: int = 1
    """Number of processes in the job."""
    local_world_size: int = 1
    """Number of processes on this node."""
    node_rank: int = 0
    """Index of this node in the job."""
    source: str = "single"
    """Which variables these came from: "torchrun", "slurm" or "single"."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))


def _int_env(name: str, environ) -> int:
    value = environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def _slurm_tasks_per_node(environ) -> int:
    # SLURM_NTASKS_PER_NODE is only set when requested explicitly; SLURM_TASKS_PER_NODE is
    # always set, in the compressed form "4(x2)" or "4,3".
    if "SLURM_NTASKS_PER_NODE" in environ:
        return _int_env("SLURM_NTASKS_PER_NODE", environ)
    first = environ.get("SLURM_TASKS_PER_NODE", "1").split(",")[0]
    return int(first.split("(")[0])


def read_dist_env(environ=None) -> DistEnv:
    """Ranks from torchrun's variables, else from SLURM's (``srun`` one task per GPU), else one process.

    torchrun wins when both are present: inside an ``srun ... torchrun`` job SLURM_PROCID is the
    node's task id, not the process rank.
    """
    environ = os.environ if environ is None else environ
    if "RANK" in environ and "WORLD_SIZE" in environ:
        rank = _int_env("RANK", environ)
        local_rank = _int_env("LOCAL_RANK", environ) if "LOCAL_RANK" in environ else 0
        world_size = _int_env("WORLD_SIZE", environ)
        local_world_size = (
            _int_env("LOCAL_WORLD_SIZE", environ) if "LOCAL_WORLD_SIZE" in environ else world_size
        )
        node_rank = _int_env("GROUP_RANK", environ) if "GROUP_RANK" in environ else rank // local_world_size
        return DistEnv(rank, local_rank, world_size, local_world_size, node_rank, "torchrun")
    if "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        rank = _int_env("SLURM_PROCID", environ)
        world_size = _int_env("SLURM_NTASKS", environ)
        local_rank = _int_env("SLURM_LOCALID", environ) if "SLURM_LOCALID" in environ else 0
        local_world_size = _slurm_tasks_per_node(environ)
        node_rank = _int_env("SLURM_NODEID", environ) if "SLURM_NODEID" in environ else 0
        if world_size > 1:
            return DistEnv(rank, local_rank, world_size, local_world_size, node_rank, "slurm")
    return DistEnv()


def device_for(env: DistEnv) -> torch.device:
    """The device this process should use: GPU number ``local_rank`` if CUDA is available, else CPU."""
    if torch.cuda.is_available():
        if env.local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"local rank {env.local_rank} but only {torch.cuda.device_count()} GPUs are visible on "
                f"{socket.gethostname()}: launch at most one process per GPU (--nproc-per-node)"
            )
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


def lone_process_note(device: torch.device) -> str:
    """Said when a distributed script starts without torchrun or srun: it then trains on one device only."""
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    here = f"this node has {gpus} GPUs" if gpus else "no GPU here"
    return (f"note: started without torchrun or srun, so this is 1 process on {device} ({here}); "
            f"for N processes: torchrun --nproc-per-node N {Path(sys.argv[0]).name} ...")


_joined_job = False  # set by init_distributed: this process is one rank of a multi-process job


def joined_job() -> bool:
    """Whether this process joined a job of several processes (init_distributed), now or earlier."""
    return _joined_job


def init_distributed(timeout_s: float = 300.0) -> tuple[DistEnv, torch.device]:
    """Read the environment, pick the device and join the process group (one of its own for a lone process).

    nccl on GPUs, gloo on CPU. The bounded timeout makes a job whose peer died fail instead of hanging.
    For SLURM-only launches (srun, one task per GPU) MASTER_ADDR/MASTER_PORT must be exported.
    """
    env = read_dist_env()
    device = device_for(env)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return env, device
    backend = "nccl" if device.type == "cuda" else "gloo"
    if env.world_size == 1:
        # Started without a launcher: a one-process group in memory, so DDP/FSDP code runs unchanged.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=timeout_s))
        if env.source == "single":
            print(lone_process_note(device), flush=True)
        return env, device
    if env.source == "slurm":
        os.environ.setdefault("RANK", str(env.rank))
        os.environ.setdefault("WORLD_SIZE", str(env.world_size))
        os.environ.setdefault("LOCAL_RANK", str(env.local_rank))
        if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            raise RuntimeError(
                "launched by srun without torchrun: export MASTER_ADDR (first host of the "
                "allocation) and MASTER_PORT, or launch with torchrun"
            )
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend=backend, timeout=timeout, device_id=device if device.type == "cuda" else None,
                            **_attempt_store(env, timeout))
    _bound_later_groups(timeout)
    global _joined_job
    _joined_job = True
    return env, device


def _attempt_store(env: DistEnv, timeout: datetime.timedelta) -> dict:
    """init_process_group's store for a worker that torchrun restarted: the agent's own store (which torchrun
    shares with its workers unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) seen under a prefix of its own.

    That store outlives the workers, and PyTorch assumes a new one per attempt: without the prefix, a restarted
    worker reads the previous attempt's addresses and keys, and its connections fail now and then (PyTorch
    issue 135712; reproduced here: "Gloo connectFullMesh failed ... Connection refused" after a restart), or the
    live ranks' notes of an earlier timeout make a missing rank look present. {} (torch's env:// default) when
    the store is not torchrun's, or on a first attempt, whose keys are fresh.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or attempt == "0":
        return {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), env.world_size,
                          is_master=False, timeout=timeout)
    return {"store": dist.PrefixStore(f"attempt_{attempt}", store), "rank": env.rank, "world_size": env.world_size}


def _bound_later_groups(timeout: datetime.timedelta) -> None:
    """Give every process group made from now on the job's timeout, not PyTorch's default (30 min for gloo,
    10 min for NCCL): init_device_mesh makes its dimensions' groups (HSDP, tp, cp, pp) without one, and has no
    argument that would pass it (its pg options are backend-specific). PyTorch has no public setting for the
    default; new_group reads it from this module variable (torch 2.6 onwards)."""
    c10d = dist.distributed_c10d
    c10d.default_pg_timeout = timeout
    if hasattr(c10d, "default_pg_nccl_timeout"):
        c10d.default_pg_nccl_timeout = timeout


def mp_mesh_layout(world_size: int, tp: int, cp: int, order: str = "tp-cp-dp",
                   ens: int = 1) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(shape, names) of the model-parallel mesh, slowest-varying dimension first.

    ``order`` lists the dimensions from the fastest-varying rank to the slowest (NERSC's
    ``--parallel_order``): with the default tp-cp-dp, ranks 0..tp-1 form the first tensor-parallel
    group, and torchrun numbers a node's ranks consecutively, so tp (the chattiest: collectives in
    every layer) stays on a node's NVLink while dp crosses nodes. dp = world_size / (tp * cp * ens).
    ``ens`` > 1 adds the ensemble's dimension (the ranks that share a sample's members), just before dp unless
    ``order`` places it: its one gather of predictions per step stays inside a node before dp's does.
    """
    if world_size % (tp * cp * ens):
        raise ConfigError(f"tp {tp} x cp {cp}{f' x ens {ens}' if ens > 1 else ''} = {tp * cp * ens} does not divide "
                          f"the {world_size} ranks: choose tp and cp{' and ens' if ens > 1 else ''} whose product "
                          f"divides the number of processes (dp = ranks / (tp x cp{' x ens' if ens > 1 else ''}))")
    sizes = {"dp": world_size // (tp * cp * ens), "cp": cp, "tp": tp, "ens": ens}
    fastest_first = order.split("-")
    if "ens" not in fastest_first:
        fastest_first.insert(fastest_first.index("dp"), "ens")
    names = tuple(name for name in reversed(fastest_first) if name != "ens" or ens > 1)
    return tuple(sizes[name] for name in names), names


def ensure_process_group(device: torch.device) -> None:
    """A single process (python train_fsdp.py) still needs a group for DeviceMesh and DCP: an in-memory one."""
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(),
                                rank=0, world_size=1)


def build_mp_mesh(world_size: int, tp: int, cp: int, order: str, device: torch.device, ens: int = 1):
    """(mesh, dp_cp): the ("dp", "cp", "tp") DeviceMesh of train_mp.py (with "ens" when ``ens`` > 1), and its dp,
    ens and cp dimensions flattened into one (the ranks that hold the same parameters and average their gradients:
    FSDP2's mesh). One process: a group of its own."""
    shape, names = mp_mesh_layout(world_size, tp, cp, order, ens)
    ensure_process_group(device)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    replicas = tuple(name for name in names if name in ("dp", "ens", "cp"))
    return mesh, mesh[replicas]._flatten("_".join(replicas))


def build_pp_mesh(world_size: int, pp: int, device: torch.device):
    """The ("dp", "dp_shard", "pp") DeviceMesh of train_pp.py: consecutive ranks (one node's GPUs) form a
    pipeline, so only stage-boundary activations cross nodes in a pipeline, and dp (gradients) spans
    nodes. "dp_shard" has size 1: ``mesh["dp", "dp_shard"]`` is a 2-D (replicate, shard) mesh on which
    FSDP2 replicates parameters and all-reduces gradients, as DDP does."""
    if world_size % pp:
        raise ConfigError(f"pp {pp} does not divide the {world_size} ranks: choose a pp that divides the number "
                          "of processes (dp = ranks / pp)")
    ensure_process_group(device)
    return init_device_mesh(device.type, (world_size // pp, 1, pp), mesh_dim_names=("dp", "dp_shard", "pp"))


def cleanup_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_mean(value: torch.Tensor) -> torch.Tensor:
    """Mean over ranks (a no-op for one process); the input is left unchanged."""
    if not dist.is_initialized():
        return value
    value = value.detach().clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value / dist.get_world_size()


def all_reduce_max(value: float, device: torch.device) -> float:
    """Largest value over ranks (e.g. peak memory)."""
    if not dist.is_initialized():
        return value
    t = torch.tensor(float(value), device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()
