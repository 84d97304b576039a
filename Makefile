# ddplab: two commands.
#   make lab    environment + JupyterLab on labs/ (gloo on CPU; GPUs when present)
#   make test   every test, building .venv from scratch when it is missing
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.ddplab-installed

.PHONY: lab test test-unit test-labs test-browser handouts bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# -c pins torch to the CPU wheel (an unpinned torch is a ~5 GB CUDA build).
	$(PY) -m pip install --quiet -c constraints.txt -e '.[lab,test,browser]'
	touch $(STAMP)

lab: $(STAMP)
	$(VENV)/bin/jupyter lab labs/

# unit tests (<= 5 min), the labs executed by nbval (<= 10 min), a real browser (<= 2 min)
test: test-unit test-labs test-browser

test-unit: $(STAMP)
	$(PY) -m pytest -q tests --ignore=tests/test_browser.py

test-labs: $(STAMP)
	$(PY) -m pytest -q --nbval-lax --nbval-current-env --nbval-sanitize-with labs/nbval-sanitize.cfg \
	  -p no:cacheprovider labs

test-browser: $(STAMP)
	$(PY) -m pytest -q tests/test_browser.py

# Every solution notebook executed on live ranks and saved as static HTML with its figures
# (build/handouts/, not committed): for slides, and for learners who cannot run the lab.
handouts: $(STAMP)
	$(PY) -m ddplab.handouts -o build/handouts

bench: $(STAMP)
	$(PY) benchmarks/launch.py
	$(PY) benchmarks/strategies.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info test-artifacts
