#!/usr/bin/env python3
"""Load and checks for scripts/soak.sh (standard library only: threads + http.client).

  soak.py --url CONTROLLER_URL --pids NAME=PID,NAME=PID [--concurrency 8]
          [--calibrate-s 15] [--duration 60] [--factor 10] [--max-tokens 32]
          [--rss-ratio 1.5] [--json OUT]

1. Closed loop: `--concurrency` clients back to back for `--calibrate-s`
   (after a 3 s warm-up that is not counted): the sustained rate, in completed
   requests per second.
2. RSS after warm-up of each process (VmRSS), then its VmHWM is reset
   (`echo 5 > /proc/PID/clear_refs`) so the VmHWM read at the end is the peak
   since warm-up, including spikes between two 200 ms samples.
3. Open loop: Poisson arrivals (seeded) at `--factor` x the sustained rate for
   `--duration` s, one thread per request, then every request is awaited.

Every request is `POST /v1/completions`, `stream: true`,
`stream_options.include_usage`, `ignore_eos`, `max_tokens`. An accepted (2xx)
request must end with usage.completion_tokens == max_tokens, finish_reason
`length`, `[DONE]` and no error event; a refusal must be 429 or 503 with
`Retry-After`. Anything else (another status, a broken connection) fails.
Exit 1 if any check fails, naming it.
"""
import argparse
import json
import os
import random
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pielib  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def read_status(pid):
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                k, v = line.split(":", 1)
                out[k] = int(v.split()[0]) * 1024
    return out


class Sampler(threading.Thread):
    """VmRSS of each process every 200 ms; the peak since `mark()`."""

    def __init__(self, pids):
        super().__init__(daemon=True)
        self.pids = pids
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.peak = {n: 0 for n in pids}
        self.samples = 0
        self.gone = {}

    def mark(self):
        with self.lock:
            self.peak = {n: 0 for n in self.pids}

    def run(self):
        while not self.stop.is_set():
            for name, pid in self.pids.items():
                try:
                    rss = read_status(pid)["VmRSS"]
                except (OSError, KeyError) as e:
                    self.gone.setdefault(name, str(e))
                    continue
                with self.lock:
                    self.peak[name] = max(self.peak[name], rss)
            self.samples += 1
            self.stop.wait(0.2)


class Result:
    def __init__(self):
        self.status = None
        self.retry_after = None
        self.error = None  # a failed check, in words
        self.completion_tokens = None
        self.text_chunks = 0
        self.start = time.monotonic()
        self.end = None


def one_request(url, max_tokens, timeout):
    r = Result()
    body = json.dumps({
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    })
    conn = pielib.connect(url, timeout)
    try:
        conn.request("POST", "/v1/completions", body=body,
                     headers={"content-type": "application/json"})
        resp = conn.getresponse()
        r.status = resp.status
        r.retry_after = resp.getheader("retry-after")
        if not 200 <= resp.status < 300:
            resp.read()
            return r
        finish, done, events = None, False, 0
        for raw in resp:  # SSE: one line per iteration
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                continue
            events += 1
            try:
                ev = json.loads(data)
            except ValueError:
                r.error = f"unparsable event: {data[:120]}"
                continue
            if "error" in ev:
                r.error = f"error event: {json.dumps(ev['error'])[:200]}"
                continue
            for c in ev.get("choices") or []:
                if c.get("text"):
                    r.text_chunks += 1
                if c.get("finish_reason"):
                    finish = c["finish_reason"]
            if ev.get("usage"):
                r.completion_tokens = ev["usage"].get("completion_tokens")
        if r.error is None:
            if not done:
                r.error = "stream ended without [DONE]"
            elif r.completion_tokens != max_tokens:
                r.error = f"completion_tokens {r.completion_tokens} != max_tokens {max_tokens}"
            elif finish != "length":
                r.error = f"finish_reason {finish!r}, expected 'length'"
    except Exception as e:  # a broken or timed-out connection
        r.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
        r.end = time.monotonic()
    return r


def closed_loop(url, concurrency, seconds, max_tokens, timeout):
    """Clients back to back until `seconds` pass; the results that ended in time."""
    results, lock = [], threading.Lock()
    deadline = time.monotonic() + seconds

    def client():
        while time.monotonic() < deadline:
            r = one_request(url, max_tokens, timeout)
            with lock:
                results.append(r)
            if r.status != 200:
                time.sleep(0.1)  # a refusal (a failure here) is not a reason to spin

    ts = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    t0 = time.monotonic()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return results, t0, time.monotonic()


def open_loop(url, rate, seconds, max_tokens, timeout, seed):
    results, lock, threads = [], threading.Lock(), []
    rng = random.Random(seed)

    def run():
        r = one_request(url, max_tokens, timeout)
        with lock:
            results.append(r)

    t0 = time.monotonic()
    at = 0.0
    while True:
        at += rng.expovariate(rate)
        if at >= seconds:
            break
        delay = t0 + at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        t = threading.Thread(target=run, daemon=True)
        t.start()
        threads.append(t)
    sent_s = time.monotonic() - t0
    for t in threads:
        t.join()
    return results, len(threads), sent_s, time.monotonic() - t0


