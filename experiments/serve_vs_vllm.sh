#!/usr/bin/env bash
# vLLM's CPU build against tandem on the same model (SmolLM2-135M) and dtype, one server after the other on
# this machine, under vLLM's own load generator (`vllm bench serve`): 512 random prompt tokens, 64 out
# (--ignore-eos), Poisson arrivals at each rate of RATES, goodput SLO TTFT <= 2 s and TPOT <= 100 ms.
# Servers: vLLM, tandem 1P+1D (configs/default.yaml) and tandem colocated (one worker of 2 torch threads).
#
# Each server first serves one whole unmeasured pass of the load on other prompts (vLLM compiles per batch
# shape during its first requests: a few warm-up requests leave its TPOT several times too high). Every pass
# on a server has prompts of its own seed (a measured pass: its rate in hundredths; the warm-up: 1), so none
# hits a prefix cache an earlier pass filled, and a rate's prompts and arrival times are the same for every
# server.
#
#   experiments/serve_vs_vllm.sh /path/to/vllm-venv/bin/python OUT_DIR [NUM_PROMPTS=40] [RATES="0.5 1.0"]
# Environment: DTYPE=float32|bfloat16 (both servers; default float32); WARM_N warm-up requests (default
# NUM_PROMPTS) at WARM_RATE (default the highest rate run); CAPACITY=1 also finds each server's capacity:
# the rates 0.25, 0.5, ... up to CAP_MAX (default 3) until one keeps < 90% of requests within the SLO.
# Writes OUT_DIR/<server>/{warmup,rate-R}.{json,log} (vLLM's result format with per-request detail),
# OUT_DIR/<server>-server.log, the derived tandem configs OUT_DIR/{1p1d,colocated}.yaml, and prints the
# table, the ratios to vLLM and the capacities (experiments/serve_table.py).
set -euo pipefail
cd "$(dirname "$0")/.."
VPY=$1 OUT=$2 N=${3:-40} RATES=${4:-"0.5 1.0"}
DTYPE=${DTYPE:-float32} WARM_N=${WARM_N:-$N} CAPACITY=${CAPACITY:-0} CAP_MAX=${CAP_MAX:-3}
export LC_NUMERIC=C RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1
export VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind
READY_TIMEOUT_S=600 STOP_TIMEOUT_S=60 PORT=8021
MODEL=$(python -c 'from actors.engine.model.default_model import resolve_model as r; print(r("builtin:smollm2"))')
COMMIT=$(git rev-parse --short HEAD)
GOODPUT=$(python -m experiments.serve_table goodput)
if [ "$CAPACITY" = 1 ]; then
  WARM_RATE=${WARM_RATE:-$(printf '%s\n' $RATES "$CAP_MAX" | sort -g | tail -1)}
else
  WARM_RATE=${WARM_RATE:-$(printf '%s\n' $RATES | sort -g | tail -1)}
fi
mkdir -p "$OUT"
python -m experiments.serve_table configs "$OUT" "$DTYPE"
server=""
trap stop EXIT

stop() {  # Ctrl-C to the running server, then SIGKILL if it has not exited within STOP_TIMEOUT_S
  [ -n "$server" ] || return 0
  kill -INT "$server" 2>/dev/null || true
  for _ in $(seq "$STOP_TIMEOUT_S"); do kill -0 "$server" 2>/dev/null || break; sleep 1; done
  kill -KILL "$server" 2>/dev/null || true
  wait "$server" 2>/dev/null || true
  server=""
}

wait_ready() {  # url pattern: until the server's answer at url matches pattern, or it exits, or the deadline
  for _ in $(seq "$READY_TIMEOUT_S"); do
    curl -sf "$1" 2>/dev/null | grep -q "$2" && return 0
    kill -0 "$server" 2>/dev/null || { echo "the server exited before it was ready (see its log)" >&2; return 1; }
    sleep 1
  done
  echo "no answer matching '$2' at $1 within ${READY_TIMEOUT_S}s" >&2; return 1
}

bench() {  # name rate seed num_prompts file: one `vllm bench serve` pass against the running server
  "$VPY" experiments/vllm_cli.py bench serve --backend openai --endpoint /v1/completions \
    --base-url "http://127.0.0.1:$PORT" --model smollm2 --tokenizer "$MODEL" --dataset-name random \
    --random-input-len 512 --random-output-len 64 --ignore-eos --num-prompts "$4" --request-rate "$2" \
    --seed "$3" --goodput $GOODPUT --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 \
    --metadata "server=$1" "dtype=$DTYPE" "seed=$3" "commit=$COMMIT" \
    --save-result --save-detailed --result-dir "$(dirname "$5")" --result-filename "$(basename "$5")" \
    > "${5%.json}.log" 2>&1
}

measure() {  # name rate: the measured pass at rate, unless this run already has it
  local rate file
  rate=$(printf %.2f "$2")
  file="$OUT/$1/rate-$rate.json"
  [ -f "$file" ] && return 0
  bench "$1" "$rate" "$(awk -v r="$rate" 'BEGIN { printf "%d", r * 100 + 0.5 }')" "$N" "$file"
  echo "$1 at $rate req/s: $(grep -E 'Request goodput' "${file%.json}.log" | tr -s ' ')"
}

run_server() {  # name: warm up, measure each rate, then the capacity steps; the server is running
  mkdir -p "$OUT/$1"
  rm -f "$OUT/$1"/*.json
  echo "$1: warm-up, $WARM_N requests at $WARM_RATE req/s"
  bench "$1" "$WARM_RATE" 1 "$WARM_N" "$OUT/$1/warmup.json"
  for rate in $RATES; do measure "$1" "$rate"; done
  if [ "$CAPACITY" = 1 ]; then
    for rate in $(seq -f %.2f 0.25 0.25 "$CAP_MAX"); do
      measure "$1" "$rate"
      python -m experiments.serve_table meets "$OUT/$1/rate-$rate.json" || break
    done
  fi
  stop
}

"$VPY" experiments/vllm_cli.py serve "$MODEL" --served-model-name smollm2 --dtype "$DTYPE" --port "$PORT" \
  --max-model-len 8192 > "$OUT/vllm-server.log" 2>&1 &
server=$!
wait_ready "http://127.0.0.1:$PORT/v1/models" smollm2
run_server vllm

for layout in 1p1d colocated; do
  python -m tandem.cli serve --config "$OUT/$layout.yaml" --port "$PORT" > "$OUT/tandem-$layout-server.log" 2>&1 &
  server=$!
  wait_ready "http://127.0.0.1:$PORT/ready" '"ready": *true'
  run_server "tandem-$layout"
done

python -m experiments.serve_table table "$OUT" "$RATES"
if [ "$CAPACITY" = 1 ]; then echo; python -m experiments.serve_table capacity "$OUT"; fi
