#!/usr/bin/env bash
# Offloading-runtime latency on one GPU: ideal / infinigen / h2o / quant-int4 / offload rows (one table each) for
#   (a) OPT-13B shape, random init, fp16, batch 8, prompt 1920 + 128 generated (InfiniGen Figs. 14-15's setting)
#   (b) SmolLM2-135M shape, random init, fp16, batch 32, prompt 4096 + 64 generated
# Sized for ~6 minutes on one H200: each config has its own timeout and rows print as they finish (offload, the
# slowest, last). Random init: real shapes without weights; prompts are random ids, so InfiniGen's dynamic count
# mostly hits its budget cap (0.2).
#
#   bash experiments/gpu_check.sh                 # on the GPU machine, from the repo root
#   bash experiments/gpu_check.sh --cpu-smoke     # tiny shapes on CPU: the same code path, in seconds
#   bash experiments/gpu_check.sh --fetch-wheels  # once, where pip reaches PyPI: what the GPU image lacks
#
# --fetch-wheels puts pinned pure-Python wheels (transformers, hydra-core, omegaconf, antlr4) and the pg19 text
# InfiniGen calibrates on into .gpu_check/ (git-ignored through .git/info/exclude); a GPU run installs the wheels
# into /tmp/gpu_check_site first. Env: PYTHON (default python3), DATA_DIR (default ../shared/data, then
# .gpu_check/data).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1

data_dir() {
  for d in "${DATA_DIR:-}" ../shared/data .gpu_check/data; do
    if [ -n "$d" ] && [ -f "$d/pg19/pg19_firstbook.txt" ]; then echo "$d"; return 0; fi
  done
  echo "pg19/pg19_firstbook.txt (InfiniGen's calibration text) not found: set DATA_DIR or run --fetch-wheels" >&2
  return 1
}

case "${1:-gpu}" in
  --fetch-wheels)
    mkdir -p .gpu_check/wheels .gpu_check/data/pg19
    grep -qxF '/.gpu_check/' .git/info/exclude 2>/dev/null || echo '/.gpu_check/' >> .git/info/exclude
    "$PY" -m pip download -q --no-deps --only-binary=:all: -d .gpu_check/wheels \
      transformers==5.24.0 hydra-core==1.3.8 omegaconf==2.3.1
    "$PY" -m pip wheel -q --no-deps -w .gpu_check/wheels antlr4-python3-runtime==4.9.3  # published as sdist only
    cp "$(data_dir)/pg19/pg19_firstbook.txt" .gpu_check/data/pg19/
    ls -l .gpu_check/wheels
    exit 0 ;;
  --cpu-smoke)
    data=$(data_dir)
    timeout 300 "$PY" -m experiments.latency --device cpu --data-dir "$data" --model tiny-opt --batch 2 \
      --prompt 64 --gen 6 --set task.warmup=1
    timeout 300 "$PY" -m experiments.latency --device cpu --data-dir "$data" --model tiny-llama-gqa --batch 3 \
      --prompt 80 --gen 6 --set task.warmup=1
    exit 0 ;;
  gpu) ;;
  *) echo "usage: bash experiments/gpu_check.sh [--cpu-smoke | --fetch-wheels]" >&2; exit 2 ;;
esac

if compgen -G ".gpu_check/wheels/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/gpu_check_site .gpu_check/wheels/*.whl
  export PYTHONPATH=/tmp/gpu_check_site${PYTHONPATH:+:$PYTHONPATH}
fi
"$PY" -c "import torch, transformers, hydra, omegaconf
assert torch.cuda.is_available(), 'no CUDA device visible'
print('torch', torch.__version__, '| transformers', transformers.__version__, '|', torch.cuda.get_device_name())"
timeout 60 "$PY" -c "import torch, time
x = torch.empty(2**30, dtype=torch.uint8, pin_memory=True); y = torch.empty_like(x, device='cuda')
y.copy_(x, non_blocking=True); torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(5): y.copy_(x, non_blocking=True)
torch.cuda.synchronize(); print(f'pinned host->device: {5 * 2**30 / (time.perf_counter() - t) / 1e9:.1f} GB/s')" || true
data=$(data_dir)
status=0
rows="ideal infinigen h2o quant-int4 offload"  # offload, the slowest, last: a timeout costs the least there
shape="--set model.random_init=true model.dtype=float16"
timeout 240 "$PY" -m experiments.latency --device cuda --data-dir "$data" --model opt-13b --batch 8 \
  --prompt 1920 --gen 128 $shape --rows $rows || status=$?
timeout 100 "$PY" -m experiments.latency --device cuda --data-dir "$data" --model smollm2-135m --batch 32 \
  --prompt 4096 --gen 64 $shape --rows $rows || status=$?
exit $status
