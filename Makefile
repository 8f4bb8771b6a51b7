# Two commands on a fresh clone:
#   make train   virtualenv + install + synthetic data (if missing) + train.py --config quickstart
#   make test    virtualenv + install + test dependencies + the import contracts (.importlinter) + pytest
# and for Part II's ViT forecaster:
#   make train-vit   virtualenv + install + synthetic 20-channel data (if missing) + train.py --config vit_quickstart
# and for Part III's 3-D U-Net:
#   make train-unet  virtualenv + install + synthetic N-body -> hydro boxes (if missing) + train.py --config unet3d_quickstart
# and for your own netCDF / GRIB / Zarr data (datasets/convert.py):
#   make install-data  the converter's further readers (requirements-data.txt: h5netcdf, cfgrib with ecCodes)
#   make real-data     real ERA5 fields for its tests and examples (datasets/real: cfgrib's sample, from PyPI)
# and on a machine with a CUDA GPU, with the torch already there (no .venv, no network):
#   make gpu-check   tests/gpu_check.py: the CUDA tests, Steps 1-2 measured, MFU, profiling, the ladder; one report
# and other libraries' models by class path alone (MONAI, neuraloperator, segmentation_models_pytorch), as CI runs it:
#   make test-libraries  tests/libraries.py: each through every script, in .venv-libraries over .venv (a few minutes)
# and after a change to what the pages' deterministic outputs show (the estimate, the plan):
#   make docs-outputs  rewrites those output blocks from fresh runs (tests/test_readme.py compares them exactly)
# Installs take the tested versions from constraints.txt; `make lock` refreshes it, LOCK= skips it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
QUICKSTART_DATA := datasets/synthetic_small
VIT_DATA := datasets/synthetic_vit
VOLUME_DATA := datasets/synthetic_volume
VIT_LAYOUT := --channels nersc20 --hours-per-step 6 --height 33 --width 64 --seed 0
# The tested versions (see its header). LOCK= installs the newest versions requirements.txt allows.
LOCK_FILE := constraints.txt
LOCK ?= $(LOCK_FILE)
# Where PyTorch comes from, if not PyPI: TORCH_INDEX=https://download.pytorch.org/whl/cpu installs its CPU wheel
# (the pinned version, without the CUDA libraries) before everything else, which then keeps it.
TORCH_INDEX ?=
# Not given, the install takes the build this node's NVIDIA driver runs: tools/torch_build.py prints its one line
# (stderr) and the index (stdout; empty: PyPI). Expanded with the install's recipe, so `make -n install` shows the
# choice and other targets never run nvidia-smi; the $(eval) keeps the first answer (one run, one line).
# A driver too old for any CUDA build of the pin: the script says so in one line and fails; STOP then ends the
# install before anything is made (no stamp).
TORCH_BUILD_INDEX = $(eval TORCH_BUILD_INDEX := $(or $(TORCH_INDEX),$(shell $(PYTHON) tools/torch_build.py \
	--index-url || echo STOP)))$(TORCH_BUILD_INDEX)
TORCH_PIN = $$(sed -n 's/^torch==//p' $(LOCK_FILE))
TORCHVISION_PIN = $$(sed -n 's/^torchvision==//p' $(LOCK_FILE))
# pip's own error says why; this line says what to do (set apart: its commas would split the $(if ...) below).
TORCH_INDEX_FAILED = echo "error: pip could not install torch==$(TORCH_PIN) from $(TORCH_BUILD_INDEX) (its reason \
	above): load the site's PyTorch module (docs/setup.md), or choose the index: make install TORCH_INDEX=URL \
	(https://download.pytorch.org/whl/cpu: CPU only)" >&2; exit 1

.PHONY: train train-vit train-unet test test-torch test-libraries data data-vit data-unet install install-data real-data \
	lock clean gpu-check docs-outputs

install: $(VENV)/.installed

# Depends on the lock too, so that a refreshed lock reinstalls (pip moves every package to its pin).
$(VENV)/.installed: requirements.txt $(LOCK)
	$(if $(filter STOP,$(TORCH_BUILD_INDEX)),@exit 1)
	@echo "Installing the tested versions into $(VENV): about 5.7 GB, most of it the CUDA libraries that PyTorch's" \
	  "Linux wheel brings also to a machine without a GPU (a CPU-only install: README.md, Quickstart)."
	$(PYTHON) -m venv $(VENV)
	$(if $(TORCH_BUILD_INDEX),$(PY) -m pip install "torch==$(TORCH_PIN)" "torchvision==$(TORCHVISION_PIN)" \
		--index-url $(TORCH_BUILD_INDEX) \
		|| { $(TORCH_INDEX_FAILED); })
	$(PY) -m pip install -r requirements.txt $(if $(LOCK),-c $(LOCK))
	touch $@

# datasets/convert.py's optional readers; after the main install, so that the lock's versions stay.
install-data: $(VENV)/.installed-data

$(VENV)/.installed-data: requirements-data.txt $(VENV)/.installed
	$(PY) -m pip install -r requirements-data.txt $(if $(LOCK),-c $(LOCK))
	touch $@

# Real ERA5 fields that no one here wrote: the sample cfgrib's source release ships (t and z at 850 and 500 hPa,
# 10 ensemble members at 4 times 12 hours apart, 3 degrees; GRIB and the same fields as netCDF), from PyPI.
REAL_DATA := datasets/real
CFGRIB_SDIST := cfgrib-0.9.15.1
real-data: $(REAL_DATA)/era5-levels-members.nc

