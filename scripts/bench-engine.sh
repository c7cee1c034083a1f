#!/usr/bin/env bash
# Engine throughput, Pie beside llama.cpp on the same GGUF with the same shapes
# and thread count: prefill of a PROMPT-token and of a LONG-token prompt, prefill
# of PROMPT tokens after DEPTH cached tokens, single-stream decode (from a short
# prompt and at DEPTH), and aggregate decode at each concurrency in CONC (32-token
# prompts, DECODE new tokens each). RAW_DIR keeps the tools' own output. Each
# figure is the best of ROUNDS rounds, the tools alternating, so a busy neighbour
# on a shared machine skews both sides alike.
#
#   LLAMA_CPP_BIN=/path/with/llama-bench scripts/bench-engine.sh
#
# Without LLAMA_CPP_BIN (or without the tools there) only Pie runs. PIE_BASE=path
# runs a second `pie` binary (an earlier commit) with the same commands in the
# same rounds and adds its column and the ratio to it. KV_DTYPE (f16 or f32,
# default f16, as `pie serve`'s) is Pie's KV page dtype, BASE_KV_DTYPE the base's (default
# KV_DTYPE): `PIE_BASE=target/release/pie KV_DTYPE=f16 BASE_KV_DTYPE=f32` sets
# f16 pages beside f32 pages on one binary. MATMUL (a kernel name such as avx2 or
# portable; an unknown one fails, listing the names; default: the fastest this
# CPU runs) forces Pie's matmul kernel
# (PIE_MATMUL_KERNEL), BASE_MATMUL the base's (default MATMUL):
# `PIE_BASE=target/release/pie MATMUL=avx2 BASE_MATMUL=portable` compares two
# kernels in one run. Pie's engine-bench also measures this machine's
# streaming-read bandwidth; the summary gives single-stream decode's weight
# traffic as a share of it.
#
# See docs/benchmarks/engine.md for how to build llama.cpp's tools.
set -euo pipefail

MODEL=${MODEL:-$HOME/.cache/pie/models/SmolLM2-135M-Instruct.Q4_1.gguf}
THREADS=${THREADS:-2}
PROMPT=${PROMPT:-512}
LONG=${LONG:-2048}
DEPTH=${DEPTH:-2048}
DECODE=${DECODE:-64}
CONC=${CONC:-1,8,32,64}
ROUNDS=${ROUNDS:-2}
PIE=${PIE:-target/release/pie}
PIE_BASE=${PIE_BASE:-}
KV_DTYPE=${KV_DTYPE:-f16}
BASE_KV_DTYPE=${BASE_KV_DTYPE:-$KV_DTYPE}
MATMUL=${MATMUL:-}
BASE_MATMUL=${BASE_MATMUL:-$MATMUL}
LLAMA_CPP_BIN=${LLAMA_CPP_BIN:-}

cd "$(dirname "$0")/.."
[ -x "$PIE" ] || cargo build --release --bin pie
[ -f "$MODEL" ] || "$PIE" model fetch >/dev/null
llama=0
if [ -n "$LLAMA_CPP_BIN" ] && [ -x "$LLAMA_CPP_BIN/llama-bench" ] &&
    [ -x "$LLAMA_CPP_BIN/llama-batched-bench" ]; then
    llama=1
else
    echo "llama.cpp's tools not found (LLAMA_CPP_BIN=${LLAMA_CPP_BIN:-unset}): Pie only" >&2
fi

max_conc=$(tr ',' '\n' <<<"$CONC" | sort -n | tail -1)
# llama.cpp splits its context between the sequences; give each room to spare.
ctx=$((max_conc * (32 + DECODE) * 2))
out=${RAW_DIR:-$(mktemp -d)}
mkdir -p "$out"
rm -f "$out/pie" "$out/base" "$out/pie.err" "$out/llama-bench" "$out/batched"

