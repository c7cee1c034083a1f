#!/usr/bin/env python3
"""Pie's controller beside SGLang's router, in front of the same Pie workers (issue 12).

Usage: scripts/bench-sglang-router.py [--pie target/release/pie]
           [--controller target/release/pie-controller] [--model PATH]
           [--sglang-python python3] [--workers 3] [--kv-pages 40]
           [--groups 8] [--prefix-words 200] [--question-words 24]
           [--max-tokens 16] [--requests 40] [--concurrency 1,4,8,16]
           [--seeds 1,2,3] [--routers pie,sglang] [--json out.json]
           [--sglang-args "--cache-threshold 0.3 ..."]
           [--pie-config controller.toml] [--pie-policies LIST] [--persist]

Needs SGLang's router importable by --sglang-python (`pip install
sglang-router`; this script was run with 0.3.2).

For every concurrency level and seed, each router in turn gets fresh workers:
--workers `pie serve --kv-pages N` processes (pages of 16 tokens, so small pools
make placement matter) are started, the router is started in front of them,
the run is made, then router and workers are killed, so every run starts with
cold caches. The order of the two routers alternates from seed to seed.

Routers: `pie` is `pie-controller --model M --policies
session-affinity,cache-aware` (no session header is sent, so only cache-aware
decides; other settings default, or a `[cluster.cache-aware]` table from
--pie-config, e.g. `balance_abs = 64` for SGLang's balance threshold); `sglang` is `python -m
sglang_router.launch_router --policy cache_aware` with its CLI defaults
(cache threshold 0.3, balance thresholds 64 absolute / 1.5 relative) plus
--sglang-args. --pie-policies replaces Pie's policy list.

--persist gives every worker a disk tier (`[runtime.persist] dir`, a fresh
temporary directory per worker and run), for both routers alike: the workers
are the same processes either way, and a prefix reaches the disk only when
something asks for it (Pie's `persist-prefix` actor, if --pie-policies lists
it; SGLang's router asks for nothing). Pages loaded back from disk before a
prefill count as prefix hits.

Workload (text, so that SGLang's router, which routes on prompt text, sees
prefixes): --groups system prompts of --prefix-words random words (seeded),
then --requests requests taking the groups in turn (request i belongs to group
i mod groups), each its group's prompt followed by a distinct question of
--question-words words. Every request is `POST /v1/completions`, streaming,
`temperature` 0, `max_tokens` --max-tokens; the same bytes go to both routers.
Closed loop: --concurrency requests in flight.

Measured per run: prefix hit rate, hit / (hit + computed), summed over the
workers' deltas of `pie_prefix_cache_hit_tokens_total` (hit) and
`pie_prompt_tokens_total` (prompt tokens computed, recomputation after
preemption included), as `pie bench` reports it; TTFT p50/p90 (nearest rank,
client side, until the first SSE chunk with text); wall time (first send to last end); and
the prompt tokens each worker computed. Per level the medians over
the seeds are printed with the ratios Pie/SGLang, and the issue's target
(Pie's hit rate and wall time within 5% of SGLang's or better at every level,
wall time at least 1.2x better at concurrency >= 4) is checked and reported.

Exit 1 with a message naming the failing process or request on failure.
Python standard library only.
"""
import argparse
import json
import os
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pielib  # noqa: E402
from pielib import percentile  # noqa: E402

WORDS = ("time year people way day man thing woman life child world school state family student "
         "group country problem hand part place case week company system program question work "
         "government number night point home water room mother area money story fact month lot "
         "right study book eye job word business issue side kind head house service friend father "
         "power hour game line end member law car city community name president team minute idea "
         "kid body information back parent face others level office door health person art war "
         "history party result change morning reason research girl guy moment air teacher force "
         "education lighthouse river mountain quiet bright green silver ancient modern").split()

HIT = "pie_prefix_cache_hit_tokens_total"
PROMPT = "pie_prompt_tokens_total"
PREEMPT = "pie_preemptions_total"
DISK_LOADED = 'pie_kv_persist_pages_total{event="loaded"}'
DISK_WRITTEN = 'pie_kv_persist_pages_total{event="written"}'


def workload(seed, a):
    rng = random.Random(seed)
    prefixes = [f"Group {g} brief: " + " ".join(rng.choice(WORDS) for _ in range(a.prefix_words))
                for g in range(a.groups)]
    out = []
    for i in range(a.requests):
        g = i % a.groups
        q = " ".join(rng.choice(WORDS) for _ in range(a.question_words))
        out.append(prefixes[g] + f"\nQuestion {i}: {q}\nAnswer:")
    return out


