#!/usr/bin/env bash
# Soak: 10x overload through the controller (issue 16, "Must show").
#
# One `pie serve` worker on the default model behind a `pie-controller` with
# `cluster_policies = ["cluster-priority", "least-loaded"]` (requests wait in the
# controller, bounded by a small `max_queued` and `max_wait_ms`; the worker's own
# `[server] max_queued` is small too). scripts/soak.py measures the rate the
# worker sustains (closed loop at concurrency = max_running, CALIBRATE_S seconds),
# then offers FACTOR x that rate open loop (Poisson) for --duration seconds as
# streamed `/v1/completions` (`max_tokens` 32, `ignore_eos`), and checks:
#   - every accepted request ends with exactly max_tokens completion tokens
#     (final usage), finish_reason `length`, `[DONE]`, no error event;
#   - every refusal is 429 or 503 and carries Retry-After (anything else fails);
#   - each process's peak RSS after warm-up (VmRSS every 200 ms, and VmHWM reset
#     at warm-up) is at most RSS_RATIO x its RSS right after the closed loop;
#   - no "panicked" in either process's stderr, and both still run at the end.
# The worker's max_queued defaults to max_running, not below: the controller
# admits up to max_running requests per worker, and when a batch of equal-length
# requests finishes in one engine step, max_running new ones reach the worker
# before its next step admits them; a smaller worker queue refuses (429, with
# Retry-After, relayed by the controller) requests the controller admitted
# (WORKER_MAX_QUEUED=4 shows it; see docs/benchmarks/serving.md).
# Exits non-zero naming every failed check. The processes it starts are killed
# on exit, whatever happens.
#
# Why a script and not `pie bench`: bench measures successful requests (it
# treats a refusal as an error), has no open-loop rate relative to a measured
# one, and knows nothing of processes' RSS or stderr; the soak is those
# things, and a ~250-line stdlib Python helper keeps the product code unchanged.
#
#   scripts/soak.sh [--duration 60] [--out DIR]
#   env: MODEL, MAX_RUNNING (8), WORKER_MAX_QUEUED (= MAX_RUNNING), CTL_MAX_QUEUED (16),
#        MAX_WAIT_MS (1000), CALIBRATE_S (15), FACTOR (10), MAX_TOKENS (32),
#        RSS_RATIO (1.5), BIN (directory of pie and pie-controller;
#        default ${CARGO_TARGET_DIR:-target}/release)
set -euo pipefail

DURATION=60
OUT=
while [ $# -gt 0 ]; do
  case "$1" in
    --duration) DURATION=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) echo "soak.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

cd "$(dirname "$0")/.."
MODEL=${MODEL:-$HOME/.cache/pie/models/SmolLM2-135M-Instruct.Q4_1.gguf}
MAX_RUNNING=${MAX_RUNNING:-8}
WORKER_MAX_QUEUED=${WORKER_MAX_QUEUED:-$MAX_RUNNING}
CTL_MAX_QUEUED=${CTL_MAX_QUEUED:-16}
MAX_WAIT_MS=${MAX_WAIT_MS:-1000}
CALIBRATE_S=${CALIBRATE_S:-15}
FACTOR=${FACTOR:-10}
MAX_TOKENS=${MAX_TOKENS:-32}
RSS_RATIO=${RSS_RATIO:-1.5}
BIN=${BIN:-${CARGO_TARGET_DIR:-target}/release}

[ -x "$BIN/pie" ] && [ -x "$BIN/pie-controller" ] || cargo build --release --bin pie --bin pie-controller
[ -f "$MODEL" ] || "$BIN/pie" model fetch >/dev/null

OUT=${OUT:-$(mktemp -d -t pie-soak.XXXXXX)}
mkdir -p "$OUT"
echo "soak: logs and configs in $OUT"

PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Wait for "PREFIX: listening on http://ADDR" in FILE; print the URL.
listening() {
  local file=$1 prefix=$2 pid=$3
  for _ in $(seq 600); do
    local url
    url=$(sed -n "s|^$prefix: listening on \(http://[^ ]*\).*|\1|p" "$file" | head -1)
    if [ -n "$url" ]; then echo "$url"; return 0; fi
    kill -0 "$pid" 2>/dev/null || { echo "soak: $prefix exited at start-up" >&2; return 1; }
    sleep 0.1
  done
  echo "soak: $prefix did not print its address" >&2; return 1
}

# Wait for GET URL/health to answer 200.
healthy() {
  for _ in $(seq 1200); do
    curl -fsS -o /dev/null "$1/health" 2>/dev/null && return 0
    sleep 0.1
  done
  echo "soak: $1/health never answered 200" >&2; return 1
}

cat >"$OUT/controller.toml" <<EOF
[cluster]
cluster_policies = ["cluster-priority", "least-loaded"]
max_queued = $CTL_MAX_QUEUED
max_wait_ms = $MAX_WAIT_MS
EOF

"$BIN/pie" serve --port 0 --model "$MODEL" --max-running "$MAX_RUNNING" \
  --max-queued "$WORKER_MAX_QUEUED" >"$OUT/worker.out" 2>"$OUT/worker.err" &
WORKER_PID=$!
PIDS+=("$WORKER_PID")
WORKER_URL=$(listening "$OUT/worker.out" pie "$WORKER_PID")
healthy "$WORKER_URL"

"$BIN/pie-controller" --config "$OUT/controller.toml" --port 0 --model "$MODEL" \
  --worker "w0=$WORKER_URL" >"$OUT/controller.out" 2>"$OUT/controller.err" &
CTL_PID=$!
PIDS+=("$CTL_PID")
CTL_URL=$(listening "$OUT/controller.out" pie-controller "$CTL_PID")
healthy "$CTL_URL"
echo "soak: worker $WORKER_URL (pid $WORKER_PID, max_running $MAX_RUNNING, max_queued $WORKER_MAX_QUEUED)," \
  "controller $CTL_URL (pid $CTL_PID, max_queued $CTL_MAX_QUEUED, max_wait_ms $MAX_WAIT_MS)"

rc=0
python3 scripts/soak.py --url "$CTL_URL" --pids "worker=$WORKER_PID,controller=$CTL_PID" \
  --concurrency "$MAX_RUNNING" --calibrate-s "$CALIBRATE_S" --duration "$DURATION" \
  --factor "$FACTOR" --max-tokens "$MAX_TOKENS" --rss-ratio "$RSS_RATIO" \
  --json "$OUT/soak.json" &
# In the background and waited for: a TERM to this script runs the trap at once
# (bash defers traps until a foreground child ends).
LOAD_PID=$!
PIDS+=("$LOAD_PID")
wait "$LOAD_PID" || rc=1

for name in worker controller; do
  pid=$([ $name = worker ] && echo "$WORKER_PID" || echo "$CTL_PID")
  panics=$(grep -c panicked "$OUT/$name.err" || true)
  echo "soak: $name panics: $panics"
  if [ "$panics" != 0 ]; then
    echo "FAIL: $name panicked ($OUT/$name.err):" >&2
    grep -m3 -A2 panicked "$OUT/$name.err" >&2
    rc=1
  fi
  if ! kill -0 "$pid" 2>/dev/null; then
    echo "FAIL: $name (pid $pid) is no longer running" >&2
    rc=1
  fi
done
curl -fsS "$CTL_URL/metrics" 2>/dev/null | grep -E '^pie_controller_(queue_full|wait_timeouts|retries|rejections)[a-z_]* ' \
  >"$OUT/controller-metrics.txt" || true
[ -s "$OUT/controller-metrics.txt" ] && sed 's/^/soak: /' "$OUT/controller-metrics.txt"

if [ $rc = 0 ]; then echo "soak: PASS"; else echo "soak: FAIL" >&2; fi
exit $rc
