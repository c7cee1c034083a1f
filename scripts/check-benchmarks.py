#!/usr/bin/env python3
"""Check BENCHMARKS.md's current table, the history under docs/benchmarks/ and README's figures.

usage: check-benchmarks.py [--repo DIR]

It prints one line per problem (`FILE:LINE: what`) and exits 1 when there is any:

  table    BENCHMARKS.md holds exactly one markdown table (a row starting with `|` followed by a
           delimiter row such as `|---|---|`, outside fenced code), whose header's columns are
           COLUMNS (`What | Figure | Command | Machine | Date, commit`; case and the spaces around
           a cell ignored). Every row has that many cells, none empty, and its last cell holds:
           a date YYYY-MM-DD that is a real date; a commit, 7 to 40 hex digits standing alone,
           that `git cat-file -e HASH^{commit}` finds; and a markdown link to a file
           docs/benchmarks/*.md that exists. The link's `#anchor` is optional; when it is there it
           must name an entry heading of that file by GitHub's slug (`## 2026-12-04, 6dc8ee4` is
           `#2026-12-04-6dc8ee4`; the second heading of the same text in one file gets `-1`, the
           third `-2`), and that entry's date and commit must be the row's.
  history  docs/benchmarks/ holds at least one .md file. In each, every `##` heading outside
           fenced code is exactly `## YYYY-MM-DD, HASH` (an entry) with a real date and a commit
           git finds; the first non-blank line after it is a bold one-line title (`**...**`); the
           file has at least one entry; and the entries are newest first (each date on or before
           the date of the entry above it; the same date may repeat). `#` and `###` and deeper
           headings are free.
  readme   README.md has a section headed `## How fast` (the heading may go on: `## How fast is
           it?`), running to the next `#` or `##` heading, which holds a markdown table; every
           figure in that section appears verbatim in BENCHMARKS.md's table. Without the section
           the problem is "README has no How fast section".

A figure is a number standing on its own, with an optional unit:
  - the number: digits with optional thousands groups and decimals (`2,000`, `189.5`,
    `25,708,373,377`), optionally signed (`-0.6`, `+1.8`), or a range of two such numbers joined
    by `-` or an en dash (`0.94-1.01`), or a date (`2026-12-04`);
  - the unit: `x`, `×` or `%` written against the number (`1.86x`, `73.5%`), or one of UNITS
    against it or after one space (`0.45 ms`, `189.5 tok/s`, `30.23 GB/s`, `1B`), ending at a
    word boundary (`8 sequences` is the figure `8`);
  - standing on its own: the character before it is not a letter, digit, `_`, `.`, `,` or a
    hyphen or dash, and it
    is not followed by a letter, digit or `_`, nor by `.` or `,` and a digit. So the digits of a
    word (`Q4_K`, `pp512`, `AVX2`, `Qwen3`, a hash such as `6dc8ee4`), of a version (`0.3.2`)
    or after a hyphen (`Llama-3.2-1B`, `tiny-qwen2`) are not figures.
Not read for figures: fenced code blocks, inline code spans (commands, paths, flags), link
targets (the `(...)` of `[text](target)`, so `[1.86x](docs/x.md#2026-12-04-6dc8ee4)` gives only
`1.86x`), bare `http(s)://` addresses, HTML comments and the section's heading line.
A figure is found in the table when the table's text (whitespace runs read as one space) holds
it with the same boundaries: no letter, digit, `_`, `.` or `,` right before it, and after it no
letter, digit or `_`, nor `.` or `,` and a digit (so `1.8x` is not found inside `11.8x`, nor `2`
inside `2,000`).

Commits are not checked (a note on stderr says so) when DIR is a shallow clone; when DIR is not
a git checkout at all, that is a problem.
"""
import argparse
import datetime
import os
import re
import subprocess
import sys

COLUMNS = ("what", "figure", "command", "machine", "date, commit")
TABLE_FILE = "BENCHMARKS.md"
HISTORY_DIR = os.path.join("docs", "benchmarks")
README = "README.md"