def one_request(url, model, prompt, max_tokens):
    """(ttft_s, total_s, worker, route) of one streaming completion; the last two
    are Pie's `x-pie-worker` and `x-pie-route` headers (None from other routers)."""
    c = pielib.connect(url, 600)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True}
    t0 = time.perf_counter()
    ttft = None
    try:
        c.request("POST", "/v1/completions", json.dumps(body),
                  {"content-type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read().decode()[:300]}")
        worker, route = r.getheader("x-pie-worker"), r.getheader("x-pie-route")
        while True:
            line = r.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            if ttft is None:
                try:
                    chunk = json.loads(data)
                except ValueError:
                    continue
                if "error" in chunk:
                    raise RuntimeError(f"stream error: {data[:300]!r}")
                if any(ch.get("text") for ch in chunk.get("choices") or []):
                    ttft = time.perf_counter() - t0
    finally:
        c.close()
    total = time.perf_counter() - t0
    return (ttft if ttft is not None else total), total, worker, route


def run_load(url, model, prompts, concurrency, max_tokens):
    results = [None] * len(prompts)
    errors = []
    nxt = [0]
    lock = threading.Lock()

    def worker():
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= len(prompts) or errors:
                return
            try:
                results[i] = one_request(url, model, prompts[i], max_tokens)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(f"request {i}: {e}")
                return

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise SystemExit(f"{url}: {errors[0]}")
    return results, wall


def start_router(kind, procs, a, wurls):
    if kind == "pie":
        args = [a.controller, "--port", "0", "--model", a.model, "--policies", a.pie_policies]
        for i, w in enumerate(wurls):
            args += ["--worker", f"w{i}={w}"]
        if a.pie_config:
            args += ["--config", a.pie_config]
        proc, url = procs.spawn(args, "pie-controller: listening on ", "pie-controller")
        pielib.wait_healthy(url, 300, workers=len(wurls), proc=proc, what="pie-controller")
        return url
    port = pielib.free_port()
    args = [a.sglang_python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
            "--port", str(port), "--policy", "cache_aware",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(pielib.free_port()),
            "--log-level", "warn", "--worker-urls", *wurls] + shlex.split(a.sglang_args)
    proc, _ = procs.spawn(args, None, "sglang router")
    url = f"http://127.0.0.1:{port}"
    pielib.wait_healthy(url, 120, path="/readiness", proc=proc, what="sglang router")
    return url


def worker_args(a, i, scratch):
    """`pie serve` arguments of worker `i`; with --persist, a config naming
    its own disk tier under `scratch`."""
    args = [a.pie, "serve", "--port", "0", "--model", a.model, "--kv-pages", str(a.kv_pages)]
    if a.persist:
        cfg = os.path.join(scratch, f"w{i}.toml")
        with open(cfg, "w") as f:
            f.write(f'[runtime.persist]\ndir = "{os.path.join(scratch, f"kv-w{i}")}"\n')
        args += ["--config", cfg]
    return args


def one_run(kind, seed, conc, a):
    procs = pielib.Procs()
    scratch = tempfile.mkdtemp(prefix="pie-router-bench-")
    try:
        wurls = []
        for i in range(a.workers):
            proc, url = procs.spawn(worker_args(a, i, scratch), "pie: listening on ",
                                    f"pie serve w{i}")
            wurls.append(url)
        for i, (p, u) in enumerate(zip(procs.procs, wurls)):
            pielib.wait_healthy(u, 300, proc=p, what=f"pie serve w{i}")
        model = pielib.get_json(wurls[0], "/v1/models")["data"][0]["id"]
        url = start_router(kind, procs, a, wurls)
        before = [pielib.scrape(u) for u in wurls]
        results, wall = run_load(url, model, workload(seed, a), conc, a.max_tokens)
        after = [pielib.scrape(u) for u in wurls]
        delta = lambda name: [pielib.prom_delta(b, x, name) for b, x in zip(before, after)]
        computed, hit = delta(PROMPT), sum(delta(HIT))
        ttfts = [r[0] for r in results]
        routes = [[i % a.groups, r[2], r[3]] for i, r in enumerate(results)]
        return {"router": kind, "seed": seed, "concurrency": conc, "wall_s": wall,
                "hit_rate": hit / max(hit + sum(computed), 1), "ttft_p50_s": percentile(ttfts, 50),
                "ttft_p90_s": percentile(ttfts, 90), "computed_tokens_per_worker": computed,
                "preemptions_per_worker": delta(PREEMPT), "disk_pages_written": sum(delta(DISK_WRITTEN)),
                "disk_pages_loaded": sum(delta(DISK_LOADED)), "routes": routes}
    finally:
        procs.stop_all()
        shutil.rmtree(scratch, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pie", default="target/release/pie")
    ap.add_argument("--controller", default="target/release/pie-controller")
    ap.add_argument("--model", default=os.path.expanduser(
        "~/.cache/pie/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--sglang-python", default="python3")
    ap.add_argument("--sglang-args", default="")
    ap.add_argument("--pie-config", help="a pie-controller config file (its [cluster] table)")
    ap.add_argument("--pie-policies", default="session-affinity,cache-aware")
    ap.add_argument("--persist", action="store_true",
                    help="every worker gets a disk tier of its own (both routers)")
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--kv-pages", type=int, default=40)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--prefix-words", type=int, default=200)
    ap.add_argument("--question-words", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--concurrency", default="1,4,8,16")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--routers", default="pie,sglang")
    ap.add_argument("--json", help="write every run here as it ends")
    ap.add_argument("--summarize", metavar="JSON",
                    help="print the table of an earlier --json file; run nothing")
    a = ap.parse_args()
    if a.summarize:
        with open(a.summarize) as f:
            runs = json.load(f)["runs"]
        summarize(runs, sorted({r["concurrency"] for r in runs}),
                  sorted({r["router"] for r in runs}), a.summarize)
        return 0
    levels = [int(x) for x in a.concurrency.split(",")]
    seeds = [int(x) for x in a.seeds.split(",")]
    routers = a.routers.split(",")
    for r in routers:
        if r not in ("pie", "sglang"):
            raise SystemExit(f"unknown router {r!r}")
    if "sglang" in routers:
        chk = subprocess.run([a.sglang_python, "-c", "import sglang_router"],
                             capture_output=True, text=True)
        if chk.returncode != 0:
            raise SystemExit(f"{a.sglang_python} cannot import sglang_router "
                             f"(pip install sglang-router): {chk.stderr.strip()[-300:]}")

    runs = []
    t_start = time.time()
    for conc in levels:
        for si, seed in enumerate(seeds):
            order = routers if si % 2 == 0 else routers[::-1]
            for kind in order:
                r = one_run(kind, seed, conc, a)
                runs.append(r)
                if a.json:
                    with open(a.json, "w") as f:
                        json.dump({"args": vars(a), "runs": runs}, f, indent=1)
                print(f"c={conc:<3} seed={seed} {kind:<6} wall {r['wall_s']:6.2f} s  "
                      f"hit {r['hit_rate']:.3f}  ttft p50 {r['ttft_p50_s'] * 1e3:7.0f} ms  "
                      f"p90 {r['ttft_p90_s'] * 1e3:7.0f} ms  prompt tokens computed per worker "
                      f"{[int(x) for x in r['computed_tokens_per_worker']]}  preemptions "
                  f"{[int(x) for x in r['preemptions_per_worker']]}  disk pages written "
                  f"{int(r['disk_pages_written'])} loaded {int(r['disk_pages_loaded'])}", flush=True)
    print(f"total {time.time() - t_start:.0f} s")
    summarize(runs, levels, routers, f"seeds {a.seeds}, {a.requests} requests per run")
    return 0


def summarize(runs, levels, routers, what):
    def med(kind, conc, key):
        xs = [r[key] for r in runs if r["router"] == kind and r["concurrency"] == conc]
        return percentile(xs, 50) if xs else float("nan")

    keys = [("hit_rate", "hit rate", 1, "{:.3f}"), ("ttft_p50_s", "TTFT p50 ms", 1e3, "{:.0f}"),
            ("ttft_p90_s", "TTFT p90 ms", 1e3, "{:.0f}"), ("wall_s", "wall s", 1, "{:.2f}")]
    print(f"\nmedian over {what}; "
          "cells: Pie / SGLang (ratio Pie/SGLang)")
    print("| concurrency | " + " | ".join(k[1] for k in keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    verdicts = []
    for conc in levels:
        cells = []
        for key, _, scale, fmt in keys:
            p, s = med("pie", conc, key), med("sglang", conc, key)
            ratio = p / s if s else float("inf") if p else float("nan")
            cells.append(f"{fmt.format(p * scale)} / {fmt.format(s * scale)} ({ratio:.2f})")
        print(f"| {conc} | " + " | ".join(cells) + " |")
        if "pie" in routers and "sglang" in routers:
            hp, hs = med("pie", conc, "hit_rate"), med("sglang", conc, "hit_rate")
            wp, ws = med("pie", conc, "wall_s"), med("sglang", conc, "wall_s")
            ok = hp >= 0.95 * hs and wp <= 1.05 * ws and (conc < 4 or ws / wp >= 1.2)
            hit_ratio = f"{hp / hs:.2f}x" if hs else f"{hp:.3f} against 0"
            verdicts.append(f"c={conc}: hit {hit_ratio}, wall speedup {ws / wp:.2f}x: "
                            f"{'meets' if ok else 'MISSES'} the target")
    for v in verdicts:
        print(v)


if __name__ == "__main__":
    sys.exit(main())
