#!/usr/bin/env python3
"""Agents three ways on one `pie serve`, in one run (issue 34).

Usage: scripts/agent-bench.py [--pie target/release/pie] [--model PATH]
           [--agents 8,32,64] [--max-steps 6] [--latency-ms 100,2000]
           [--seed 1] [--variants inferlet,session,plain]
           [--pool-share 0.5 | --kv-pages N] [--admission-wait-ms MS]
           [--rounds 1] [--duration SECONDS] [--sim]

One ReAct agent protocol (the `agent` inferlet's: a system prompt, each
step constrained to `Thought: ...` then `Action: TOOL[INPUT]` or
`Final Answer: ...`, the last step to an answer, the tool's result sent
back as the user turn `Observation: ...`), run by N agents at once in
three ways against the same worker (`[runtime] worker_policy = ["fair",
"keep-session"]`):

- inferlet: the `agent` inferlet, launched with `keep-ms` (keep-session
  holds its context's pages between steps); the tool's result is a message
  to its process;
- session: a client loop over `/v1/chat/completions` with a `session` and
  `keep-ms` (keep-session holds the conversation's pages between calls);
- plain: the same loop without a session (each step re-sends the history, as
  a vLLM user's loop does);
- session-release (only if named in --variants): the session loop whose
  last step (the one constrained to an answer) asks `keep-ms: 0`, so its
  pages are freed as the agent ends, as the inferlet's are (an agent that
  answers sooner keeps its last turn: the loop cannot know it is the last).

Agent i asks the i % 8th question tagged with its number (no two agents
share a conversation). The tool answers after a latency drawn per agent and
step (seeded, uniform in --latency-ms) with a text that depends only on the
call, so every way gets the same results. The KV pool holds --pool-share (at
most half) of the agents' contexts at their longest: a first pass runs the
plain loop of the first eight agents on an ample pool and takes its longest
context (prompt and answer of a last step), and each row's kv_pages is that
share of N such contexts. --admission-wait-ms sets keep-session's
`admission_wait_ms` for every variant. Per variant: agents per
minute, per-step latency (p50, p99: from the request, or the tool's result,
to the next step's end), prompt tokens computed and found cached, and
preemptions; then how many agents made the same calls and answer in every
way (temperature 0). With --rounds R each row runs its variants R times in
turn (so a slow spell of the host falls on every variant alike), and a
variant's figures are those of its median round by agents per minute, the
ratios each round's beside them. A batch's rate is set by its slowest
agent; with --duration each run is instead a steady stream: N slots start
a new agent whenever theirs finishes, and the rate counts the agents that
finish between the first third of the duration (the warm-up) and its end;
steps and latencies are those agents', token counts the whole run's.
With --sim, every served run logs its engine steps (`pie serve
--step-log`), and after the rows pie-sim runs each row's agents, pool and
`[runtime]` on the measured shape (each agent's steps and output length,
taken in turn) in each way, beside the measured median rounds: the
inferlet as held sessions whose last step keeps nothing (its process
frees its contexts when it ends), the session loop as held sessions, and
the plain loop. Its cost profile is fitted to the row's own served steps
(`pie bench --calibrate --from-steps`, every way and round of the row),
as `scripts/fidelity.sh` does: a served step carries what an in-process
calibration does not (the grammar's mask, the HTTP server and the
benchmark's own client on the same cores), and the speed the host had
while the row ran. With --duration the simulated ways are streams too
(each slot runs its agents back to back), their rates counted over the
same window of simulated time.
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pielib  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AGENT_WASM = os.path.join(ROOT, "inferlets", "target", "wasm32-wasip2", "release", "agent.wasm")

# The `agent` inferlet's protocol (inferlets/agent/src/protocol.rs), verbatim.
SYSTEM = ("You are an agent that answers questions with tools. Each turn, write "
          "one line `Thought: ...`, then either `Action: search[QUERY]` or `Action: calculate[EXPRESSION]` "
          "to use a tool, or `Final Answer: ...` when you know the answer. Tool results come back as "
          "`Observation: ...`.")
STEP = r"Thought: [ -~]{1,100}\n(Action: (search|calculate)\[[a-zA-Z0-9 +*/.-]{1,40}\]|Final Answer: [ -~]{1,100})"
FINAL = r"Thought: [ -~]{1,100}\nFinal Answer: [ -~]{1,100}"
PAGE_SIZE = 16
# keep-session's hold on a context between steps, the inferlet's and the
# session loop's alike (above the longest tool latency).
KEEP_MS = 30000
# The `agent` workload's question length in tokens (the questions below
# with their chat template's tokens).
QUESTION_LEN = 16

QUESTIONS = [
    "How tall is the Eiffel Tower in meters?", "What is 17 times 23?",
    "Which river flows through Cairo?", "How many days are in a leap year?",
    "Who wrote the novel Moby Dick?", "What is the boiling point of water in Fahrenheit?",
    "What is the capital of Australia?", "How many legs does a spider have?",
]


def question(i):
    """Agent `i`'s question: one of the eight, tagged with the agent's
    number so that no two agents share a conversation (at temperature 0 two
    agents asking the same text would share every KV page, and 64 agents
    would hold the pages of eight)."""
    return f"{QUESTIONS[i % len(QUESTIONS)]} (case {i})"


def tool(name, argument):
    """The tool's result: a function of the call only."""
    h = sum(ord(c) * (i + 7) for i, c in enumerate(name + argument)) % 1000
    return f"{name} result {h} for {argument.strip()[:30]}"


