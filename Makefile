# ddplab: two commands.
#   make lab    environment + JupyterLab opened on labs/exercises/ (gloo on CPU; GPUs when present)
#   make test   every test, building .venv from scratch when it is missing
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.ddplab-installed

.PHONY: lab test test-unit test-labs test-browser bench clean exercises

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# -c pins torch to the CPU wheel (an unpinned torch is a ~5 GB CUDA build).
	$(PY) -m pip install --quiet -c constraints.txt -e '.[lab,test,browser]'
	touch $(STAMP)

# Serves labs/ (solutions one folder up) and opens on the exercises.
lab: $(STAMP)
	$(VENV)/bin/jupyter lab --ServerApp.root_dir=labs --LabApp.default_url=/lab/tree/exercises

# labs/exercises/ is generated from labs/ (cells tagged "solution" are stubbed).
exercises: $(STAMP)
	$(PY) -m ddplab.exercises

# unit tests (<= 5 min), the labs executed by nbval (<= 10 min), a real browser (<= 2 min)
test: test-unit test-labs test-browser

test-unit: $(STAMP)
	$(PY) -m pytest -q tests --ignore-glob='tests/test_browser*.py'

test-labs: $(STAMP)
	$(PY) -m pytest -q --nbval-lax --nbval-current-env -p no:cacheprovider --ignore=labs/exercises labs

test-browser: $(STAMP)
	$(PY) -m pytest -q tests/test_browser.py tests/test_browser_exercises.py

bench: $(STAMP)
	$(PY) benchmarks/launch.py
	$(PY) benchmarks/strategies.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info test-artifacts
