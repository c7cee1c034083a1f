#!/usr/bin/env python3
"""Moving streams and KV between workers, measured on the default model (issues 14, 15).

Usage: scripts/bench-migrate.py [downtime|drain|rebalance|replicate|all]
           [--pie target/release/pie] [--controller target/release/pie-controller]
           [--model PATH] [--seed 14]
           downtime: [--reps 3] [--context 2000] [--after 40] [--tokens 120]
           drain:    [--clients 32] [--drain-tokens 160] [--term-after-s 2]
           rebalance: [--sessions 12] [--turns 3] [--turn-tokens 96] [--max-running 2]
           replicate: [--clients-replicate 8] [--requests-replicate 96] [--system-words 300]
                      [--answer-tokens 24] [--max-running 2]

`downtime`: per repetition a fresh cluster, two `pie serve` workers behind
`pie-controller --policies least-loaded,drain-migrate`. One streaming request through the
controller: a prompt of --context random token ids (seeded), `max_tokens`
--tokens, greedy, `ignore_eos`. Client side, the gap between consecutive
chunks with text is timed. Three requests per repetition, each on a fresh
prompt: (1) undisturbed: the median gap of its last half is one decode step
at about --context tokens; its time to first chunk is the prompt's prefill
(what recomputing the context costs); (2) after --after chunks the serving
worker is drained (`POST /v1/admin/drain`): the largest gap the client sees
after that bounds the pause of the live move (it also includes the source's
steps slowed while it exports pages); the pause itself, last token of the
source to first of the target, is the controller's
`pie_controller_stream_move_pause_seconds{reason="drain"}`; (3) the same with
the serving worker killed (SIGKILL): the pause of a resume by recompute. A
drained worker exits; (3) runs on a fresh cluster. The target of the issue:
pause (2) <= one decode step at that context + 20 ms.

`drain`: three workers behind `pie-controller --policies least-loaded,drain-migrate`;
--clients streaming requests at once (distinct short text prompts, greedy,
`max_tokens` --drain-tokens, `ignore_eos`): first undisturbed, then again
with SIGTERM to the worker holding the most streams --term-after-s seconds in.
Checked: every request of the second run ends with `[DONE]` and no error
event, its text equals the undisturbed run's, and the worker exits before its
`drain_timeout_ms` (default 120 s); printed: the moves counted by the
controller and the time from SIGTERM to the worker's exit.

`rebalance`: three workers with `--max-running` 2 behind `pie-controller`
(`pin,session-affinity,least-loaded,drain-migrate`, then the same plus
`rebalance` with `high` 1.0, `low` 0.9 (a worker below its `max_running` takes work), `max_migrations` 4, ticking every
250 ms). --sessions sessions at once, each a first turn pinned to w0 (8
tokens) and then --turns turns of --turn-tokens tokens carrying only the
session: affinity keeps every session on w0, whose own `max_running` binds.
Printed: the later turns' TTFT p50/p90/p99 (client side), the wall time, and
the streams `rebalance` moved.

`replicate`: three workers with `--max-running` 2 behind `pie-controller`
(`cache-aware`, then `cache-aware,replicate` with `hot_rps` 0.2, `high` 1.0,
`low` 0.6, ticking every 250 ms). --clients-replicate closed-loop clients send
--requests-replicate streamed requests in all (greedy, `max_tokens`
--answer-tokens): half of them start with one hot system prompt of about
--system-words words, the rest with one of eight others, each followed by a
short question. Printed per pipeline: TTFT p50/p90 (client side) of all
requests and of the hot ones, the wall time, the copies `replicate` made and
the KV pages the workers pulled. Checked: with `replicate` the hot prefix was
copied at least once.

Exit 1 with a message naming the failed check. Python standard library only.
"""
import argparse
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pielib  # noqa: E402
from pielib import fail, percentile  # noqa: E402

PROCS = pielib.Procs()


class Cluster:
    def __init__(self, args, workers, policies="least-loaded,drain-migrate", worker_args=(), config=None):
        self.workers = []
        for _ in range(workers):
            proc, url = PROCS.spawn([args.pie, "serve", "--port", "0", "--model", args.model, *worker_args],
                                    "pie: listening on ")
            self.workers.append((proc, url))
        for proc, url in self.workers:
            pielib.wait_healthy(url, 120, proc=proc, what="a worker")
        cmd = [args.controller, "--port", "0", "--model", args.model, "--policies", policies]
        if config:
            path = os.path.join(tempfile.mkdtemp(), "controller.toml")
            with open(path, "w") as f:
                f.write(config)
            cmd += ["--config", path]
        for i, (_, url) in enumerate(self.workers):
            cmd += ["--worker", f"w{i}={url}"]
        self.ctl_proc, self.ctl = PROCS.spawn(cmd, "pie-controller: listening on ")
        pielib.wait_healthy(self.ctl, 60, workers=workers, proc=self.ctl_proc,
                            what="the controller's workers")

    def worker(self, name):
        return self.workers[int(name[1:])]

    def metric(self, name):
        return pielib.prom_sum(pielib.scrape(self.ctl), name, 0.0)


