#!/usr/bin/env python3
"""Run the README's tour: its ```sh tour blocks, in order, as one bash script.

usage: readme-tour.py [--readme README.md] [--bin-dir target/release]
                      [--timeout 900] [--list]

The blocks run in a fresh, empty temporary directory with the absolute
--bin-dir first on PATH (HOME and PIE_HOME as they are, so the default model
cached in ~/.cache/pie is used), under `set -euo pipefail`, each preceded by
an echo of its number and first line. The script runs in its own process
group: whatever it started (servers in the background included) is killed
when it ends, fails or times out, and the temporary directory is removed.
Exits 0 when every block passed, else 1 naming the failing block.
--list prints the blocks without running them.
"""
import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FENCE = re.compile(r"^(`{3,}|~{3,})\s*(.*?)\s*$")


class Block:
    def __init__(self, number, line, text):
        self.number = number  # 1-based, in README order
        self.line = line  # the fence line's number in the README
        self.text = text

    def first_line(self):
        for line in self.text.splitlines():
            if line.strip():
                return line.strip()
        return ""


def extract(markdown):
    """The ```sh tour blocks of `markdown`, in order. Other fenced blocks
    (untagged, ```sh, ```python, ...) are skipped whole, so a tour fence
    quoted inside one of them does not count."""
    blocks = []
    lines = markdown.splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info = m.group(1), m.group(2)
        start = i
        body = []
        i += 1
        while i < len(lines):
            close = FENCE.match(lines[i])
            if close and close.group(2) == "" and close.group(1)[0] == fence[0] \
                    and len(close.group(1)) >= len(fence):
                break
            body.append(lines[i])
            i += 1
        i += 1  # past the closing fence (or the end of an unclosed block)
        if info.split() == ["sh", "tour"]:
            blocks.append(Block(len(blocks) + 1, start + 1, "\n".join(body) + "\n"))
    return blocks


def script(blocks, readme_name, state_file):
    """One bash script running every block in order; before each, the block's
    number goes to `state_file` so that a failure (or a timeout) is named."""
    out = ["set -euo pipefail", ""]
    for b in blocks:
        header = f"== tour block {b.number} ({readme_name}:{b.line}): {b.first_line()}"
        out.append(f"printf '%s\\n' {b.number} > {shell_quote(state_file)}")
        # A blank line first: a block's last output may end without one.
        out.append(f"printf '\\n%s\\n' {shell_quote(header)}")
        out.append(b.text.rstrip("\n"))
        out.append("")
    out.append(f"printf '%s\\n' done > {shell_quote(state_file)}")
    out.append(f"printf '\\n%s\\n' {shell_quote(f'== tour: all {len(blocks)} blocks passed')}")
    return "\n".join(out) + "\n"


def shell_quote(s):
    return "'" + s.replace("'", "'\"'\"'") + "'"


def group_alive(pgid):
    """Whether any process of the group is still running (zombies left
    unreaped by an init that does not reap count as gone)."""
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    if not os.path.isdir("/proc"):
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
    return False


def kill_group(pgid, grace_s=10.0):
    """SIGTERM to the whole group (servers drain and exit), then SIGKILL to
    whatever is left after `grace_s`."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not group_alive(pgid):
                return
            time.sleep(0.1)


def run(blocks, readme_name, bin_dir, timeout_s):
    """Run the tour; returns (exit status, failing block or None, timed out)."""
    work = tempfile.mkdtemp(prefix="pie-tour-")
    aside = tempfile.mkdtemp(prefix="pie-tour-script-")
    state_file = os.path.join(aside, "block")
    script_file = os.path.join(aside, "tour.sh")
    with open(script_file, "w") as f:
        f.write(script(blocks, readme_name, state_file))
    env = dict(os.environ)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    proc = None
    timed_out = False
    try:
        proc = subprocess.Popen(["bash", script_file], cwd=work, env=env, start_new_session=True)
        try:
            status = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            status = 124
    except KeyboardInterrupt:
        status = 130
    finally:
        if proc is not None:
            kill_group(proc.pid)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        try:
            with open(state_file) as f:
                state = f.read().strip()
        except OSError:
            state = ""
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(aside, ignore_errors=True)
    failing = None
    if status != 0 and state.isdigit():
        failing = blocks[int(state) - 1]
    return status, failing, timed_out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--readme", default=os.path.join(REPO, "README.md"))
    ap.add_argument("--bin-dir", default=os.path.join(REPO, "target", "release"),
                    help="put first on PATH (default: target/release)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds for the whole tour")
    ap.add_argument("--list", action="store_true", help="print the blocks, run nothing")
    args = ap.parse_args(argv)

    with open(args.readme) as f:
        blocks = extract(f.read())
    name = os.path.basename(args.readme)
    if not blocks:
        print(f"readme-tour: no ```sh tour blocks in {args.readme}", file=sys.stderr)
        return 1
    if args.list:
        for b in blocks:
            print(f"== tour block {b.number} ({name}:{b.line})")
            print(b.text, end="")
        return 0

    bin_dir = os.path.abspath(args.bin_dir)
    if not os.path.isdir(bin_dir):
        print(f"readme-tour: --bin-dir {bin_dir} is not a directory", file=sys.stderr)
        return 1
    started = time.monotonic()
    status, failing, timed_out = run(blocks, name, bin_dir, args.timeout)
    wall = time.monotonic() - started
    if status == 0:
        print(f"readme-tour: {len(blocks)} blocks passed in {wall:.1f} s")
        return 0
    what = f"timed out after {args.timeout:g} s" if timed_out else f"failed (exit status {status})"
    if failing is not None:
        where = f"block {failing.number} ({name}:{failing.line}, `{failing.first_line()}`)"
    else:
        where = "the tour"
    print(f"readme-tour: {where} {what}, after {wall:.1f} s", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