def mib(b):
    return f"{b / 2**20:.1f} MiB"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--pids", required=True, help="NAME=PID,...")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--calibrate-s", type=float, default=15)
    ap.add_argument("--duration", type=float, default=60)
    ap.add_argument("--factor", type=float, default=10)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rss-ratio", type=float, default=1.5)
    ap.add_argument("--timeout", type=float, default=300, help="per socket read, s")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json")
    a = ap.parse_args()
    pids = dict(p.split("=") for p in a.pids.split(","))
    pids = {k: int(v) for k, v in pids.items()}
    failures = []
    sampler = Sampler(pids)
    sampler.start()

    # 1. Sustained rate, closed loop.
    closed_loop(a.url, a.concurrency, 3, a.max_tokens, a.timeout)  # warm-up
    res, t0, t1 = closed_loop(a.url, a.concurrency, a.calibrate_s, a.max_tokens, a.timeout)
    ok = [r for r in res if r.status == 200 and r.error is None]
    bad = [r for r in res if not (r.status == 200 and r.error is None)]
    for r in bad[:5]:
        failures.append(f"closed loop: status {r.status}: {r.error}")
    if not ok:
        print("no request completed in the closed loop", file=sys.stderr)
        return 1
    sustained = len(ok) / (t1 - t0)
    print(f"closed loop: {len(ok)} requests in {t1 - t0:.1f} s at concurrency {a.concurrency}: "
          f"{sustained:.2f} req/s ({sustained * a.max_tokens:.0f} generated tok/s)"
          + (f", {len(bad)} failed" if bad else ""))

    # 2. RSS after warm-up; peaks from here on.
    base, hwm_reset = {}, {}
    for name, pid in pids.items():
        base[name] = read_status(pid)["VmRSS"]
        try:
            with open(f"/proc/{pid}/clear_refs", "w") as f:
                f.write("5")
            hwm_reset[name] = True
        except OSError as e:
            hwm_reset[name] = False
            print(f"{name}: cannot reset VmHWM ({e}); its VmHWM includes start-up", file=sys.stderr)
    sampler.mark()

    # 3. Open loop at factor x.
    rate = sustained * a.factor
    print(f"open loop: Poisson arrivals at {rate:.2f} req/s ({a.factor:g}x) for {a.duration:g} s ...",
          flush=True)
    res, sent, sent_s, total_s = open_loop(a.url, rate, a.duration, a.max_tokens, a.timeout, a.seed)
    sampler.stop.set()
    sampler.join()

    by_status = {}
    for r in res:
        by_status[r.status] = by_status.get(r.status, 0) + 1
    accepted = [r for r in res if r.status is not None and 200 <= r.status < 300]
    complete = [r for r in accepted if r.error is None]
    incomplete = [r for r in accepted if r.error is not None]
    refused = [r for r in res if r.status in (429, 503)]
    no_retry_after = [r for r in refused if not r.retry_after]
    other = [r for r in res if r not in accepted and r not in refused]
    lat = [r.end - r.start for r in complete]
    print(f"open loop: {sent} requests sent in {sent_s:.1f} s ({sent / sent_s:.2f} req/s offered), "
          f"all answered after {total_s:.1f} s")
    print(f"  accepted {len(accepted)} (complete with {a.max_tokens} tokens: {len(complete)}), "
          f"429: {by_status.get(429, 0)}, 503: {by_status.get(503, 0)}, "
          f"other: {len(other)}; accepted rate {len(accepted) / a.duration:.2f} req/s")
    if lat:
        print(f"  accepted latency p50 {pielib.percentile(lat, 50):.2f} s, max {max(lat):.2f} s")
    if incomplete:
        failures.append(f"{len(incomplete)} accepted requests incomplete, e.g. {incomplete[0].error}")
    if no_retry_after:
        failures.append(f"{len(no_retry_after)} refusals ({no_retry_after[0].status}) without Retry-After")
    if other:
        kinds = {}
        for r in other:
            k = f"status {r.status}: {r.error}" if r.status is None else f"status {r.status}"
            kinds[k] = kinds.get(k, 0) + 1
        failures.append(f"{len(other)} answers neither 2xx nor 429/503: {kinds}")
    if not refused:
        failures.append("no request was refused: the overload did not reach the controller's bounds")

    rss = {}
    for name, pid in pids.items():
        if name in sampler.gone:
            failures.append(f"{name} (pid {pid}) exited during the soak: {sampler.gone[name]}")
            continue
        st = read_status(pid)
        peak = max(sampler.peak[name], st["VmHWM"] if hwm_reset[name] else 0)
        ratio = peak / base[name]
        rss[name] = {"after_warmup": base[name], "peak_sampled": sampler.peak[name],
                     "vmhwm": st["VmHWM"], "vmhwm_since_warmup": hwm_reset[name],
                     "end": st["VmRSS"], "peak": peak, "ratio": ratio}
        print(f"  {name}: RSS after warm-up {mib(base[name])}, peak {mib(peak)} "
              f"(sampled {mib(sampler.peak[name])}, VmHWM{' since warm-up' if hwm_reset[name] else ''} "
              f"{mib(st['VmHWM'])}), at end {mib(st['VmRSS'])}: ratio {ratio:.2f}")
        if ratio > a.rss_ratio:
            failures.append(f"{name}: peak RSS {ratio:.2f}x its RSS after warm-up (limit {a.rss_ratio})")

    if a.json:
        with open(a.json, "w") as f:
            json.dump({
                "sustained_req_s": sustained, "offered_req_s": sent / sent_s, "target_req_s": rate,
                "sent": sent, "accepted": len(accepted), "complete": len(complete),
                "status_counts": {str(k): v for k, v in by_status.items()},
                "rss": rss, "failures": failures,
            }, f, indent=1)
    for f in failures:
        print(f"FAIL: {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
