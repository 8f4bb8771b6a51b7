# Two commands on a fresh clone:
#   make train   virtualenv + install + synthetic data (if missing) + train.py --config quickstart
#   make test    virtualenv + install + test dependencies + pytest
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
QUICKSTART_DATA := datasets/synthetic_small

.PHONY: train test data install clean

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

# Test dependencies beyond pip (slurm-wlm, munge, shellcheck) come from apt when running as root.
test: $(VENV)/.installed
	bash tests/install_slurm.sh
	$(PY) -m pytest -q tests

clean:
	rm -rf runs $(QUICKSTART_DATA)