UNITS = (
    "agents/min", "tokens/s", "GMAC/s", "GiB/s", "GB/s", "MB/s", "req/s", "tok/s",
    "GiB", "MiB", "KiB", "GB", "MB", "KB", "kB", "B",
    "min", "ms", "us", "µs", "ns", "s",
)
_NUM = r"[-+−]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_PLAIN = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_UNIT = "|".join(re.escape(u) for u in sorted(UNITS, key=len, reverse=True))
FIGURE = re.compile(
    r"(?<![\w.,\-–−])"
    r"(?:\d{4}-\d{2}-\d{2}"
    r"|" + _NUM + r"(?:[-–]" + _PLAIN + r")?"
    r"(?:[x×%]|\s?(?:" + _UNIT + r")(?![\w/]))?"
    r")"
    r"(?![\w]|[.,]\d)"
)
DATE = re.compile(r"(?<![\d-])(\d{4}-\d{2}-\d{2})(?![\d-])")
HASH = re.compile(r"(?<![\w-])([0-9a-f]{7,40})(?![\w-])")
ENTRY = re.compile(r"^## (\d{4}-\d{2}-\d{2}), ([0-9a-f]{7,40})$")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
DELIM = re.compile(r"^\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$")
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]*)(?:\s+\"[^\"]*\")?\)")
CODE = re.compile(r"(`+)(.+?)\1")
URL = re.compile(r"https?://\S+")
COMMENT = re.compile(r"<!--.*?-->")
HOW_FAST = re.compile(r"^##\s+How fast\b", re.IGNORECASE)


def read_lines(path):
    with open(path, encoding="utf-8") as f:
        return f.read().split("\n")


def unfenced(lines):
    """(index, line) of the lines outside fenced code blocks (the fences themselves left out)."""
    fence = None
    for i, line in enumerate(lines):
        s = line.strip()
        m = re.match(r"^(`{3,}|~{3,})", s)
        if m:
            if fence is None:
                fence = m.group(1)[0] * len(m.group(1))
                continue
            if s.startswith(fence) and not s[len(fence):].strip():
                fence = None
                continue
        if fence is None:
            yield i, line


def split_cells(line):
    """The cells of a table row: `|` splits, except escaped (`\\|`) or inside a code span."""
    s = line.strip()
    if s.startswith("|"):
        s = s[1:]
    if s.endswith("|") and not s.endswith("\\|"):
        s = s[:-1]
    cells, cur, code, i = [], [], False, 0
    while i < len(s):
        c = s[i]
        if c == "\\" and i + 1 < len(s) and s[i + 1] == "|":
            cur.append("|")
            i += 2
            continue
        if c == "`":
            code = not code
        if c == "|" and not code:
            cells.append("".join(cur).strip())
            cur = []
        else:
            cur.append(c)
        i += 1
    cells.append("".join(cur).strip())
    return cells


def tables(lines):
    """Markdown tables outside fenced code: a list of [(index, line), ...], header row first."""
    body = list(unfenced(lines))
    out, k = [], 0
    while k < len(body):
        i, line = body[k]
        if (line.strip().startswith("|") and k + 1 < len(body) and body[k + 1][0] == i + 1
                and DELIM.match(body[k + 1][1].strip())):
            rows = [(i, line)]
            k += 2
            last = i + 1
            while (k < len(body) and body[k][1].strip().startswith("|")
                   and body[k][0] == last + 1):
                rows.append(body[k])
                last = body[k][0]
                k += 1
            out.append(rows)
            continue
        k += 1
    return out


def slug(text):
    """GitHub's anchor for a heading's text (without the duplicate suffix)."""
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def strip_for_figures(line):
    line = COMMENT.sub(" ", line)
    line = CODE.sub(" ", line)
    line = LINK.sub(lambda m: m.group(1), line)
    return URL.sub(" ", line)


def figures(text):
    """The figures of one line of prose (see the module's docstring)."""
    return [m.group(0) for m in FIGURE.finditer(strip_for_figures(text))]


