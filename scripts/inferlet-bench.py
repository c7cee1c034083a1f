#!/usr/bin/env python3
"""WebAssembly inferlets against the built-ins, in one run (issue 33).

Usage: scripts/inferlet-bench.py [--pie target/release/pie] [--model PATH]
           [--processes 32] [--max-tokens 128] [--rounds 3]

Builds the guests (`cargo build --release` in inferlets/), starts one
`pie serve` (the default model unless --model) and measures:

- aggregate decode: --processes `text-completion` processes at once, native
  and as the component, alternated for --rounds rounds; generated tokens / s
  from the first launch to the last end, the ratio component / native, and
  the per-token overhead (ms a stream spends per token beyond the native's);
- launch: time to the end of a 1-token process, native and component, the
  component's first launch after a restart (compiled code read from disk)
  and later ones (in memory);
- a spinning guest: a native stream's inter-token p50 and p99 alone and
  beside a guest that computes without calling the host (`spin`, killed past
  `max_cpu_ms`), with `[runtime.inferlets] threads = 1`.

Python standard library only (threads + scripts/pielib.py).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pielib  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUESTS = os.path.join(ROOT, "inferlets", "target", "wasm32-wasip2", "release")
PROMPT = "Tell me a story about a lighthouse keeper who"


def serve(procs, a, store):
    config = os.path.join(store, "config.toml")
    with open(config, "w") as f:
        f.write(f"[runtime.inferlets]\ndir = {json.dumps(store)}\nmax_cpu_ms = 5000\nthreads = 1\n")
    args = [a.pie, "serve", "--port", "0", "--config", config]
    if a.model:
        args += ["--model", a.model]
    proc, url = procs.spawn(args, prefix="pie: listening on ")
    pielib.wait_healthy(url, 600, proc=proc)
    return url


def upload(url, name, guest):
    with open(os.path.join(GUESTS, guest + ".wasm"), "rb") as f:
        wasm = f.read()
    c = pielib.connect(url)
    c.request("POST", f"/v1/inferlets?name={name}", wasm)
    r = c.getresponse()
    body = r.read()
    if r.status != 201:
        pielib.fail(f"upload {name}: {r.status} {body[:200]!r}")


def launch(url, inferlet, args):
    r = pielib.request(url, "POST", "/v1/processes", {"inferlet": inferlet, "args": args})
    if r.status != 201:
        pielib.fail(f"launch {inferlet}: {r}")
    return r.json()["id"]


def wait_done(url, pid, must_finish=True):
    while True:
        p = pielib.get_json(url, f"/v1/processes/{pid}")
        if p["state"] not in ("queued", "running"):
            if must_finish and p["state"] != "finished":
                pielib.fail(f"{pid}: {p['state']} {p.get('error')}")
            return p
        time.sleep(0.01)


def aggregate(url, inferlet, n, max_tokens):
    args = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True}
    start = time.monotonic()
    ids = [launch(url, inferlet, args) for _ in range(n)]
    tokens = sum(wait_done(url, i)["usage"]["completion_tokens"] for i in ids)
    return tokens / (time.monotonic() - start)


def launch_time(url, inferlet):
    start = time.monotonic()
    wait_done(url, launch(url, inferlet, {"prompt": "Hi", "max_tokens": 1}))
    return (time.monotonic() - start) * 1000


def inter_token_gaps(url, tokens=128):
    model = pielib.get_json(url, "/v1/models")["data"][0]["id"]
    body = {"model": model, "prompt": PROMPT, "max_tokens": tokens, "ignore_eos": True,
            "temperature": 0, "stream": True}
    c = pielib.connect(url)
    c.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        pielib.fail(f"/v1/completions: {r.status} {r.read()[:200]!r}")
    stamps = []
    while data := r.read1(65536):  # as each chunk comes, not line-buffered
        stamps += [time.monotonic()] * data.count(b"data: {")
    c.close()
    return [(b - a) * 1000 for a, b in zip(stamps, stamps[1:])]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pie", default=os.path.join(ROOT, "target", "release", "pie"))
    ap.add_argument("--model")
    ap.add_argument("--processes", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    subprocess.run(["cargo", "build", "--release", "--quiet"], cwd=os.path.join(ROOT, "inferlets"),
                   check=True)
    store = tempfile.mkdtemp(prefix="pie-inferlet-bench-")
    with pielib.Procs() as procs:
        url = serve(procs, a, store)
        upload(url, "text-completion-wasm", "text_completion")
        upload(url, "spin", "spin")
        native, wasm = [], []
        aggregate(url, "text-completion", a.processes, 16)  # warm-up
        for _ in range(a.rounds):
            native.append(aggregate(url, "text-completion", a.processes, a.max_tokens))
            wasm.append(aggregate(url, "text-completion-wasm", a.processes, a.max_tokens))
        n, w = sum(native) / len(native), sum(wasm) / len(wasm)
        per_stream = lambda rate: a.processes / rate * 1000  # ms per token of one stream
        print(f"aggregate decode, {a.processes} processes x {a.max_tokens} tokens, {a.rounds} rounds")
        print(f"  native      {n:8.1f} tokens/s  (rounds: {', '.join(f'{x:.0f}' for x in native)})")
        print(f"  component   {w:8.1f} tokens/s  (rounds: {', '.join(f'{x:.0f}' for x in wasm)})")
        print(f"  ratio component/native {w / n:.3f}; per-token overhead "
              f"{per_stream(w) - per_stream(n):+.2f} ms per stream-token")
        procs.stop_all()
        url = serve(procs, a, store)
        cold = launch_time(url, "text-completion-wasm")
        warm = sorted(launch_time(url, "text-completion-wasm") for _ in range(10))[5]
        nat = sorted(launch_time(url, "text-completion") for _ in range(10))[5]
        counts = pielib.get_json(url, "/v1/inferlets")
        print(f"launch to end of a 1-token process (ms): native {nat:.1f}, component "
              f"after a restart {cold:.1f} (compiles {counts['compiles']}, cache loads "
              f"{counts['cache_loads']}), component warm {warm:.1f}")
        alone = inter_token_gaps(url)
        spinner = launch(url, "spin", {})
        time.sleep(0.2)
        beside = inter_token_gaps(url)
        spun = wait_done(url, spinner, must_finish=False)
        pct = lambda v, p: pielib.percentile(v, p)
        print(f"native stream inter-token ms, alone: p50 {pct(alone, 50):.2f} p99 {pct(alone, 99):.2f}; "
              f"beside a spinning guest: p50 {pct(beside, 50):.2f} p99 {pct(beside, 99):.2f} "
              f"(guest threads 1; the guest ended {spun['state']}: {spun.get('error')})")


if __name__ == "__main__":
    main()
