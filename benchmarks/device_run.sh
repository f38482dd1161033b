#!/usr/bin/env bash
# The GPU runs on the lent device, one stage per device call, after the carry parts are unpacked
# (../shared/device/README.md; carry build/generated and .gpu/smollm2, the tokenizer). A call may run 10 minutes and
# a warm machine keeps files, and the processes started in their own session, so a prepare stage starts the memory
# service, KV worker and node in their own session, gives the users their memories, warms them up and records it all
# under /tmp/inferscale-bench/<servers>/ (state.json: pids, ports, logs, phases done); the measuring stages attach to
# those servers and measure one workload each, every measurement written to OUT as it finishes. A prepare cut at the
# limit resumes where it stopped when run again; a measuring stage that finds its servers gone says so (exit 4; exit 3
# is serve's: requests lost their memory).
#
#   bash benchmarks/device_run.sh OUT prepare-latency     # 4 users x 60 facts (k sweep) + 4 long users, node for both
#   bash benchmarks/device_run.sh OUT latency             # k = 1 2 5 10 20 50, 1 in flight; then the crossover
#   bash benchmarks/device_run.sh OUT long                # ~6,500 memory tokens: 1 in flight, then 32 in flight
#   bash benchmarks/device_run.sh OUT prepare-throughput  # 128 users x 50 facts ($THROUGHPUT_USERS), node cache for them
#   bash benchmarks/device_run.sh OUT throughput          # 128 in flight, each request the user's whole memory
#   bash benchmarks/device_run.sh OUT varying             # 128 in flight, k = 10 and 20 of each user's 50 facts (servers:
#                                                         #   $VARYING_SERVERS, default throughput; defaults-128 after
#                                                         #   DEFAULTS_USERS=128 prepare-defaults)
#   bash benchmarks/device_run.sh OUT prepare-cold        # 2 x $COLD_REQUESTS users' KV (x3: kv, kv-auto, kv-host), node at its
#                                                         #   defaults but a device tier for two users (miss policy auto)
#   bash benchmarks/device_run.sh OUT cold                # 1 and 2 in flight, $COLD_REQUESTS (16) requests each, every user new to
#                                                         #   the node: kv, kv-auto, text, text-stable, off, kv-warm (device
#                                                         #   tier), kv-host (host tier), kv-second (a user's second question)
#   bash benchmarks/device_run.sh OUT prepare-cold-wait   # the cold servers' memories, a new node with --kv-miss-policy wait
#   bash benchmarks/device_run.sh OUT cold-wait           # kv forced to inject (fully cold), text, text-stable, off; 1 and 2 in flight
#   bash benchmarks/device_run.sh OUT prepare-defaults    # $DEFAULTS_USERS (32) users x 50 facts, node flags only dtype, length, GPU share
#   bash benchmarks/device_run.sh OUT defaults            # whole memory (k=50), $DEFAULTS_USERS in flight, 3 requests per user:
#                                                         #   kv, kv-auto, text, text-stable, off; partial loads and load failures
#   bash benchmarks/device_run.sh OUT failure [RUNS]      # every way a load can fail (RUNS: model runners; default all)
#   bash benchmarks/device_run.sh OUT memory-step         # RetrieveAndStage at 64 and 128 callers, either side embedding,
#                                                         #   over $STEP_REPLICAS (1 4 8 12) replicas on PostgreSQL + S3
#                                                         #   ($STEP_CALLERS, $STEP_EMBEDS narrow the sweep)
#   bash benchmarks/device_run.sh OUT stop                # stops every prepared server
#
# Llama-3-8B shape with DUMMY weights and SYNTHETIC fact KV (the reports say so); facts of 2 synthetic clauses.
# Contenders kv (always injects), kv-auto (the node's crossover policy, where its users fit), text, text-stable, off.
# DURABLE_READS=1 before prepare-cold / prepare-cold-wait: their nodes read the service's KV directory themselves.
# Issue 41's GPU evidence: prepare-cold + cold, prepare-cold-wait + cold-wait, prepare-defaults + defaults (a prepare
# and its measurement fit one call where the prepare is not cut; run the same call again if it is: it resumes).
# On the CPU (a check of the stages, not a result): BENCH_SHAPE=llama-tiny BENCH_MODEL=<tokenizer folder>
# BENCH_DTYPE=float32 COLD_REQUESTS=2 DEFAULTS_USERS=2 STEP_REPLICAS="1 2" ...
set -euo pipefail
usage="usage: device_run.sh OUT_DIR prepare-latency|latency|long|prepare-throughput|throughput|varying|prepare-cold|cold|\
prepare-cold-wait|cold-wait|prepare-defaults|defaults|failure [RUNS]|memory-step|stop"
out=${1:?$usage}
stage=${2:?$usage}
root=${INFERSCALE_BENCH_DIR:-/tmp/inferscale-bench}  # the prepared servers: state, data, logs
export PYTHONPATH=/tmp/site:$PWD:$PWD/build/generated PATH=/tmp/site/bin:$PATH VLLM_USE_FLASHINFER_SAMPLER=0 \
  VLLM_WORKER_MULTIPROC_METHOD=spawn HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1
