#!/usr/bin/env bash
# The checks a machine with a CUDA GPU runs (CI has none): tests/test_cuda.py, then the throughput,
# latency and attention (TRITON vs TORCH_SDPA) benchmarks on the bundled demo model. Runs from a
# checkout, no install needed (PYTHONPATH); logs go to $OUT (default /tmp/cuda-check).
# PAGEDLLM_DISABLE_CPU_KERNELS=1 skips building the C++ CPU ops, which the GPU path does not use.
#   bash scripts/cuda_check.sh [pytest args...]     (CUDA_CHECK_BENCH=0: the tests alone)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cuda-check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PAGEDLLM_DISABLE_CPU_KERNELS=${PAGEDLLM_DISABLE_CPU_KERNELS:-1}
nvidia-smi -L
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton',
triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
status=0
$PY -m pytest tests/test_cuda.py -q -p no:cacheprovider -o addopts="" -rfE "$@" 2>&1 | tee "$OUT/pytest.log" || status=1
if [ "${CUDA_CHECK_BENCH:-1}" = 1 ]; then
  $PY -m pagedllm bench throughput --device cuda --dataset random --num-prompts 256 --input-len 128 \
      --output-len 128 --compare hf --profile 2>&1 | tee "$OUT/throughput.log" || status=1
  $PY -m pagedllm bench latency --device cuda --input-len 128 --output-len 128 --num-iters 3 \
      2>&1 | tee "$OUT/latency.log" || status=1
  $PY -m pagedllm bench attention --device cuda --batch-sizes 1,16,64 --num-iters 10 \
      2>&1 | tee "$OUT/attention.log" || status=1
fi
exit $status
