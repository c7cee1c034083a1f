#!/usr/bin/env python3
"""Structured output (`response_format`) on one `pie serve`, in one run (issue 34).

Usage: scripts/structured-bench.py [--pie target/release/pie] [--model PATH]
           [--requests 200] [--concurrency 16] [--streams 32] [--max-tokens 128]
           [--rounds 3]

Starts one `pie serve` (the default model unless --model) and measures:

- validity: --requests `json_schema` chat requests through the unmodified
  OpenAI SDK, over four schemas (nested objects, arrays with `minItems`,
  enums, numeric bounds, string patterns, `additionalProperties: false`), at
  temperature 0.7 with a seed each, `max_tokens` 400 so that a length stop
  counts as a failure: every answer must stop by itself, parse and validate
  (`jsonschema`); and an uncompilable schema must get the 400;
- decode beside a constrained stream: --streams free streams against
  --streams - 1 free ones beside one constrained (a regular expression that
  outlasts --max-tokens), alternated for --rounds rounds; aggregate tokens/s
  of each, and their ratio;
- the mask cost per token: p50 and p99 of `pie_constraint_mask_seconds`
  over the whole run (bucket upper bounds, buckets 1.5x apart).

Needs the `openai` and `jsonschema` packages.
"""
import argparse
import json
import os
import sys
import threading
import time

import jsonschema
import openai

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pielib  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCHEMAS = {
    "pet": {
        "type": "object", "additionalProperties": False,
        "required": ["name", "species", "age", "tags"],
        "properties": {
            "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}$"},
            "species": {"enum": ["cat", "dog", "rabbit", "parrot"]},
            "age": {"type": "integer", "minimum": 0, "maximum": 30},
            "tags": {"type": "array", "minItems": 1, "maxItems": 4,
                     "items": {"type": "string", "maxLength": 12}},
        },
    },
    "order": {
        "type": "object", "additionalProperties": False,
        "required": ["id", "items", "total"],
        "properties": {
            "id": {"type": "string", "pattern": "^ORD-[0-9]{4}$"},
            "items": {"type": "array", "minItems": 2, "maxItems": 4, "items": {
                "type": "object", "additionalProperties": False,
                "required": ["sku", "qty"],
                "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                               "qty": {"type": "integer", "minimum": 1, "maximum": 9}}}},
            "total": {"type": "integer", "minimum": 1, "maximum": 10000},
        },
    },
    "city": {
        "type": "object", "additionalProperties": False,
        "required": ["city", "country", "location", "population"],
        "properties": {
            "city": {"type": "string", "maxLength": 30},
            "country": {"type": "string", "pattern": "^[A-Z]{2}$"},
            "location": {"type": "object", "additionalProperties": False,
                         "required": ["lat", "lon"],
                         "properties": {"lat": {"type": "integer", "minimum": -90, "maximum": 90},
                                        "lon": {"type": "integer", "minimum": -180, "maximum": 180}}},
            "population": {"type": "integer", "minimum": 0, "maximum": 40000000},
        },
    },
    "review": {
        "type": "object", "additionalProperties": False,
        "required": ["stars", "verdict", "pros"],
        "properties": {
            "stars": {"type": "integer", "minimum": 1, "maximum": 5},
            "verdict": {"enum": ["buy", "skip", "wait"]},
            "pros": {"type": "array", "minItems": 2, "maxItems": 3,
                     "items": {"type": "string", "maxLength": 24}},
        },
    },
}
PROMPTS = {
    "pet": "Describe a pet as JSON.",
    "order": "Write a small shop order as JSON.",
    "city": "Describe a city as JSON.",
    "review": "Review a pair of headphones as JSON.",
}


def serve(procs, a):
    args = [a.pie, "serve", "--port", "0"]
    if a.model:
        args += ["--model", a.model]
    proc, url = procs.spawn(args, prefix="pie: listening on ")
    pielib.wait_healthy(url, 600, proc=proc)
    return url


def validity(url, a):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    model = pielib.get_json(url, "/v1/models")["data"][0]["id"]
    names = sorted(SCHEMAS)
    failures, lock = [], threading.Lock()
    next_i = iter(range(a.requests))

    def worker():
        for i in next_i:
            name = names[i % len(names)]
            try:
                r = client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": PROMPTS[name]}],
                    max_tokens=400, temperature=0.7, seed=i,
                    response_format={"type": "json_schema", "json_schema": {
                        "name": name, "schema": SCHEMAS[name], "strict": True}})
                choice = r.choices[0]
                if choice.finish_reason != "stop":
                    raise ValueError(f"finish_reason {choice.finish_reason}")
                jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])
            except Exception as e:  # noqa: BLE001 - every failure is counted and shown
                with lock:
                    failures.append(f"request {i} ({name}): {e}")

    start = time.monotonic()
    threads = [threading.Thread(target=worker) for _ in range(a.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.monotonic() - start
    print(f"validity: {a.requests - len(failures)}/{a.requests} json_schema answers stopped, "
          f"parsed and validated ({len(SCHEMAS)} schemas, {a.concurrency} at once, {took:.1f} s)")
    for f in failures[:10]:
        print("  FAILED", f)
    try:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "json_schema", "json_schema": {
                "name": "bad", "schema": {"type": "object",
                                          "properties": {"a": {"type": "no-such-type"}}}}})
        print("uncompilable schema: FAILED, it was accepted")
    except openai.BadRequestError as e:
        print(f"uncompilable schema: 400 ({e.body.get('param')}): {e.body.get('message')[:120]}")
    return not failures