def latency(seed, agent, step, bounds):
    rng = random.Random(f"{seed}-{agent}-{step}")
    return rng.uniform(*bounds) / 1000


def runtime_config(a):
    """Every variant's `[runtime]`, and pie-sim's."""
    return ('[runtime]\nworker_policy = ["fair", "keep-session"]\nmax_running = 64\n'
            f"[runtime.keep-session]\nadmission_wait_ms = {a.admission_wait_ms}\n")


def serve(procs, a, pages, store, step_log=None):
    """A `pie serve` with an `agent` inferlet uploaded; its URL. With
    `step_log`, the server writes its engine steps there."""
    config = os.path.join(store, "config.toml")
    with open(config, "w") as f:
        f.write(runtime_config(a) + f"[runtime.inferlets]\ndir = {json.dumps(store)}\n")
    args = [a.pie, "serve", "--port", "0", "--config", config, "--kv-pages", str(pages),
            "--page-size", str(PAGE_SIZE)]
    if a.model:
        args += ["--model", a.model]
    if step_log:
        args += ["--step-log", step_log]
    proc, url = procs.spawn(args, prefix="pie: listening on ")
    pielib.wait_healthy(url, 600, proc=proc)
    with open(AGENT_WASM, "rb") as f:
        c = pielib.connect(url)
        c.request("POST", "/v1/inferlets?name=agent", f.read())
        r = c.getresponse()
        if r.status != 201:
            pielib.fail(f"upload agent: {r.status} {r.read()[:200]!r}")
    return url


def parse(text):
    """A step's (tool, argument) call or its answer; the answer is a
    failure naming the text when the step is neither (cut short, as the
    `agent` inferlet reports it)."""
    decision = text.split("\n", 1)[-1]
    if decision.startswith("Final Answer: "):
        return None, decision[len("Final Answer: "):]
    if decision.startswith("Action: ") and "[" in decision and decision.endswith("]"):
        name, argument = decision[len("Action: "):-1].split("[", 1)
        return (name, argument), None
    return None, f"FAILED: a step that is neither an action nor an answer: {text!r}"


def run_inferlet(url, i, a, out):
    body = {"inferlet": "agent", "args": {"question": question(i), "max_steps": a.max_steps},
            "props": {"keep-ms": KEEP_MS}}
    r = pielib.request(url, "POST", "/v1/processes", body)
    pid = r.json()["id"]
    c = pielib.connect(url)
    c.request("GET", f"/v1/processes/{pid}/events")
    resp = c.getresponse()
    calls, steps, answer, buf, kind = [], [], None, b"", None
    started = time.monotonic()
    while answer is None and (data := resp.read1(65536)):
        buf += data
        while b"\n\n" in buf:
            block, buf = buf.split(b"\n\n", 1)
            lines = block.decode(errors="replace").split("\n")
            kind = next((ln[7:] for ln in lines if ln.startswith("event: ")), None)
            payload = next((ln[6:] for ln in lines if ln.startswith("data: ")), None)
            if kind == "status" and payload and json.loads(payload)["state"] != "running":
                answer = answer or f"FAILED: {payload}"
            if kind != "json" or payload is None:
                continue
            event = json.loads(payload)
            steps.append(time.monotonic() - started)
            if event["type"] == "final":
                answer = event["answer"]
                break
            calls.append((event["tool"], event["input"]))
            time.sleep(latency(a.seed, i, len(calls), a.bounds))
            started = time.monotonic()
            pielib.request(url, "POST", f"/v1/processes/{pid}/messages",
                           {"message": tool(event["tool"], event["input"])})
    c.close()
    out[i] = (calls, answer, steps, None)