mkdir -p "$out" "$root"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
# NVML's Python binding (the node's budget check, the workers' reports), carried as a wheel in .gpu/wheels.
if compgen -G ".gpu/wheels/*.whl" >/dev/null; then
  python3 -c "import pynvml" 2>/dev/null || python3 -m pip install -q --no-deps --target /tmp/site .gpu/wheels/*.whl
fi
dtype=${BENCH_DTYPE:-bfloat16}
common=(--shape "${BENCH_SHAPE:-llama3-8b}" --model "${BENCH_MODEL:-.gpu/smollm2}" --kv-dtype "$dtype" --fact-clauses 2
  --max-tokens "${BENCH_MAX_TOKENS:-32}")
cold_requests=${COLD_REQUESTS:-16}  # per load (1 and 2 in flight), each for a user the node has not seen
cold_users=${COLD_USERS:-$((2 * cold_requests))}
cold_node="--dtype $dtype --max-model-len 4096 --gpu-memory-utilization 0.6"  # + a device tier for two users (serve)
cold_prepare=(--workloads cold --cold-users "$cold_users" --cold-k 20 --facts-per-user 50 --kv-auto --tails
  --service-flags "--embedding-threads 8 --kv-host-budget-mb 36000")
# DURABLE_READS=1: the cold nodes read fact KV from the service's KV directory themselves (--kv-durable-tier).
[ -n "${DURABLE_READS:-}" ] && cold_prepare+=(--durable-reads)
defaults_users=${DEFAULTS_USERS:-32}
contenders=(--kv-auto --tails)
quiet() { grep --line-buffered -v "it/s\]$\|req/s\]$\|s/req\]$\|fact/s\]$\|user/s\]$"; }
serve() { python3 -m benchmarks.serve "$@" 2>&1 | quiet; }
stop_all() {  # every prepared session, through its state file (their pids): the GPU is free after
  for state in "$root"/*/state.json; do
    [ -e "$state" ] && python3 -m benchmarks.serve --stop "$state" && rm -f "$state"
  done
  return 0
}
prepare() {  # servers NAME [serve flags]: stops other servers, then prepares (or resumes) these in their own session
  local name=$1; shift
  for state in "$root"/*/state.json; do  # the other sessions' servers and data go: the disk holds one at a time
    [ -e "$state" ] && [ "$state" != "$root/$name/state.json" ] && python3 -m benchmarks.serve --stop "$state" \
      && rm -rf "$(dirname "$state")"
  done
  setsid -w python3 -m benchmarks.serve --prepare "$root/$name/state.json" "${common[@]}" "$@" 2>&1 | quiet \
    | tee -a "$out/prepare-$name.txt"
}
attach() {  # servers NAME OUTPUT [serve flags]
  local name=$1 output=$2; shift 2
  set +e
  serve --attach "$root/$name/state.json" --output "$out/$output" "$@" | tee "$out/$output.txt"
  local status=${PIPESTATUS[0]}
  set -e
  if [ "$status" -ne 0 ] && grep -q "rerun the prepare stage\|no prepared servers" "$out/$output.txt"; then
    echo "device_run: the $name servers are gone: run the ${prepare_stage:-prepare-$name} stage again" >&2
    exit 4
  fi
  return "$status"
}
pack_results() {  # OUTPUT: its folder (results.json, plots) as one file, OUTPUT.tgz: a call returns at most 8 files
  [ -d "$out/$1" ] && tar -C "$out" -czf "$out/$1.tgz" "$1" && rm -rf "${out:?}/$1"
  return 0
}
node_flags_of() {  # servers NAME -> the node flags its state records (empty if none)
  python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['setup']['node_flags'])" \
    "$root/$1/state.json" 2>/dev/null || true
}
need_node() {  # servers NAME, the prepare stage, wait|auto: exit 4 unless its node runs that miss policy
  case $(node_flags_of "$1") in
    *"--kv-miss-policy wait"*) policy=wait ;;
    "") return 0 ;;  # no servers: attach says so
    *) policy=auto ;;
  esac
  if [ "$policy" != "$3" ]; then
    echo "device_run: the $1 node's miss policy is $policy, this stage needs $3: run the $2 stage first" >&2
    exit 4
  fi
}
latency_node="--dtype bfloat16 --max-model-len 8192 --gpu-memory-utilization 0.7 --node-cache-mb 16384 \
--embed-queries-locally"
case $stage in
  prepare-latency)
    prepare latency --workloads synthetic long --users 4 --facts-per-user 60 --long-users 4 --k 50 "${contenders[@]}" \
      --service-flags "--embedding-threads 8 --kv-host-budget-mb 24000" --node-flags "$latency_node" ;;
  latency)
    attach latency serve-latency --workloads synthetic --k 1 2 5 10 20 50 --requests 12 --concurrency 1 \
      "${contenders[@]}"
    python3 -m benchmarks.crossover "$out/serve-latency/results.json" --shape llama3-8b --model .gpu/smollm2 \
      --dtype bfloat16 --write 2>&1 | tail -2 | tee "$out/crossover.txt"
    cp inference_node/kv_crossover.json "$out/" ;;
  long)
    attach latency serve-long --workloads long --requests 8 --concurrency 1 "${contenders[@]}"
    attach latency serve-long-c32 --workloads long --requests 64 --concurrency 32 "${contenders[@]}" ;;
  prepare-throughput)  # no kv-auto: its users would need a second copy of every memory (kv-auto is kv at k=50)
    # The memory service's host cache and the node's RetrieveAndStage deadline at their defaults: the memory step
    # must keep every memory as shipped.
    prepare throughput --workloads synthetic --users "${THROUGHPUT_USERS:-128}" --facts-per-user 50 --k 50 --tails \
      --service-flags "--embedding-threads 8" \
      --node-flags "--dtype bfloat16 --max-model-len 4096 --gpu-memory-utilization 0.9 --node-cache-mb 30000 \
--embed-queries-locally" ;;
  throughput)
    attach throughput serve-throughput --workloads synthetic --k 50 --requests 256 --concurrency 128 --tails ;;
  varying)
    attach "${VARYING_SERVERS:-throughput}" serve-varying --workloads synthetic --k 10 20 --requests 256 \
      --concurrency 128 --tails ;;
  prepare-cold)  # the node's defaults (host tier, miss policy auto, warm-up) but a device tier for two users
    prepare cold "${cold_prepare[@]}" --node-flags "$cold_node" ;;
  cold)
    need_node cold prepare-cold auto
    attach cold serve-cold --workloads cold --requests "$cold_requests" --concurrency 1 2 --kv-auto --tails \
      --prefilled-ok
    pack_results serve-cold ;;
  prepare-cold-wait)  # the same memories (same state), a new node that waits for every miss: kv forced to inject
    prepare cold "${cold_prepare[@]}" --node-flags "$cold_node --kv-miss-policy wait" ;;
  cold-wait)
    need_node cold prepare-cold-wait wait
    prepare_stage=prepare-cold-wait attach cold serve-cold-wait --workloads cold --requests "$cold_requests" --concurrency 1 2 --kv-auto --tails \
      --contenders kv text text-stable off
    pack_results serve-cold-wait ;;
  prepare-defaults)  # as a new user would: node flags only dtype, length and GPU share
    prepare "defaults-$defaults_users" --workloads synthetic --users "$defaults_users" --facts-per-user 50 --k 50 \
      --kv-auto --tails --service-flags "--embedding-threads 8" \
      --node-flags "--dtype $dtype --max-model-len 4096 --gpu-memory-utilization 0.85" ;;
  defaults)
    prepare_stage=prepare-defaults attach "defaults-$defaults_users" serve-defaults --workloads synthetic --k 50 \
      --requests "${DEFAULTS_REQUESTS:-$((3 * defaults_users))}" --concurrency "$defaults_users" --kv-auto --tails \
      --prefilled-ok
    pack_results serve-defaults ;;
  failure)
    stop_all  # the scenario starts engines of its own
    python3 -m benchmarks.gpu_failure_path --output "$out/failure-path" --work "$root/failure" \
      ${3:+--runs $3} 2>&1 | grep --line-buffered "^run=\|^verdict" | tee "$out/failure-path.txt" ;;
  memory-step)  # no node: the memory service alone, Llama-3-8B-sized KV; replicas on a real PostgreSQL and SeaweedFS
    stop_all
    python3 -m benchmarks.memory_step --users 8 --facts-per-user 50 --k 50 --callers ${STEP_CALLERS:-64 128} \
      --duration-s 12 --embeds ${STEP_EMBEDS:-caller service} --replicas ${STEP_REPLICAS:-1 4 8 12} --shared-stores --client-processes 4 --node-batching \
      --model "${BENCH_MODEL:-.gpu/smollm2}" --shape "${BENCH_SHAPE:-llama3-8b}" \
      --service-flags "--embedding-threads 2" \
      --output "$out/memory-step.json" 2>&1 | quiet | grep --line-buffered "^{\||" | tee "$out/memory-step.txt" ;;
  stop)
    stop_all ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
