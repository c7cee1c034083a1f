#!/usr/bin/env python3
"""Shares of service among closed-loop clients, on one worker or through a
controller (issues 16 and 36).

Usage: scripts/fair-share.py [--pie target/release/pie]
           [--controller target/release/pie-controller] [--model PATH]
           [--clients flood:12,light:2] [--policies fair,fcfs]
           [--workers 0] [--queue-orders fair,priority] [--max-running 4]
           [--duration 60] [--expect 0.5,0.5] [--by tokens] [--tolerance 0.04]

Each client is NAME:STREAMS[:WEIGHT[:PROMPT_WORDS]]: it keeps STREAMS
`/v1/completions` open (a short prompt, or PROMPT_WORDS words; `max_tokens` 48,
`ignore_eos`), with the `client` and `weight` props set.

With --workers 0 (the default), for each of --policies: one `pie serve
--worker-policy P --max-running M`. With --workers N, for each of
--queue-orders: N `pie serve --worker-policy fcfs --max-running M` behind a
`pie-controller` with `cluster-priority,least-loaded` and that `queue_order`,
so the controller's queue decides who runs next.

Prints per client its generated tokens and its weighted service (input_weight
1 x prompt tokens + output_weight 2 x generated tokens, divided by its
weight, from each answer's `usage`), each as a share of the whole, counting
requests that finished inside the window; and per run the workers' preemptions
and the aggregate generated tokens/s. With --expect (one share per client, in
--clients order), exits non-zero if the first run's shares (--by tokens or
service) are further than --tolerance from it. Python standard library only
(threads + scripts/pielib.py).
"""
import argparse
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pielib  # noqa: E402

INPUT_WEIGHT, OUTPUT_WEIGHT = 1.0, 2.0
MAX_TOKENS = 48


def parse_clients(spec):
    clients = []
    for part in spec.split(","):
        fields = part.split(":")
        if not 2 <= len(fields) <= 4:
            raise SystemExit(f"--clients: {part!r} is not NAME:STREAMS[:WEIGHT[:PROMPT_WORDS]]")
        name, streams = fields[0], int(fields[1])
        weight = float(fields[2]) if len(fields) > 2 else 1.0
        words = int(fields[3]) if len(fields) > 3 else 0
        prompt = " ".join(["lighthouse"] * words) if words else \
            "Tell me a story about a lighthouse keeper."
        clients.append({"name": name, "streams": streams, "weight": weight, "prompt": prompt})
    return clients


def serve(procs, a, policy):
    args = [a.pie, "serve", "--port", "0", "--worker-policy", policy,
            "--max-running", str(a.max_running)]
    if a.model:
        args += ["--model", a.model]
    proc, url = procs.spawn(args, "pie: listening on ", "pie serve")
    pielib.wait_healthy(url, 600, proc=proc, what="pie serve")
    return url


def cluster(procs, a, queue_order):
    """Workers behind a controller; returns (controller URL, worker URLs)."""
    workers = [serve(procs, a, "fcfs") for _ in range(a.workers)]
    config = os.path.join(tempfile.mkdtemp(prefix="pie-fair-"), "controller.toml")
    with open(config, "w") as f:
        f.write(f'[cluster]\nqueue_order = "{queue_order}"\npoll_ms = 50\n')
    args = [a.controller, "--port", "0", "--config", config,
            "--policies", "cluster-priority,least-loaded"]
    if a.model:
        args += ["--model", a.model]
    for i, url in enumerate(workers):
        args += ["--worker", f"w{i}={url}"]
    proc, url = procs.spawn(args, "pie-controller: listening on ", "pie-controller")
    pielib.wait_healthy(url, 600, workers=len(workers), proc=proc, what="the controller's workers")
    return url, workers


