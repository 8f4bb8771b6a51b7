#!/bin/bash
# Multi-node training (tutorial Steps 4-5): N nodes x 4 GPUs, one srun task per node, each running
# torchrun with the c10d rendezvous on the first node of the allocation. Submit from the repository root:
#
#   sbatch [SBATCH OPTIONS] submit_multinode.sh SCRIPT.py [SCRIPT ARGUMENTS...]
#   sbatch --nodes 4 submit_multinode.sh train_ddp.py --config baseline
#   sbatch submit_multinode.sh comm_check.py                   # network check before a long run
#
# Options on the sbatch command line win over the #SBATCH lines below (--nodes, --time, ...). The
# account, partition and constraint are best given through sbatch's own variables, e.g. in ~/.bashrc:
#   Kestrel:    export SBATCH_ACCOUNT=<project>     (jobs are routed to the GPU partition by the request)
#               and sbatch --mem 300G ...: a Kestrel job gets 1 GB per core unless it asks (--exclusive adds none)
#   Perlmutter: export SBATCH_ACCOUNT=<project> SBATCH_CONSTRAINT=gpu SBATCH_QOS=regular
# Nodes without GPUs (e.g. the local test cluster: add --gpus-per-node=0) run CPU processes with gloo.
#
# Long runs (docs/part1-swinir.md, "Long runs"): SLURM sends the batch shell SIGUSR1 120 s before the time
# limit (--signal below; change the lead with sbatch --signal=B:USR1@SECONDS); the training run then
# checkpoints the step it is on and stops (exit code 75), and the job requeues itself to continue from
# that checkpoint (a training script gets --resume auto unless its arguments set --resume), at most
# MAX_REQUEUES times. --signal=USR1@SECONDS without B: (SIGUSR1 to the run's processes, not this shell) does
# the same: torchrun runs through launch.py, which handles it. scancel or a preemption (SIGTERM) also
# checkpoints and stops the run, without requeue.
#SBATCH --job-name=era5-multinode
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --exclusive
#SBATCH --time=00:30:00
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@120
#SBATCH --requeue

# ---- Settings: edit here, or set them in the environment of sbatch (SITE=kestrel sbatch ...) -------
# SITE picks the defaults of the settings below: kestrel, perlmutter or generic (any other SLURM).
# Exported: comm_check.py reads it for the expected bus bandwidth of the site's nodes.
export SITE=${SITE:-generic}
# Python environment: a virtualenv directory (has pyvenv.cfg) or a conda environment name or path;
# empty = the python already on PATH (e.g. from a module). The default is the conda environment that
# `conda env create -f conda-env.yml` makes (docs/setup.md).
PYTHON_ENV=${PYTHON_ENV-era5-scaling}
# Processes per node: "auto" = one per GPU SLURM gave the job on a node, CPU_NPROC_PER_NODE without GPUs.
NPROC_PER_NODE=${NPROC_PER_NODE:-auto}
CPU_NPROC_PER_NODE=${CPU_NPROC_PER_NODE:-2}
# Rendezvous port on the first node; derived from the job id so that jobs sharing a host do not collide.
RDZV_PORT=${RDZV_PORT:-$((29500 + ${SLURM_JOB_ID:-0} % 1000))}
# torchrun on every node (through launch.py, which adds SIGUSR1 to the signals it handles), or python: a single
# process without torchrun (what submit_singlegpu.sh sets).
LAUNCHER=${LAUNCHER:-torchrun}
# How often a job may requeue itself after a stop before its time limit (SLURM_RESTART_COUNT counts them).
MAX_REQUEUES=${MAX_REQUEUES:-10}
# How often torchrun restarts the workers after one of them died (a crash, an OOM kill, a lost node); they
# continue from the newest checkpoint. Bad input, a diverged loss or a full disk are not retried.
MAX_RESTARTS=${MAX_RESTARTS:-3}
# Restarted workers must not read the previous attempt's addresses from torchrun's own store, which they
# share by default and which then fails their connections now and then (PyTorch issue 135712); the training
# scripts also look at that store under a prefix of each attempt's own (utils/parallel/distributed.py).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}

