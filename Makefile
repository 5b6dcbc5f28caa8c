# Two entry points, each doing its own set-up from a fresh clone:
#   make demo   creates .venv, installs stepfx, trains a small GPT (ZeRO-3, 2 local processes)
#   make test   creates .venv, installs stepfx with test extras, runs the whole suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.stepfx-installed

.PHONY: demo test install clean

install: $(STAMP)

# torch is pinned to the CPU build served from local disk; a range would pull a CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,report]'
	@# the report's browser test drives Debian's Chromium (playwright downloads no browser here);
	@# without apt or a network it skips, saying so
	command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) \
		|| echo "stepfx: could not install chromium: tests/report/test_browser.py will skip"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m torch.distributed.run --standalone --nproc_per_node 2 examples/demo_gpt.py

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
