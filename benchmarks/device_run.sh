#!/usr/bin/env bash
# The GPU run (lent device, vLLM 0.26.0), after the carry parts are unpacked (../shared/device/README.md):
#   bash benchmarks/device_run.sh OUT_DIR
# Needs, carried beside the tree: build/generated (the gRPC modules) and .gpu/smollm2 (tokenizer files).
set -euo pipefail
out=${1:?usage: device_run.sh OUT_DIR}
export PYTHONPATH=/tmp/site:$PWD:$PWD/build/generated PATH=/tmp/site/bin:$PATH VLLM_USE_FLASHINFER_SAMPLER=0 \
  VLLM_WORKER_MULTIPROC_METHOD=spawn HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -m benchmarks.compose_check --k 10 50 2>&1 | tee "$out/compose_check.txt"
python3 -m benchmarks.serve --shape llama3-8b --model .gpu/smollm2 --kv-dtype bfloat16 --k 10 50 --users 4 \
  --facts-per-user 60 --requests 16 --load-stats --output "$out/serve" \
  --node-flags "--dtype bfloat16 --max-model-len 4096 --gpu-memory-utilization 0.6 --node-cache-mb 8192" \
  2>&1 | grep -v "it/s\]$" | tee "$out/serve.txt"