def run_loop(url, i, a, out, session, release_at_end=False):
    model = pielib.get_json(url, "/v1/models")["data"][0]["id"]
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": question(i)}]
    calls, steps, answer, usages = [], [], None, []
    for step in range(a.max_steps):
        last = step + 1 == a.max_steps
        body = {"model": model, "messages": messages, "max_tokens": 256, "temperature": 0,
                "response_format": {"type": "regex", "regex": FINAL if last else STEP}}
        if session:
            body["session"] = f"agent-{a.run}-{i}"
            body["props"] = {"keep-ms": 0 if last and release_at_end else KEEP_MS}
        started = time.monotonic()
        r = pielib.request(url, "POST", "/v1/chat/completions", body)
        if r.status != 200:
            answer = f"FAILED: {r}"
            break
        reply = r.json()
        text = reply["choices"][0]["message"]["content"]
        usages.append((reply["usage"]["prompt_tokens"], reply["usage"]["completion_tokens"]))
        steps.append(time.monotonic() - started)
        messages.append({"role": "assistant", "content": text})
        call, answer = parse(text)
        if call is None:
            break
        calls.append(call)
        time.sleep(latency(a.seed, i, len(calls), a.bounds))
        messages.append({"role": "user", "content": f"Observation: {tool(*call)}"})
    out[i] = (calls, answer, steps, usages)


TARGETS = {"inferlet": run_inferlet,
           "session": lambda u, i, a, o: run_loop(u, i, a, o, True),
           "plain": lambda u, i, a, o: run_loop(u, i, a, o, False),
           "session-release": lambda u, i, a, o: run_loop(u, i, a, o, True, True)}


def run_agent(target, url, i, a, out):
    """Agent `i` in one way (`target`); an exception (the server's
    shutdown at a stream's end, or a failure) is its record's answer, so
    that it counts as failed rather than vanishing."""
    try:
        target(url, i, a, out)
    except Exception as e:  # noqa: BLE001 (recorded, not raised)
        out[i] = ([], f"FAILED: {e!r}", [], None)


