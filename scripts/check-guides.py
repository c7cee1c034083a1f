#!/usr/bin/env python3
"""Check the contributor guides, the commit subjects and the code map's links.

usage: check-guides.py [--repo DIR] [--since COMMIT]

It prints one line per problem and exits 1 when there is any:

  path     a path CONTRIBUTING.md or docs/contributing/*.md names does not exist, or points
           outside the repository. Checked: (1) every inline code span (`...`, outside fenced
           code blocks) that reads as a path, taken relative to the repository root; (2) every
           markdown link or image target, taken relative to the file that holds it (`http:`,
           `https:`, `mailto:` and `#anchor` targets are not checked). A code span reads as a
           path when it holds no whitespace and contains a `/` or ends in one of EXTENSIONS
           (`ARCHITECTURE.md`, `crates/pie-kv/src/disk.rs`, `docs/contributing/`), except that
           these are skipped as not naming one file: a template or glob (any of `< > * { } [ ]
           ? $ |`, or `...`: `crates/pie-policy/src/<name>.rs`), a name with `:` (a URL, a WIT
           interface `pie:inferlet/shaping`, a Rust path, `file:line`), one starting with `/`
           (an HTTP route `/v1/completions`) or `~`, a flag (`--arch`) and anything with `=`.
           So write a cargo feature as `fault-injection`, not `pie-worker/fault-injection`,
           and alternatives as "`a` or `b`", not `a/b`. A `#fragment` is ignored. Every
           docs/contributing/*.md must also be linked from CONTRIBUTING.md.
  commit   a commit subject in `git log SINCE..HEAD` is over 72 characters (git's subject: the
           message's first paragraph). Skipped, saying so on stderr, when REPO is no git
           checkout or SINCE is not an ancestor of HEAD (a shallow clone).
  outside  ARCHITECTURE.md links outside the repository: any `http://` or `https://` text; a
           markdown link target with a scheme (`file:`, `mailto:`), or a relative one that
           leaves the repository root; a code span that is a relative path leaving the root
           (`../shared/x.md`; resolved from crates/NAME/src under a `## NAME` crate section, as
           check-architecture.py reads them, else from the root); an absolute path whose top
           directory exists on this machine (`/work/...`, `/tmp/...`; a route like `/health`
           names none).

The self-test is scripts/test_check_guides.py.
"""
import argparse
import glob
import os
import re
import subprocess
import sys

MAX_SUBJECT = 72
DEFAULT_SINCE = "d79d21d"
EXTENSIONS = (".rs", ".md", ".toml", ".wit", ".py", ".sh", ".lock", ".yml", ".yaml")
TEMPLATE_CHARS = set("<>*{}[]?$|")

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s.*)?$", re.M)
URL = re.compile(r"https?://[^\s)>`\]]*", re.I)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def blank_fences(text):
    """The text with fenced code blocks' lines blanked (offsets and line numbers kept)."""
    out, fence = [], None
    for line in text.split("\n"):
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
            out.append(" " * len(line))
        elif fence is not None:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not line.strip()[len(m.group(1)):]:
                fence = None
            out.append(" " * len(line))
        else:
            out.append(line)
    return "\n".join(out)


def line_of(text, offset):
    return text.count("\n", 0, offset) + 1


def code_spans(text):
    """(offset, line, content) of each inline code span outside fenced blocks."""
    body = blank_fences(text)
    return [(m.start(), line_of(body, m.start()), m.group(2)) for m in CODE_SPAN.finditer(body)]


def link_targets(text):
    """(line, target) of each markdown link, image and reference definition outside code."""
    body = blank_fences(text)
    bare = CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), body)
    found = [(line_of(bare, m.start()), m.group(1)) for m in LINK.finditer(bare)]
    found += [(line_of(bare, m.start()), m.group(1)) for m in REF_DEF.finditer(bare)]
    return sorted(found)


def path_of_span(span):
    """The path a code span names (fragment dropped), or None when it names none."""
    s = span
    if not s or any(c.isspace() for c in s):
        return None
    if TEMPLATE_CHARS & set(s) or "..." in s or "\u2026" in s:
        return None
    if ":" in s or "=" in s or s[0] in "/~-":
        return None
    s = s.split("#", 1)[0]
    if not s:
        return None
    if "/" in s or s.endswith(EXTENSIONS):
        return s
    return None


def inside(root, path):
    root = os.path.realpath(root)
    full = os.path.normpath(os.path.join(root, path))
    return full == root or full.startswith(root + os.sep)


def check_exists(root, base, path):
    """A problem text, or None: `path` from `base` (inside `root`) must exist inside it."""
    rel = os.path.normpath(os.path.join(base, path))
    if not inside(root, rel):
        return f"`{path}` points outside the repository"
    full = os.path.join(root, rel)
    if path.endswith("/") and not os.path.isdir(full):
        return f"`{path}` is no directory"
    if not os.path.exists(full):
        return f"`{path}` does not exist"
    return None


def guide_files(root):
    files = []
    if os.path.isfile(os.path.join(root, "CONTRIBUTING.md")):
        files.append("CONTRIBUTING.md")
    guides = sorted(glob.glob(os.path.join(root, "docs", "contributing", "*.md")))
    files += [os.path.relpath(g, root) for g in guides]
    return files


