#!/usr/bin/env python3
"""The pie:inferlet@0.3.0 world's passes against their baselines, in one run.

Usage: scripts/passes-bench.py [--pie target/release/pie] [--model PATH]
           [--rounds 3] [--quick] [--out /tmp/passes-bench.json] [--no-build]

Builds the guests (`cargo build --release` in inferlets/, unless
--no-build), starts one `pie serve` (the default model unless --model) with
a step log, uploads `custom-sampler`, `spec-decode`, the guest
`text-completion` (as `text-completion-wasm`) and the previous SDK's
component (crates/pie-worker/tests/fixtures/text-completion-0.2.0.wasm, as
`text-completion-020`), and measures, alternating the variants for --rounds
rounds and reporting each figure against its baseline of the same run
(ratios: the median over rounds of each round's ratio):

1. a guest sampler: `custom-sampler` (forward(k) per token, temperature 0)
   against the native built-in `text-completion` (ignore_eos), 128 tokens,
   1 process and 8 at once: aggregate generated tokens / s (sum of
   completion tokens / server time from the first process's creation to the
   last one's end), ratio guest / native. Its prompts are ones the default
   model does not end within 128 tokens; the run fails unless both made the
   same number of tokens (and says whether the texts matched).
2. a pass's cost: from the step log, the median ms of the steps of one
   sequence taken while `spec-decode` ran alone (task 3's runs, from each
   process's first token to its end, so no prefill), 1 token against k
   tokens for k in 2..=9, k / 1 per round.
3. speculative decoding: `spec-decode` defaults (adaptive drafts up to 16, ngram 3) against
   `"plain": true` on scripts/data/code-edit-prompts.jsonl (a source file and
   a small edit; chat template; 256 tokens) and on five chat questions that
   copy nothing (128 tokens), one process at a time: decode tokens / s
   (tokens / (finished - first token)) and wall tokens / s (tokens /
   (finished - created)), per prompt and overall (sum of tokens / sum of
   times), ratio spec / plain, the acceptance (accepted / drafted), and
   whether both made the same tokens (greedy: they must; the run fails
   otherwise). Tokens are those of spec-decode's final JSON event (in spec
   mode the usage counts passes). Every prompt is run once first, so both
   modes find its prefix cached.
4. the new world costs old programs nothing: native `text-completion`,
   `text-completion-wasm` and `text-completion-020`, 32 processes at once,
   128 tokens (ignore_eos): aggregate tokens / s, ratios wasm /
   native and 020 / wasm.

--quick (a smoke test): 1 round, 2 code prompts, 64 tokens everywhere.
Prints tables and writes a JSON summary to --out (per-round figures
included); the server is killed at the end, its step log left in the
temporary directory it names. Python standard library only (scripts/pielib.py).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pielib  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUESTS = os.path.join(ROOT, "inferlets", "target", "wasm32-wasip2", "release")
FIXTURE_020 = os.path.join(ROOT, "crates", "pie-worker", "tests", "fixtures",
                           "text-completion-0.2.0.wasm")
CODE_PROMPTS = os.path.join(ROOT, "scripts", "data", "code-edit-prompts.jsonl")

# Completions the default model (SmolLM2-135M-Instruct) does not end within
# 128 greedy tokens: custom-sampler, which has no ignore_eos, makes them all.
SAMPLER_PROMPTS = [
    "The history of the Roman Empire begins with",
    "Once upon a time, in a small village by the sea, there lived",
    "The following is a detailed guide to growing tomatoes at home.",
    "Chapter 1\n\nThe rain had not stopped for three days when",
    "In computer science, a hash table is",
    "The recipe for a classic French omelette calls for",
    "Dear diary, today was the strangest day of my life.",
    "The city of Paris is known for",
]
# Chat that does not copy its input: little for prompt lookup to find.
CHAT_QUESTIONS = [
    "Explain why the sky is blue.",
    "What are three tips for staying focused while studying?",
    "Describe how a bicycle works.",
    "Why do cats purr?",
    "What is the difference between weather and climate?",
]
SAMPLER_K = 20
SAMPLER_PROCESSES = (1, 8)
WORLD_PROCESSES = 32
PASS_SIZES = range(2, 18)  # a pass of `next` and up to 16 drafts
WAIT_S = 900  # the longest one process may take


def median(values):
    """Nearest-rank median (pielib's rule); None when there are none."""
    values = [v for v in values if v is not None]
    return pielib.percentile(values, 50) if values else None


def ratio(a, b):
    return a / b if a is not None and b else None


# ---------------------------------------------------------------------------
# the server and its processes

def serve(procs, a, store, step_log):
    config = os.path.join(store, "config.toml")
    with open(config, "w") as f:
        f.write(f"[server]\nport = 0\nstep_log = {json.dumps(step_log)}\n\n"
                f"[runtime.inferlets]\ndir = {json.dumps(os.path.join(store, 'inferlets'))}\n")
    args = [a.pie, "serve", "--config", config]
    if a.model:
        args += ["--model", a.model]
    proc, url = procs.spawn(args, prefix="pie: listening on ")
    pielib.wait_healthy(url, 600, proc=proc)
    kernel = next((line.split("matmul kernel", 1)[1].strip() for line in proc.tail
                   if "matmul kernel" in line), None)
    return url, kernel


def upload(url, name, path):
    if not os.path.exists(path):
        pielib.fail(f"{path} is missing: build the guests (cd inferlets && cargo build --release)")
    with open(path, "rb") as f:
        wasm = f.read()
    c = pielib.connect(url)
    try:
        c.request("POST", f"/v1/inferlets?name={name}", wasm, {"content-type": "application/wasm"})
        r = c.getresponse()
        body = r.read()
    finally:
        c.close()
    if r.status != 201:
        pielib.fail(f"upload {name}: HTTP {r.status} {body[:200]!r}")


def launch(url, inferlet, args):
    r = pielib.request(url, "POST", "/v1/processes", {"inferlet": inferlet, "args": args})
    if r.status != 201:
        pielib.fail(f"launch {inferlet}: {r}")
    return r.json()["id"]


def wait_done(url, pid, what):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        p = pielib.get_json(url, f"/v1/processes/{pid}")
        if p["state"] in ("finished", "failed", "killed"):
            if p["state"] != "finished":
                pielib.fail(f"{what} ({pid}): {p['state']}: {p.get('error')}")
            return p
        time.sleep(0.02)
    pielib.fail(f"{what} ({pid}): not done after {WAIT_S} s")


def json_events(url, pid):
    """The `json` events of a finished process (its events replayed, up to
    the final `status`)."""
    c = pielib.connect(url)
    try:
        c.request("GET", f"/v1/processes/{pid}/events")
        r = c.getresponse()
        if r.status != 200:
            pielib.fail(f"GET /v1/processes/{pid}/events: HTTP {r.status} {r.read()[:200]!r}")
        event, found = None, []
        for raw in r:
            line = raw.decode(errors="replace").rstrip("\r\n")
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                if event == "json":
                    found.append(json.loads(line[5:].strip()))
                elif event == "status":
                    break
            elif not line:
                event = None
        return found
    finally:
        c.close()


def batch(url, inferlet, arg_list):
    """Launch a process per args at once and wait for all: their records,
    completion tokens, and the server's time from the first creation to the
    last end."""
    ids = [launch(url, inferlet, args) for args in arg_list]
    records = [wait_done(url, pid, inferlet) for pid in ids]
    ms = max(r["finished_ms"] for r in records) - min(r["created_ms"] for r in records)
    tokens = sum(r["usage"]["completion_tokens"] for r in records)
    return {"records": records, "tokens": tokens, "ms": ms,
            "tokens_per_s": tokens / max(ms, 1) * 1000}


# ---------------------------------------------------------------------------
# 1. a guest sampler against the native built-in

def sampler_bench(url, a):
    out = {}
    for n in SAMPLER_PROCESSES:
        prompts = [SAMPLER_PROMPTS[i % len(SAMPLER_PROMPTS)] for i in range(n)]
        native_args = [{"prompt": p, "max_tokens": a.max_tokens, "ignore_eos": True,
                        "temperature": 0} for p in prompts]
        guest_args = [{"prompt": p, "max_tokens": a.max_tokens, "k": SAMPLER_K,
                       "temperature": 0} for p in prompts]
        rounds = []
        for r in range(a.rounds):
            got = {}
            for variant in (["native", "guest"] if r % 2 == 0 else ["guest", "native"]):
                got[variant] = (batch(url, "text-completion", native_args) if variant == "native"
                                else batch(url, "custom-sampler", guest_args))
            native, guest = got["native"], got["guest"]
            per_native = [x["usage"]["completion_tokens"] for x in native["records"]]
            per_guest = [x["usage"]["completion_tokens"] for x in guest["records"]]
            if per_native != per_guest:
                pielib.fail(f"sampler, {n} processes: custom-sampler made {per_guest} tokens, "
                            f"text-completion {per_native}: pick prompts the model does not "
                            f"end within {a.max_tokens} tokens")
            same_text = all(x["output"] == y["output"]
                            for x, y in zip(native["records"], guest["records"]))
            rounds.append({"native_tokens_per_s": native["tokens_per_s"],
                           "guest_tokens_per_s": guest["tokens_per_s"],
                           "native_tokens": native["tokens"], "guest_tokens": guest["tokens"],
                           "native_ms": native["ms"], "guest_ms": guest["ms"],
                           "ratio": guest["tokens_per_s"] / native["tokens_per_s"],
                           "same_text": same_text})
        out[str(n)] = {
            "processes": n,
            "native_tokens_per_s": median(x["native_tokens_per_s"] for x in rounds),
            "guest_tokens_per_s": median(x["guest_tokens_per_s"] for x in rounds),
            "ratio_guest_native": median(x["ratio"] for x in rounds),
            "tokens_per_round": rounds[0]["native_tokens"],
            "same_text": all(x["same_text"] for x in rounds),
            "rounds": rounds,
        }
    return out


def print_sampler(s, a):
    print(f"\n1. custom-sampler (forward(k={SAMPLER_K}) per token) vs native text-completion, "
          f"temperature 0, {a.max_tokens} tokens, median of {a.rounds} round(s)")
    print(f"  {'processes':>9} {'tokens':>7} {'native tok/s':>13} {'guest tok/s':>12} "
          f"{'guest/native':>13}  same text")
    for v in s.values():
        print(f"  {v['processes']:>9} {v['tokens_per_round']:>7} {v['native_tokens_per_s']:>13.1f} "
              f"{v['guest_tokens_per_s']:>12.1f} {v['ratio_guest_native']:>13.3f}  "
              f"{'yes' if v['same_text'] else 'NO'}")


# ---------------------------------------------------------------------------
# 3. speculative decoding against plain greedy (and the windows for 2.)

def spec_run(url, prompt, max_tokens, plain):
    args = {"prompt": prompt, "max_tokens": max_tokens, "chat": True, "plain": plain}
    what = f"spec-decode ({'plain' if plain else 'spec'})"
    pid = launch(url, "spec-decode", args)
    rec = wait_done(url, pid, what)
    events = json_events(url, pid)
    if not events:
        pielib.fail(f"{what} ({pid}): no json event")
    ev = events[-1]
    tokens = ev["tokens"]
    if plain and rec["usage"]["completion_tokens"] != len(tokens):
        pielib.fail(f"{what} ({pid}): usage counts {rec['usage']['completion_tokens']} "
                    f"tokens, its event {len(tokens)}")
    first = rec["first_token_ms"] or rec["created_ms"]
    decode_ms = max(rec["finished_ms"] - first, 1)
    wall_ms = max(rec["finished_ms"] - rec["created_ms"], 1)
    return {"tokens": tokens, "n": len(tokens), "decode_ms": decode_ms, "wall_ms": wall_ms,
            "passes": ev["passes"], "drafted": ev["drafted"], "accepted": ev["accepted"],
            "window": (first, rec["finished_ms"]), "plain": plain}


def spec_bench(url, a, workload, prompts, max_tokens, windows):
    """prompts: [(name, prompt)]; each run's (first token, end) window goes
    to `windows` as (round, plain, start, end)."""
    for _, prompt in prompts:  # cache every prompt's prefix, for both modes alike
        spec_run(url, prompt, 1, True)
    runs = {name: [] for name, _ in prompts}  # per prompt: per round {plain, spec}
    for r in range(a.rounds):
        for i, (name, prompt) in enumerate(prompts):
            got = {}
            for plain in ((True, False) if (r + i) % 2 == 0 else (False, True)):
                got["plain" if plain else "spec"] = run = spec_run(url, prompt, max_tokens, plain)
                windows.append((r, plain) + run["window"])
            runs[name].append(got)

    def rates(run):
        return run["n"] / run["decode_ms"] * 1000, run["n"] / run["wall_ms"] * 1000

    per_prompt = []
    for name, _ in prompts:
        rows = []
        for got in runs[name]:
            (pd, pw), (sd, sw) = rates(got["plain"]), rates(got["spec"])
            rows.append({"plain_decode": pd, "spec_decode": sd, "plain_wall": pw, "spec_wall": sw,
                         "identical": got["plain"]["tokens"] == got["spec"]["tokens"],
                         "tokens": got["plain"]["n"], "spec_tokens": got["spec"]["n"],
                         "drafted": got["spec"]["drafted"], "accepted": got["spec"]["accepted"],
                         "passes": got["spec"]["passes"]})
        drafted = sum(x["drafted"] for x in rows)
        per_prompt.append({
            "name": name, "tokens": rows[0]["tokens"],
            "plain_decode_tokens_per_s": median(x["plain_decode"] for x in rows),
            "spec_decode_tokens_per_s": median(x["spec_decode"] for x in rows),
            "ratio_decode": median(x["spec_decode"] / x["plain_decode"] for x in rows),
            "plain_wall_tokens_per_s": median(x["plain_wall"] for x in rows),
            "spec_wall_tokens_per_s": median(x["spec_wall"] for x in rows),
            "ratio_wall": median(x["spec_wall"] / x["plain_wall"] for x in rows),
            "passes": rows[0]["passes"], "drafted": rows[0]["drafted"],
            "accepted": rows[0]["accepted"],
            "acceptance": ratio(sum(x["accepted"] for x in rows), drafted),
            "identical": all(x["identical"] for x in rows),
            "rounds": rows,
        })
    overall_rounds = []
    for r in range(a.rounds):
        total = {}
        for mode in ("plain", "spec"):
            got = [runs[name][r][mode] for name, _ in prompts]
            n = sum(x["n"] for x in got)
            total[mode] = (n / sum(x["decode_ms"] for x in got) * 1000,
                           n / sum(x["wall_ms"] for x in got) * 1000, n)
        overall_rounds.append({
            "plain_decode": total["plain"][0], "spec_decode": total["spec"][0],
            "plain_wall": total["plain"][1], "spec_wall": total["spec"][1],
            "plain_tokens": total["plain"][2], "spec_tokens": total["spec"][2],
            "ratio_decode": total["spec"][0] / total["plain"][0],
            "ratio_wall": total["spec"][1] / total["plain"][1]})
    drafted = sum(p["drafted"] for p in per_prompt)
    return {
        "workload": workload, "max_tokens": max_tokens, "prompts": per_prompt,
        "overall": {
            "tokens": overall_rounds[0]["plain_tokens"],
            "plain_decode_tokens_per_s": median(x["plain_decode"] for x in overall_rounds),
            "spec_decode_tokens_per_s": median(x["spec_decode"] for x in overall_rounds),
            "ratio_decode": median(x["ratio_decode"] for x in overall_rounds),
            "plain_wall_tokens_per_s": median(x["plain_wall"] for x in overall_rounds),
            "spec_wall_tokens_per_s": median(x["spec_wall"] for x in overall_rounds),
            "ratio_wall": median(x["ratio_wall"] for x in overall_rounds),
            "drafted": drafted, "accepted": sum(p["accepted"] for p in per_prompt),
            "acceptance": ratio(sum(p["accepted"] for p in per_prompt), drafted),
            "identical": all(p["identical"] for p in per_prompt),
            "rounds": overall_rounds,
        },
    }


def print_spec(s, a):
    print(f"\n3. spec-decode (adaptive drafts up to 16, ngram 3) vs plain greedy, {s['workload']}, chat template, "
          f"{s['max_tokens']} tokens, one process at a time, median of {a.rounds} round(s)")
    print(f"  {'prompt':<26} {'tokens':>6} {'decode tok/s plain':>18} {'spec':>7} {'spec/plain':>10}"
          f" {'wall tok/s plain':>16} {'spec':>7} {'spec/plain':>10} {'accept':>7} {'passes':>6}"
          f"  identical")
    rows = s["prompts"] + [dict(s["overall"], name="overall (sum/sum)", passes=None)]
    for p in rows:
        acc = "-" if p["acceptance"] is None else f"{p['acceptance']:.2f}"
        passes = "" if p["passes"] is None else p["passes"]
        print(f"  {p['name']:<26} {p['tokens']:>6} {p['plain_decode_tokens_per_s']:>18.1f} "
              f"{p['spec_decode_tokens_per_s']:>7.1f} {p['ratio_decode']:>10.3f} "
              f"{p['plain_wall_tokens_per_s']:>16.1f} {p['spec_wall_tokens_per_s']:>7.1f} "
              f"{p['ratio_wall']:>10.3f} {acc:>7} {passes:>6}  {'yes' if p['identical'] else 'NO'}")


# ---------------------------------------------------------------------------
# 2. a pass's cost, from the step log

def pass_cost(step_log, windows, rounds):
    """Steps of one sequence inside spec-decode's windows, by batch tokens."""
    with open(step_log) as f:
        steps = [json.loads(line) for line in f if line.strip()]
    by = {}  # (round, kind) -> [ms]; kind: "plain-1", "pass-1", k for k in PASS_SIZES
    for s in steps:
        if s["sequences"] != 1:
            continue
        start, end = s["start_unix_ms"], s["start_unix_ms"] + s["ms"]
        for r, plain, lo, hi in windows:
            if lo <= start and end <= hi + 1:  # the records' ms are whole
                bt = s["batch_tokens"]
                if bt == 1:
                    kind = "plain-1" if plain else "pass-1"
                elif bt in PASS_SIZES and not plain:
                    kind = bt
                else:
                    break
                by.setdefault((r, kind), []).append(s["ms"])
                break
    out = {"rounds": []}
    for r in range(rounds):
        one = by.get((r, "plain-1"), []) + by.get((r, "pass-1"), [])
        base = median(one)
        row = {"one_token_ms": base, "one_token_steps": len(one),
               "plain_one_token_ms": median(by.get((r, "plain-1"), [])),
               "pass_one_token_ms": median(by.get((r, "pass-1"), [])), "k": {}}
        for k in PASS_SIZES:
            ms = by.get((r, k), [])
            row["k"][str(k)] = {"ms": median(ms), "steps": len(ms), "ratio": ratio(median(ms), base)}
        out["rounds"].append(row)
    pooled = lambda kinds: [ms for (_, kind), v in by.items() if kind in kinds for ms in v]
    out["one_token_ms"] = median(pooled({"plain-1", "pass-1"}))
    out["one_token_steps"] = len(pooled({"plain-1", "pass-1"}))
    out["plain_one_token_ms"] = median(pooled({"plain-1"}))
    out["plain_one_token_steps"] = len(pooled({"plain-1"}))
    out["pass_one_token_ms"] = median(pooled({"pass-1"}))
    out["pass_one_token_steps"] = len(pooled({"pass-1"}))
    out["k"] = {}
    for k in PASS_SIZES:
        ms = pooled({k})
        out["k"][str(k)] = {"ms": median(ms), "steps": len(ms),
                            "ratio": median(x["k"][str(k)]["ratio"] for x in out["rounds"])}
    return out


def print_pass_cost(c, a):
    fmt = lambda v: "-" if v is None else f"{v:.2f}"
    print(f"\n2. a pass's cost: step ms, one sequence, while spec-decode ran alone (task 3, "
          f"first token to end), median of {a.rounds} round(s)")
    print(f"  1 token: {fmt(c['one_token_ms'])} ms over {c['one_token_steps']} steps "
          f"(plain generate {fmt(c['plain_one_token_ms'])} ms x{c['plain_one_token_steps']}, "
          f"1-token passes {fmt(c['pass_one_token_ms'])} ms x{c['pass_one_token_steps']})")
    print(f"  {'tokens':>6} {'steps':>6} {'median ms':>10} {'k / 1':>7}")
    for k, v in c["k"].items():
        print(f"  {k:>6} {v['steps']:>6} {fmt(v['ms']):>10} {fmt(v['ratio']):>7}")


# ---------------------------------------------------------------------------
# 4. old programs under the new world

WORLD_VARIANTS = [("native", "text-completion"), ("wasm", "text-completion-wasm"),
                  ("020", "text-completion-020")]


def world_bench(url, a):
    args = [{"prompt": SAMPLER_PROMPTS[i % len(SAMPLER_PROMPTS)], "max_tokens": a.max_tokens,
             "ignore_eos": True} for i in range(WORLD_PROCESSES)]
    rounds = []
    for r in range(a.rounds):
        got = {}
        order = WORLD_VARIANTS[r % 3:] + WORLD_VARIANTS[:r % 3]
        for variant, inferlet in order:
            got[variant] = batch(url, inferlet, args)
        counts = {v: got[v]["tokens"] for v, _ in WORLD_VARIANTS}
        if len(set(counts.values())) != 1:
            pielib.fail(f"32 processes: tokens differ between variants: {counts}")
        rounds.append({**{f"{v}_tokens_per_s": got[v]["tokens_per_s"] for v, _ in WORLD_VARIANTS},
                       **{f"{v}_ms": got[v]["ms"] for v, _ in WORLD_VARIANTS},
                       "tokens": counts["native"],
                       "ratio_wasm_native": got["wasm"]["tokens_per_s"] / got["native"]["tokens_per_s"],
                       "ratio_020_wasm": got["020"]["tokens_per_s"] / got["wasm"]["tokens_per_s"],
                       "order": [v for v, _ in order]})
    return {"processes": WORLD_PROCESSES, "max_tokens": a.max_tokens,
            "tokens_per_round": rounds[0]["tokens"],
            **{f"{v}_tokens_per_s": median(x[f"{v}_tokens_per_s"] for x in rounds)
               for v, _ in WORLD_VARIANTS},
            "ratio_wasm_native": median(x["ratio_wasm_native"] for x in rounds),
            "ratio_020_wasm": median(x["ratio_020_wasm"] for x in rounds),
            "rounds": rounds}


def print_world(w, a):
    print(f"\n4. old programs: text-completion native vs guest (0.3.0 SDK) vs guest (0.2.0 SDK), "
          f"{w['processes']} processes x {w['max_tokens']} tokens, median of {a.rounds} round(s)")
    print(f"  tokens {w['tokens_per_round']}; tokens/s native {w['native_tokens_per_s']:.1f}, "
          f"wasm {w['wasm_tokens_per_s']:.1f}, 020 {w['020_tokens_per_s']:.1f}")
    print(f"  wasm/native {w['ratio_wasm_native']:.3f}   020/wasm {w['ratio_020_wasm']:.3f}")


# ---------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pie", default=os.path.join(ROOT, "target", "release", "pie"))
    ap.add_argument("--model")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true",
                    help="a smoke test: 1 round, 2 code prompts, 64 tokens")
    ap.add_argument("--out", default="/tmp/passes-bench.json")
    ap.add_argument("--no-build", action="store_true", help="use the guests as built")
    a = ap.parse_args()
    a.max_tokens, code_tokens, chat_tokens = 128, 256, 128
    with open(CODE_PROMPTS) as f:
        code = [(p["name"], p["prompt"]) for p in map(json.loads, filter(str.strip, f))]
    if a.quick:
        a.rounds, code = 1, code[:2]
        a.max_tokens = code_tokens = chat_tokens = 64
    if a.rounds < 1:
        pielib.fail("--rounds must be at least 1")
    if not a.no_build:
        subprocess.run(["cargo", "build", "--release", "--quiet"],
                       cwd=os.path.join(ROOT, "inferlets"), check=True)
    store = tempfile.mkdtemp(prefix="pie-passes-bench-")
    step_log = os.path.join(store, "steps.jsonl")
    started = time.monotonic()
    with pielib.Procs() as procs:
        url, kernel = serve(procs, a, store, step_log)
        model = pielib.get_json(url, "/v1/models")["data"][0]["id"]
        print(f"passes-bench: {model} on {url} (matmul kernel {kernel}), {a.rounds} round(s)"
              f"{', quick' if a.quick else ''}; step log {step_log}")
        upload(url, "custom-sampler", os.path.join(GUESTS, "custom_sampler.wasm"))
        upload(url, "spec-decode", os.path.join(GUESTS, "spec_decode.wasm"))
        upload(url, "text-completion-wasm", os.path.join(GUESTS, "text_completion.wasm"))
        upload(url, "text-completion-020", FIXTURE_020)
        warm = {"prompt": SAMPLER_PROMPTS[0], "max_tokens": 4}
        for inferlet in ("text-completion", "text-completion-wasm", "text-completion-020"):
            batch(url, inferlet, [dict(warm, ignore_eos=True)])
        batch(url, "custom-sampler", [warm])

        sampler = sampler_bench(url, a)
        print_sampler(sampler, a)
        windows = []
        spec_code = spec_bench(url, a, "code edits", code, code_tokens, windows)
        spec_chat = spec_bench(url, a, "chat", list(zip(
            (f"chat-{i + 1}" for i in range(len(CHAT_QUESTIONS))), CHAT_QUESTIONS)),
            chat_tokens, windows)
        cost = pass_cost(step_log, windows, a.rounds)
        print_pass_cost(cost, a)
        print_spec(spec_code, a)
        print_spec(spec_chat, a)
        world = world_bench(url, a)
        print_world(world, a)
        procs.stop_all()

    identical = spec_code["overall"]["identical"] and spec_chat["overall"]["identical"]
    summary = {
        "model": model, "matmul_kernel": kernel, "pie": a.pie, "rounds": a.rounds,
        "quick": a.quick, "seconds": round(time.monotonic() - started, 1),
        "sampler": sampler, "pass_cost": cost,
        "spec": {"code": spec_code, "chat": spec_chat},
        "world": world, "identical": identical,
    }
    with open(a.out, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"\nsummary written to {a.out} ({summary['seconds']} s)")
    if not identical:
        bad = [p["name"] for s in (spec_code, spec_chat) for p in s["prompts"] if not p["identical"]]
        pielib.fail(f"spec-decode's tokens differ from plain greedy's on {', '.join(bad)}")


if __name__ == "__main__":
    main()
