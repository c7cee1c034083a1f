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
gives it all of it). Python standard library only (threads + scripts/pielib.py).
"""
import argparse
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pielib  # noqa: E402


def serve(procs, pie, model, policy):
    args = [pie, "serve", "--port", "0", "--worker-policy", policy, "--max-running", "4"]
    if model:
        args += ["--model", model]
    proc, url = procs.spawn(args, "pie: listening on ", "pie serve")
    pielib.wait_healthy(url, 600, proc=proc, what="pie serve")
    return url


def complete(url, client):
    body = {"prompt": "Tell me a story about a lighthouse keeper.", "max_tokens": 48,
            "ignore_eos": True, "props": {"client": client}}
    try:
        return pielib.post_json(url, "/v1/completions", body)["usage"]["completion_tokens"]
    except pielib.HttpError as e:
        raise RuntimeError(f"{client}: {e}") from None


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
        with pielib.Procs() as procs:
            tokens = run(serve(procs, a.pie, a.model, policy), a.duration)
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