def found_in(figure, text):
    pat = r"(?<![\w.,])" + re.escape(figure) + r"(?![\w]|[.,]\d)"
    return re.search(pat, text) is not None


def real_date(s):
    try:
        datetime.date.fromisoformat(s)
        return True
    except ValueError:
        return False


class Commits:
    """`git cat-file -e` answers, cached; `skip` when commits cannot or need not be checked."""

    def __init__(self, repo, problems):
        self.repo, self.cache, self.skip = repo, {}, False
        git = lambda *a: subprocess.run(["git", "-C", repo, *a], capture_output=True, text=True)
        if git("rev-parse", "--git-dir").returncode != 0:
            problems.append(f"{repo}: not a git repository, so no commit can be checked")
            self.skip = True
        elif git("rev-parse", "--is-shallow-repository").stdout.strip() == "true":
            print("check-benchmarks: a shallow clone; commits not checked", file=sys.stderr)
            self.skip = True

    def exists(self, h):
        if self.skip:
            return True
        if h not in self.cache:
            r = subprocess.run(["git", "-C", self.repo, "cat-file", "-e", h + "^{commit}"],
                               capture_output=True)
            self.cache[h] = r.returncode == 0
        return self.cache[h]


def same_commit(a, b):
    return a.startswith(b) or b.startswith(a)


