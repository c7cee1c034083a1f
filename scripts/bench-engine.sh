#!/usr/bin/env bash
# Engine throughput, Pie beside llama.cpp on the same GGUF with the same shapes
# and thread count: prefill of a PROMPT-token prompt, single-stream decode, and
# aggregate decode at each concurrency in CONC (32-token prompts, DECODE new
# tokens each). RAW_DIR keeps the tools' own output. Each figure is the best of ROUNDS rounds, the tools alternating,
# so a busy neighbour on a shared machine skews both sides alike.
#
#   LLAMA_CPP_BIN=/path/with/llama-bench scripts/bench-engine.sh
#
# See BENCHMARKS.md for how to build llama.cpp's tools.
set -euo pipefail

: "${LLAMA_CPP_BIN:?set LLAMA_CPP_BIN to the directory holding llama-bench and llama-batched-bench}"
MODEL=${MODEL:-$HOME/.cache/pie/models/SmolLM2-135M-Instruct.Q4_1.gguf}
THREADS=${THREADS:-2}
PROMPT=${PROMPT:-512}
DECODE=${DECODE:-64}
CONC=${CONC:-1,8,32,64}
ROUNDS=${ROUNDS:-2}
PIE=${PIE:-target/release/pie}

cd "$(dirname "$0")/.."
[ -x "$PIE" ] || cargo build --release --bin pie
[ -f "$MODEL" ] || "$PIE" model fetch >/dev/null

max_conc=$(tr ',' '\n' <<<"$CONC" | sort -n | tail -1)
# llama.cpp splits its context between the sequences; give each room to spare.
ctx=$((max_conc * (32 + DECODE) * 2))
out=${RAW_DIR:-$(mktemp -d)}
mkdir -p "$out"
rm -f "$out/pie" "$out/llama-bench" "$out/batched"

for round in $(seq "$ROUNDS"); do
    echo "round $round/$ROUNDS ..." >&2
    RAYON_NUM_THREADS=$THREADS "$PIE" engine-bench --model "$MODEL" \
        --prompt-tokens "$PROMPT" --decode-tokens "$DECODE" --concurrency "$CONC" \
        >>"$out/pie"
    "$LLAMA_CPP_BIN/llama-bench" -m "$MODEL" -t "$THREADS" -p "$PROMPT" -n "$DECODE" \
        -r 3 -o csv 2>/dev/null >>"$out/llama-bench"
    "$LLAMA_CPP_BIN/llama-batched-bench" -m "$MODEL" -t "$THREADS" -tb "$THREADS" \
        -c "$ctx" -b 2048 -ub 512 -npp 32 -ntg "$DECODE" -npl "$CONC" 2>/dev/null \
        >>"$out/batched"
done

# One "key value" line per figure, best over rounds.
{
    awk '/^prefill:/ {print "prefill", $(NF-1)}
         /^decode:/ {print "decode" $2, $(NF-2)}' "$out/pie" | sed 's/^/pie_/'
    # The header is bare, the rows quoted: row field i + 1 is header column i.
    awk -F'","|"' '
        /^build_commit/ {n = split($0, h, ","); for (i = 1; i <= n; i++) col[h[i]] = i + 1; next}
        /^"/ {
            if ($col["n_gen"] == 0) print "llama_prefill", $col["avg_ts"]
            else print "llama_decode1", $col["avg_ts"]
        }' "$out/llama-bench"
    awk -F'|' '$2 ~ /^ *[0-9]+ *$/ {gsub(/ /, ""); print "batched_decode" $4, $9}' \
        "$out/batched"
} | awk '!($1 in best) || $2 > best[$1] {best[$1] = $2} END {for (k in best) print k, best[k]}' \
    >"$out/figures"

fig() { awk -v k="$1" '$1 == k {print $2}' "$out/figures"; }
row() { # label, ours, theirs, target
    awk -v l="$1" -v a="$2" -v b="$3" -v t="$4" 'BEGIN {
        r = (a != "" && b != "" && b > 0) ? sprintf("%.2fx", a / b) : "n/a"
        printf "| %-34s | %9s | %9s | %6s | %6s |\n", l, f(a), f(b), r, t }
        function f(x) { return x == "" ? "" : sprintf("%.1f", x) }'
}

echo
echo "model: $(basename "$MODEL"), $THREADS threads, best of $ROUNDS rounds, tok/s"
echo
printf "| %-34s | %9s | %9s | %6s | %6s |\n" "figure" "pie" "llama.cpp" "ratio" "target"
echo "|------------------------------------|-----------|-----------|--------|--------|"
row "prefill, ${PROMPT}-token prompt (pp$PROMPT)" "$(fig pie_prefill)" "$(fig llama_prefill)" ">=1.2x"
row "decode, 1 sequence (tg$DECODE)" "$(fig pie_decode1)" "$(fig llama_decode1)" ">=1.0x"
for n in $(tr ',' ' ' <<<"$CONC"); do
    target=""
    [ "$n" = 32 ] && target=">=1.5x"
    row "decode aggregate, $n sequences" "$(fig pie_decode$n)" "$(fig batched_decode$n)" "$target"
done
echo
echo "llama.cpp: llama-bench -p $PROMPT -n $DECODE; llama-batched-bench -npp 32 -ntg $DECODE -npl $CONC"
