# Two entry points, each doing its own set-up from a fresh clone:
#   make demo   creates .venv, installs stepfx, trains a small GPT (ZeRO-3, 2 local processes)
#   make test   creates .venv, installs stepfx with test extras, runs the whole suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.stepfx-installed

.PHONY: demo test test-all install browser clean

install: $(STAMP)

# torch is pinned to the CPU build served from local disk; a range would pull a CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,report]'
	touch $(STAMP)

# The report's browser test (tests/report/test_browser.py) drives Debian's Chromium through
# playwright; without it the test skips, saying so. Not part of `make install`: installing
# Chromium with apt took 3 min 15 s here, a fifth of CI's 15-minute budget.
browser: $(STAMP)
	command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium)
	$(PY) -m pytest -q tests/report/test_browser.py

demo: $(STAMP)
	$(PY) -m torch.distributed.run --standalone --nproc_per_node 2 examples/demo_gpt.py

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup

# every case of the parametrizations that rotate (tests/rotation.py), not today's sample
test-all: $(STAMP)
	STEPFX_TEST_ROTATION=all $(PY) -m pytest -q -n 2 --dist loadgroup

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
