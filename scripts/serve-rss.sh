#!/usr/bin/env bash
# Peak and resident memory of `pie serve` on a model: starts it with a KV pool
# of KV_MEMORY (default 256MiB), waits for /health, prints VmHWM and VmRSS,
# sends one completion of a PROMPT_WORDS-word prompt (default 480) and 32
# tokens, prints them again, and stops the server.
#
#   scripts/serve-rss.sh target/release/pie /work/models/llama-3.2-1b-shaped.Q4_K_M.gguf
set -euo pipefail

PIE=${1:?usage: serve-rss.sh PIE_BINARY MODEL}
MODEL=${2:?usage: serve-rss.sh PIE_BINARY MODEL}
KV_MEMORY=${KV_MEMORY:-256MiB}
PROMPT_WORDS=${PROMPT_WORDS:-480}

dir=$(mktemp -d)
printf '[runtime]\nkv_memory = "%s"\n' "$KV_MEMORY" >"$dir/config.toml"
"$PIE" serve --model "$MODEL" --config "$dir/config.toml" --host 127.0.0.1 --port 0 \
    >"$dir/log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$dir"' EXIT

memory() { # label
    awk -v l="$1" '/^VmHWM|^VmRSS/ {printf "%s %s kB  ", $1, $2} END {print "(" l ")"}' \
        "/proc/$pid/status"
}

url=
for _ in $(seq 300); do
    url=$(grep -o 'http://127.0.0.1:[0-9]*' "$dir/log" | head -1 || true)
    [ -n "$url" ] && curl -sf "$url/health" >/dev/null && break
    kill -0 $pid 2>/dev/null || { cat "$dir/log" >&2; exit 1; }
    sleep 1
done
memory ready
prompt=$(python3 -c "print(' '.join('word%d' % (i % 50) for i in range($PROMPT_WORDS)))")
curl -sf "$url/v1/completions" -H 'content-type: application/json' \
    -d "{\"prompt\": \"$prompt\", \"max_tokens\": 32, \"temperature\": 0}" -o /dev/null
memory "after a request"
