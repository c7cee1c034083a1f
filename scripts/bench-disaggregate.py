#!/usr/bin/env python3
"""KV page transfer and disaggregated serving, measured (issue 13).

Usage: scripts/bench-disaggregate.py [transfer|serve|all]
           [--pie target/release/pie] [--controller target/release/pie-controller]
           [--model PATH] [--seed 13]
           transfer: [--prompts 3] [--prompt-tokens 2000] [--check-tokens 8]
           serve:    [--streams 8] [--stream-tokens 300] [--long-prompts 6]
                     [--long-tokens 1500] [--long-interval 25] [--warmup-s 5]
                     [--min-remote 512] [--cores 0,1]

`transfer` (default part of `all`): starts three `pie serve` workers A, B, C.
For each of --prompts distinct prompts (--prompt-tokens random token ids in
1000..40000, seeded), A computes it from scratch (`max_tokens`
--check-tokens, temperature 0): the recompute time is A's
`pie_time_to_first_token_seconds` for it (a prompt it has never seen). Then B
(which has never seen it either) gets the same request with
`pie_prefill_from` = A, so B pulls A's pages (A's own part is a cache hit plus
the last page): from B's /metrics, the bytes in and the
`pie_kv_transfer_seconds` of that pull (which includes A's short prefill), hence
the loopback MB/s and recompute/transfer. B's greedy text must equal A's. C
gets the prompt with `max_tokens` 1 and no peer: a second recompute figure on a
worker that never computed anything. Medians over the prompts are printed.

`serve`: two setups, each two workers pinned with `taskset -c` to one core each
(--cores; the controller and this load generator share those cores):
(a) colocated: two `--stage both` workers behind `pie-controller --policies
cache-aware`; (b) disaggregated: `--stage prefill` (first core) and `--stage
decode` (second core) behind `--policies disaggregate,cache-aware`
(`min_remote_prefill_tokens` --min-remote). Load, through the controller:
--streams closed-loop streaming decode clients (a short distinct prompt,
`max_tokens` --stream-tokens, `ignore_eos`, temperature 0, restarted when
done); after --warmup-s, --long-prompts long prompts (--long-tokens distinct
random token ids, `max_tokens` 8, streaming) arrive every --long-interval s
(each in its own thread, so they may overlap if one takes longer). Keep
--long-interval above one core's prefill time for a long prompt (about 12-20 s
on a shared 2-core machine): otherwise the one prefill worker's queue grows,
pulls reach `[runtime.transfer] timeout_ms` and fall back, and (b) fails. Measured,
client side, in the window from the first long prompt's arrival to the last
one's end: the decode streams' inter-token latency p50/p99 (gaps between
consecutive SSE chunks with text of one stream, both inside the window; a chunk
is one token except where the detokenizer holds back a partial character), the
long prompts' TTFT p50/p90 (first chunk with text), and output tokens/s (the
workers' `pie_generated_tokens_total` over the window). Also printed: ITL p99.9
and max, and the share of the streams' time spent in gaps over 1 s (a prefill
chunk sharing a step stalls a stream for seconds, but such gaps are few, so
count-based percentiles can miss them). In (b) every long prompt's `x-pie-route` must
say `disaggregate: prefill on`, and `pie_kv_transfer_fallbacks_total` must be 0.

Exit 1 with a message naming the failed check or the failing process.
Python standard library only.
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pielib  # noqa: E402
from pielib import fail, percentile  # noqa: E402

PROCS = pielib.Procs()


def worker(a, name, stage="both", core=None):
    args = [a.pie, "serve", "--port", "0", "--model", a.model, "--stage", stage]
    if core is not None:
        args = ["taskset", "-c", str(core)] + args
    proc, url = PROCS.spawn(args, "pie: listening on ", f"worker {name}")
    pielib.wait_healthy(url, 300, proc=proc, what=f"worker {name}")
    return url


def prompt_ids(rng, n):
    return [rng.randint(1000, 40000) for _ in range(n)]


def complete(url, body):
    return pielib.post_json(url, "/v1/completions", body)


# ---------------------------------------------------------------------------
# transfer vs recompute

def bench_transfer(a):
    rng = random.Random(a.seed)
    wa, wb, wc = worker(a, "A"), worker(a, "B"), worker(a, "C")
    rows = []
    for i in range(a.prompts):
        ids = prompt_ids(rng, a.prompt_tokens)
        body = {"prompt": ids, "max_tokens": a.check_tokens, "temperature": 0}
        ma0, mb0, mc0 = pielib.scrape(wa), pielib.scrape(wb), pielib.scrape(wc)
        ra = complete(wa, body)
        ma1 = pielib.scrape(wa)
        t = time.monotonic()
        rb = complete(wb, dict(body, pie_prefill_from=wa))
        b_wall = time.monotonic() - t
        mb1 = pielib.scrape(wb)
        ma2 = pielib.scrape(wa)
        complete(wc, dict(body, max_tokens=1))
        mc1 = pielib.scrape(wc)
        if pielib.prom_delta(ma0, ma1, "pie_time_to_first_token_seconds_count") != 1:
            fail(f"prompt {i}: A's time_to_first_token_seconds_count moved by "
                 f"{pielib.prom_delta(ma0, ma1, 'pie_time_to_first_token_seconds_count')}, not 1")
        if ra["usage"]["prompt_tokens_details"]["cached_tokens"] != 0:
            fail(f"prompt {i}: A had {ra['usage']['prompt_tokens_details']} cached")
        pulls = pielib.prom_delta(mb0, mb1, "pie_kv_transfer_seconds_count")
        fallbacks = pielib.prom_delta(mb0, mb1, "pie_kv_transfer_fallbacks_total")
        if pulls != 1 or fallbacks != 0:
            fail(f"prompt {i}: B made {pulls} pulls with {fallbacks} fallbacks (want 1 and 0)")
        ta, tb = ra["choices"][0]["text"], rb["choices"][0]["text"]
        if ta != tb:
            fail(f"prompt {i}: B's greedy text {tb!r} differs from A's {ta!r}")
        row = {
            "recompute_a": pielib.prom_delta(ma0, ma1, "pie_time_to_first_token_seconds_sum"),
            "recompute_c": pielib.prom_delta(mc0, mc1, "pie_time_to_first_token_seconds_sum"),
            "transfer": pielib.prom_delta(mb0, mb1, "pie_kv_transfer_seconds_sum"),
            "bytes": pielib.prom_delta(mb0, mb1, 'pie_kv_transfer_bytes_total{direction="in"}'),
            "pages": pielib.prom_delta(mb0, mb1, 'pie_kv_transfer_pages_total{direction="in"}'),
            "b_ttft": pielib.prom_delta(mb0, mb1, "pie_time_to_first_token_seconds_sum"),
            "b_computed": pielib.prom_delta(mb0, mb1, "pie_prompt_tokens_total"),
            "b_cached": rb["usage"]["prompt_tokens_details"]["cached_tokens"],
            "b_wall": b_wall,
            "a_computed": pielib.prom_delta(ma1, ma2, "pie_prompt_tokens_total"),  # A's part of the pull
            "text": ta,
        }
        row["mbps"] = row["bytes"] / row["transfer"] / 1e6
        row["ratio"] = row["recompute_a"] / row["transfer"]
        rows.append(row)
    print(f"== transfer vs recompute: {a.prompts} prompts of {a.prompt_tokens} token ids, "
          "loopback, unpinned workers")
    print(f"{'prompt':<7}{'pages':>6}{'MB':>8}{'pull s':>9}{'MB/s':>8}{'A TTFT s':>10}"
          f"{'C TTFT s':>10}{'A/pull':>8}{'B TTFT s':>10}{'B computed':>11}"
          f"{'A computed':>11}  greedy A == B")
    for i, r in enumerate(rows):
        print(f"{i:<7}{r['pages']:>6.0f}{r['bytes'] / 1e6:>8.1f}{r['transfer']:>9.3f}"
              f"{r['mbps']:>8.0f}{r['recompute_a']:>10.3f}{r['recompute_c']:>10.3f}"
              f"{r['ratio']:>8.1f}{r['b_ttft']:>10.3f}{r['b_computed']:>11.0f}"
              f"{r['a_computed']:>11.0f}  yes {r['text']!r}")
    med = {k: percentile([r[k] for r in rows], 50)
           for k in ["pages", "bytes", "transfer", "mbps", "recompute_a", "recompute_c",
                     "ratio", "b_ttft", "b_computed", "a_computed"]}
    print(f"{'median':<7}{med['pages']:>6.0f}{med['bytes'] / 1e6:>8.1f}{med['transfer']:>9.3f}"
          f"{med['mbps']:>8.0f}{med['recompute_a']:>10.3f}{med['recompute_c']:>10.3f}"
          f"{med['ratio']:>8.1f}{med['b_ttft']:>10.3f}{med['b_computed']:>11.0f}"
          f"{med['a_computed']:>11.0f}")
    print(f"recompute (C, never used before) / pull, median: "
          f"{percentile([r['recompute_c'] / r['transfer'] for r in rows], 50):.1f}x; "
          f"A/pull median {med['ratio']:.1f}x (target >= 50x)")
    PROCS.stop_all()
    return med


# ---------------------------------------------------------------------------
# colocated vs disaggregated

class Stream:
    """One streaming request: chunk arrival times (monotonic) and its headers."""

    def __init__(self):
        self.start = time.monotonic()
        self.chunks = []
        self.route = None
        self.usage = None
        self.finish = None
        self.done = False


def stream(url, body, stop=None):
    s = Stream()
    c = pielib.connect(url, 600)
    try:
        c.request("POST", "/v1/completions",
                  json.dumps(dict(body, stream=True, stream_options={"include_usage": True})),
                  {"content-type": "application/json"})
        r = c.getresponse()
        s.route = r.getheader("x-pie-route")
        if r.status != 200:
            fail(f"streaming POST {url}: HTTP {r.status}: {r.read()[:300]!r}")
        for raw in r:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                s.done = True
                break
            ev = json.loads(data)
            if "error" in ev:
                fail(f"error event from {url}: {data[:300]}")
            if ev.get("usage"):
                s.usage = ev["usage"]
            for ch in ev.get("choices") or []:
                if ch.get("finish_reason"):
                    s.finish = ch["finish_reason"]
                if ch.get("text"):
                    s.chunks.append(time.monotonic())
            if stop is not None and stop.is_set():
                break
    finally:
        c.close()
    return s


def run_setup(a, label, disaggregate, tmp):
    c0, c1 = a.cores.split(",")
    if disaggregate:
        w0 = worker(a, "w0", "prefill", c0)
        w1 = worker(a, "w1", "decode", c1)
        policies = "disaggregate,cache-aware"
    else:
        w0 = worker(a, "w0", "both", c0)
        w1 = worker(a, "w1", "both", c1)
        policies = "cache-aware"
    cfg = os.path.join(tmp, "controller.toml")
    with open(cfg, "w") as f:
        f.write(f"[cluster.disaggregate]\nmin_remote_prefill_tokens = {a.min_remote}\n")
    ctl, curl = PROCS.spawn([a.controller, "--port", "0", "--model", a.model, "--config", cfg,
                             "--policies", policies, "--worker", f"w0={w0}", "--worker", f"w1={w1}"],
                            "pie-controller: listening on ")
    pielib.wait_healthy(curl, 300, workers=2, proc=ctl, what="the controller's workers")
    # Warm each worker up directly (its first engine steps are slower), so the
    # prefill-stage worker's first long prompt is not a cold start.
    warm = prompt_ids(random.Random(a.seed + 7), 256)
    for w in (w0, w1):
        complete(w, {"prompt": warm, "max_tokens": 2, "temperature": 0})

    stop = threading.Event()
    lock = threading.Lock()
    decode, errors = [], []

    def decode_client(k):
        n = 0
        try:
            while not stop.is_set():
                body = {"prompt": f"Client {k}, story {n}: write a long tale about a lighthouse "
                                  "keeper and the sea.",
                        "max_tokens": a.stream_tokens, "ignore_eos": True, "temperature": 0}
                s = stream(curl, body, stop)
                with lock:
                    decode.append(s)
                if not stop.is_set() and (not s.done or s.usage is None
                                          or s.usage["completion_tokens"] != a.stream_tokens):
                    raise RuntimeError(f"decode stream ended early: done={s.done} "
                                       f"usage={s.usage} chunks={len(s.chunks)}")
                n += 1
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(f"decode client {k}: {e}")

    clients = [threading.Thread(target=decode_client, args=(k,), daemon=True)
               for k in range(a.streams)]
    for t in clients:
        t.start()
    time.sleep(a.warmup_s)

    rng = random.Random(a.seed * 1000 + (1 if disaggregate else 0))
    longs = [None] * a.long_prompts

    def long_client(i, ids):
        try:
            longs[i] = stream(curl, {"prompt": ids, "max_tokens": 8, "temperature": 0,
                                     "ignore_eos": True})
        except BaseException as e:  # noqa: BLE001
            errors.append(f"long prompt {i}: {e}")

    m_before = {"w0": pielib.scrape(w0), "w1": pielib.scrape(w1)}
    prompts = [prompt_ids(rng, a.long_tokens) for _ in range(a.long_prompts)]
    threads = []
    t0 = time.monotonic()
    for i, ids in enumerate(prompts):
        delay = t0 + i * a.long_interval - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        if errors:
            break
        th = threading.Thread(target=long_client, args=(i, ids), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    t1 = time.monotonic()
    m_after = {"w0": pielib.scrape(w0), "w1": pielib.scrape(w1)}
    stop.set()
    for t in clients:
        t.join(timeout=a.stream_tokens)  # a stream stops at its next chunk
    if errors:
        fail(f"{label}: " + "; ".join(errors[:3]))

    gaps = []
    for s in decode:
        for x, y in zip(s.chunks, s.chunks[1:]):
            if x >= t0 and y <= t1:
                gaps.append(y - x)
    tokens = sum(pielib.prom_delta(m_before[w], m_after[w], "pie_generated_tokens_total") for w in m_after)
    ttfts = []
    remote = 0
    for i, s in enumerate(longs):
        if s is None or not s.done or not s.usage or s.usage["completion_tokens"] != 8:
            fail(f"{label}: long prompt {i} did not complete with 8 tokens")
        ttfts.append(s.chunks[0] - s.start)
        if (s.route or "").startswith("disaggregate: prefill on"):
            remote += 1
    window = t1 - t0
    fallbacks = sum(pielib.prom_sum(m, "pie_kv_transfer_fallbacks_total", 0.0)
                    for m in m_after.values())
    tin = pielib.prom_delta(m_before["w1"], m_after["w1"], 'pie_kv_transfer_bytes_total{direction="in"}')
    pulls = pielib.prom_delta(m_before["w1"], m_after["w1"], "pie_kv_transfer_seconds_count")
    pull_s = pielib.prom_delta(m_before["w1"], m_after["w1"], "pie_kv_transfer_seconds_sum")
    res = {
        "label": label,
        "itl_p50": percentile(gaps, 50) * 1e3, "itl_p99": percentile(gaps, 99) * 1e3,
        "gaps": len(gaps), "itl_p999": percentile(gaps, 99.9) * 1e3, "itl_max": max(gaps) * 1e3,
        # share of the streams' time spent in gaps over 1 s (time-weighted, unlike
        # the percentiles, which count a 5 s stall once)
        "stall": sum(g for g in gaps if g > 1.0) / sum(gaps),
        "ttft_p50": percentile(ttfts, 50), "ttft_p90": percentile(ttfts, 90),
        "tok_s": tokens / window, "window": window, "remote": remote, "fallbacks": fallbacks,
        "pulls": pulls, "pull_s": pull_s / pulls if pulls else 0.0, "pull_mb": tin / 1e6,
        "routes": sorted({(s.route or "").split(";")[0] for s in longs}),
        "w0_prompt": pielib.prom_delta(m_before["w0"], m_after["w0"], "pie_prompt_tokens_total"),
        "w1_prompt": pielib.prom_delta(m_before["w1"], m_after["w1"], "pie_prompt_tokens_total"),
    }
    print(f"== {label}: window {window:.1f} s, {len(gaps)} decode gaps, routes {res['routes']}")
    print(f"   decode routes (up to 4) {sorted({(s.route or '').split(';')[0] for s in decode})[:4]}")
    print(f"   decode ITL p50 {res['itl_p50']:.1f} ms, p99 {res['itl_p99']:.1f} ms, p99.9 "
          f"{res['itl_p999']:.0f} ms, max {res['itl_max']:.0f} ms, time in gaps > 1 s "
          f"{res['stall'] * 100:.1f}%; long-prompt "
          f"TTFT p50 {res['ttft_p50']:.2f} s, p90 {res['ttft_p90']:.2f} s (all: "
          + ", ".join(f"{x:.2f}" for x in ttfts) + f"); {res['tok_s']:.1f} output tok/s")
    print(f"   prompt tokens computed in the window: w0 {res['w0_prompt']:.0f}, "
          f"w1 {res['w1_prompt']:.0f}; pulls {pulls:.0f} ({tin / 1e6:.1f} MB in, mean "
          f"{res['pull_s']:.3f} s each), fallbacks {fallbacks:.0f}, "
          f"remote prefills {remote}/{len(longs)}")
    PROCS.stop_all()
    return res


def bench_serve(a):
    for tool in ["taskset"]:
        if subprocess.call(["sh", "-c", f"command -v {tool} >/dev/null"]) != 0:
            fail(f"{tool} not found")
    tmp = tempfile.mkdtemp(prefix="pie-disagg-")
    colo = run_setup(a, "(a) colocated: 2 x both, cache-aware", False, tmp)
    dis = run_setup(a, "(b) disaggregated: prefill + decode, disaggregate,cache-aware", True, tmp)
    if dis["remote"] != a.long_prompts:
        fail(f"only {dis['remote']} of {a.long_prompts} long prompts were prefilled remotely "
             f"(routes {dis['routes']})")
    if dis["fallbacks"] != 0:
        fail(f"{dis['fallbacks']:.0f} transfers fell back to a local prefill")
    print(f"== {a.streams} decode streams ({a.stream_tokens} tokens each), {a.long_prompts} long "
          f"prompts of {a.long_tokens} tokens every {a.long_interval} s, cores {a.cores}")
    print(f"{'':<25}{'colocated':>11}{'disagg':>11}{'disagg/colo':>13}")
    for key, name, fmt in [("itl_p50", "decode ITL p50 ms", "{:.1f}"),
                           ("itl_p99", "decode ITL p99 ms", "{:.1f}"),
                           ("itl_p999", "decode ITL p99.9 ms", "{:.0f}"),
                           ("itl_max", "decode ITL max ms", "{:.0f}"),
                           ("stall", "stream time in >1s gaps", "{:.3f}"),
                           ("ttft_p50", "long TTFT p50 s", "{:.2f}"),
                           ("ttft_p90", "long TTFT p90 s", "{:.2f}"),
                           ("tok_s", "output tok/s", "{:.1f}")]:
        ratio = dis[key] / colo[key] if colo[key] else float("nan")
        print(f"{name:<25}{fmt.format(colo[key]):>11}{fmt.format(dis[key]):>11}{ratio:>13.2f}")
    print(f"remote prefills {dis['remote']}/{a.long_prompts}, fallbacks {dis['fallbacks']:.0f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("what", nargs="?", choices=["transfer", "serve", "all"], default="all")
    ap.add_argument("--pie", default="target/release/pie")
    ap.add_argument("--controller", default="target/release/pie-controller")
    ap.add_argument("--model", default=os.path.expanduser(
        "~/.cache/pie/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--seed", type=int, default=13)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--check-tokens", type=int, default=8)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--stream-tokens", type=int, default=300)
    ap.add_argument("--long-prompts", type=int, default=6)
    ap.add_argument("--long-tokens", type=int, default=1500)
    ap.add_argument("--long-interval", type=float, default=25.0)
    ap.add_argument("--warmup-s", type=float, default=5.0)
    ap.add_argument("--min-remote", type=int, default=512)
    ap.add_argument("--cores", default="0,1")
    a = ap.parse_args()
    for path in [a.pie, a.controller, a.model]:
        if not os.path.exists(path):
            fail(f"{path} not found")
    try:
        print(f"machine: {os.cpu_count()} CPUs, "
              + next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                      if line.startswith("model name")), "?"))
        if a.what in ("transfer", "all"):
            bench_transfer(a)
        if a.what in ("serve", "all"):
            bench_serve(a)
    except pielib.HttpError as e:
        fail(e)
    finally:
        PROCS.stop_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
