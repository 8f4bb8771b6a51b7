# Two commands on a fresh clone:
#   make train   virtualenv + install + synthetic data (if missing) + train.py --config quickstart
#   make test    virtualenv + install + test dependencies + pytest
# and for Part II's ViT forecaster:
#   make train-vit   virtualenv + install + synthetic 20-channel data (if missing) + train.py --config vit_quickstart
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
QUICKSTART_DATA := datasets/synthetic_small
VIT_DATA := datasets/synthetic_vit
VIT_LAYOUT := --channels nersc20 --hours-per-step 6 --height 33 --width 64 --seed 0

.PHONY: train train-vit test data data-vit install clean

install: $(VENV)/.installed

$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -r requirements.txt
	touch $@

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

# Test dependencies beyond pip (slurm-wlm, munge, shellcheck) come from apt when running as root.
test: $(VENV)/.installed
	bash tests/install_slurm.sh
	$(PY) -m pytest -q tests

clean:
	rm -rf runs $(QUICKSTART_DATA) $(VIT_DATA)