def check_paths(root):
    problems = []
    if not os.path.isfile(os.path.join(root, "CONTRIBUTING.md")):
        problems.append("CONTRIBUTING.md: missing")
    linked = set()
    for rel in guide_files(root):
        text = read(os.path.join(root, rel))
        for _, line, span in code_spans(text):
            path = path_of_span(span)
            if path is None:
                continue
            why = check_exists(root, "", path)
            if why:
                problems.append(f"{rel}:{line}: path {why}")
        here = os.path.dirname(rel)
        for line, target in link_targets(text):
            if target.startswith("#") or SCHEME.match(target):
                continue
            path = target.split("#", 1)[0]
            why = check_exists(root, here, path)
            if why:
                problems.append(f"{rel}:{line}: link {why}")
            elif rel == "CONTRIBUTING.md":
                linked.add(os.path.normpath(os.path.join(here, path)))
    for rel in guide_files(root):
        if rel != "CONTRIBUTING.md" and os.path.normpath(rel) not in linked:
            problems.append(f"{rel}: not linked from CONTRIBUTING.md")
    return problems


def git(root, *args):
    return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, encoding="utf-8",
                          errors="replace")


def check_commits(root, since):
    if git(root, "rev-parse", "--is-inside-work-tree").returncode != 0:
        print(f"check-guides: {root} is no git checkout: commit subjects not checked", file=sys.stderr)
        return []
    if git(root, "rev-parse", "--verify", "--quiet", f"{since}^{{commit}}").returncode != 0:
        print(f"check-guides: {since} is not in this clone (shallow?): commit subjects not checked",
              file=sys.stderr)
        return []
    if git(root, "merge-base", "--is-ancestor", since, "HEAD").returncode != 0:
        print(f"check-guides: {since} is not an ancestor of HEAD: commit subjects not checked", file=sys.stderr)
        return []
    log = git(root, "log", "--format=%h%x1f%s%x1e", f"{since}..HEAD")
    if log.returncode != 0:
        return [f"commit: git log {since}..HEAD failed: {log.stderr.strip()}"]
    problems = []
    for entry in log.stdout.split("\x1e"):
        entry = entry.strip("\n")
        if not entry:
            continue
        sha, subject = entry.split("\x1f", 1)
        if len(subject) > MAX_SUBJECT:
            problems.append(f"commit {sha}: subject is {len(subject)} characters (at most {MAX_SUBJECT}; "
                            f"details go in the body): {subject[:MAX_SUBJECT]}...")
    return problems


def crate_section_bases(root, text):
    """(offset, base) per `## ` heading: crates/NAME/src when NAME is a crate, else the root."""
    bases = [(0, "")]
    for m in re.finditer(r"^## +(\S+)\s*$", text, re.M):
        name = m.group(1)
        src = os.path.join("crates", name, "src")
        bases.append((m.start(), src if os.path.isdir(os.path.join(root, src)) else ""))
    return bases


def check_architecture_links(root):
    rel = "ARCHITECTURE.md"
    path = os.path.join(root, rel)
    if not os.path.isfile(path):
        return []
    text = read(path)
    problems = []
    for m in URL.finditer(text):
        problems.append(f"{rel}:{line_of(text, m.start())}: links outside the repository: {m.group(0)}")
    for line, target in link_targets(text):
        if target.startswith("#") or URL.match(target):
            continue
        if SCHEME.match(target):
            problems.append(f"{rel}:{line}: links outside the repository: {target}")
            continue
        if target.startswith("/") or not inside(root, target.split("#", 1)[0]):
            problems.append(f"{rel}:{line}: link leaves the repository: {target}")
    bases = crate_section_bases(root, text)
    for offset, line, span in code_spans(text):
        if not span or any(c.isspace() for c in span):
            continue
        if span.startswith("/"):
            top = span.strip("/").split("/", 1)[0]
            real = os.path.realpath(root)
            if top and os.path.isdir("/" + top) and not (span + "/").startswith(real + "/"):
                problems.append(f"{rel}:{line}: names a path outside the repository: `{span}`")
            continue
        if ".." not in span.split("/"):
            continue
        base = [b for o, b in bases if o <= offset][-1]
        if not inside(root, os.path.join(base, span)):
            problems.append(f"{rel}:{line}: names a path outside the repository: `{span}`")
    return problems


def check(root, since):
    return check_paths(root) + check_commits(root, since) + check_architecture_links(root)


def main(argv=None):
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repo", default=os.path.dirname(here), help="the repository root (default: this script's ..)")
    ap.add_argument("--since", default=DEFAULT_SINCE,
                    help=f"check the subjects of the commits after this one (default {DEFAULT_SINCE})")
    args = ap.parse_args(argv)
    problems = check(args.repo, args.since)
    for p in problems:
        print(p)
    if problems:
        print(f"check-guides: {len(problems)} problems", file=sys.stderr)
        return 1
    print("check-guides: ok (guides' paths exist, commit subjects fit, ARCHITECTURE.md stays inside)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
