# The two newcomer commands (see README): `make demo` and `make test`. Both set up .venv first.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
# CPU build of torch: the pinned version installs from the local wheel here; GPU users may preinstall
# their own torch>=2.6 in the venv, which pip then keeps.
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup demo test bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

demo: setup
	$(VENV)/bin/scalerl demo

# pytest exits 5 when it collects no test; that is reported, not hidden, and is not a crash.
# scripts/install_test_packages.sh installs Slurm/iproute2 for their tests when root (else says what skips).
test: setup
	scripts/install_test_packages.sh
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(PY) -m pytest -q -p no:cacheprovider; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 0; fi; exit $$rc

bench: setup
	$(PY) benchmarks/generation.py

clean:
	rm -rf $(VENV) outputs
