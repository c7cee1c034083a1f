#!/usr/bin/env python3
"""Hostile guests: one tenant runs hostile WebAssembly guests with its whole
allowance against one worker while another tenant is measured.

Usage: scripts/hostile-guests.py [--pie target/release/pie] [--model PATH]
           [--scale full|small] [--rounds 3] [--context-length N]
           [--json PATH] [--check] [--strict-latency]

Starts one `pie serve` with three keys (root: admin; mallory: a client that
may upload; alice: a client), `worker_policy = ["fair", "keep-session"]` and
`[runtime.inferlets]` limits by --scale: `full`, the defaults of
docs/tenancy-and-limits.md with `max_cpu_ms` 2000 (the default model unless
--model); `small` (for CI), 4 instances of 64 MiB, `max_cpu_ms` 1000, 1 MiB
of output, `max_idle_ms` 2000, `max_wall_ms` 20000, `[server] max_queued` 16
and `max_finished_bytes` 32 MiB
(the synthesized test model, `pie model synth`, unless --model). It reads the
worker's resident-memory bound from its start-up log (`memory bound ... = N
MiB`) and uploads the guests of inferlets/testing/ and text-completion (as
`text-completion-wasm`) as root: build them first (`cd inferlets && cargo
build --release`).

Each round runs the hostile cases one after another, each as mallory, with
`max_instances` processes (the surplus waits in the queue), each case run to
its end or killed after a per-case timeout (10 s small, 60 s full; the
waiters 3 x `max_idle_ms` + that):

  flood-emit, flood-json, flood-props, flood-log   `flood`, 4x the output
      budget's count of the smallest calls;
  bigcalls      the largest allowed text (context length x 16 bytes, at most
      1 MiB; --context-length, default 1024 for the synthesized model, else
      8192, SmolLM2's) through encode, chat template and decode, 100000 rounds;
  waiters       `sleeper` (10^9 ms) and `echo` (never sent a message), which
      must end by `max_idle_ms`;
  fork-storm    `forker`, 64 forks x (context - 48) tokens, its four steps
      driven by "go" messages; alice's 200-token native stream runs meanwhile;
  launch-storm  `spin` launched until the first refusal (a 429 naming the
      share), held 3 s, then killed;
  malformed     uploads of random bytes, a truncated component, an empty body
      and one byte over `max_upload`;
  memory        `hog` (grows until refused at `max_memory`).

Measured: the worker's VmRSS every 100 ms (peak per case and per round, and
2 s after each round, once every mallory process has ended); during each case
alice launches a 1-token `text-completion-wasm` back to back: the time to her
201 (admitted) and to its end, against the same alone before round 1 (median
of 5); her 200-token native stream's inter-token p50/p99 alone and during the
fork storm. Prints a table per round and writes the figures as JSON (--json).

--check exits 1 (naming each) when a bound is broken: a round's peak RSS
above the logged bound; RSS after the last round more than 64 MiB above after
round 1; an alice launch not admitted (201) within 1 s, or her process not
finished, or her stream refused; a waiter not ended by `max_idle_ms`; no 429
naming the share in the launch storm; a malformed upload answered other than
4xx (a 5xx above all); /health other than 200 after the uploads or at the
end. Her 1-token inferlet's median per case within 2x alone + 50 ms is
reported always but checked only with --strict-latency: CI machines are too
noisy for a latency bound. Python standard library only (threads +
scripts/pielib.py).
"""
import argparse
import http.client
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pielib  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WASM = os.path.join(ROOT, "inferlets", "target", "wasm32-wasip2", "release")
GUESTS = {"flood": "flood", "bigcalls": "bigcalls", "sleeper": "sleeper", "echo": "echo",
          "forker": "forker", "hog": "hog", "spin": "spin",
          "text-completion-wasm": "text_completion"}
ROOT_KEY, MALLORY, ALICE = "sk-root", "sk-mallory", "sk-alice"
MIB = 1 << 20
EVENT_OVERHEAD = 64  # bytes charged per event beside its text (limits.rs)
SYNTH_CONTEXT = 1024  # the synthesized test model's context length
BOUND = re.compile(r"memory bound .*= (\d+) MiB")
PROMPT = "Tell me a story about a lighthouse keeper who"
SCALES = {
    "full": {"limits": {"max_instances": 32, "max_memory": 256 * MIB, "max_cpu_ms": 2000,
                        "max_output_bytes": 16 * MIB, "max_idle_ms": 300000,
                        "max_wall_ms": 1800000, "max_upload": 32 * MIB},
             "max_queued": 256, "max_finished_bytes": 256 * MIB, "case_s": 60},
    "small": {"limits": {"max_instances": 4, "max_memory": 64 * MIB, "max_cpu_ms": 1000,
                         "max_output_bytes": MIB, "max_idle_ms": 2000, "max_wall_ms": 20000,
                         "max_upload": 32 * MIB},
              "max_queued": 16, "max_finished_bytes": 32 * MIB, "case_s": 10},
}


