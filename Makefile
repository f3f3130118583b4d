# Shortcuts for instructors and contributors. Everything here is a plain command you can also type.
#   make results        full re-run of the four labs on a CUDA GPU, capped to GPU_MEMORY_GB (default 8):
#                       results/*.json, results/figures/, results/README-results.md and the README tables
#   make smoke-results  the same on the tiny smoke configuration (CPU is fine), into a temp folder or OUT=DIR;
#                       never touches results/ or README.md
#   make test           the README's (and .ci/run's) test command: unit tests + every notebook (smoke mode), each run
#                       once through regenerate --smoke, which also serves the acceptance test of all four labs
#   make test-regen-all the acceptance test alone: regenerate all four notebooks in smoke mode (minutes)
PYTHON ?= python
GPU_MEMORY_GB ?= 8
ONLY ?=
OUT ?=

.PHONY: results smoke-results test test-regen-all

results:
	$(PYTHON) -m labutils regenerate --gpu-memory-gb $(GPU_MEMORY_GB) $(if $(ONLY),--only $(ONLY)) $(if $(OUT),--out $(OUT))

smoke-results:
	$(PYTHON) -m labutils regenerate --smoke --gpu-memory-gb $(GPU_MEMORY_GB) $(if $(ONLY),--only $(ONLY)) $(if $(OUT),--out $(OUT))

test:
	LAB_SMOKE=1 $(PYTHON) -m pytest -n auto tests *.ipynb

test-regen-all:
	LAB_FULL_REGEN=1 $(PYTHON) -m pytest -q tests/test_regenerate.py tests/test_one_number.py tests/test_worktree_clean.py