def complete(url, client):
    body = {"prompt": client["prompt"], "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "props": {"client": client["name"], "weight": client["weight"]}}
    try:
        return pielib.post_json(url, "/v1/completions", body)["usage"]
    except pielib.HttpError as e:
        raise RuntimeError(f"{client['name']}: {e}") from None


def run(url, clients, duration):
    """Per client: generated tokens and weighted service in the window."""
    got = {c["name"]: {"tokens": 0, "service": 0.0} for c in clients}
    lock = threading.Lock()
    end = time.time() + duration
    errors = []

    def loop(client):
        while time.time() < end:
            try:
                usage = complete(url, client)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(str(e))
                return
            if time.time() <= end:
                cost = (INPUT_WEIGHT * usage["prompt_tokens"]
                        + OUTPUT_WEIGHT * usage["completion_tokens"]) / client["weight"]
                with lock:
                    got[client["name"]]["tokens"] += usage["completion_tokens"]
                    got[client["name"]]["service"] += cost

    threads = [threading.Thread(target=loop, args=(c,)) for c in clients
               for _ in range(c["streams"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise SystemExit(f"requests failed: {errors[:3]}")
    return got


def preemptions(workers):
    return sum(pielib.prom_sum(pielib.scrape(w), "pie_preemptions_total", 0.0) for w in workers)


def measure(a, clients, label, start):
    """Start the servers, run the clients, print and return the shares."""
    with pielib.Procs() as procs:
        url, workers = start(procs)
        before = preemptions(workers)
        got = run(url, clients, a.duration)
        preempted = preemptions(workers) - before
    tokens = sum(g["tokens"] for g in got.values())
    service = sum(g["service"] for g in got.values())
    shares = {}
    print(f"{label}: {tokens / a.duration:.1f} tokens/s, {preempted:.0f} preemptions")
    for c in clients:
        g = got[c["name"]]
        shares[c["name"]] = {"tokens": g["tokens"] / tokens if tokens else 0.0,
                             "service": g["service"] / service if service else 0.0}
        print(f"  {c['name']:>8} (x{c['streams']}, weight {c['weight']:g}): "
              f"{g['tokens']} tokens ({shares[c['name']]['tokens']:.3f}), "
              f"weighted service {g['service']:.0f} ({shares[c['name']]['service']:.3f})")
    return shares


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pie", default="target/release/pie")
    ap.add_argument("--controller", default="target/release/pie-controller")
    ap.add_argument("--model", default=None)
    ap.add_argument("--clients", default="flood:12,light:2")
    ap.add_argument("--policies", default="fair,fcfs")
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--queue-orders", default="fair,priority")
    ap.add_argument("--max-running", type=int, default=4)
    ap.add_argument("--duration", type=float, default=60)
    ap.add_argument("--expect", default=None)
    ap.add_argument("--by", choices=["tokens", "service"], default="tokens")
    ap.add_argument("--tolerance", type=float, default=0.04)
    a = ap.parse_args()
    clients = parse_clients(a.clients)
    if a.workers and a.model is None:
        a.model = os.path.expanduser("~/.cache/pie/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    if a.workers:
        runs = [(f"controller, {a.workers} fcfs workers, queue_order {order}",
                 lambda procs, order=order: cluster(procs, a, order))
                for order in a.queue_orders.split(",")]
    else:
        runs = [(f"one worker, {policy}",
                 lambda procs, policy=policy: (lambda u: (u, [u]))(serve(procs, a, policy)))
                for policy in a.policies.split(",")]
    results = [measure(a, clients, label, start) for label, start in runs]
    if a.expect is None:
        return
    expected = [float(x) for x in a.expect.split(",")]
    if len(expected) != len(clients):
        raise SystemExit("--expect needs one share per client")
    off = [(c["name"], results[0][c["name"]][a.by], want) for c, want in zip(clients, expected)
           if abs(results[0][c["name"]][a.by] - want) > a.tolerance]
    for name, got, want in off:
        print(f"FAIL: {runs[0][0]}: {name}'s {a.by} share {got:.3f}, expected {want} "
              f"+- {a.tolerance}")
    sys.exit(1 if off else 0)


if __name__ == "__main__":
    main()