# ---------------------------------------------------------------------------
# the worker

def write_config(store, scale):
    keys = ('[{name="root",key="sk-root",role="admin"},'
            '{name="mallory",key="sk-mallory",limits={upload_inferlets=true}},'
            '{name="alice",key="sk-alice"}]')
    limits = "".join(f"{k} = {v}\n" for k, v in scale["limits"].items())
    path = os.path.join(store, "config.toml")
    with open(path, "w") as f:
        f.write(f"[server]\napi_keys = {keys}\nmax_queued = {scale['max_queued']}\n"
                f"max_finished_bytes = {scale['max_finished_bytes']}\n"
                f'[runtime]\nworker_policy = ["fair", "keep-session"]\n'
                f"[runtime.inferlets]\ndir = {json.dumps(os.path.join(store, 'inferlets'))}\n"
                f"{limits}")
    return path


def pick_model(a, store):
    """(--model for `pie serve` or None for its default, the context length)."""
    if a.model or a.scale == "full":
        return a.model, a.context_length or 8192
    path = os.path.join(store, "tiny.gguf")
    subprocess.run([a.pie, "model", "synth", "--out", path], check=True,
                   stdout=subprocess.DEVNULL)
    return path, a.context_length or SYNTH_CONTEXT


def logged_bound(proc):
    """N of the worker's `memory bound ... = N MiB` start-up line."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for line in list(proc.tail):
            if m := BOUND.search(line):
                return int(m[1])
        time.sleep(0.1)
    pielib.fail(f"the worker logged no `memory bound ... = N MiB`: {proc.tail_text()}")


def start_worker(procs, a, store):
    scale = SCALES[a.scale]
    model, context = pick_model(a, store)
    args = [a.pie, "serve", "--port", "0", "--config", write_config(store, scale)]
    proc, url = procs.spawn(args + (["--model", model] if model else []),
                            "pie: listening on ", "pie serve")
    pielib.wait_healthy(url, 600, proc=proc, what="pie serve")
    bound_mib = logged_bound(proc)
    for name, file in GUESTS.items():
        install(url, name, file)
    model_id = pielib.get_json(url, "/v1/models", key=ALICE)["data"][0]["id"]
    return SimpleNamespace(url=url, proc=proc, bound_mib=bound_mib, model_id=model_id,
                           context_length=context, limits=scale["limits"],
                           max_queued=scale["max_queued"], case_s=scale["case_s"])


def upload(url, key, name, body):
    """POST `body` as inferlet `name`: (status or None, text or the error)."""
    c = pielib.connect(url, 120)
    try:
        c.request("POST", f"/v1/inferlets?name={name}", body, {"authorization": f"Bearer {key}"})
        r = c.getresponse()
        return r.status, r.read().decode(errors="replace")[:200]
    except (OSError, http.client.HTTPException) as e:
        return None, repr(e)
    finally:
        c.close()


def install(url, name, file):
    path = os.path.join(WASM, file + ".wasm")
    if not os.path.exists(path):
        pielib.fail(f"{path} is missing: cd inferlets && cargo build --release")
    with open(path, "rb") as f:
        status, text = upload(url, ROOT_KEY, name, f.read())
    if status != 201:
        pielib.fail(f"upload {name}: {status} {text}")


class Rss(threading.Thread):
    """The worker's VmRSS (MiB) every 100 ms."""

    def __init__(self, pid):
        super().__init__(daemon=True)
        self.pid, self.samples, self.halt = pid, [], threading.Event()

    def run(self):
        while not self.halt.wait(0.1):
            try:
                self.samples.append((time.monotonic(), vmrss_mib(self.pid)))
            except OSError:
                return  # the worker is gone; the cases say so

    def peak(self, since):
        """The peak since `since`, with a reading now (a case may end between samples)."""
        return max([m for t, m in list(self.samples) if t >= since] + [vmrss_mib(self.pid)])

    def stop(self):
        self.halt.set()
        self.join()