def stream_tokens(url, body, out, i):
    c = pielib.connect(url)
    c.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        pielib.fail(f"/v1/completions: {r.status} {r.read()[:200]!r}")
    chunks = 0
    while data := r.read1(65536):
        chunks += data.count(b"data: {")
    c.close()
    out[i] = chunks


def aggregate(url, streams, constrained, max_tokens):
    """Tokens/s of `streams` streams, `constrained` of them under a grammar."""
    free = {"prompt": "Tell me a story about a lighthouse keeper who", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True}
    held = dict(free, response_format={"type": "regex", "regex": "[a-z ]{%d}" % (max_tokens * 8)})
    counts = [0] * streams
    threads = [threading.Thread(target=stream_tokens,
                                args=(url, held if i < constrained else free, counts, i))
               for i in range(streams)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.monotonic() - start)


def mask_percentile(text, p):
    """The upper bound (ms) of the bucket holding the p-th percentile mask."""
    buckets = sorted((float(labels["le"]), v) for _, labels, v in
                     pielib.prom_samples(text, "pie_constraint_mask_seconds_bucket"))
    total = buckets[-1][1] if buckets else 0
    for le, count in buckets:
        if total and count >= p / 100 * total:
            return le * 1000, int(total)
    return float("nan"), int(total)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pie", default=os.path.join(ROOT, "target", "release", "pie"))
    ap.add_argument("--model")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    with pielib.Procs() as procs:
        url = serve(procs, a)
        ok = validity(url, a)
        aggregate(url, a.streams, 1, 16)  # warm-up, the trie built
        free, beside = [], []
        for _ in range(a.rounds):
            free.append(aggregate(url, a.streams, 0, a.max_tokens))
            beside.append(aggregate(url, a.streams, 1, a.max_tokens))
        f, b = sum(free) / len(free), sum(beside) / len(beside)
        rounds = lambda v: ", ".join(f"{x:.0f}" for x in v)
        print(f"aggregate decode, {a.streams} streams x {a.max_tokens} tokens, {a.rounds} rounds")
        print(f"  {a.streams} free                 {f:8.1f} tokens/s  (rounds: {rounds(free)})")
        print(f"  {a.streams - 1} free + 1 constrained {b:8.1f} tokens/s  (rounds: {rounds(beside)})")
        print(f"  ratio {b / f:.3f}")
        text = pielib.get_text(url, "/metrics")
        p50, n = mask_percentile(text, 50)
        p99, _ = mask_percentile(text, 99)
        print(f"mask per token (pie_constraint_mask_seconds, {n} masks): p50 <= {p50:.3f} ms, "
              f"p99 <= {p99:.3f} ms")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
