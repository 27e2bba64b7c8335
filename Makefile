# Routine commands. Each target sets up .venv from env/requirements-cpu.lock first (idempotent).
VENV ?= .venv
PY := $(VENV)/bin/python
SETUP := bash env/setup.sh
PYTEST_ARGS ?=

.PHONY: peer-src gpu-topics ncu-gpu setup test test-fast test-fuzz tour lab aot bench-gpu step-gpu lock clean info doctor plan serve serve-bench tiny screenshots

setup:
	@$(SETUP)

## The main job: every notebook headless on the embedded defaults -> build/tour/index.html
tour: setup
	$(PY) -m ds4lab tour

## The whole test suite (CPU: Triton interpreter lane, sm_89/sm_90 compile report, real vLLM, notebooks)
test: setup
	$(PY) -m pytest --nbval-lax tests notebooks $(PYTEST_ARGS)

## Everything but the slow lanes (vLLM server, notebooks)
test-fast: setup
	$(PY) -m pytest -m "not vllm and not notebook" $(PYTEST_ARGS)

## The interpreter lane with fresh random draws (CI uses fixed per-test seeds; a failure prints its seed)
test-fuzz: setup
	DS4LAB_TEST_SEED=random $(PY) -m pytest -m interp $(PYTEST_ARGS)

## JupyterLab on notebooks/ (as root, e.g. in a container, Jupyter refuses to start without --allow-root)
LAB_UID ?= $(shell id -u)
lab: setup
	$(VENV)/bin/jupyter lab --notebook-dir=notebooks$(if $(filter 0,$(LAB_UID)), --allow-root)

## The kernel notebooks' charts drawn in headless Chromium (apt-get install -y chromium) and checked -> build/screenshots/
screenshots: setup
	$(PY) -m ds4lab.views.screenshot build/screenshots --numerics

info: setup
	$(PY) -m ds4lab info

## sm_89 / sm_90 / sm_120 compile report of every registered kernel config (sm_120: its table's GPU defaults)
aot: setup
	$(PY) -m ds4lab aot

## On the H200 image (no venv): python3 -m ds4lab.harness.bench --out results/
bench-gpu:
	python3 -m ds4lab.harness.bench --out results

## The peer kernels' vLLM source for a machine without vLLM (the H200): copied into the ignored
## .peer/ (never committed); pass it as `--peer-src .peer` (carry .peer to the device)
peer-src: setup
	$(PY) -m ds4lab.harness.peers --copy-to .peer

## On the H200 image: issue-20 candidate sweeps, at most ~3 topics per 10-minute device call
## (e.g. make gpu-topics TOPICS="gemm moe mhc", then TOPICS="route oproj attn"), .peer carried
gpu-topics:
	OUT=results/gpu TOPICS="$(or $(TOPICS),gemm moe mhc)" bash scripts/gpu/topics.sh

## On the H200 image: Nsight Compute counters of the decode step's largest kernels at batch 1 (digest printed)
ncu-gpu:
	OUT=results/ncu bash scripts/gpu/ncu_decode.sh

## On the H200 image: the decode step, model check + native and sm_89 builds (MODE=full for all points)
step-gpu:
	OUT=results bash scripts/gpu/step.sh

doctor: setup
	$(PY) -m ds4lab doctor

plan: setup
	$(PY) -m ds4lab plan

## OpenAI-compatible vLLM server with MTP (PROFILE=tiny-cpu | ada-upstream | community-sm89-fork)
PROFILE ?= tiny-cpu
serve: setup
	$(PY) -m ds4lab serve --profile $(PROFILE)

## With and without MTP: warmup, canary, tokens/s, TTFT, TPOT, acceptance (table)
serve-bench: setup
	$(PY) -m ds4lab serve --profile $(PROFILE) --bench

## The embedded tiny DeepSeek-V4 checkpoint (~/.cache/ds4lab/tiny-dsv4[-agree])
tiny: setup
	$(PY) -m ds4lab tiny
	$(PY) -m ds4lab tiny --agree-heads

## Re-resolve env/requirements-cpu.in into the lock (needs network to PyPI)
lock:
	bash env/lock.sh

clean:
	rm -rf build .pytest_cache