def vmrss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        return next((int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:")),
                    0.0)  # none: the worker has exited


# ---------------------------------------------------------------------------
# processes

def ms_since(t0):
    return (time.monotonic() - t0) * 1000


def launch(url, key, inferlet, args):
    return pielib.request(url, "POST", "/v1/processes", {"inferlet": inferlet, "args": args},
                          timeout=30, key=key)


def launch_many(url, inferlet, args, n):
    """`n` launches as mallory: (ids admitted, statuses refused)."""
    ids, refused = [], []
    for _ in range(n):
        r = launch(url, MALLORY, inferlet, args)
        if r.status == 201:
            ids.append(r.json()["id"])
        else:
            refused.append(r.status)
    return ids, refused


def events(url, key, pid, last="status", n=1):
    """(event, data) of process `pid` until its status, or its `n`-th `last`."""
    c = pielib.connect(url, 120)
    try:
        c.request("GET", f"/v1/processes/{pid}/events", headers={"authorization": f"Bearer {key}"})
        r = c.getresponse()
        if r.status != 200:
            return [("error", f"HTTP {r.status}")]
        out, name = [], None
        for raw in r:
            line = raw.decode(errors="replace").rstrip("\r\n")
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                out.append((name, line[5:].strip()))
                if name == "status" or sum(e == last for e, _ in out) >= n:
                    return out
        return out
    finally:
        c.close()


def live(url):
    """Ids of mallory's queued and running processes."""
    ids = set()
    for state in ("queued", "running"):
        page = pielib.get_json(url, f"/v1/processes?state={state}&limit=1000", 30, MALLORY)
        ids |= {p["id"] for p in page["data"]}
    return ids


def wait_until(cond, timeout_s):
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.2)


def settle(url, ids, timeout_s):
    """Wait up to `timeout_s` for `ids` to end, kill the rest; their final views."""
    wait_until(lambda: not live(url) & set(ids), timeout_s)
    for pid in live(url) & set(ids):
        pielib.request(url, "DELETE", f"/v1/processes/{pid}", timeout=30, key=MALLORY)
    wait_until(lambda: not live(url) & set(ids), 30)
    return [pielib.get_json(url, f"/v1/processes/{pid}", 30, MALLORY) for pid in ids]


def outcome(views):
    return {"states": dict(Counter(v["state"] for v in views)),
            "errors": dict(Counter(v["error"][:100] for v in views if v.get("error")))}


# ---------------------------------------------------------------------------
# alice

def alice_once(url):
    """Alice's 1-token inferlet: {status, admit_ms, done_ms, state} or the refusal."""
    t0 = time.monotonic()
    try:
        r = launch(url, ALICE, "text-completion-wasm", {"prompt": "Hi", "max_tokens": 1})
        admit = ms_since(t0)
        if r.status != 201:
            return {"status": r.status, "admit_ms": admit, "body": r.text[:200]}
        name, data = (events(url, ALICE, r.json()["id"]) or [("error", "no events")])[-1]
        state = json.loads(data)["state"] if name == "status" else data
        return {"status": 201, "admit_ms": admit, "done_ms": ms_since(t0), "state": state}
    except (OSError, http.client.HTTPException) as e:
        return {"status": None, "admit_ms": ms_since(t0), "body": repr(e)}


class Alice(threading.Thread):
    """Alice's 1-token inferlets back to back, 0.1 s apart, until stop()."""

    def __init__(self, url):
        super().__init__(daemon=True)
        self.url, self.runs, self.halt = url, [], threading.Event()

    def run(self):
        while True:
            self.runs.append(alice_once(self.url))
            if self.halt.wait(0.1):
                return

    def stop(self):
        self.halt.set()
        self.join()
        return self.runs


def alice_stats(runs, base_ms):
    done = [r["done_ms"] for r in runs if "done_ms" in r]
    p50 = pielib.percentile(done, 50)
    return {"n": len(runs), "admit_max_ms": max((r["admit_ms"] for r in runs), default=0.0),
            "done_p50_ms": p50, "done_p99_ms": pielib.percentile(done, 99),
            "done_max_ms": max(done, default=0.0), "x_alone": p50 / base_ms,
            "bad": [r for r in runs if r["status"] != 201 or r.get("state") != "finished"]}


