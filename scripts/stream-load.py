#!/usr/bin/env python3
"""Concurrent streaming clients against a running `pie serve` (OpenAI SDK).

Usage: scripts/stream-load.py URL [--clients 32] [--requests 2] [--max-tokens 64]

Prints aggregate generated tokens/s, TTFT percentiles (nearest rank), and checks /metrics:
every request completed, no negative gauge, KV pages back to the baseline.
"""
import argparse
import asyncio
import os
import sys
import time

import openai

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pielib  # noqa: E402


def metrics(url):
    """`url`'s /metrics text, after checking that no sample is negative."""
    text = pielib.scrape(url)
    for name, labels, value in pielib.prom_samples(text):
        if value < 0:
            raise SystemExit(f"negative metric: {name}{labels or ''} {value}")
    return text


async def client(api, model, i, requests, max_tokens, ttfts):
    tokens = 0
    for r in range(requests):
        start = time.perf_counter()
        first = None
        stream = await api.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"Client {i}, request {r}: tell me a short story about a cache."}],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - start
            if chunk.usage:
                tokens += chunk.usage.completion_tokens
        ttfts.append(first or 0.0)
    return tokens


async def main():
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--requests", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    a = p.parse_args()
    before = metrics(a.url)
    api = openai.AsyncOpenAI(base_url=a.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    model = (await api.models.list()).data[0].id
    ttfts = []
    start = time.perf_counter()
    counts = await asyncio.gather(*(client(api, model, i, a.requests, a.max_tokens, ttfts) for i in range(a.clients)))
    wall = time.perf_counter() - start
    after = metrics(a.url)
    total = sum(counts)
    expected = a.clients * a.requests * a.max_tokens
    ttft = pielib.percentiles(ttfts)
    pages_before = pielib.prom_sum(before, "pie_kv_pages_used")
    pages_after = pielib.prom_sum(after, "pie_kv_pages_used")
    print(f"clients={a.clients} requests={a.clients * a.requests} tokens={total}/{expected} wall={wall:.1f}s")
    print(f"aggregate decode: {total / wall:.1f} tok/s; TTFT p50 {ttft['p50']:.2f}s p90 {ttft['p90']:.2f}s")
    print(f"pages used after: {pages_after:.0f} (before {pages_before:.0f}); "
          f"finished requests +{pielib.prom_delta(before, after, 'pie_requests_total'):.0f}")
    assert total == expected, "every request completes with all its tokens"
    assert pages_after == pages_before, "pages return to baseline"


asyncio.run(main())
