#!/usr/bin/env bash
# The serving path against the engine alone at N concurrent streams, in one run:
#
# - engine: `pie engine-bench --prompt-tokens 0 --concurrency N` (N distinct
#   32-token prompts, DECODE new tokens each, decode timed after every prompt is in);
# - serving: a `pie serve` on a free port (`--port 0`) with the same model and thread count,
#   driven by `pie bench` with N requests sent together (distinct 32-token
#   prompts, DECODE tokens each, streamed over HTTP with ignore_eos); its "while
#   all N streams decoded" rate counts streamed tokens from the last first token
#   to the first last token, the same window as the engine's.
#
# Each figure is the best of ROUNDS rounds, the two alternating, so a busy
# neighbour skews both alike; prints both and serving / engine.
#
#   scripts/serving-vs-engine.sh            # PIE, N (32), DECODE (64), ROUNDS (3), THREADS (2)
set -euo pipefail

PIE=${PIE:-target/release/pie}
N=${N:-32}
DECODE=${DECODE:-64}
ROUNDS=${ROUNDS:-3}
THREADS=${THREADS:-2}
MODEL=${MODEL:-$HOME/.cache/pie/models/SmolLM2-135M-Instruct.Q4_1.gguf}

cd "$(dirname "$0")/.."
[ -x "$PIE" ] || cargo build --release --bin pie
[ -f "$MODEL" ] || "$PIE" model fetch >/dev/null
export RAYON_NUM_THREADS=$THREADS
work=$(mktemp -d)
server=
cleanup() {
    [ -n "$server" ] && kill "$server" 2>/dev/null && wait "$server" 2>/dev/null
    rm -rf "$work"
}
trap cleanup EXIT

# --port 0: the first stdout line says `pie: listening on http://ADDR`.
"$PIE" serve --model "$MODEL" --port 0 >"$work/serve.log" 2>&1 &
server=$!
url=
for _ in $(seq 300); do
    [ -n "$url" ] || url=$(sed -n 's|^pie: listening on \(http://[^ ]*\).*|\1|p' "$work/serve.log" | head -1)
    [ -n "$url" ] && curl -sf "$url/health" >/dev/null && break
    kill -0 "$server" 2>/dev/null || { cat "$work/serve.log" >&2; exit 1; }
    sleep 0.2
done
[ -n "$url" ] && curl -sf "$url/health" >/dev/null || { echo "pie serve did not come up" >&2; exit 1; }

best() { sort -g | tail -1; }
for round in $(seq "$ROUNDS"); do
    echo "round $round/$ROUNDS ..." >&2
    "$PIE" engine-bench --model "$MODEL" --prompt-tokens 0 --decode-tokens "$DECODE" \
        --concurrency "$N" 2>/dev/null |
        sed -n "s/^decode: $N concurrent sequences: \([0-9.]*\) tok\/s.*/\1/p" >>"$work/engine"
    "$PIE" bench --url "$url" --workload priority-mix \
        --set high_fraction=0 --set input_len=32 --set "output_len=$DECODE" \
        --requests "$N" --concurrency "$N" --seed "$round" --quiet >"$work/bench.txt"
    grep -q "$N completed" "$work/bench.txt" || { cat "$work/bench.txt" >&2; exit 1; }
    sed -n "s/.*; \([0-9.]*\) tok\/s while all $N streams decoded.*/\1/p" "$work/bench.txt" >>"$work/serving"
done

engine=$(best <"$work/engine")
serving=$(best <"$work/serving")
[ -n "$engine" ] && [ -n "$serving" ] || { echo "a figure is missing" >&2; exit 1; }
echo "engine rounds: $(paste -sd' ' "$work/engine"); serving rounds: $(paste -sd' ' "$work/serving")"
awk -v n="$N" -v d="$DECODE" -v e="$engine" -v s="$serving" 'BEGIN {
    printf "%d streams, %d new tokens each, best of rounds: engine %.1f tok/s, serving %.1f tok/s, serving / engine %.2fx\n", n, d, e, s, s / e
}'