# The three engine-bench runs of one round, for binary $1 with KV dtype $2 and
# matmul kernel $3 (empty: the fastest).
pie_round() {
    local run=(env PIE_MATMUL_KERNEL="$3" RAYON_NUM_THREADS="$THREADS"
        "$1" engine-bench --model "$MODEL" --kv-dtype "$2")
    "${run[@]}" --prompt-tokens "$PROMPT" --decode-tokens "$DECODE" --concurrency "$CONC" &&
        "${run[@]}" --prompt-tokens "$LONG" --concurrency 0 &&
        "${run[@]}" --prompt-tokens "$PROMPT" --depth "$DEPTH" --decode-tokens "$DECODE" \
            --concurrency 1
}

for round in $(seq "$ROUNDS"); do
    echo "round $round/$ROUNDS ..." >&2
    # A run that fails (an unknown MATMUL, say) stops the script with its error.
    pie_round "$PIE" "$KV_DTYPE" "$MATMUL" >>"$out/pie" 2>"$out/pie.err" || {
        cat "$out/pie.err" >&2
        exit 1
    }
    if [ -n "$PIE_BASE" ]; then
        pie_round "$PIE_BASE" "$BASE_KV_DTYPE" "$BASE_MATMUL" >>"$out/base" 2>/dev/null || true
    fi
    if [ "$llama" = 1 ]; then
        for args in "-p $PROMPT -n $DECODE" "-p $LONG -n 0" "-p $PROMPT -n $DECODE -d $DEPTH"; do
            # shellcheck disable=SC2086
            "$LLAMA_CPP_BIN/llama-bench" -m "$MODEL" -t "$THREADS" $args \
                -r 3 -o csv 2>/dev/null >>"$out/llama-bench"
        done
        "$LLAMA_CPP_BIN/llama-batched-bench" -m "$MODEL" -t "$THREADS" -tb "$THREADS" \
            -c "$ctx" -b 2048 -ub 512 -npp 32 -ntg "$DECODE" -npl "$CONC" 2>/dev/null \
            >>"$out/batched"
    fi
done

# One "key value" line per figure, best over rounds. Keys: ppP, ppP_dD (prefill
# of P tokens after D cached), tgN / decode1 (one sequence), tgN_dD / decode1_dD,
# decodeN (aggregate at N sequences).
pie_keys() { # prefix, file
    [ -f "$2" ] || return 0
    awk -v p="$1" '
        /^prefill:/ {
            n = $2; sub(/-token/, "", n)
            k = "pp" n
            if ($4 == "at") { d = $6; sub(/:/, "", d); k = k "_d" d }
            print p k, $(NF-1)
        }
        /^decode:/ {
            k = "decode" $2
            if ($5 == "at") { d = $7; sub(/:/, "", d); k = k "_d" d }
            print p k, $(NF-2)
        }
        /^memory:/ { print p "membw", $2 }' "$2"
}
{
    pie_keys pie_ "$out/pie"
    pie_keys base_ "$out/base"
    if [ "$llama" = 1 ]; then
        # The header is bare, the rows quoted: row field i + 1 is header column i.
        awk -F'","|"' '
            /^build_commit/ {n = split($0, h, ","); for (i = 1; i <= n; i++) col[h[i]] = i + 1; next}
            /^"/ {
                d = ("n_depth" in col && $col["n_depth"] > 0) ? "_d" $col["n_depth"] : ""
                if ($col["n_gen"] == 0) print "llama_pp" $col["n_prompt"] d, $col["avg_ts"]
                else print "llama_decode1" d, $col["avg_ts"]
            }' "$out/llama-bench"
        awk -F'|' '$2 ~ /^ *[0-9]+ *$/ {gsub(/ /, ""); print "llama_decode" $4, $9}' \
            "$out/batched"
    fi
} | awk '!($1 in best) || $2 > best[$1] {best[$1] = $2} END {for (k in best) print k, best[k]}' \
    >"$out/figures"

