#!/usr/bin/env python3
"""What the scripts in `scripts/` share: processes, HTTP, health waits,
Prometheus text and percentiles. Python standard library only.

Import it from a script beside it, however the script was started
(`python3 scripts/X.py`, `scripts/X.py`, from a shell script):

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import pielib

Processes: `Procs().spawn(args, prefix)` starts a program (the project's
binaries with `--port 0` in `args`), reads the URL from its first stdout line
(`pie: listening on http://...`, `pie-controller: listening on http://...`)
and drains its stdout and stderr, keeping the last lines for error messages.
Every process it starts is killed when `stop_all()` or the `with` block ends,
and at the latest when the interpreter exits, also on an exception, Ctrl-C or
SIGTERM.

Percentiles: one rule for the project, nearest rank, as Rust's
`Percentiles::of` (`crates/pie-sim/src/metrics.rs` today): values sorted ascending, the p-th percentile
is the value at 1-based rank ceil(p / 100 * n) clamped to [1, n]; the mean is
the arithmetic mean (summed in sorted order); no values give zeros.

Prometheus: `prom_sum(text, name)` is `crates/pie-client/src/prom.rs::sum`:
the sum of metric `name` over its label sets, a `name` with labels
(`x_total{direction="in"}`) selecting that one series, a longer name sharing
the prefix not matched, `None` when absent.

CLI (for a cross-check against the Rust rules):
    python3 scripts/pielib.py percentiles 3 1 2   # {"p50": 2.0, "p90": 3.0, "p99": 3.0, "mean": 2.0}
    python3 scripts/pielib.py prom-sum NAME < metrics.txt   # the sum, or null
"""
import atexit
import http.client
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse


def fail(msg):
    """Exit 1 with `SCRIPT: FAIL: msg` (SCRIPT: the running script's name)."""
    name = os.path.basename(sys.argv[0] or "pielib")
    raise SystemExit(f"{name.removesuffix('.py')}: FAIL: {msg}")


# ---------------------------------------------------------------------------
# percentiles

def percentile(values, p):
    """Nearest-rank p-th percentile (0 < p <= 100) of `values`; 0.0 when empty."""
    s = sorted(values)
    if not s:
        return 0.0
    rank = math.ceil(p / 100 * len(s))
    return s[min(max(rank, 1), len(s)) - 1]


def percentiles(values):
    """{"p50", "p90", "p99", "mean"} of `values` (zeros when empty), as
    pie-sim's `Percentiles::of`."""
    s = sorted(values)
    if not s:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "mean": 0.0}
    total = s[0]
    for v in s[1:]:  # in order, as Rust's `iter().sum()` (Python 3.12's sum() compensates)
        total += v
    return {"p50": percentile(s, 50), "p90": percentile(s, 90), "p99": percentile(s, 99),
            "mean": total / len(s)}


# ---------------------------------------------------------------------------
# Prometheus text exposition

def _lines(text):
    """Lines as Rust's `str::lines` splits them (at \\n, one \\r before it dropped)."""
    return [line[:-1] if line.endswith("\r") else line for line in text.split("\n")]


def prom_sum(text, name, default=None):
    """The sum of every sample of metric `name` (all label sets; a `name` with
    labels selects that series), or `default` when the text has none."""
    found = None
    for line in _lines(text):
        if line.startswith("#") or not line.startswith(name):
            continue
        rest = line[len(name):]
        if rest.startswith("{"):
            value = rest.rpartition("}")[2] if "}" in rest else None
        elif rest.startswith(" "):
            value = rest
        else:
            value = None  # a longer name sharing this prefix
        try:
            token = value.split()[0]
            v = float(token) if "_" not in token else None  # Rust's f64 parse takes no `_`
        except (AttributeError, IndexError, ValueError):
            continue
        if v is None:
            continue
        found = (found or 0.0) + v
    return default if found is None else found


def prom_delta(before, after, name):
    """`prom_sum(after) - prom_sum(before)`, a scrape without the metric
    counting as 0 (a labelled series appears at its first increment)."""
    return prom_sum(after, name, 0.0) - prom_sum(before, name, 0.0)


_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')


def prom_samples(text, name=None):
    """Every sample as (name, {label: value}, value); of metric `name` only
    (exactly that name, any labels) when given."""
    out = []
    for line in _lines(text):
        if not line.strip() or line.startswith("#"):
            continue
        head, brace, rest = line.partition("{")
        if brace:
            body, _, tail = rest.rpartition("}")
            labels = {k: re.sub(r"\\(.)", lambda m: "\n" if m[1] == "n" else m[1], v)
                      for k, v in _LABEL.findall(body)}
            metric, fields = head.strip(), tail.split()
        else:
            metric, *fields = line.split()
            labels = {}
        if (name is None or metric == name) and fields:
            try:
                out.append((metric, labels, float(fields[0])))
            except ValueError:
                pass
    return out


# ---------------------------------------------------------------------------
# HTTP

class Reply:
    """One HTTP answer: status, body text, headers (lower-case names)."""

    def __init__(self, status, text, headers):
        self.status, self.text, self.headers = status, text, headers

    def json(self):
        return json.loads(self.text)

    def __repr__(self):
        return f"Reply({self.status}, {self.text[:200]!r})"


class HttpError(RuntimeError):
    """A reply other than 200 where one was required."""

    def __init__(self, method, url, reply):
        super().__init__(f"{method} {url}: HTTP {reply.status}: {reply.text[:300]}")
        self.reply = reply


def connect(url, timeout=600):
    """An `http.client.HTTPConnection` to the host and port of `url`."""
    u = urllib.parse.urlsplit(url)
    return http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)


