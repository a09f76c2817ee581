#!/usr/bin/env bash
# tandem 1P+1D (`tandem serve`'s default: SmolLM2-135M, float32) and vLLM's CPU build on the same model and
# dtype, one after the other on this machine, under the same `vllm bench serve` load: 512-token prompts,
# 64 tokens out, Poisson arrivals at 0.5 req/s (or RATE). tandem runs twice: one torch thread per worker (the
# default), and the prefill worker with 2 (the cores the decode worker leaves idle between its steps).
#   experiments/serve_vs_vllm.sh /path/to/vllm-venv/bin/python OUT_DIR [NUM_PROMPTS] [RATE]
# Writes OUT_DIR/{vllm,tandem,tandem-prefill2}.json (vLLM's result format) and prints the ratios.
set -euo pipefail
cd "$(dirname "$0")/.."
VPY=$1 OUT=$2 N=${3:-60} RATE=${4:-0.5}
export RAY_USAGE_STATS_ENABLED=0 VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind HF_HUB_OFFLINE=1
MODEL=$(python -c 'from actors.engine.model.default_model import resolve_model as r; print(r("builtin:smollm2"))')
mkdir -p "$OUT"
server=""
trap '[ -n "$server" ] && kill -INT $server 2>/dev/null; wait' EXIT

wait_ready() {  # url
  for _ in $(seq 1 300); do curl -sf "$1" >/dev/null 2>&1 && return 0; sleep 1; done
  echo "server at $1 never became ready" >&2; return 1
}

load() {  # name port
  "$VPY" experiments/vllm_cli.py bench serve --backend openai --endpoint /v1/completions \
    --base-url "http://127.0.0.1:$2" --model smollm2 --tokenizer "$MODEL" --dataset-name random \
    --random-input-len 512 --random-output-len 64 --num-prompts "$N" --request-rate "$RATE" --seed 0 --ignore-eos \
    --goodput ttft:2000 tpot:100 --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 \
    --save-result --result-dir "$OUT" --result-filename "$1.json" > "$OUT/$1.log" 2>&1
  grep -E "Request goodput|Median TTFT|P99 ITL" "$OUT/$1.log" | sed "s/^/$1: /"
}

stop() { kill -INT "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; server=""; sleep 3; }

"$VPY" experiments/vllm_cli.py serve "$MODEL" --served-model-name smollm2 --dtype float32 --port 8021 \
  --max-model-len 8192 > "$OUT/vllm-server.log" 2>&1 &
server=$!
wait_ready http://127.0.0.1:8021/v1/models
load vllm 8021
stop

for variant in tandem tandem-prefill2; do
  config=configs/default.yaml
  if [ "$variant" = tandem-prefill2 ]; then
    config="$OUT/prefill2.yaml"
    python - "$config" <<'PY'
import sys, yaml
config = yaml.safe_load(open("configs/default.yaml"))
config["prefill"]["torch_threads"] = 2
yaml.safe_dump(config, open(sys.argv[1], "w"))
PY
  fi
  python -m tandem.cli serve --config "$config" --port 8022 > "$OUT/$variant-server.log" 2>&1 &
  server=$!
  wait_ready http://127.0.0.1:8022/ready
  until curl -s http://127.0.0.1:8022/ready | grep -q '"ready": *true'; do sleep 1; done
  load "$variant" 8022
  stop
done

python - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
runs = {name: json.load(open(f"{out}/{name}.json")) for name in ("vllm", "tandem", "tandem-prefill2")}
v = runs["vllm"]
ratio = lambda a, b: f"{a / b:.2f}x" if b else "n/a (vLLM's is 0)"
for name in ("tandem", "tandem-prefill2"):
    r = runs[name]
    print(f"{name} vs vLLM: goodput {ratio(r['request_goodput'], v['request_goodput'])} "
          f"({r['request_goodput']:.3f} vs {v['request_goodput']:.3f} req/s), TTFT p50 {ratio(r['median_ttft_ms'], v['median_ttft_ms'])} "
          f"({r['median_ttft_ms']:.0f} vs {v['median_ttft_ms']:.0f} ms), p99 ITL {ratio(r['p99_itl_ms'], v['p99_itl_ms'])}")
PY