case "$SITE" in
  kestrel)
    # Modules to load, space separated (the conda of the cluster); `module avail` lists the names.
    MODULES=${MODULES-anaconda3}
    # Slingshot: NCCL needs the aws-ofi-nccl plugin; point NCCL_PLUGIN_DIR at its lib/ if your
    # environment does not bring it. NREL's tutorial had to limit GPUDirect RDMA to the NICs (LOC) for NCCL to run.
    NCCL_PLUGIN_DIR=${NCCL_PLUGIN_DIR-}
    export NCCL_NET_GDR_LEVEL=${NCCL_NET_GDR_LEVEL:-LOC}
    # HDF5 file locking fails on Lustre mounted without flock (Kestrel's /scratch, as Perlmutter's).
    export HDF5_USE_FILE_LOCKING=${HDF5_USE_FILE_LOCKING:-FALSE}
    ;;
  perlmutter)
    # NERSC's conda module. Slingshot needs NCCL's aws-ofi-nccl plugin (NCCL_PLUGIN_DIR), which NERSC's
    # own PyTorch brings: MODULES=pytorch PYTHON_ENV= uses it instead of a conda environment.
    MODULES=${MODULES-conda}
    NCCL_PLUGIN_DIR=${NCCL_PLUGIN_DIR-}
    # HDF5 file locking fails on Perlmutter's file systems when many ranks open the same file.
    export HDF5_USE_FILE_LOCKING=${HDF5_USE_FILE_LOCKING:-FALSE}
    ;;
  generic)
    MODULES=${MODULES-}
    NCCL_PLUGIN_DIR=${NCCL_PLUGIN_DIR-}
    ;;
  *)
    echo "error: SITE=$SITE is not one of kestrel, perlmutter, generic" >&2
    exit 2
    ;;
esac
# ------------------------------------------------------------------------------------------------------
set -euo pipefail

die() {
  echo "error: $*" >&2
  exit 2
}

