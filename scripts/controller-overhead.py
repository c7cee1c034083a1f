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
import os
import random
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pielib  # noqa: E402

WORDS = ("time year people way day man thing woman life child world school state family student "
         "group country problem hand part place case week company system program question work "
         "government number night point home water room mother area money story fact month lot "
         "right study book eye job word business issue side kind head house service friend father "
         "power hour game line end member law car city community name president team minute idea "
         "kid body information back parent face others level office door health person art war "
         "history party result change morning reason research girl guy moment air teacher force "
         "education lighthouse river mountain quiet bright green silver ancient modern").split()


def buckets(metrics, part):
    """Cumulative (le, count) pairs of one part's histogram."""
    return sorted((float(labels["le"]), count) for _, labels, count
                  in pielib.prom_samples(metrics, "pie_controller_overhead_seconds_bucket")
                  if labels.get("part") == part)


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
    with pielib.Procs() as procs:
        worker, wurl = procs.spawn([a.pie, "serve", "--port", "0", "--model", a.model,
                                    "--config", worker_cfg], "pie: listening on ")
        pielib.wait_healthy(wurl, 600, proc=worker, what="pie serve")
        ctl, curl = procs.spawn([a.controller, "--port", "0", "--model", a.model, "--config", ctl_cfg,
                                 "--worker", f"w0={wurl}"], "pie-controller: listening on ")
        pielib.wait_healthy(curl, 600, workers=1, proc=ctl, what="the controller's worker")
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
            r = pielib.request(curl, "POST", path, body)
            if r.status != 200:
                pielib.fail(f"request {i}: HTTP {r.status}: {r.text}")
            prompt_tokens.append(r.json()["usage"]["prompt_tokens"])
        metrics = pielib.scrape(curl)
        wmetrics = pielib.scrape(wurl, key="sk-ctl")
        pre = pielib.prom_sum(wmetrics, "pie_pretokenized_requests_total", 0.0)
        print(f"{a.requests} requests ({'chat' if a.chat else 'completions'}), prompt tokens "
              f"mean {sum(prompt_tokens) / len(prompt_tokens):.0f} "
              f"(min {min(prompt_tokens)}, max {max(prompt_tokens)}); worker used forwarded ids "
              f"for {pre:.0f}")
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


if __name__ == "__main__":
    sys.exit(main())
