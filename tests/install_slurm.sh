#!/bin/bash
# Installs what the real-SLURM tests need: Debian's slurm-wlm and munge, and shellcheck; and ferret-datasets,
# whose monthly_navy_winds.cdf is datasets/README.md's file from another centre (tests/test_readme.py runs it).
# Idempotent: does nothing when they are installed. Without root or apt-get it only says so (the
# SLURM tests then skip, except under CI=true, where they fail).
set -euo pipefail

packages=(slurm-wlm munge shellcheck ferret-datasets)
missing=()
for package in "${packages[@]}"; do
  if ! dpkg-query --show --showformat='${Status}' "$package" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$package")
  fi
done
if ((${#missing[@]} == 0)); then
  exit 0
fi
if ((EUID != 0)) || ! command -v apt-get >/dev/null; then
  echo "install_slurm.sh: not installing ${missing[*]} (needs root and apt-get); the SLURM tests will skip" >&2
  exit 0
fi
echo "install_slurm.sh: installing ${missing[*]}"
apt-get update -q
DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