def stream_gaps(url, model_id):
    """Inter-token gaps (ms) of alice's 200-token native stream; HttpError if refused."""
    body = {"model": model_id, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True,
            "temperature": 0, "stream": True}
    c = pielib.connect(url, 300)
    try:
        c.request("POST", "/v1/completions", json.dumps(body),
                  {"content-type": "application/json", "authorization": f"Bearer {ALICE}"})
        r = c.getresponse()
        if r.status != 200:
            raise pielib.HttpError("POST", "/v1/completions",
                                   pielib.Reply(r.status, r.read().decode(errors="replace"), {}))
        stamps = []
        while data := r.read1(65536):  # as each chunk comes, not line-buffered
            stamps += [time.monotonic()] * data.count(b"data: {")
        return [(b - a) * 1000 for a, b in zip(stamps, stamps[1:])]
    finally:
        c.close()


def gap_stats(gaps):
    return {"p50_ms": pielib.percentile(gaps, 50), "p99_ms": pielib.percentile(gaps, 99),
            "chunks": len(gaps) + 1}


def baseline(w):
    """Alice alone: her 1-token inferlet (median of 5, after one warm-up) and stream."""
    alice_once(w.url)
    runs = [alice_once(w.url) for _ in range(5)]
    if any(r.get("state") != "finished" for r in runs):
        pielib.fail(f"alice alone: {runs}")
    stream_gaps(w.url, w.model_id)
    return {"done_ms": pielib.percentile([r["done_ms"] for r in runs], 50),
            "admit_ms": pielib.percentile([r["admit_ms"] for r in runs], 50),
            "stream": gap_stats(stream_gaps(w.url, w.model_id))}


# ---------------------------------------------------------------------------
# the hostile cases: each run(w) launches and returns (mallory's ids, a note);
# judge(views, note) names what broke a bound

def flood(kind):
    def run(w):
        count = 4 * w.limits["max_output_bytes"] // EVENT_OVERHEAD
        ids, refused = launch_many(w.url, "flood", {"kind": kind, "count": count},
                                   w.limits["max_instances"])
        return ids, {"count": count, "refused": refused}
    return run


def bigcalls(w):
    size = min(w.context_length * 16, MIB)
    ids, refused = launch_many(w.url, "bigcalls", {"bytes": size, "rounds": 100000},
                               w.limits["max_instances"])
    first = [json.loads(d) for e, d in events(w.url, MALLORY, ids[0], "json", 3)
             if e == "json"] if ids else []
    return ids, {"bytes": size, "refused": refused,
                 "first_round": {c["call"]: c["error"] or "ok" for c in first}}