def request(url, method, path, body=None, timeout=600, key=None, headers=None):
    """`method` `url``path` with `body` as JSON; the Reply, whatever its status."""
    h = {"content-type": "application/json"}
    if key:
        h["authorization"] = f"Bearer {key}"
    h.update(headers or {})
    c = connect(url, timeout)
    try:
        c.request(method, path, None if body is None else json.dumps(body), h)
        r = c.getresponse()
        text = r.read().decode(errors="replace")
        return Reply(r.status, text, {k.lower(): v for k, v in r.getheaders()})
    finally:
        c.close()


def get_text(url, path, timeout=600, key=None):
    """The body of GET `url``path`; HttpError unless 200."""
    r = request(url, "GET", path, timeout=timeout, key=key)
    if r.status != 200:
        raise HttpError("GET", url + path, r)
    return r.text


def scrape(url, key=None, timeout=600):
    """The Prometheus text of `url`/metrics; HttpError unless 200."""
    return get_text(url, "/metrics", timeout, key)


def get_json(url, path, timeout=600, key=None):
    """GET `url``path`, parsed; HttpError unless 200."""
    return json.loads(get_text(url, path, timeout, key))


def post_json(url, path, body, timeout=600, key=None):
    """POST `body` to `url``path`; the answer parsed; HttpError unless 200."""
    r = request(url, "POST", path, body, timeout=timeout, key=key)
    if r.status != 200:
        raise HttpError("POST", url + path, r)
    return r.json()


def wait_healthy(url, timeout, path="/health", workers=None, proc=None, what=None):
    """Until GET `url``path` answers 200, or with `workers`=N until a
    controller's `/v1/cluster` lists at least N healthy workers; the last
    Reply. fail()s after `timeout` s, or at once when `proc` has exited."""
    what = what or url
    if workers is not None:
        path = "/v1/cluster"
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            fail(f"{what} exited ({proc.returncode}): {proc.tail_text()}")
        try:
            r = request(url, "GET", path, timeout=5)
            last = r
            if r.status == 200 and (workers is None or sum(
                    1 for w in r.json().get("workers", []) if w.get("healthy")) >= workers):
                return r
        except (OSError, http.client.HTTPException, ValueError) as e:
            last = e
        time.sleep(0.1)
    fail(f"{what} never became healthy (GET {path}; last: {last!r})")


# ---------------------------------------------------------------------------
# processes

_LIVE = []  # every process spawned and not yet reaped, for the exit hook
_LIVE_LOCK = threading.Lock()


def _kill(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        with _LIVE_LOCK:
            if p in _LIVE:
                _LIVE.remove(p)


def _kill_live():
    with _LIVE_LOCK:
        procs = list(_LIVE)
    _kill(procs)


atexit.register(_kill_live)


def _exit_on_sigterm():
    """SIGTERM raises SystemExit (so `finally` blocks and the exit hook run),
    where nothing else handles it; only the main thread can set a handler."""
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL):
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


class Proc(subprocess.Popen):
    """A spawned process: a Popen with the last lines of its output."""

    def tail_text(self, n=10):
        time.sleep(0.05)  # let the drain threads take the last lines
        return "".join(self.tail[-n:]).strip()


def _drain(stream, tail):
    with stream:
        for line in stream:
            tail.append(line)
            del tail[:-50]


def free_port():
    """A free TCP port on 127.0.0.1, for a program without `--port 0` (SGLang's
    router); the project's binaries take `--port 0` and print their URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Procs:
    """Processes started by a script. `stop_all()`, or the end of a `with`
    block, kills them; the interpreter's exit kills whatever is left."""

    def __init__(self):
        self.procs = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop_all()

    def spawn(self, args, prefix=None, name=None, **popen):
        """Start `args`; with `prefix` (`"pie: listening on "`), its first
        stdout line must start with it and the rest is returned as the URL.
        Returns (proc, url or None); proc.tail holds its last 50 output lines."""
        _exit_on_sigterm()
        name = name or os.path.basename(str(args[0]))
        proc = Proc(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                    errors="replace", **popen)
        with _LIVE_LOCK:
            _LIVE.append(proc)
        self.procs.append(proc)
        proc.tail = []
        threading.Thread(target=_drain, args=(proc.stderr, proc.tail), daemon=True).start()
        url = None
        first = proc.stdout.readline() if prefix is not None else None
        threading.Thread(target=_drain, args=(proc.stdout, proc.tail), daemon=True).start()
        if prefix is not None:
            if not first.startswith(prefix):
                if not first:  # it exited (or closed stdout) before its first line
                    try:
                        proc.wait(timeout=1)
                    except subprocess.TimeoutExpired:
                        pass
                fail(f"{name}: unexpected first line {first.strip()!r} from "
                     f"{' '.join(map(str, args))} (exit status {proc.poll()}; "
                     f"its last output: {proc.tail_text()!r})")
            url = first.strip()[len(prefix):]
        return proc, url

    def stop_all(self):
        _kill(self.procs)
        self.procs = []


# ---------------------------------------------------------------------------
# CLI

def main(argv):
    if len(argv) >= 1 and argv[0] == "percentiles":
        print(json.dumps(percentiles([float(x) for x in argv[1:]])))
        return 0
    if len(argv) == 2 and argv[0] == "prom-sum":
        print(json.dumps(prom_sum(sys.stdin.read(), argv[1])))
        return 0
    usage = ("usage: pielib.py percentiles VALUE...   (JSON p50, p90, p99, mean; nearest rank)\n"
             "       pielib.py prom-sum NAME < METRICS  (JSON sum over label sets, or null)")
    if argv[:1] in (["-h"], ["--help"]):
        print(usage)
        return 0
    print(usage, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