[[ -n ${SLURM_JOB_ID:-} ]] || die "submit this script with sbatch (see the usage at its top)"
[[ $# -ge 1 ]] || die "no script to run: sbatch submit_multinode.sh SCRIPT.py [ARGUMENTS...]"
cd "$SLURM_SUBMIT_DIR"
[[ -f $1 ]] || die "$1 not found in $SLURM_SUBMIT_DIR: submit from the repository root"

if [[ -n $MODULES ]]; then
  # shellcheck disable=SC2086  # a list of module names
  module load $MODULES
fi
if [[ -n $NCCL_PLUGIN_DIR ]]; then
  export LD_LIBRARY_PATH=$NCCL_PLUGIN_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi

activate_python_env() {
  # Activation scripts read unset variables; relax -u while they run.
  set +u
  if [[ -f $PYTHON_ENV/pyvenv.cfg ]]; then
    # shellcheck disable=SC1091  # the path is only known at run time
    source "$PYTHON_ENV/bin/activate"
  elif command -v conda >/dev/null; then
    eval "$(conda shell.bash hook)"
    conda activate "$PYTHON_ENV" || die "conda cannot activate PYTHON_ENV=$PYTHON_ENV"
  else
    die "PYTHON_ENV=$PYTHON_ENV is neither a virtualenv directory nor usable with conda (not on PATH)"
  fi
  set -u
}
[[ -z $PYTHON_ENV ]] || activate_python_env
command -v python >/dev/null || die "python not found: set PYTHON_ENV to an environment with PyTorch"

gpus_per_node=${SLURM_GPUS_ON_NODE:-0}
[[ $LAUNCHER == torchrun || $LAUNCHER == python ]] || die "LAUNCHER=$LAUNCHER is not one of torchrun, python"

# The time limit as Unix seconds: a run asked to stop compares the time left with its last checkpoint write and
# warns when the signal's lead looks too short (SLURM tells a job nothing of its lead).
end_time=$(squeue -h -j "$SLURM_JOB_ID" -o %e 2>/dev/null || true)
if [[ -z ${JOB_END_TIME:-} && $end_time == [0-9]* ]]; then  # not N/A (no limit), nor empty (date would say today)
  JOB_END_TIME=$(date -d "$end_time" +%s 2>/dev/null || true)
fi
export JOB_END_TIME=${JOB_END_TIME:-}

# A requeued job continues its run: training scripts resume from the newest checkpoint, if there is one.
if [[ $(basename "$1") == train*.py && " $* " != *" --resume"* ]]; then
  set -- "$@" --resume auto
fi

# The run goes on in the background so that this shell can catch SIGUSR1 (the time limit is near) and
# SIGTERM (scancel, preemption) and pass them on as SIGTERM: the training processes then checkpoint
# the step they are on and stop (exit code 75). torchrun forwards SIGTERM to its workers.
stop_signal=
# shellcheck disable=SC2317  # called by the traps below
stop_run() {
  stop_signal=$1
  echo "job $SLURM_JOB_ID: SIG$1 received: the run checkpoints its current step and stops"
  if [[ $LAUNCHER == python ]]; then
    kill -TERM "$run_pid" 2>/dev/null || true
  else
    scancel --signal=TERM "$SLURM_JOB_ID"  # every process of the job's steps, not this shell
  fi
}
trap 'stop_run USR1' USR1
trap 'stop_run TERM' TERM

finish() {  # $1: the run's exit status
  # Stopped (75) without a signal to this shell: the run's processes got the time limit's SIGUSR1 themselves
  # (--signal=USR1@N without B:); scancel JOBID and preemption signal this shell too.
  if [[ $stop_signal == USR1 || ( -z $stop_signal && $1 == 75 ) ]]; then
    local restarts=${SLURM_RESTART_COUNT:-0}
    if ((restarts >= MAX_REQUEUES)); then
      echo "error: job $SLURM_JOB_ID reached its time limit $((restarts + 1)) times (MAX_REQUEUES=$MAX_REQUEUES):" \
        "not requeued; submit it again to continue (the run resumes from its newest checkpoint)" >&2
      exit 1
    fi
    echo "job $SLURM_JOB_ID: requeued (segment $((restarts + 2))), to continue from the newest checkpoint"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
  fi
  exit "$1"
}

wait_for_run() {  # a trapped signal interrupts `wait`: wait again until the run itself has ended
  local status=0
  wait "$run_pid" || status=$?
  while kill -0 "$run_pid" 2>/dev/null; do
    status=0
    wait "$run_pid" || status=$?
  done
  finish "$status"
}

if [[ $LAUNCHER == python ]]; then
  echo "job $SLURM_JOB_ID: 1 process on ${SLURMD_NODENAME:-$(hostname)}, $gpus_per_node GPUs, site $SITE"
  echo "running: python $*"
  python "$@" &
  run_pid=$!
  wait_for_run
fi
if [[ $NPROC_PER_NODE == auto ]]; then
  if ((gpus_per_node > 0)); then NPROC_PER_NODE=$gpus_per_node; else NPROC_PER_NODE=$CPU_NPROC_PER_NODE; fi
fi
if ((gpus_per_node > 0)); then
  # NCCL's flight recorder: the last collectives of every rank, dumped when one times out (a hang), one file
  # per rank in nccl_trace_<job id>/; read them with `torchfrtrace nccl_trace_<job id> -p rank_`.
  export TORCH_NCCL_TRACE_BUFFER_SIZE=${TORCH_NCCL_TRACE_BUFFER_SIZE:-20000}
  export TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}
  export TORCH_FR_DUMP_TEMP_FILE=${TORCH_FR_DUMP_TEMP_FILE:-$SLURM_SUBMIT_DIR/nccl_trace_$SLURM_JOB_ID/rank_}
  mkdir -p "$(dirname "$TORCH_FR_DUMP_TEMP_FILE")"
fi
if ((gpus_per_node == 0)); then
  # CPU processes share the node's cores; torchrun would otherwise give each a single thread.
  threads=$((SLURM_CPUS_ON_NODE / NPROC_PER_NODE))
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$((threads > 0 ? threads : 1))}
fi

# The first node hosts the rendezvous. A node name that does not resolve (emulated nodes sharing a
# host) is replaced by the address SLURM itself uses for that node.
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
rdzv_host=$head_node
if ! getent hosts "$head_node" >/dev/null; then
  rdzv_host=$(scontrol show node "$head_node" | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p')
fi

echo "job $SLURM_JOB_ID: $SLURM_JOB_NUM_NODES nodes ($SLURM_JOB_NODELIST) x $NPROC_PER_NODE processes," \
  "$gpus_per_node GPUs per node, site $SITE, rendezvous $rdzv_host:$RDZV_PORT"
echo "running: $*"

# srun does not pass sbatch's CPU count on to the step (Slurm >= 22.05): give each node task all of them.
srun --ntasks="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 --cpus-per-task="$SLURM_CPUS_ON_NODE" \
  --kill-on-bad-exit=1 \
  python launch.py \
  --nnodes="$SLURM_JOB_NUM_NODES" \
  --nproc-per-node="$NPROC_PER_NODE" \
  --rdzv-backend=c10d \
  --rdzv-endpoint="$rdzv_host:$RDZV_PORT" \
  --rdzv-id="$SLURM_JOB_ID" \
  --max-restarts="$MAX_RESTARTS" \
  "$@" &
run_pid=$!
wait_for_run
