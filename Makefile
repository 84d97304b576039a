# ddplab: two commands.
#   make lab    environment + JupyterLab opened on labs/exercises/ (gloo on CPU; GPUs when present)
#   make test   every test, building .venv from scratch when it is missing
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.ddplab-installed

.PHONY: lab test test-unit test-labs test-browser test-gpu handouts exercises bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# -c pins torch to the CPU wheel (an unpinned torch is a ~5 GB CUDA build).
	$(PY) -m pip install --quiet -c constraints.txt -e '.[lab,test,browser]'
	touch $(STAMP)

# Serves labs/ (solutions one folder up) and opens on the exercises.
lab: $(STAMP)
	$(VENV)/bin/jupyter lab --ServerApp.root_dir=labs --LabApp.default_url=/lab/tree/exercises

# labs/exercises/ is nbgrader generate_assignment's output for labs/ (nbgrader solution cells stubbed).
exercises: $(STAMP)
	$(PY) -m ddplab.course.exercises

# unit tests (<= 5 min), the labs executed by nbval (<= 10 min), a real browser (<= 2 min)
test: test-unit test-labs test-browser

test-unit: $(STAMP)
	$(PY) -m pytest -q tests --ignore-glob='tests/test_browser*.py'

test-labs: $(STAMP)
	$(PY) -m pytest -q --nbval-lax --nbval-current-env --nbval-sanitize-with labs/nbval-sanitize.cfg \
	  -p no:cacheprovider --ignore=labs/exercises labs

test-browser: $(STAMP)
	$(PY) -m pytest -q tests/test_browser.py tests/test_browser_exercises.py

# On a GPU machine: the CUDA build of torch already installed there (never the CPU pin),
# the other dependencies from PyPI or from a folder of wheels (make test-gpu WHEELS=dir).
# Runs the GPU tests (one GPU is enough: world size 1 over nccl) and every lab at the
# world size the GPUs allow (DDPLAB_WORLD_SIZE; cells that need 2 ranks skip saying so).
GPU_VENV ?= .venv-gpu
GPU_PY   := $(GPU_VENV)/bin/python
test-gpu:
	test -x $(GPU_PY) || $(PYTHON) -m venv --system-site-packages $(GPU_VENV)
	$(GPU_PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'make test-gpu needs a CUDA build of torch and a GPU; this torch is ' + torch.__version__)"
	$(GPU_PY) -m pip install --quiet --no-build-isolation $(if $(WHEELS),--no-index --find-links $(WHEELS)) -e '.[test]'
	$(GPU_PY) -m ddplab doctor --world-size 1 --world-size 2
	DDPLAB_REQUIRE_DEVICE_GRADS=1 $(GPU_PY) -m pytest -q -rs -m gpu tests
	DDPLAB_REQUIRE_DEVICE_GRADS=1 DDPLAB_WORLD_SIZE=$$($(GPU_PY) -c "import torch; print(min(2, torch.cuda.device_count()))") \
	  $(GPU_PY) -m pytest -q --nbval-lax --nbval-current-env -p no:cacheprovider --ignore=labs/exercises labs

# Every solution notebook executed on live ranks and saved as static HTML with its figures
# (build/handouts/, not committed): for slides, and for learners who cannot run the lab.
handouts: $(STAMP)
	$(PY) -m ddplab.course.handouts -o build/handouts

# BEFORE: the commit whose BucketedDDP per_tensor.py times beside today's (issue 17's "before";
# skipped with a message where git does not have it, e.g. a shallow clone).
BEFORE ?= 1121edf
bench: $(STAMP)
	$(PY) benchmarks/launch.py
	$(PY) benchmarks/strategies.py
	$(PY) benchmarks/per_tensor.py --against $(BEFORE)

clean:
	rm -rf $(VENV) $(GPU_VENV) .pytest_cache build *.egg-info test-artifacts
