#!/usr/bin/env python3
"""The controller's own time per request, by part (issue 19).

Usage: scripts/controller-overhead.py [--pie target/release/pie]
           [--controller target/release/pie-controller] [--model PATH]
           [--requests 20] [--words 750] [--chat]

Starts `pie serve` (trusting the controller's worker key `sk-ctl`) and
`pie-controller --model` in front of it, sends --requests `/v1/completions`
(or `/v1/chat/completions` with --chat) one at a time, each a distinct prompt
of --words words (about 1,000 tokens at 750), `max_tokens` 1, then reads
`pie_controller_overhead_seconds` from the controller's /metrics and prints
p50 and p99 per part (tokenize, hash, route, proxy), interpolated within the
histogram's buckets (1.5x apart) as Prometheus' histogram_quantile does, and
the worker's `pie_pretokenized_requests_total` (the ids it did not tokenize
again). The sum of the parts' quantiles is printed as the per-request figure:
for p99 it is an upper estimate (the parts' tails need not coincide).
Python standard library only.
"""
import argparse
import http.client
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse

WORDS = ("time year people way day man thing woman life child world school state family student "
         "group country problem hand part place case week company system program question work "
         "government number night point home water room mother area money story fact month lot "
         "right study book eye job word business issue side kind head house service friend father "
         "power hour game line end member law car city community name president team minute idea "
         "kid body information back parent face others level office door health person art war "
         "history party result change morning reason research girl guy moment air teacher force "
         "education lighthouse river mountain quiet bright green silver ancient modern").split()


def spawn(args, prefix):
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    first = proc.stdout.readline().strip()
    if not first.startswith(prefix):
        proc.kill()
        raise SystemExit(f"unexpected first line from {args[0]}: {first!r}")
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    return proc, first[len(prefix):]


def call(url, method, path, body=None, key=None, timeout=600):
    u = urllib.parse.urlparse(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    c.request(method, path, json.dumps(body) if body is not None else None, headers)
    r = c.getresponse()
    return r.status, r.read().decode()


def wait_healthy(url, what, path="/health"):
    deadline = time.time() + 600
    while time.time() < deadline:
        try:
            status, text = call(url, "GET", path, timeout=5)
            if status == 200 and (path == "/health" or '"healthy":true' in text.replace(" ", "")):
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{what} never became healthy")


def buckets(metrics, part):
    """Cumulative (le, count) pairs of one part's histogram."""
    out = []
    pat = re.compile(r'pie_controller_overhead_seconds_bucket\{(.*)\} (\S+)')
    for line in metrics.splitlines():
        m = pat.match(line)
        if not m or f'part="{part}"' not in m.group(1):
            continue
        le = re.search(r'le="([^"]+)"', m.group(1)).group(1)
        out.append((float("inf") if le == "+Inf" else float(le), float(m.group(2))))
    return sorted(out)


def quantile(bs, q):
    total = bs[-1][1] if bs else 0
    if total == 0:
        return float("nan")
    rank = q * total
    lo, below = 0.0, 0.0
    for le, count in bs:
        if count >= rank:
            if le == float("inf"):
                return lo
            return lo + (le - lo) * (rank - below) / max(count - below, 1e-12)
        lo, below = le, count
    return lo


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pie", default="target/release/pie")
    ap.add_argument("--controller", default="target/release/pie-controller")
    ap.add_argument("--model", default=os.path.expanduser(
        "~/.cache/pie/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--words", type=int, default=750)
    ap.add_argument("--chat", action="store_true")
    a = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="pie-overhead-")
    worker_cfg = os.path.join(tmp, "worker.toml")
    with open(worker_cfg, "w") as f:
        f.write('[server]\napi_keys = [{ name = "controller", key = "sk-ctl", role = "worker" }]\n')
    ctl_cfg = os.path.join(tmp, "controller.toml")
    with open(ctl_cfg, "w") as f:
        f.write('[cluster]\nworker_key = "sk-ctl"\npoll_ms = 100\n')
    procs = []
    try:
        worker, wurl = spawn([a.pie, "serve", "--port", "0", "--model", a.model,
                              "--config", worker_cfg], "pie: listening on ")
        procs.append(worker)
        wait_healthy(wurl, "pie serve")
        ctl, curl = spawn([a.controller, "--port", "0", "--model", a.model, "--config", ctl_cfg,
                           "--worker", f"w0={wurl}"], "pie-controller: listening on ")
        procs.append(ctl)
        wait_healthy(curl, "the controller's worker", "/v1/cluster")
        rng = random.Random(19)
        prompt_tokens = []
        for i in range(a.requests):
            text = f"Request {i}. " + " ".join(rng.choice(WORDS) for _ in range(a.words))
            if a.chat:
                path = "/v1/chat/completions"
                body = {"messages": [{"role": "user", "content": text}], "max_tokens": 1,
                        "temperature": 0}
            else:
                path = "/v1/completions"
                body = {"prompt": text, "max_tokens": 1, "temperature": 0}
            status, resp = call(curl, "POST", path, body)
            if status != 200:
                raise SystemExit(f"request {i}: HTTP {status}: {resp}")
            prompt_tokens.append(json.loads(resp)["usage"]["prompt_tokens"])
        _, metrics = call(curl, "GET", "/metrics")
        _, wmetrics = call(wurl, "GET", "/metrics", key="sk-ctl")
        pre = re.search(r"^pie_pretokenized_requests_total (\S+)", wmetrics, re.M)
        print(f"{a.requests} requests ({'chat' if a.chat else 'completions'}), prompt tokens "
              f"mean {sum(prompt_tokens) / len(prompt_tokens):.0f} "
              f"(min {min(prompt_tokens)}, max {max(prompt_tokens)}); worker used forwarded ids "
              f"for {pre.group(1) if pre else '0'}")
        print(f"{'part':<10}{'count':>7}{'p50 ms':>10}{'p99 ms':>10}")
        p50s, p99s = 0.0, 0.0
        for part in ["tokenize", "hash", "route", "proxy"]:
            bs = buckets(metrics, part)
            n = int(bs[-1][1]) if bs else 0
            p50, p99 = quantile(bs, 0.5) * 1e3, quantile(bs, 0.99) * 1e3
            p50s += p50
            p99s += p99
            print(f"{part:<10}{n:>7}{p50:>10.3f}{p99:>10.3f}")
        print(f"{'sum':<10}{'':>7}{p50s:>10.3f}{p99s:>10.3f}")
    finally:
        for p in procs:
            p.kill()
            p.wait()


if __name__ == "__main__":
    sys.exit(main())