def read_history(repo, commits, problems):
    """Check docs/benchmarks/*.md; return {relative path: {anchor: (date, hash)}}."""
    hdir = os.path.join(repo, HISTORY_DIR)
    names = sorted(n for n in os.listdir(hdir) if n.endswith(".md")) if os.path.isdir(hdir) else []
    if not names:
        problems.append(f"{HISTORY_DIR}/: no .md file (the history of BENCHMARKS.md lives there)")
    anchors = {}
    for name in names:
        rel = f"{HISTORY_DIR}/{name}".replace(os.sep, "/")
        lines = read_lines(os.path.join(hdir, name))
        seen, entries, prev = {}, {}, None
        body = list(unfenced(lines))
        for k, (i, line) in enumerate(body):
            h = HEADING.match(line)
            if not h:
                continue
            base = slug(h.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            anchor = base if n == 0 else f"{base}-{n}"
            if len(h.group(1)) != 2:
                continue
            where = f"{rel}:{i + 1}"
            m = ENTRY.match(line.rstrip())
            if not m:
                problems.append(f"{where}: entry heading {line.strip()!r} is not "
                                f"'## YYYY-MM-DD, <commit>'")
                continue
            date, commit = m.groups()
            if not real_date(date):
                problems.append(f"{where}: {date} is not a real date")
            if not commits.exists(commit):
                problems.append(f"{where}: commit {commit} not found in the repository")
            nxt = next((t for _, t in body[k + 1:] if t.strip()), "")
            t = nxt.strip()
            if not (len(t) > 4 and t.startswith("**") and t.endswith("**")):
                problems.append(f"{where}: the entry's first line is not a bold one-line title "
                                f"(**...**)")
            if prev is not None and date > prev:
                problems.append(f"{where}: entry of {date} below one of {prev}: entries go "
                                f"newest first")
            prev = date
            entries[anchor] = (date, commit)
        if not entries:
            problems.append(f"{rel}: no entry ('## YYYY-MM-DD, <commit>')")
        anchors[rel] = entries
    return anchors


def check_table(repo, commits, anchors, problems):
    """Check BENCHMARKS.md's table; return its text (None when there is no one table)."""
    path = os.path.join(repo, TABLE_FILE)
    if not os.path.isfile(path):
        problems.append(f"{TABLE_FILE}: missing")
        return None
    lines = read_lines(path)
    found = tables(lines)
    if len(found) != 1:
        where = ", ".join(str(t[0][0] + 1) for t in found) or "none"
        problems.append(f"{TABLE_FILE}: {len(found)} tables (lines {where}); it holds exactly one, "
                        f"the current figures")
        if not found:
            return None
    rows = found[0]
    head_i, head = rows[0]
    cols = [c.strip().lower() for c in split_cells(head)]
    if tuple(cols) != COLUMNS:
        problems.append(f"{TABLE_FILE}:{head_i + 1}: the table's columns are {split_cells(head)}, "
                        f"not {[c for c in COLUMNS]}")
        return "\n".join(l for _, l in rows)
    for i, line in rows[1:]:
        where = f"{TABLE_FILE}:{i + 1}"
        cells = split_cells(line)
        if len(cells) != len(COLUMNS):
            problems.append(f"{where}: {len(cells)} cells, not {len(COLUMNS)}")
            continue
        for name, cell in zip(COLUMNS, cells):
            if not cell:
                problems.append(f"{where}: the {name!r} cell is empty")
        last = cells[-1]
        links = LINK.findall(last)
        text = LINK.sub(lambda m: m.group(1), last)
        d = DATE.search(text)
        if not d:
            problems.append(f"{where}: no date (YYYY-MM-DD) in {last!r}")
        elif not real_date(d.group(1)):
            problems.append(f"{where}: {d.group(1)} is not a real date")
        h = HASH.search(text)
        if not h:
            problems.append(f"{where}: no commit hash in {last!r}")
        elif not commits.exists(h.group(1)):
            problems.append(f"{where}: commit {h.group(1)} not found in the repository")
        targets = [t for _, t in links]
        hist = [t for t in targets
                if os.path.normpath(t.split("#")[0]).replace(os.sep, "/").startswith(
                    HISTORY_DIR.replace(os.sep, "/") + "/")]
        if not hist:
            problems.append(f"{where}: no link to its entry under {HISTORY_DIR}/")
            continue
        for t in hist:
            file_part, _, anchor = t.partition("#")
            rel = os.path.normpath(file_part).replace(os.sep, "/")
            if not rel.endswith(".md") or not os.path.isfile(os.path.join(repo, rel)):
                problems.append(f"{where}: link {t!r}: no such file")
                continue
            if not anchor:
                continue
            entry = anchors.get(rel, {}).get(anchor)
            if entry is None:
                problems.append(f"{where}: link {t!r}: #{anchor} names no entry of {rel}")
                continue
            if d and h and (entry[0] != d.group(1) or not same_commit(entry[1], h.group(1))):
                problems.append(f"{where}: the row says {d.group(1)}, {h.group(1)} but its entry "
                                f"#{anchor} is {entry[0]}, {entry[1]}")
    return "\n".join(l for _, l in rows)


def check_readme(repo, table_text, problems):
    path = os.path.join(repo, README)
    if not os.path.isfile(path):
        problems.append(f"{README}: missing, so README has no How fast section")
        return
    lines = read_lines(path)
    body = list(unfenced(lines))
    start = next((k for k, (_, l) in enumerate(body) if HOW_FAST.match(l)), None)
    if start is None:
        problems.append(f"{README}: README has no How fast section ('## How fast' with a table "
                        f"of figures from {TABLE_FILE})")
        return
    section = []
    for i, line in body[start + 1:]:
        if re.match(r"^#{1,2}\s", line):
            break
        section.append((i, line))
    if not tables([l for _, l in section]):
        problems.append(f"{README}:{body[start][0] + 1}: the How fast section has no table")
    if table_text is None:
        return
    haystack = re.sub(r"\s+", " ", table_text)
    for i, line in section:
        for fig in dict.fromkeys(figures(line)):
            if not found_in(re.sub(r"\s+", " ", fig), haystack):
                problems.append(f"{README}:{i + 1}: figure {fig!r} is not in {TABLE_FILE}'s table")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repo", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    args = ap.parse_args(argv)
    repo = os.path.abspath(args.repo)
    problems = []
    commits = Commits(repo, problems)
    anchors = read_history(repo, commits, problems)
    table_text = check_table(repo, commits, anchors, problems)
    check_readme(repo, table_text, problems)
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
