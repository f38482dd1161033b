#!/usr/bin/env bash
# The GPU runs (lent device, vLLM 0.26.0), after the carry parts are unpacked (../shared/device/README.md):
#   bash benchmarks/device_run.sh OUT_DIR latency      # compose check + TTFT sweep over k at concurrency 1
#   bash benchmarks/device_run.sh OUT_DIR throughput   # 128 users with their own memories, 128 in flight, k=50
# Needs, carried beside the tree: build/generated (the gRPC modules) and .gpu/smollm2 (tokenizer files).
# Llama-3-8B shape with DUMMY weights and SYNTHETIC fact KV (the reports say so); ~34 tokens per fact.
set -euo pipefail
out=${1:?usage: device_run.sh OUT_DIR latency|throughput}
stage=${2:?usage: device_run.sh OUT_DIR latency|throughput}
export PYTHONPATH=/tmp/site:$PWD:$PWD/build/generated PATH=/tmp/site/bin:$PATH VLLM_USE_FLASHINFER_SAMPLER=0 \
  VLLM_WORKER_MULTIPROC_METHOD=spawn HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
common=(--shape llama3-8b --model .gpu/smollm2 --kv-dtype bfloat16 --fact-clauses 2 --max-tokens 32)
case $stage in
  latency)
    python3 -m benchmarks.compose_check --k 10 50 --tokens-per-fact 34 2>&1 | tee "$out/compose_check.txt"
    python3 -m benchmarks.serve "${common[@]}" --k 5 10 20 50 --users 4 --facts-per-user 60 --requests 16 \
      --concurrency 1 --load-stats --output "$out/serve-latency" \
      --node-flags "--dtype bfloat16 --max-model-len 4096 --gpu-memory-utilization 0.6 --node-cache-mb 8192" \
      2>&1 | grep -v "it/s\]$\|req/s\]$\|s/req\]$\|fact/s\]$\|user/s\]$" | tee "$out/serve-latency.txt" ;;
  throughput)
    python3 -m benchmarks.serve "${common[@]}" --k 50 --users 128 --facts-per-user 50 --requests 256 \
      --concurrency 128 --output "$out/serve-throughput" \
      --service-flags "--embedding-threads 8 --kv-host-budget-mb 36000" \
      --node-flags "--dtype bfloat16 --max-model-len 4096 --gpu-memory-utilization 0.6 --node-cache-mb 40000" \
      2>&1 | grep -v "it/s\]$\|req/s\]$\|s/req\]$\|fact/s\]$\|user/s\]$" | tee "$out/serve-throughput.txt" ;;
  *) echo "unknown stage: $stage" >&2; exit 2 ;;
esac