def variant(url, name, n, a):
    """N agents of way `name`: one batch (the rate is N over its wall time),
    or with --duration a steady stream (see `stream`)."""
    before = pielib.scrape(url)
    start = time.monotonic()
    if a.duration:
        out, rate = stream(url, TARGETS[name], n, a, start)
    else:
        out = {}
        threads = [threading.Thread(target=run_agent, args=(TARGETS[name], url, i, a, out))
                   for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rate = n / (time.monotonic() - start) * 60
    after = pielib.scrape(url)
    delta = lambda m: pielib.prom_delta(before, after, m)
    steps = [s for _, _, ss, _ in out.values() for s in ss]
    failures = {i: ans for i, (_, ans, _, _) in out.items()
                if ans is None or str(ans).startswith("FAILED")}
    for i, ans in sorted(failures.items()):
        print(f"{name}: agent {i} failed: {ans}", file=sys.stderr)
    failed = len(failures)
    return {"agents_per_min": rate, "failed": failed,
            "step_p50_ms": pielib.percentile(steps, 50) * 1000,
            "step_p99_ms": pielib.percentile(steps, 99) * 1000,
            "steps": len(steps), "generated": delta("pie_generated_tokens_total"),
            "computed": delta("pie_prompt_tokens_total"),
            "cached": delta("pie_prefix_cache_hit_tokens_total"),
            "preemptions": delta("pie_preemptions_total"), "out": out}


def window(duration):
    """The measured window of a `duration` stream, in seconds from its
    start: after the first third (the warm-up, while every slot runs its
    first agent), to the end."""
    return duration / 3, duration


def stream(url, target, n, a, start):
    """N slots, each running agents back to back (slot j: agents j, j + N,
    ...) for --duration seconds; the rate counts the agents that finished
    after the first third (the warm-up, while every slot runs its first
    agent) and before the end. Agents still running at the end are left to
    the server's shutdown. Returns the counted agents' records and the rate."""
    warm, end = (start + t for t in window(a.duration))
    finished = {}
    lock = threading.Lock()

    def slot(j):
        i = j
        while time.monotonic() < end:
            out = {}
            run_agent(target, url, i, a, out)
            if warm <= time.monotonic() <= end:
                with lock:
                    finished[i] = out[i]
            i += n

    for j in range(n):
        threading.Thread(target=slot, args=(j,), daemon=True).start()
    time.sleep(max(0.0, end - time.monotonic()))
    with lock:
        counted = dict(finished)
    return counted, len(counted) / (end - warm) * 60


def measure_shape(a):
    """The plain loop of the first eight agents (one per question) on an
    ample pool: each agent's (prompt, completion) tokens per step. They
    stand for the others, whose questions differ only in their tag."""
    n = len(QUESTIONS)
    store = tempfile.mkdtemp(prefix="pie-agent-bench-")
    with pielib.Procs() as procs:
        url = serve(procs, a, n * 64, store)
        once = argparse.Namespace(**vars(a))
        once.run, once.duration = "calibrate", 0
        out = variant(url, "plain", n, once)["out"]
        return [out[i][3] for i in range(n)]


def sim_overrides(usages):
    """`pie-sim --set` overrides for the `agent` workload of the measured
    shape: the first prompt (the workload's 16-token question and the rest
    as the shared protocol), the mean observation length, and the measured
    agents' step counts and mean output lengths, which the workload takes
    in turn."""
    mean = lambda xs: round(sum(xs) / len(xs))
    observations = [p - (q + c) for u in usages for (q, c), (p, _) in zip(u, u[1:])]
    outputs = [mean([c for _, c in u]) for u in usages]
    return {"system_len": mean([u[0][0] for u in usages]) - QUESTION_LEN,
            "question_len": QUESTION_LEN,
            "output_len": json.dumps(outputs, separators=(",", ":")),
            "observation_len": mean(observations) if observations else 0,
            "steps": json.dumps([len(u) for u in usages], separators=(",", ":"))}


def fit_profile(a, step_logs, profile):
    """A cost profile for pie-sim fitted to served steps (`pie bench
    --calibrate --from-steps`), written to `profile`; the fit's line."""
    args = [a.pie, "bench", "--calibrate", "--from-steps", *step_logs, "--out", profile]
    if a.model:
        args += ["--model", a.model]
    fit = run_tool(args)
    return next((ln.strip() for ln in fit.splitlines() if "step_ms =" in ln), "")


def run_tool(args):
    """Run a Pie tool; its stdout, or a failure naming it and the first
    lines of its error (the message, before any backtrace)."""
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        head = "\n".join(done.stderr.strip().splitlines()[:3])
        pielib.fail(f"{' '.join(args[:3])} exited {done.returncode}:\n{head}")
    return done.stdout


# Each way as the `agent` workload presents it to the scheduler: a session
# held between steps (the inferlet's context, or the loop's conversation),
# freed as the agent ends by the inferlet only; none for the plain loop.
SIM_WAYS = {"inferlet": {"keep_ms": KEEP_MS, "release_at_end": "true"},
            "session": {"keep_ms": KEEP_MS},
            "plain": {"keep_ms": 0}}


# With --duration, pie-sim's slots run this many agents each, one after
# another (its agent workload is a closed population): enough that every
# slot still runs at the end of the measured window (checked), which the
# simulated rate counts as the served one does.
SIM_AGENTS_PER_SLOT = 30


def simulate(a, profile, config, overrides, n, pages, way):
    """pie-sim's run of `n` agents of the measured shape on `pages` pages
    under every variant's `[runtime]` (`config`), in `way` (a `SIM_WAYS`
    key): one batch, or with --duration a stream of `SIM_AGENTS_PER_SLOT`
    agents a slot, its rate over `window`, in simulated time. Agents per
    minute, prompt tokens computed and cached."""
    steps = json.loads(overrides["steps"])
    agents = n * (SIM_AGENTS_PER_SLOT if a.duration else 1)
    each = [steps[i % len(steps)] for i in range(agents)]
    sets = {**overrides, **SIM_WAYS[way], "agents": n,
            "latency_min_ms": a.bounds[0], "latency_max_ms": a.bounds[1]}
    records = os.path.join(os.path.dirname(profile), f"records-{n}-{way}.jsonl")
    args = [os.path.join(os.path.dirname(a.pie), "pie-sim"), "run", "--workload", "agent",
            "--requests", str(sum(each)), "--profile", profile, "--kv-pages", str(pages), "--policy", "fair",
            "--worker-config", config]
    args += [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]
    if sets["keep_ms"]:
        args.append("--keep-session")
    if a.duration:
        args += ["--records", records]
    m = json.loads(run_tool(args))[0]
    if a.duration:
        rate = simulated_stream_rate(records, each, a.duration, f"{n} agents, {way}")
    else:
        rate = agents / m["sim_time_s"] * 60
    return {"agents_per_min": rate,
            "computed": m["prefill_tokens_computed"], "cached": m["prefix_hit_tokens"]}


def simulated_stream_rate(records, each, duration, what):
    """Agents per minute ending in the window of a `duration` stream, from
    pie-sim's per-request records (in workload order: agent `i`'s
    `each[i]` steps in turn); an agent ends as its last step does."""
    with open(records) as f:
        ends = [(r["arrival_ms"] + r["e2e_ms"]) / 1000 for r in map(json.loads, f)]
    agent_ends, at = [], 0
    for steps in each:
        agent_ends.append(ends[at + steps - 1])
        at += steps
    if max(agent_ends) < duration:
        pielib.fail(f"pie-sim ({what}) ran out of agents at {max(agent_ends):.0f} s, "
                    f"before the window's end at {duration:.0f} s: raise SIM_AGENTS_PER_SLOT")
    warm, end = window(duration)
    return sum(1 for t in agent_ends if warm <= t <= end) / (end - warm) * 60


def sim_rows(a, overrides, measured):
    """pie-sim beside each row's median rounds, way by way (agents per
    minute, simulated and measured, and their ratio), then the simulated
    inferlet's ratios to the other two ways; each row on a profile fitted
    to its own served steps."""
    stream = (f", {SIM_AGENTS_PER_SLOT} agents a slot, counted over the same window"
              if a.duration else "")
    store = tempfile.mkdtemp(prefix="pie-agent-bench-")
    fits = []
    for n, _, _, step_logs in measured:
        profile = os.path.join(store, f"profile-{n}.json")
        fits.append((n, profile, fit_profile(a, step_logs, profile)))
    print("\npie-sim's cost profiles, fitted to each row's served steps:\n")
    for n, _, fit in fits:
        print(f"- {n} agents: {fit}")
    print(f"\npie-sim on those profiles, the same shape, "
          f"pools and `[runtime]`{stream} (agents per minute: simulated, measured, their ratio; "
          "then prompt tokens computed / cached, simulated):\n")
    header = ["agents", "kv_pages"]
    for way in SIM_WAYS:
        header += [f"sim {way}", way, "sim / real", "sim computed / cached"]
    header += ["sim inferlet / sim session", "sim inferlet / sim plain"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    config = os.path.join(store, "config.toml")
    with open(config, "w") as f:
        f.write(runtime_config(a))
    rate = lambda x: f"{x:.1f}" if x else "-"
    ratio = lambda x, y: f"{x / y:.2f}" if x and y else "-"
    for (n, pages, results, _), (_, profile, _) in zip(measured, fits):
        cells = [n, pages]
        sim = {}
        for way in SIM_WAYS:
            s = simulate(a, profile, config, overrides, n, pages, way)
            sim[way] = s["agents_per_min"]
            real = results.get(way, {}).get("agents_per_min")
            cells += [rate(sim[way]), rate(real), ratio(sim[way], real),
                      f"{s['computed']} / {s['cached']}"]
        cells += [ratio(sim["inferlet"], sim["session"]), ratio(sim["inferlet"], sim["plain"])]
        print("| " + " | ".join(str(c) for c in cells) + " |")


def lower_middle(ordered):
    """The median of a sorted list (the lower middle of an even count)."""
    return ordered[(len(ordered) - 1) // 2]


def median_round(rounds):
    """The round whose agents per minute is the median."""
    return lower_middle(sorted(rounds, key=lambda r: r["agents_per_min"]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pie", default=os.path.join(ROOT, "target", "release", "pie"))
    ap.add_argument("--model")
    ap.add_argument("--agents", default="8,32,64")
    ap.add_argument("--max-steps", type=int, default=6)
    ap.add_argument("--latency-ms", default="100,2000")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--variants", default="inferlet,session,plain")
    ap.add_argument("--admission-wait-ms", type=int, default=0,
                    help="keep-session's admission_wait_ms, for every variant (0: off)")
    ap.add_argument("--pool-share", type=float, default=0.5,
                    help="each row's pool as a share of its agents' contexts at their longest")
    ap.add_argument("--kv-pages", type=int, help="every row's pool (overrides --pool-share)")
    ap.add_argument("--duration", type=float, default=0,
                    help="seconds of a steady stream of agents per run (0: one batch of N)")
    ap.add_argument("--sim", action="store_true",
                    help="also run pie-sim on each row, on a profile fitted to the row's "
                         "served steps (with --duration, a stream counted over the same window)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="runs of every variant per row, in turn; the median is reported")
    a = ap.parse_args()
    a.bounds = tuple(float(x) for x in a.latency_ms.split(","))
    unknown = [name for name in a.variants.split(",") if name not in TARGETS]
    if unknown:
        pielib.fail(f"--variants: no way named {', '.join(unknown)} (known: {', '.join(TARGETS)})")
    subprocess.run(["cargo", "build", "--release", "--quiet"], cwd=os.path.join(ROOT, "inferlets"),
                   check=True)
    usages = measure_shape(a)
    tokens = max(p + c for u in usages for p, c in u)
    longest = -(-tokens // PAGE_SIZE)
    overrides = sim_overrides(usages)
    shape = " ".join(f"--set {k}={v}" for k, v in overrides.items())
    print(f"A context at its longest: {tokens} tokens, {longest} pages of {PAGE_SIZE}.")
    print(f"The workload's shape for pie-sim: --workload agent {shape}\n")
    print("| agents | kv_pages | variant | agents/min | ratio to plain | step p50 / p99 ms "
          "| steps / tokens generated | prompt tokens computed / cached | preemptions | failed |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    measured = []
    for n in [int(x) for x in a.agents.split(",")]:
        pages = a.kv_pages or int(n * longest * a.pool_share)
        names = a.variants.split(",")
        rounds = {name: [] for name in names}
        step_logs = []
        for k in range(a.rounds):
            for name in names:
                store = tempfile.mkdtemp(prefix="pie-agent-bench-")
                step_log = os.path.join(store, "steps.jsonl") if a.sim else None
                step_logs += [step_log] if step_log else []
                with pielib.Procs() as procs:
                    url = serve(procs, a, pages, store, step_log)
                    a.run = f"{n}-{name}-{k}"
                    rounds[name].append(variant(url, name, n, a))
        results = {name: median_round(rs) for name, rs in rounds.items()}
        plain = results.get("plain", {}).get("agents_per_min")
        for name, r in results.items():
            ratio = f"{r['agents_per_min'] / plain:.2f}" if plain else "-"
            if plain and a.rounds > 1:
                each = [f"{x['agents_per_min'] / y['agents_per_min']:.2f}"
                        for x, y in zip(rounds[name], rounds["plain"])]
                ratio += f" ({', '.join(each)})"
            print(f"| {n} | {pages} | {name} | {r['agents_per_min']:.1f} | {ratio} | "
                  f"{r['step_p50_ms']:.0f} / {r['step_p99_ms']:.0f} | "
                  f"{r['steps']} / {r['generated']:.0f} | "
                  f"{r['computed']:.0f} / {r['cached']:.0f} | {r['preemptions']:.0f} | {r['failed']} |")
        if {"inferlet", "session"} <= set(names) and a.rounds > 1:
            each = sorted(x["agents_per_min"] / y["agents_per_min"]
                          for x, y in zip(rounds["inferlet"], rounds["session"]))
            print(f"|  |  | inferlet / session, each round (sorted): "
                  f"{', '.join(f'{r:.2f}' for r in each)}; median {lower_middle(each):.2f} "
                  f"| | | | | | | |")
        outs = [r["out"] for rs in rounds.values() for r in rs]
        common = sorted(set.intersection(*(set(o) for o in outs)))
        same = sum(1 for i in common if all(o[i][:2] == outs[0][i][:2] for o in outs))
        calls = sum(len(outs[0][i][0]) for i in common)
        print(f"|  |  | same calls and answer in every way: {same}/{len(common)} agents "
              f"({calls} tool calls) | | | | | | | |")
        measured.append((n, pages, results, step_logs))
    if a.sim:
        sim_rows(a, overrides, measured)


if __name__ == "__main__":
    main()