def stream(url, body, on_chunk=None):
    """A streamed completion: (worker, [(time, text)], clean end, raw)."""
    c = pielib.connect(url, 600)
    c.request("POST", "/v1/completions", body=json.dumps(body), headers={"content-type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        fail(f"status {r.status}: {r.read()[:300]!r}")
    worker = r.getheader("x-pie-worker")
    chunks, raw = [], []
    while True:
        line = r.readline()
        if not line:
            break
        raw.append(line)
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            break
        v = json.loads(data)
        if "error" in v:
            break
        text = v["choices"][0].get("text") or ""
        if text:
            chunks.append((time.perf_counter(), text))
            if on_chunk:
                on_chunk(len(chunks), worker)
    c.close()
    joined = b"".join(raw).decode(errors="replace")
    clean = joined.rstrip().endswith("data: [DONE]") and '"error"' not in joined
    return worker, chunks, clean, joined


def gaps(chunks):
    return [b[0] - a[0] for a, b in zip(chunks, chunks[1:])]


def token_prompt(rng, n):
    return [rng.randrange(1000, 40000) for _ in range(n)]


def downtime(args, rng):
    results = {"step": [], "prefill": [], "drain": [], "drain_ctl": [], "crash": [], "crash_ctl": []}
    for rep in range(args.reps):
        for disturbance in ("drain", "crash"):
            c = Cluster(args, 2)
            body = {"max_tokens": args.tokens, "temperature": 0, "ignore_eos": True, "stream": True}
            if disturbance == "drain":
                t0 = time.perf_counter()
                _, chunks, clean, raw = stream(c.ctl, {**body, "prompt": token_prompt(rng, args.context)})
                if not clean or len(chunks) < args.tokens // 2:
                    fail(f"undisturbed stream broke: {raw[-300:]}")
                results["prefill"].append(chunks[0][0] - t0)
                results["step"].append(percentile(gaps(chunks)[len(chunks) // 2:], 50))
            moved_at = []

            def disturb(n, worker):
                if n == args.after and not moved_at:
                    moved_at.append(time.perf_counter())
                    proc, url = c.worker(worker)
                    if disturbance == "drain":
                        pielib.request(url, "POST", "/v1/admin/drain", {})
                    else:
                        proc.send_signal(signal.SIGKILL)

            _, chunks, clean, raw = stream(c.ctl, {**body, "prompt": token_prompt(rng, args.context)}, disturb)
            if not clean or len(chunks) < args.tokens // 2:
                fail(f"{disturbance}: the moved stream broke: {raw[-300:]}")
            after = [g for (a, b), g in zip(zip(chunks, chunks[1:]), gaps(chunks)) if b[0] > moved_at[0]]
            results[disturbance].append(max(after))
            s = c.metric(f'pie_controller_stream_move_pause_seconds_sum{{reason="{disturbance}"}}')
            n = c.metric(f'pie_controller_stream_move_pause_seconds_count{{reason="{disturbance}"}}')
            if n < 1:
                fail(f"{disturbance}: the controller counted no move")
            results[f"{disturbance}_ctl"].append(s / n)
            if disturbance == "drain" and os.environ.get("BENCH_MIGRATE_DEBUG"):
                for _, url in c.workers:
                    try:
                        text = pielib.scrape(url)
                    except (OSError, pielib.HttpError):
                        continue
                    print("  ", url, [l for l in text.splitlines() if l.startswith("pie_kv_transfer_")])
            PROCS.stop_all()
        print(f"rep {rep + 1}: step {results['step'][-1] * 1e3:.1f} ms, prefill {results['prefill'][-1] * 1e3:.0f} ms, "
              f"drain pause {results['drain'][-1] * 1e3:.1f} ms (controller {results['drain_ctl'][-1] * 1e3:.1f}), "
              f"crash pause {results['crash'][-1] * 1e3:.1f} ms (controller {results['crash_ctl'][-1] * 1e3:.1f})")
    med = {k: percentile(v, 50) * 1e3 for k, v in results.items()}
    print(f"\nmedians over {args.reps} reps at {args.context} tokens of context (+{args.after} generated):")
    print(f"  one decode step:             {med['step']:.1f} ms")
    print(f"  prefill of the context:      {med['prefill']:.0f} ms")
    print(f"  live move (drain) pause:     {med['drain_ctl']:.1f} ms (controller: last token of the source to "
          f"first of the target) = step + {med['drain_ctl'] - med['step']:.1f} ms (target: step + 20 ms)")
    print(f"    client's largest gap after the drain request: {med['drain']:.1f} ms (also the source's steps "
          f"slowed while it exports pages)")
    print(f"  crash resume pause:          {med['crash_ctl']:.0f} ms (controller), {med['crash']:.0f} ms client")
    print(f"  recompute / live move:       {med['crash_ctl'] / med['drain_ctl']:.0f}x")


def drain(args, rng):
    c = Cluster(args, 3)
    words = "river stone lamp harbor meadow signal copper lantern orchard glacier".split()
    prompts = [" ".join(rng.choice(words) for _ in range(24)) + f" ({i})" for i in range(args.clients)]
    body = {"max_tokens": args.drain_tokens, "temperature": 0, "ignore_eos": True, "stream": True}

    def run(disturb):
        out = [None] * args.clients
        threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, stream(c.ctl, {**body, "prompt": prompts[i]})))
                   for i in range(args.clients)]
        for t in threads:
            t.start()
        extra = disturb() if disturb else None
        for t in threads:
            t.join()
        return out, extra

    undisturbed, _ = run(None)
    for w, chunks, clean, raw in undisturbed:
        if not clean:
            fail(f"undisturbed run broke: {raw[-300:]}")

    def sigterm():
        time.sleep(args.term_after_s)
        ws = pielib.get_json(c.ctl, "/v1/cluster")["workers"]
        busiest = max(ws, key=lambda w: w["in_flight"])
        proc, _ = c.worker(busiest["name"])
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=150)
        return busiest["name"], busiest["in_flight"], time.perf_counter() - t0

    disturbed, (name, held, exit_s) = run(sigterm)
    failed = sum(1 for _, _, clean, _ in disturbed if not clean)
    differ = sum(1 for a, b in zip(undisturbed, disturbed) if "".join(t for _, t in a[1]) != "".join(t for _, t in b[1]))
    moved = c.metric('pie_controller_streams_moved_total{reason="drain"}')
    print(f"SIGTERM to {name} holding {held} of {args.clients} streams: {failed} failed, {differ} transcripts differ "
          f"from the undisturbed run, {moved:.0f} streams moved, the worker exited {exit_s:.1f} s after SIGTERM")
    PROCS.stop_all()
    if failed or differ:
        fail(f"{failed} failed and {differ} differing transcripts")
    if moved < 1:
        fail("no stream moved: SIGTERM came too late")


def rebalance(args, rng):
    """Skewed sessions on three workers, with and without `rebalance`."""
    rows = []
    for label, policies in (("session-affinity", "pin,session-affinity,least-loaded,drain-migrate"),
                            ("session-affinity + rebalance",
                             "pin,session-affinity,least-loaded,drain-migrate,rebalance")):
        c = Cluster(args, 3, policies, ("--max-running", str(args.max_running)),
                    "[cluster]\nactor_tick_ms = 250\n[cluster.rebalance]\nhigh = 1.0\nlow = 0.9\n"
                    "max_migrations = 4\n")
        ttfts, lock = [], threading.Lock()
        words = "river stone lamp harbor meadow signal copper lantern orchard glacier".split()

        def session(i):
            s = f"session-{i}"
            # The first turn lands on w0 (pinned); affinity keeps the rest there.
            first = {"prompt": " ".join(rng.choice(words) for _ in range(40)), "max_tokens": 8,
                     "temperature": 0, "stream": True, "session": s, "props": {"pin": "w0"}}
            stream(c.ctl, first)
            for turn in range(args.turns):
                body = {"prompt": " ".join(rng.choice(words) for _ in range(60)) + f" turn {turn}",
                        "max_tokens": args.turn_tokens, "temperature": 0, "ignore_eos": True,
                        "stream": True, "session": s}
                t0 = time.perf_counter()
                _, chunks, clean, raw = stream(c.ctl, body)
                if not clean:
                    fail(f"{label}: a turn broke: {raw[-300:]}")
                with lock:
                    ttfts.append(chunks[0][0] - t0)

        threads = [threading.Thread(target=session, args=(i,)) for i in range(args.sessions)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        moved = c.metric('pie_controller_streams_moved_total{reason="rebalance"}')
        rows.append((label, *(percentile(ttfts, p) * 1e3 for p in (50, 90, 99)), wall, moved))
        PROCS.stop_all()
    print(f"\n{args.sessions} sessions x {args.turns} turns of {args.turn_tokens} tokens, first turn pinned to w0, "
          f"3 workers, --max-running {args.max_running}")
    print("| pipeline | TTFT p50 / p90 / p99 (ms) | wall (s) | streams moved |")
    print("|---|---|---|---|")
    for label, p50, p90, p99, wall, moved in rows:
        print(f"| {label} | {p50:.0f} / {p90:.0f} / {p99:.0f} | {wall:.1f} | {moved:.0f} |")
    print(f"TTFT p99 with / without rebalance: {rows[1][3] / rows[0][3]:.2f}x")


def replicate(args, rng):
    """A skewed shared-prefix workload on three workers, with and without `replicate`."""
    words = ("river stone lamp harbor meadow signal copper lantern orchard glacier "
             "falcon quarry ember willow canyon velvet anchor thistle beacon saddle").split()
    systems = [" ".join(rng.choice(words) for _ in range(args.system_words)) for _ in range(9)]
    plan = [(0 if i % 2 == 0 else 1 + rng.randrange(8), f" Question {i}: what is {rng.choice(words)}?")
            for i in range(args.requests_replicate)]
    rows = []
    for label, policies in (("cache-aware", "cache-aware"), ("cache-aware + replicate", "cache-aware,replicate")):
        c = Cluster(args, 3, policies, ("--max-running", str(args.max_running)),
                    "[cluster]\nactor_tick_ms = 250\n[cluster.replicate]\nhot_rps = 0.2\n"
                    "high = 1.0\nlow = 0.6\n")
        ttfts, lock, queue = [], threading.Lock(), list(enumerate(plan))

        def client():
            while True:
                with lock:
                    if not queue:
                        return
                    i, (system, question) = queue.pop(0)
                body = {"prompt": systems[system] + question, "max_tokens": args.answer_tokens,
                        "temperature": 0, "ignore_eos": True, "stream": True}
                t0 = time.perf_counter()
                _, chunks, clean, raw = stream(c.ctl, body)
                if not clean or not chunks:
                    fail(f"{label}: request {i} broke: {raw[-300:]}")
                with lock:
                    ttfts.append((system == 0, chunks[0][0] - t0))

        threads = [threading.Thread(target=client) for _ in range(args.clients_replicate)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        log = pielib.get_json(c.ctl, "/v1/cluster/actions")
        copies = sum(1 for a in log["actions"] if a["kind"] == "copy-prefix" and a["outcome"] == "executed")
        pulled = sum(pielib.prom_sum(pielib.scrape(url), 'pie_kv_transfer_pages_total{direction="in"}', 0.0)
                     for _, url in c.workers)
        every = [t * 1e3 for _, t in ttfts]
        hot = [t * 1e3 for is_hot, t in ttfts if is_hot]
        rows.append((label, percentile(every, 50), percentile(every, 90), percentile(hot, 50), percentile(hot, 90),
                     wall, copies, pulled))
        PROCS.stop_all()
    print(f"\n{args.requests_replicate} requests from {args.clients_replicate} clients, half on one system prompt "
          f"of {args.system_words} words, {args.answer_tokens} tokens each, 3 workers, --max-running {args.max_running}")
    print("| pipeline | TTFT p50 / p90, all (ms) | TTFT p50 / p90, hot prefix (ms) | wall (s) | copies | pages pulled |")
    print("|---|---|---|---|---|---|")
    for label, p50, p90, h50, h90, wall, copies, pulled in rows:
        print(f"| {label} | {p50:.0f} / {p90:.0f} | {h50:.0f} / {h90:.0f} | {wall:.1f} | {copies} | {pulled:.0f} |")
    print(f"TTFT p90 with / without replicate: all {rows[1][2] / rows[0][2]:.2f}x, hot {rows[1][4] / rows[0][4]:.2f}x")
    if rows[1][6] == 0:
        fail("replicate made no copy of the hot prefix")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("part", nargs="?", default="all", choices=["downtime", "drain", "rebalance", "replicate", "all"])
    ap.add_argument("--pie", default="target/release/pie")
    ap.add_argument("--controller", default="target/release/pie-controller")
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/pie/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--seed", type=int, default=14)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--after", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=120)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--drain-tokens", type=int, default=160)
    ap.add_argument("--term-after-s", type=float, default=2.0)
    ap.add_argument("--sessions", type=int, default=12)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--turn-tokens", type=int, default=96)
    ap.add_argument("--max-running", type=int, default=2)
    ap.add_argument("--clients-replicate", type=int, default=8)
    ap.add_argument("--requests-replicate", type=int, default=96)
    ap.add_argument("--system-words", type=int, default=300)
    ap.add_argument("--answer-tokens", type=int, default=24)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    try:
        if args.part in ("downtime", "all"):
            downtime(args, rng)
        if args.part in ("drain", "all"):
            drain(args, rng)
        if args.part in ("rebalance", "all"):
            rebalance(args, rng)
        if args.part in ("replicate", "all"):
            replicate(args, rng)
    except pielib.HttpError as e:
        fail(e)
    finally:
        PROCS.stop_all()


if __name__ == "__main__":
    sys.exit(main())