$(REAL_DATA)/era5-levels-members.nc: | $(VENV)/.installed
	$(PY) -m pip download --no-binary :all: --no-deps $(subst -,==,$(CFGRIB_SDIST)) -d $(REAL_DATA)
	tar -xzf $(REAL_DATA)/$(CFGRIB_SDIST).tar.gz -C $(REAL_DATA) --strip-components 3 --touch \
		$(CFGRIB_SDIST)/tests/sample-data/era5-levels-members.grib $(CFGRIB_SDIST)/tests/sample-data/era5-levels-members.nc

# Refresh the lock: the newest versions requirements.txt allows, installed into a throwaway virtualenv,
# frozen into $(LOCK_FILE) under its comment header (pip itself left out: it is not a dependency).
lock:
	set -e; tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	$(PYTHON) -m venv "$$tmp/venv"; \
	"$$tmp/venv/bin/python" -m pip install -r requirements.txt; \
	"$$tmp/venv/bin/python" -m pip install -r requirements-data.txt; \
	{ grep '^#' $(LOCK_FILE) | grep -v '^# Generated by make lock' || true; \
	  py=$$("$$tmp/venv/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])'); \
	  echo "# Generated by make lock: Python $$py, $$(uname -s) $$(uname -m)"; \
	  "$$tmp/venv/bin/python" -m pip freeze --all --exclude pip; } > "$$tmp/lock"; \
	cp "$$tmp/lock" $(LOCK_FILE)

# The quickstart's synthetic stand-in for ERA5: same layout, 181x360 fields (a quarter of ERA5's resolution).
data: $(QUICKSTART_DATA)/valid

$(QUICKSTART_DATA)/valid: | $(VENV)/.installed
	$(PY) datasets/make_synthetic_era5.py --out $(QUICKSTART_DATA) --samples-per-year 64 \
		--height 181 --width 360 --seed 0 --train-years 2008 2010 --valid-years 2015

train: $(VENV)/.installed data
	$(PY) train.py --config quickstart

# The ViT quickstart's stand-in for NERSC's ERA5: 20 channels every 6 hours, 33x64 fields (32x64
# once the loader drops the last row), 2 training years of 730 samples (half a year each) with
# their stats/, then 128 validation samples. The validation file comes last and appears only when
# complete (written under a temporary name), so it marks the whole data set as done.
data-vit: $(VIT_DATA)/valid/2015.h5

$(VIT_DATA)/valid/2015.h5: | $(VENV)/.installed
	$(PY) datasets/make_synthetic_era5.py --out $(VIT_DATA) $(VIT_LAYOUT) --samples-per-year 730 \
		--train-years 2008 2010 --valid-years
	$(PY) datasets/make_synthetic_era5.py --out $(VIT_DATA) $(VIT_LAYOUT) --samples-per-year 128 \
		--train-years --valid-years 2015 --no-stats

train-vit: $(VENV)/.installed data-vit
	$(PY) train.py --config vit_quickstart

# The U-Net quickstart's stand-in for SC22's boxes (utils/data/volume.py's STAND_IN): a 96^3 training box,
# then a 64^3 validation box; each file appears only when complete, so the validation file marks the whole set.
data-unet: $(VOLUME_DATA)/valid.h5

$(VOLUME_DATA)/valid.h5: | $(VENV)/.installed
	$(PY) datasets/make_synthetic_volume.py --out $(VOLUME_DATA) --train-side 96 --valid-side 64 --seed 0

train-unet: $(VENV)/.installed data-unet
	$(PY) train.py --config unet3d_quickstart

# Test dependencies beyond pip (slurm-wlm, munge, shellcheck, ferret-datasets) come from apt when running as root;
# the converter's readers and real fields (tests/test_convert.py) from PyPI.
test: $(VENV)/.installed $(VENV)/.installed-data real-data
	bash tests/install_slurm.sh
	$(VENV)/bin/lint-imports --no-logo
	$(PY) -m pytest -q --durations=25 tests

# The GPU check runs with whatever python holds the GPU's torch (PYTHON=python3: a GPU machine's own, or an activated
# cluster environment); it makes its own small data and writes $(GPU_CHECK_OUT)/gpu_check.json and .md.
GPU_CHECK_OUT ?= runs/gpu_check
gpu-check:
	$(PYTHON) tests/gpu_check.py --out $(GPU_CHECK_OUT)

docs-outputs: $(VENV)/.installed
	$(PY) -m tests.page_outputs --write

# Every script's laptop command, a few steps each, on another torch (tests/torch_versions.py; docs/setup.md has the
# table): make test-torch TORCH=2.11.0 builds .venv-torch-2.11.0 (that torch, the lock's versions of the rest) or
# reuses it; TORCH_VENV=.venv checks the pinned environment as it is. CI runs the suite on the pin only.
TORCH ?=
TORCH_VENV ?= .venv-torch-$(TORCH)
test-torch: data data-vit
	$(PYTHON) tests/torch_versions.py --torch "$(TORCH)" --venv "$(TORCH_VENV)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))

# Other libraries' models, each by its class path alone, through every script (tests/libraries.py; docs/development.md):
# .venv-libraries holds the versions of requirements-libraries.txt and reads .venv for the rest (its torch is not
# installed again); made once, then reused. CI runs it after make test (.ci/run).
LIBRARIES_VENV ?= .venv-libraries
test-libraries: $(VENV)/.installed $(VENV)/.installed-data
	$(PY) tests/libraries.py --venv "$(LIBRARIES_VENV)"

clean:
	rm -rf runs $(QUICKSTART_DATA) $(VIT_DATA) $(VOLUME_DATA)