fig() { awk -v k="$1" '$1 == k {print $2}' "$out/figures"; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN {
    print (a != "" && b != "" && b > 0) ? sprintf("%.2fx", a / b) : "n/a" }'; }
row() { # label, key, target
    local a b l
    a=$(fig "pie_$2")
    b=$(fig "base_$2")
    l=$(fig "llama_$2")
    awk -v lab="$1" -v a="$a" -v b="$b" -v l="$l" -v rb="$(ratio "$a" "$b")" \
        -v rl="$(ratio "$a" "$l")" -v t="$3" 'BEGIN {
        printf "| %-42s | %8s | %8s | %9s | %8s | %8s | %6s |\n", lab, f(a), f(b), f(l), rb, rl, t }
        function f(x) { return x == "" ? "" : sprintf("%.1f", x) }'
}

echo
echo "model: $(basename "$MODEL"), $THREADS threads, best of $ROUNDS rounds, tok/s"
echo "KV pages: pie $(grep -m1 '^kv:' "$out/pie" | cut -d' ' -f2-)"
[ -f "$out/base" ] && echo "KV pages: base $(grep -m1 '^kv:' "$out/base" | cut -d' ' -f2-)"
echo "matmul: pie $(grep -m1 '^matmul:' "$out/pie" | cut -d' ' -f2-)"
[ -f "$out/base" ] && echo "matmul: base $(grep -m1 '^matmul:' "$out/base" | cut -d' ' -f2-)"
# Single-stream decode's weight traffic (bytes per token x best tok/s) against the
# best streaming-read bandwidth the same runs measured.
awk -v w="$(grep -m1 '^weights:' "$out/pie" | cut -d' ' -f2)" -v bw="$(fig pie_membw)" \
    -v tg="$(fig pie_decode1)" -v tgd="$(fig "pie_decode1_d$DEPTH")" -v d="$DEPTH" 'BEGIN {
    if (w == "" || bw == "" || bw <= 0) exit
    printf "memory: %.2f GB/s streaming read; single-stream decode reads %.1f MiB of weights per token:", bw, w / 1048576
    if (tg != "") printf " tg %.1f%% of it", 100 * w * tg / (bw * 1e9)
    if (tgd != "") printf ", at depth %d %.1f%%", d, 100 * w * tgd / (bw * 1e9)
    print "" }'
echo
printf "| %-42s | %8s | %8s | %9s | %8s | %8s | %6s |\n" \
    "figure" "pie" "base" "llama.cpp" "vs base" "vs llama" "target"
echo "|--------------------------------------------|----------|----------|-----------|----------|----------|--------|"
row "prefill, ${PROMPT}-token prompt (pp$PROMPT)" "pp$PROMPT" ">=1.5x"
row "prefill, ${LONG}-token prompt (pp$LONG)" "pp$LONG" ">=1.5x"
row "prefill, $PROMPT after $DEPTH cached (pp$PROMPT @ d$DEPTH)" "pp${PROMPT}_d$DEPTH" ""
row "decode, 1 sequence (tg$DECODE)" "decode1" ">=1.5x"
row "decode, 1 sequence at depth $DEPTH (tg$DECODE @ d$DEPTH)" "decode1_d$DEPTH" ">=1.5x"
for n in $(tr ',' ' ' <<<"$CONC"); do
    target=""
    [ "$n" = 32 ] && target=">=2x"
    row "decode aggregate, $n sequences" "decode$n" "$target"
done
echo
echo "pie: engine-bench --prompt-tokens $PROMPT --decode-tokens $DECODE --concurrency $CONC;" \
    "--prompt-tokens $LONG --concurrency 0;" \
    "--prompt-tokens $PROMPT --depth $DEPTH --decode-tokens $DECODE --concurrency 1"
echo "llama.cpp: llama-bench -p $PROMPT -n $DECODE; -p $LONG -n 0; -p $PROMPT -n $DECODE -d $DEPTH;" \
    "llama-batched-bench -npp 32 -ntg $DECODE -npl $CONC"