def waiters(w):
    n = w.limits["max_instances"]
    sleepers, refused = launch_many(w.url, "sleeper", {"ms": 10**9}, (n + 1) // 2)
    echoes, refused_echo = launch_many(w.url, "echo", {}, n // 2)
    return sleepers + echoes, {"refused": refused + refused_echo}


def judge_waiters(views, note):
    late = [v["id"] for v in views if "max_idle_ms" not in (v.get("error") or "")]
    return [f"{len(late)} waiters did not end by max_idle_ms ({late[:3]})"] if late else []


def fork_storm(w):
    max_tokens = w.context_length - 48
    ids, refused = launch_many(w.url, "forker", {"tokens": 32, "forks": 64,
                                                 "max_tokens": max_tokens},
                               w.limits["max_instances"])
    sent = Counter(pielib.request(w.url, "POST", f"/v1/processes/{pid}/messages",
                                  {"message": "go"}, timeout=30, key=MALLORY).status
                   for pid in ids for _ in range(4))
    time.sleep(1)  # the forks generating
    note = {"max_tokens": max_tokens, "refused": refused, "messages": dict(sent)}
    try:
        note["stream"] = gap_stats(stream_gaps(w.url, w.model_id))
    except (pielib.HttpError, OSError, http.client.HTTPException) as e:
        note["stream_error"] = str(e)
    return ids, note


def judge_fork_storm(views, note):
    return [f"alice's stream: {note['stream_error']}"] if "stream_error" in note else []


def launch_storm(w):
    ids = []
    for _ in range(w.max_queued + w.limits["max_instances"] + 8):
        r = launch(w.url, MALLORY, "spin", {})
        if r.status != 201:
            return ids, {"launched": len(ids), "refusal": r.status,
                         "retry_after": r.headers.get("retry-after"), "body": r.text[:300]}
        ids.append(r.json()["id"])
    return ids, {"launched": len(ids), "refusal": None}


def judge_launch_storm(views, note):
    if note["refusal"] == 429 and "share" in note["body"]:
        return []
    return [f"launch storm: {note['launched']} launches, then {note['refusal']} "
            f"{note.get('body', '')!r} (want a 429 naming the share)"]


def malformed(w):
    with open(os.path.join(WASM, "flood.wasm"), "rb") as f:
        wasm = f.read()
    bodies = {"random": os.urandom(64 << 10), "truncated": wasm[:len(wasm) // 2], "empty": b"",
              "oversize": bytes(w.limits["max_upload"] + 1)}
    uploads = {name: upload(w.url, MALLORY, f"bad-{name}", body) for name, body in bodies.items()}
    health = pielib.request(w.url, "GET", "/health", timeout=30).status
    return [], {"statuses": {k: s for k, (s, _) in uploads.items()}, "health": health,
                "bodies": {k: t for k, (_, t) in uploads.items()}}


def judge_malformed(views, note):
    bad = [f"upload {k}: {s} {note['bodies'][k][:120]!r} (want 4xx)"
           for k, s in note["statuses"].items() if not (s and 400 <= s < 500)]
    return bad + ([f"/health {note['health']} after the uploads"] if note["health"] != 200 else [])


def memory(w):
    ids, refused = launch_many(w.url, "hog", {}, w.limits["max_instances"])
    return ids, {"refused": refused}


def no_bound(views, note):
    return []


def cases(w):
    """(name, run, timeout_s, judge) of every case, in order."""
    idle_s = w.limits["max_idle_ms"] / 1000
    return [(f"flood-{k}", flood(k), w.case_s, no_bound) for k in ("emit", "json", "props", "log")] + [
        ("bigcalls", bigcalls, w.case_s, no_bound),
        ("waiters", waiters, 3 * idle_s + w.case_s, judge_waiters),
        ("fork-storm", fork_storm, w.case_s, judge_fork_storm),
        ("launch-storm", launch_storm, 3, judge_launch_storm),
        ("malformed", malformed, 0, judge_malformed),
        ("memory", memory, w.case_s, no_bound),
    ]


# ---------------------------------------------------------------------------
# rounds

def log_lines_dropped(w):
    return pielib.prom_sum(pielib.scrape(w.url, ROOT_KEY, 30),
                           "pie_inferlet_log_lines_dropped_total", 0.0)


def run_case(w, rss, base, case):
    name, run, timeout_s, judge = case
    dropped, rss0 = log_lines_dropped(w), vmrss_mib(w.proc.pid)
    alice = Alice(w.url)
    alice.start()
    t0 = time.monotonic()
    ids, note = run(w)
    views = settle(w.url, ids, timeout_s)
    runs = alice.stop()
    if w.proc.poll() is not None:
        pielib.fail(f"the worker exited ({w.proc.returncode}) in {name}: {w.proc.tail_text()}")
    if dropped := log_lines_dropped(w) - dropped:
        note["log_lines_dropped"] = dropped
    peak = rss.peak(t0)
    return {"case": name, "seconds": time.monotonic() - t0, "mallory": outcome(views),
            "note": note, "alice": alice_stats(runs, base["done_ms"]), "rss_peak_mib": peak,
            "rss_rise_mib": peak - rss0, "broken": judge(views, note)}


def run_round(w, rss, base):
    t0 = time.monotonic()
    rows = [run_case(w, rss, base, case) for case in cases(w)]
    wait_until(lambda: not live(w.url), 60)
    time.sleep(2)
    return {"cases": rows, "rss_peak_mib": rss.peak(t0), "rss_after_mib": vmrss_mib(w.proc.pid)}


def mallory_cell(m):
    states = " ".join(f"{s} {n}" for s, n in sorted(m["states"].items())) or "-"
    error = next(iter(m["errors"]), "")
    return f"{states}: {error[:44]}" if error else states


def print_round(i, rnd, bound):
    print(f"\nround {i}: peak RSS {rnd['rss_peak_mib']:.0f} MiB (bound {bound} MiB), "
          f"after {rnd['rss_after_mib']:.0f} MiB")
    print(f"{'case':<13} {'s':>5} {'RSS MiB':>7} {'rise':>5}  {'mallory':<58} {'alice n':>7} "
          f"{'admit max':>9} {'done p50':>8} {'p99':>7} {'x alone':>7}")
    for r in rnd["cases"]:
        a = r["alice"]
        print(f"{r['case']:<13} {r['seconds']:5.1f} {r['rss_peak_mib']:7.0f} "
              f"{r['rss_rise_mib']:+5.0f}  "
              f"{mallory_cell(r['mallory']):<58} {a['n']:7d} {a['admit_max_ms']:9.1f} "
              f"{a['done_p50_ms']:8.1f} {a['done_p99_ms']:7.1f} {a['x_alone']:7.2f}")
    for r in rnd["cases"]:
        if r["note"]:
            print(f"  {r['case']}: {json.dumps(r['note'])[:240]}")


def alice_broken(where, stats, base, strict):
    out = [f"{where}: alice's launch {r['status']} in {r['admit_ms']:.0f} ms, "
           f"{r.get('state') or r.get('body')}" for r in stats["bad"]]
    if stats["admit_max_ms"] > 1000:
        out.append(f"{where}: alice's launch admitted in {stats['admit_max_ms']:.0f} ms (> 1000)")
    limit = 2 * base["done_ms"] + 50
    if strict and stats["done_p50_ms"] > limit:
        out.append(f"{where}: alice's 1-token inferlet p50 {stats['done_p50_ms']:.0f} ms "
                   f"> 2 x alone + 50 = {limit:.0f} ms")
    return out


def broken_bounds(w, summary, strict):
    out = []
    for i, rnd in enumerate(summary["rounds"], 1):
        if rnd["rss_peak_mib"] > w.bound_mib:
            out.append(f"round {i}: peak RSS {rnd['rss_peak_mib']:.0f} MiB > bound {w.bound_mib} MiB")
        for r in rnd["cases"]:
            where = f"round {i} {r['case']}"
            out += [f"{where}: {b}" for b in r["broken"]]
            out += alice_broken(where, r["alice"], summary["alone"], strict)
    growth = summary["rounds"][-1]["rss_after_mib"] - summary["rounds"][0]["rss_after_mib"]
    if growth > 64:
        out.append(f"RSS after the last round {growth:.0f} MiB above after round 1 (> 64)")
    if summary["health_end"] != 200:
        out.append(f"/health {summary['health_end']} at the end")
    return out


def run_suite(a, store, procs):
    """Baseline and rounds against one worker: the summary."""
    w = start_worker(procs, a, store)
    rss = Rss(w.proc.pid)
    rss.start()
    base = baseline(w)
    print(f"alice alone: 1-token inferlet {base['done_ms']:.1f} ms (admitted "
          f"{base['admit_ms']:.1f} ms); stream inter-token p50 {base['stream']['p50_ms']:.2f} "
          f"p99 {base['stream']['p99_ms']:.2f} ms; memory bound {w.bound_mib} MiB")
    summary = {"scale": a.scale, "limits": w.limits, "bound_mib": w.bound_mib,
               "context_length": w.context_length, "alone": base, "rounds": []}
    for i in range(1, a.rounds + 1):
        summary["rounds"].append(run_round(w, rss, base))
        print_round(i, summary["rounds"][-1], w.bound_mib)
    summary["health_end"] = pielib.request(w.url, "GET", "/health", timeout=30).status
    summary["broken"] = broken_bounds(w, summary, a.strict_latency)
    rss.stop()
    return summary


def print_end(summary):
    storms = [r["note"].get("stream", {}).get("p99_ms") for rnd in summary["rounds"]
              for r in rnd["cases"] if r["case"] == "fork-storm"]
    storms = ", ".join("-" if p is None else f"{p:.2f}" for p in storms)
    after = ", ".join(f"{rnd['rss_after_mib']:.0f}" for rnd in summary["rounds"])
    print(f"\nalice's stream inter-token p99: alone {summary['alone']['stream']['p99_ms']:.2f} "
          f"ms, during the fork storm {storms} ms; RSS after each round {after} MiB")
    for b in summary["broken"]:
        print(f"broken: {b}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pie", default=os.path.join(ROOT, "target", "release", "pie"))
    ap.add_argument("--model")
    ap.add_argument("--scale", choices=sorted(SCALES), default="full")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--context-length", type=int)
    ap.add_argument("--json")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--strict-latency", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="pie-hostile-") as store, pielib.Procs() as procs:
        summary = run_suite(a, store, procs)
    print_end(summary)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)
    if a.check and summary["broken"]:
        pielib.fail("; ".join(summary["broken"]))


if __name__ == "__main__":
    main()
