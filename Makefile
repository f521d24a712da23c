VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-fast clean-venv

$(VENV)/.installed: pyproject.toml scripts/setup_env.sh
	bash scripts/setup_env.sh $(VENV)
	touch $@

demo: $(VENV)/.installed
	$(PY) run_70b.py

test: $(VENV)/.installed
	$(PY) -m pytest -q

test-fast: $(VENV)/.installed
	$(PY) -m pytest -q -m "not slow and not cuda"

clean-venv:
	rm -rf $(VENV)
