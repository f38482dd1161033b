#!/usr/bin/env bash
# The GPU runs (lent device, its own vLLM), after the carry parts are unpacked (../shared/device/README.md):
#   bash benchmarks/device_run.sh OUT_DIR failure      # refused loads recompute to the text answer (per runner)
#   bash benchmarks/device_run.sh OUT_DIR latency      # k sweep at concurrency 1: kv (always injects), text,
#     text-stable, off, kv-tail1, the node embedding queries on the GPU (--embed-queries-locally); the kv crossover is
#     drawn from it and recorded in inference_node/kv_crossover.json
#   bash benchmarks/device_run.sh OUT_DIR connector    # the connector's own time per load (--load-stats synchronizes
#     the device at each phase, which slows kv: never in a run whose TTFTs are compared)
#   bash benchmarks/device_run.sh OUT_DIR policy       # the same sweep with kv-auto (the node's crossover policy, read
#     from the table: commit the latency stage's table first) and the memory service embedding queries
#   bash benchmarks/device_run.sh OUT_DIR throughput   # 128 users with their own memories, 128 in flight, k=50
#   bash benchmarks/device_run.sh OUT_DIR cold         # more users' KV than the node cache holds, 16 in flight
# Needs, carried beside the tree: build/generated (the gRPC modules) and .gpu/smollm2 (tokenizer files).
# Llama-3-8B shape with DUMMY weights and SYNTHETIC fact KV (the reports say so); facts of 2 synthetic clauses.
# The kv contender always injects, so the sweep measures where injection starts to win; kv-auto follows the node's policy.
set -euo pipefail
out=${1:?usage: device_run.sh OUT_DIR failure|latency|connector|policy|throughput|cold}
stage=${2:?usage: device_run.sh OUT_DIR failure|latency|connector|policy|throughput|cold}
export PYTHONPATH=/tmp/site:$PWD:$PWD/build/generated PATH=/tmp/site/bin:$PATH VLLM_USE_FLASHINFER_SAMPLER=0 \
  VLLM_WORKER_MULTIPROC_METHOD=spawn HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
# NVML's Python binding (the node's budget check, the workers' reports), carried as a wheel in .gpu/wheels.
python3 -c "import pynvml" 2>/dev/null || python3 -m pip install -q --no-deps --target /tmp/site .gpu/wheels/*.whl
python3 -c "from inferscale_kv.device_telemetry import read_device; print('NVML reading:', read_device())"
common=(--shape llama3-8b --model .gpu/smollm2 --kv-dtype bfloat16 --fact-clauses 2 --max-tokens 32)
node="--dtype bfloat16 --max-model-len 4096"
sweep=(--k 1 2 5 10 20 50 --users 4 --facts-per-user 60 --requests 12 --concurrency 1)
# A run cut short by the device's time limit leaves its servers behind, holding the GPU: stop them first.
pkill -9 -f "^VLLM::|python3? -m (vllm\.entrypoints|inference_node|memory_service|benchmarks\.synthetic_worker|benchmarks\.serve)( |$)" \
  2>/dev/null || true
quiet() { grep --line-buffered -v "it/s\]$\|req/s\]$\|s/req\]$\|fact/s\]$\|user/s\]$"; }
case $stage in
  failure)
    python3 -m benchmarks.gpu_failure_path "$out/failure-path" default-async v1-async 2>&1 \
      | grep "^run=" | tee "$out/failure-path.txt" ;;
  latency)
    python3 -m benchmarks.serve "${common[@]}" "${sweep[@]}" --tails 1 --output "$out/serve-latency" \
      --node-flags "$node --gpu-memory-utilization 0.6 --node-cache-mb 8192 --embed-queries-locally" \
      2>&1 | quiet | tee "$out/serve-latency.txt"
    python3 -m benchmarks.crossover "$out/serve-latency/results.json" --shape llama3-8b --model .gpu/smollm2 \
      --dtype bfloat16 --write 2>&1 | tail -2 | tee "$out/crossover.txt"
    cp inference_node/kv_crossover.json "$out/" ;;
  connector)
    python3 -m benchmarks.serve "${common[@]}" "${sweep[@]}" --tails --load-stats --output "$out/serve-connector" \
      --node-flags "$node --gpu-memory-utilization 0.6 --node-cache-mb 8192" 2>&1 | quiet \
      | tee "$out/serve-connector.txt" ;;
  policy)
    python3 -m benchmarks.serve "${common[@]}" "${sweep[@]}" --tails --kv-auto --output "$out/serve-policy" \
      --node-flags "$node --gpu-memory-utilization 0.6 --node-cache-mb 8192" 2>&1 | quiet \
      | tee "$out/serve-policy.txt" ;;
  throughput)
    python3 -m benchmarks.serve "${common[@]}" --k 50 --tails --users 128 --facts-per-user 50 --requests 256 \
      --concurrency 128 --output "$out/serve-throughput" \
      --service-flags "--embedding-threads 8 --kv-host-budget-mb 36000" \
      --node-flags "$node --gpu-memory-utilization 0.9 --node-cache-mb 30000" 2>&1 | quiet \
      | tee "$out/serve-throughput.txt" ;;
  cold)
    python3 -m benchmarks.serve "${common[@]}" --workloads cold --cold-users 64 --cold-k 50 --tails \
      --requests 64 --concurrency 16 --output "$out/serve-cold" --service-flags "--embedding-threads 8" \
      --node-flags "$node --gpu-memory-utilization 0.6" 2>&1 | quiet | tee "$out/serve-cold.txt" ;;
  *) echo "unknown stage: $stage" >&2; exit 2 ;;
esac
