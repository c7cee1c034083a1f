#!/usr/bin/env python3
"""The light-client scenario of issue 16, on a real `pie serve`.

Usage: scripts/fair-share.py [--pie target/release/pie] [--model PATH]
                             [--policies fair,fcfs] [--duration 60]

For each policy: starts `pie serve --worker-policy P --max-running 4` on a free
port, then runs two closed-loop clients for --duration seconds: `flood` keeps
12 requests open, `light` keeps 2, each a `/v1/completions` of a short prompt
with `max_tokens` 48 and `ignore_eos` (the client named by the `client` prop).
Prints the share of generated tokens each client got (requests that finished
inside the window) and exits non-zero if under `fair` the light client got less
than --min-light-share (0.45: its demand is half the slots, so max-min fairness
gives it all of it). Python standard library only (threads + http.client).
"""
import argparse
import http.client
import json
import subprocess
import sys
import threading
import time
import urllib.parse


def serve(pie, model, policy):
    args = [pie, "serve", "--port", "0", "--worker-policy", policy, "--max-running", "4"]
    if model:
        args += ["--model", model]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    first = proc.stdout.readline().strip()
    prefix = "pie: listening on "
    if not first.startswith(prefix):
        proc.kill()
        raise SystemExit(f"unexpected first line from pie serve: {first!r}")
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    url = urllib.parse.urlparse(first[len(prefix):])
    deadline = time.time() + 600
    while time.time() < deadline:
        try:
            c = http.client.HTTPConnection(url.hostname, url.port, timeout=5)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return proc, url
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("pie serve never became healthy")


def complete(url, client):
    body = json.dumps({"prompt": "Tell me a story about a lighthouse keeper.", "max_tokens": 48,
                       "ignore_eos": True, "props": {"client": client}})
    c = http.client.HTTPConnection(url.hostname, url.port, timeout=600)
    c.request("POST", "/v1/completions", body, {"content-type": "application/json"})
    r = c.getresponse()
    data = json.loads(r.read())
    if r.status != 200:
        raise RuntimeError(f"{client}: HTTP {r.status}: {data}")
    return data["usage"]["completion_tokens"]


def run(url, duration):
    tokens = {"flood": 0, "light": 0}
    lock = threading.Lock()
    end = time.time() + duration
    errors = []

    def loop(client):
        while time.time() < end:
            try:
                n = complete(url, client)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(str(e))
                return
            if time.time() <= end:
                with lock:
                    tokens[client] += n

    threads = [threading.Thread(target=loop, args=("flood",)) for _ in range(12)]
    threads += [threading.Thread(target=loop, args=("light",)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise SystemExit(f"requests failed: {errors[:3]}")
    return tokens


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pie", default="target/release/pie")
    ap.add_argument("--model", default=None)
    ap.add_argument("--policies", default="fair,fcfs")
    ap.add_argument("--duration", type=float, default=60)
    ap.add_argument("--min-light-share", type=float, default=0.45)
    a = ap.parse_args()
    ok = True
    for policy in a.policies.split(","):
        proc, url = serve(a.pie, a.model, policy)
        try:
            tokens = run(url, a.duration)
        finally:
            proc.kill()
            proc.wait()
        total = tokens["flood"] + tokens["light"]
        share = tokens["light"] / total if total else 0.0
        print(f"{policy}: light {tokens['light']} tokens, flood {tokens['flood']}: "
              f"light share {share:.3f}")
        if policy == "fair" and share < a.min_light_share:
            print(f"FAIL: under fair the light client got {share:.3f} < {a.min_light_share}")
            ok = False
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
