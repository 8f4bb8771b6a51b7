#!/bin/bash
# One GPU, one process (tutorial Steps 0-3). Submit from the repository root; arguments pass through:
#
#   sbatch [SBATCH OPTIONS] submit_singlegpu.sh SCRIPT.py [SCRIPT ARGUMENTS...]
#   sbatch submit_singlegpu.sh train.py --config baseline
#
# Site settings (SITE, PYTHON_ENV, MODULES, ...) are the ones documented at the top of
# submit_multinode.sh, which this job runs with LAUNCHER=python; PYTHON_ENV defaults to era5-scaling,
# the conda environment of conda-env.yml (docs/setup.md). Account, partition and constraint as there;
# on Perlmutter add `-q shared` (one GPU of a shared node; the exports' SBATCH_QOS=regular takes whole nodes),
# on Kestrel `--mem 80G` (a job gets 1 GB per core unless it asks): docs/quickstart-cluster.md.
# Long runs: as submit_multinode.sh (SIGUSR1 before the time limit -> checkpoint, stop, requeue, resume).
#SBATCH --job-name=era5-1gpu
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --gpus-per-node=1
#SBATCH --cpus-per-task=32
#SBATCH --time=01:00:00
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
set -euo pipefail

launcher=${SLURM_SUBMIT_DIR:-.}/submit_multinode.sh
if [[ -z ${SLURM_JOB_ID:-} || ! -f $launcher ]]; then
  echo "error: submit this script with sbatch from the repository root (see the usage at its top)" >&2
  exit 2
fi
export LAUNCHER=python
exec bash "$launcher" "$@"
