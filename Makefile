# ddplab: two commands to start, two to check.
#   make lab        environment + JupyterLab opened on labs/exercises/ (gloo on CPU; GPUs when present)
#   make test       the tests a maintainer runs often (<= 10 min on a 2-core machine), building .venv if missing
#   make test-fast  the unit tests not marked slow or more (<= 90 s): one quick pass over every package
#   make check      make test, then everything too long for it (<= 45 min); what CI runs
PYTHON ?= python3
# Kept out of the recipes' environment (sub-makes still get a command-line value): an exported
# PYTHON would reach the Slurm jobs of make test-slurm, whose batch files honour PYTHON=.
# (unexport of a variable not yet set defines it, empty: each is unexported after its ?=.)
unexport PYTHON
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.ddplab-installed

.PHONY: lab test test-fast test-unit test-labs test-browser test-browser-more check test-unit-more test-labs-more test-labs-ws1 \
	test-hub test-gpu gpu-check test-graders handouts exercises bench clean test-slurm test-slurm-hub \
	check-lane-a check-lane-b load-test test-class-load

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

# pytest for every target below: the slowest 15 tests are printed, so a test that grew slow
# shows. pytest exits 5 when it collected nothing, which would mean a path or a marker here
# selects no test: that is reported as such and fails, never passes as an empty green run.
PYTEST = $(PY) -m pytest -p no:cacheprovider --durations=15
define pytest_or_say_empty
$(PYTEST) $(1); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make $@: pytest collected no tests (exit 5): check its paths and -m" >&2; fi; exit $$rc
endef
UNIT = tests --ignore=tests/browser
# make test-unit leaves the tests marked `more` to make check (make test-unit-more), to stay
# within 5 minutes: the life-cycle stress tests, the graders' planted-mistake suites, the fake-NCCL
# and sharding suites, tests that start processes of their own (each file marks itself: tests/conftest.py).
NBVAL = --nbval-lax --nbval-current-env --nbval-sanitize-with labs/nbval-sanitize.cfg
LABS = $(sort $(wildcard labs/*.ipynb))
# The labs make test runs (<= 3 min together); the others run in make check.
LABS_QUICK = labs/tour.ipynb labs/02-average-gradients-vs-ddp.ipynb labs/03-buckets-network-no-sync.ipynb
LABS_MORE = $(filter-out $(LABS_QUICK),$(LABS))

# make test: every unit test (<= 5 min), the quick labs under nbval (<= 3 min) and a real
# browser driving JupyterLab (<= 1.5 min).
test: test-unit test-labs test-browser

# ruff first (pyflakes, bugbear, import order; configured in pyproject.toml, pinned in constraints.txt)
# On two pytest-xdist workers, one test file per worker at a time (--dist loadfile: a file's module
# fixtures, e.g. its own ranks, stay in one process); UNIT_WORKERS=0 runs them in this process.
UNIT_WORKERS ?= 2
test-fast: $(STAMP)
	$(VENV)/bin/ruff check .
	$(call pytest_or_say_empty,-q -m "not slow and not more" -n $(UNIT_WORKERS) --dist loadfile $(UNIT))

test-unit: $(STAMP)
	$(VENV)/bin/ruff check .
	$(call pytest_or_say_empty,-q -m "not more" -n $(UNIT_WORKERS) --dist loadfile $(UNIT))

test-labs: $(STAMP)
	$(call pytest_or_say_empty,-q $(NBVAL) $(LABS_QUICK))

test-browser: $(STAMP)
	$(call pytest_or_say_empty,-q -m "not more" tests/browser/test_browser.py tests/browser/test_browser_exercises.py)

# The browser's exercise runs make test leaves out: labs 11 and 12 filled in, in Chromium.
test-browser-more: $(STAMP)
	$(call pytest_or_say_empty,-q -m more tests/browser/test_browser.py tests/browser/test_browser_exercises.py)

# make check: make test, then CHECK_MORE in this order. Whatever is too long for make test
# goes into CHECK_MORE (add a target's name to the list: the full
# grader mutation catalogue, ...); make check stays <= 45 min on a 2-core machine.
# Every lab at the default world size runs in handouts (it executes each notebook and exits
# non-zero naming a failed one, as nbval does): test-labs-more stays as a target of its own.
#
# Most of these targets keep one of the two cores busy (a notebook's kernel and its ranks, the
# catalogue's ranks waiting out planted hangs, a hub and a browser): make check runs them in two
# lanes side by side (measured: the catalogue and the handouts took 424 s together, 695 s one
# after the other, both green), each lane about as long as the other. Not side by side:
# test-unit-more (its own two workers fill both cores). The browser's exercise runs go in lane A
# beside the hub (each has its own JupyterLab and Chromium; their time limits allow for a loaded
# machine): measured on a fresh clone, lane A 18 min 54 s without them, lane B 19 min 31 s. The two hubs may meet: their learners, instructors, grading accounts, sudo rules
# and ports differ. What the lanes install is installed before they start, never by one lane
# while the other runs from the same environment.
CHECK_LANE_A = test-graders handouts test-slurm test-slurm-hub test-browser-more
CHECK_LANE_B = test-labs-ws1 test-hub
CHECK_MORE = test-unit-more $(CHECK_LANE_A) $(CHECK_LANE_B)
check: $(STAMP)
	$(MAKE) test
	$(MAKE) test-unit-more
	$(MAKE) $(HUB_INSTALLED) $(SLURM_HUB_INSTALLED)
	$(MAKE) -j2 --output-sync=target check-lane-a check-lane-b

check-lane-a:
	$(MAKE) $(CHECK_LANE_A)

check-lane-b:
	$(MAKE) $(CHECK_LANE_B)

# The unit tests make test leaves out, on UNIT_MORE_WORKERS pytest-xdist workers, one test file
# per worker at a time (--dist loadfile: a file's module fixtures, e.g. its own ranks, stay in one
# process). Most of their time is spent waiting out planted hangs and collective timeouts, which
# the second worker overlaps; UNIT_MORE_WORKERS=0 runs them in this process, one after another.
UNIT_MORE_WORKERS ?= 2
# the trainers ddplab.record is tested under (tests/measure/test_record_trainers.py): Lightning,
# accelerate, transformers; pure-Python wheels, pinned so that they keep the CPU torch
TRAINERS_INSTALLED := $(VENV)/.ddplab-trainers
$(TRAINERS_INSTALLED): $(STAMP)
	$(PY) -m pip install --quiet -c constraints.txt -e '.[trainers]'
	touch $@

test-unit-more: $(TRAINERS_INSTALLED)
	$(call pytest_or_say_empty,-q -m more -n $(UNIT_MORE_WORKERS) --dist loadfile $(UNIT))

# The labs make test leaves out.
test-labs-more: $(STAMP)
	$(call pytest_or_say_empty,-q $(NBVAL) $(LABS_MORE))

# Every lab at world size 1, as a one-GPU server runs them: cells that need two ranks skip
# saying so (on CPU, GPU-only cells skip as well).
test-labs-ws1: $(STAMP)
	DDPLAB_WORLD_SIZE=1 $(call pytest_or_say_empty,-q $(NBVAL) $(LABS))

# A real JupyterHub from `python -m ddplab classroom`: two learners in Chromium, nbgrader
# autograde, the idle culler. The proxy is npm's configurable-http-proxy from proxy/'s lockfile.
# The real hub's learners are Unix accounts of their own: their servers run from .venv-hub, built
# from the system's Python so that every account can run it (a pyenv Python under /root is not).
# Where .venv itself is built from the system's Python, one environment serves both: CI runs
# `make check PYTHON=/usr/bin/python3 HUB_VENV=.venv` (.ci/run) and builds one instead of two.
HUB_PYTHON ?= /usr/bin/python3
HUB_VENV   ?= .venv-hub
unexport HUB_VENV
HUB_SUDO   := $(if $(filter 0,$(shell id -u)),,sudo -E)  # it creates and deletes Unix accounts
# Installed once (stamps): a pip install -e rewrites the editable install, which the other lane
# of make check may be importing at that moment.
PROXY_INSTALLED ?= proxy/node_modules/.ddplab-npm
HUB_INSTALLED := $(VENV)/.ddplab-classroom $(HUB_VENV)/.ddplab-hub $(PROXY_INSTALLED)
$(VENV)/.ddplab-classroom: $(STAMP)
	$(PY) -m pip install --quiet -c constraints.txt -e '.[classroom]'
	touch $@
$(HUB_VENV)/.ddplab-hub: $(STAMP)
	test -x $(HUB_VENV)/bin/python || $(HUB_PYTHON) -m venv $(HUB_VENV)
	$(HUB_VENV)/bin/python -m pip install --quiet -c constraints.txt -e '.[lab,test,browser,classroom]'
	touch $@
$(PROXY_INSTALLED): proxy/package-lock.json
	npm ci --prefix proxy --no-audit --no-fund
	touch $@

test-hub: $(HUB_INSTALLED)
	DDPLAB_HUB_TEST=1 $(HUB_SUDO) $(HUB_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/course/test_classroom_hub.py \
	  tests/course/test_classroom_limits.py
	DDPLAB_HUB_TEST=1 $(PY) -m pytest -q tests/course/test_classroom_grading.py

# The load test, small: 3 learners at once in a class of 2, two served, one told the class is full,
# nothing left (3-7 minutes; not in make check, whose budget it would pass: run it after changing
# the classroom's limits or its capacity rule).
test-class-load: $(HUB_INSTALLED)
	DDPLAB_HUB_TEST=1 $(HUB_SUDO) $(HUB_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/course/test_class_load.py

# A full class, measured (tools/class_load.py; docs/classroom.md, "How many learners"): classes of
# N learners one after another, each logging in at once through the proxy, starting a server and
# running lab 00's first cell on 2 gloo ranks; times, memory per learner, refusals past the class's
# size, and what was left (nothing). Heavy: not in make check. make load-test N="10 20 30"
N ?= 10
load-test: $(HUB_INSTALLED)
	$(HUB_SUDO) $(HUB_VENV)/bin/python tools/class_load.py $(N) --out build/load-test $(LOAD_ARGS)

# A real Slurm (Debian's slurm-wlm and munge, apt-installed when missing; root): munged,
# slurmctld and two emulated nodes on 127.0.0.1, started and stopped by the test. A lab's cells
# exported with %ddp_export --sbatch run as 2-node jobs (srun, and torchrun per node) and must
# print the notebook's numbers; ddplab.record in the job writes its timeline (docs/hpc.md).
# Also: a planted hang ends its job within the collective timeout, a signalled job requeues
# itself and resumes to the uninterrupted weights, two torchruns per node and a taken port
# fail in words. Jobs are followed by polling scontrol (sbatch --wait polls every ~30 s).
test-slurm: $(STAMP)
	DDPLAB_SLURM_TEST=1 $(call pytest_or_say_empty,-q tests/launchers/test_slurm.py)

# `classroom --spawner slurm` on that real Slurm: two learners in Chromium, each server a Slurm job
# submitted as the learner's own account (sudo), ended by the idle culler and by the hub's stop.
# The learners' jobs run the environment, so it is .venv-hub, from the system's Python (/root is 0700).
SLURM_HUB_VENV ?= $(HUB_VENV)
SLURM_HUB_INSTALLED := $(SLURM_HUB_VENV)/.ddplab-slurm-hub
$(SLURM_HUB_INSTALLED): $(STAMP)
	test -x $(SLURM_HUB_VENV)/bin/python || $(HUB_PYTHON) -m venv $(SLURM_HUB_VENV)
	$(SLURM_HUB_VENV)/bin/python -m pip install --quiet -c constraints.txt -e '.[lab,test,browser,classroom,slurm]'
	touch $@

test-slurm-hub: $(SLURM_HUB_INSTALLED) $(PROXY_INSTALLED)
	DDPLAB_SLURM_TEST=1 $(SLURM_HUB_VENV)/bin/python -m pytest -q -p no:cacheprovider --durations=5 \
	  tests/course/test_classroom_slurm.py

# Every exercise's grader against its mutation catalogue (correct and wrong solutions) on live ranks.
test-graders: $(STAMP)
	PYTHONPATH=. $(PY) tests/graders_catalogue.py

# On a GPU machine: the CUDA build of torch already installed there (never the CPU pin),
# the other dependencies from PyPI or from a folder of wheels (make test-gpu WHEELS=dir).
# Runs the GPU tests (one GPU is enough: world size 1 over nccl) and every lab at the
# world size the GPUs allow (DDPLAB_WORLD_SIZE; cells that need 2 ranks skip saying so).
GPU_VENV ?= .venv-gpu
GPU_PY   := $(GPU_VENV)/bin/python
# .venv-gpu over the machine's CUDA torch (also where python3 is itself a venv), [gpu] extra installed:
test-gpu:
	$(PYTHON) tools/gpu_check.py --install-only $(if $(WHEELS),--wheels $(WHEELS))
	$(GPU_PY) -m ddplab doctor --world-size 1 --world-size 2
	DDPLAB_REQUIRE_DEVICE_GRADS=1 $(GPU_PY) -m pytest -q -rs -m gpu tests
	DDPLAB_REQUIRE_DEVICE_GRADS=1 DDPLAB_WORLD_SIZE=$$($(GPU_PY) -c "import torch; print(min(2, torch.cuda.device_count()))") \
	  $(GPU_PY) -m pytest -q --nbval-lax --nbval-current-env -p no:cacheprovider --ignore=labs/exercises labs

# On a machine with one GPU and no package registry: the one prepared run (<= 8 min, one step at
# a time): doctor, the GPU tests, every lab at world size 1 over NCCL, compare/record/view on NCCL,
# a planted CUDA hang, the step-time benchmark; one table, logs under $$OUT when set.
# make gpu-check WHEELS=dir (tools/gpu_check.py --requirements lists what dir must hold).
gpu-check:
	$(PYTHON) tools/gpu_check.py $(if $(WHEELS),--wheels $(WHEELS))

# Every solution notebook executed on live ranks and saved as static HTML with its figures
# (build/handouts/, not committed): for slides, and for learners who cannot run the lab.
handouts: $(STAMP)
	$(PY) -m ddplab.course.handouts -o build/handouts

# BEFORE: the commit whose BucketedDDP per_tensor.py times beside today's: the reducer as it
# was before its gradient copies were fused per bucket (docs/benchmarks.md, "Per-tensor host
# cost"; skipped with a message where git does not have it, e.g. a shallow clone).
BEFORE ?= 1121edf
bench: $(STAMP)
	$(PY) benchmarks/launch.py
	$(PY) benchmarks/strategies.py
	$(PY) benchmarks/per_tensor.py --against $(BEFORE)
	$(PY) benchmarks/whatif.py

clean:
	rm -rf $(VENV) $(GPU_VENV) $(HUB_VENV) .pytest_cache build *.egg-info test-artifacts
