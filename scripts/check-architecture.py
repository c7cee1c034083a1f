#!/usr/bin/env python3
"""Check the crates' source against the code map in ARCHITECTURE.md.

usage: check-architecture.py [--repo DIR] [--map FILE] [--report] [--draft]

The map: one `## crate-name` section per crate (the crate's directory under crates/), holding a
markdown table whose header has the columns `layer` and `files` (and usually `owns`):

    | layer | files | owns |
    |---|---|---|
    | 0 | `ops.rs` | RMSNorm, RoPE, dot, axpy, SiLU |
    | 1 | `attention/` | causal attention over paged KV |
    | 2 | `lib.rs` | the crate root |

`layer` is a small integer, 0 at the bottom; a module may import modules of its own layer or lower.
`files` is one or more backticked paths relative to the crate's src/; `dir/` (or `dir/*.rs`) names
every .rs file under dir, and a file named on its own row overrides its directory's row; a path
starting with `../` (`../tests/api.rs`, `../benches/`) is only checked to exist, and a row of such
paths may have `-` as its layer. Other tables, rows and sections are ignored, except that a layer
table under a `##` heading that names no crate is a problem.

It prints one line per problem and exits 1 when there is any (2 when the map cannot be read):
  layers  a module imports (through `use`, a grouped `use crate::{..}`, an inline `crate::x::y`,
          `self::`/`super::` paths, or a child module's name) a module of a higher layer;
  cycle   modules of one crate import each other in a cycle;
  map     a file the map names is missing, a source file (crates/*/src/**/*.rs) is not named, a
          crate has no section, or a row cannot be read;
  size    a file passes 800 lines, or a function 120 lines (functions in a `metrics.rs` aside: tables
          of metric registrations), or the map 20,480 bytes;
  confined  code matches a pattern outside the files a crate's confinement table allows it in: a
          table whose header has the columns `pattern` and `only in`, a backticked Python regular
          expression (matched against code, comments and strings blanked) and the backticked paths
          under src/ where it may stand (one construction site, one consumer of an event type).
A file's lines are counted up to its first `#[cfg(test)]` module; test code (that module, files
declared under `#[cfg(test)] mod x;`, tests/, benches/) has no edges and no limits. Comments and
string literals are not code. A module's path follows the `mod` declarations from lib.rs,
main.rs and bin/*.rs (each its own crate root); a path to an item resolves to the longest module prefix that is
a file, then through that module's `use` declarations (re-exports: `crate::Model` to `model.rs`).
An edge to an ancestor module (`super::Item` from `dir/x.rs` to `dir/mod.rs`) counts like any other:
a directory's files that add `impl` blocks to what its mod.rs defines sit above it in the map.

--report prints per crate: modules, edges, cycles, the largest file and the longest function.
--draft prints a map drafted from the code as it is (a starting point for the layers and owns).
"""
import argparse
import os
import re
import sys
from collections import defaultdict

MAX_MAP_BYTES = 20480
MAX_FILE_LINES = 800
MAX_FN_LINES = 120
ROOTS = ("lib.rs", "main.rs")


# ---------------------------------------------------------------- lexing


RAW = re.compile(r'r(#*)"')


def ident(text, i):
    """Whether text[i] is part of an identifier (False before the start)."""
    return i >= 0 and (text[i].isalnum() or text[i] == "_")


def blank_comments_and_strings(text):
    """The text with comments and the insides of string and char literals as spaces (newlines
    kept, so offsets and line numbers still match the file)."""
    out, i, n = [], 0, len(text)

    def blank(s):
        return re.sub(r"[^\n]", " ", s)

    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(blank(text[i:j]))
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(blank(text[i:j]))
            i = j
        elif c == "r" and RAW.match(text, i) and not ident(text, i - 1 - (text[i - 1 : i] == "b")):
            m = RAW.match(text, i)
            close = '"' + m.group(1)
            j = text.find(close, m.end())
            j = n if j < 0 else j + len(close)
            out.append("r" + blank(text[i + 1 : j - 1]) + '"')
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append('"' + blank(text[i + 1 : j]) + '"')
            i = j + 1
        elif c == "'":
            if text.startswith("\\", i + 1):  # '\n', '\'', '\u{..}'
                j = text.find("'", i + 3)
                j = n if j < 0 else j
                out.append("'" + blank(text[i + 1 : j]) + "'")
                i = j + 1
            elif i + 2 < n and text[i + 2] == "'":  # 'x', '{'
                out.append("' '")
                i += 3
            else:  # a lifetime or a label
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


CFG_TEST = re.compile(r"^[ \t]*#\[cfg\(test\)\][ \t]*\n(?:[ \t]*(?:#\[[^\n]*\])?[ \t]*\n)*", re.M)
MOD_DECL = re.compile(r"^[ \t]*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*([;{])", re.M)


def split_test(code):
    """(code up to the first `#[cfg(test)]` module, names of modules declared `#[cfg(test)] mod x;`)."""
    cut, test_children = len(code), set()
    for m in CFG_TEST.finditer(code):
        d = MOD_DECL.match(code, m.end())
        if not d:
            continue  # `#[cfg(test)]` on a function or an import: ordinary code
        if d.group(2) == ";":
            test_children.add(d.group(1))
        elif m.start() < cut:
            cut = m.start()
            break
    return code[:cut], test_children


# ---------------------------------------------------------------- crates and modules


class File:
    def __init__(self, crate_dir, rel):
        self.rel = rel  # path under src/
        self.path = os.path.join(crate_dir, "src", rel)
        with open(self.path, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
        self.code_all = blank_comments_and_strings(text)
        self.code, self.test_children = split_test(self.code_all)
        self.lines = len(self.code.splitlines())
        self.root = None  # "lib.rs" / "main.rs" crate root it belongs to
        self.module = None  # module path (tuple) inside that root
        self.test_only = False

    def child_dir(self):
        d, base = os.path.split(self.rel)
        if base == "mod.rs" or self.module == ():  # a crate root's children sit beside it
            return d
        return os.path.join(d, base[:-3])


class Crate:
    def __init__(self, repo, name):
        self.name = name
        self.dir = os.path.join(repo, "crates", name)
        src = os.path.join(self.dir, "src")
        self.files = {}
        for dp, dns, fs in os.walk(src):
            dns.sort()
            for f in sorted(fs):
                if f.endswith(".rs"):
                    rel = os.path.relpath(os.path.join(dp, f), src).replace(os.sep, "/")
                    self.files[rel] = File(self.dir, rel)
        self.modules = {}  # (root, module path) -> File
        self.assign_modules()

    def assign_modules(self):
        bins = sorted(r for r in self.files if re.fullmatch(r"bin/[^/]+\.rs|bin/[^/]+/main\.rs", r))
        for root in list(ROOTS) + bins:
            if root in self.files:
                self.walk(self.files[root], root, (), False)
        for f in self.files.values():  # not declared anywhere: its place under src/ decides
            if f.root is None:
                parts = f.rel[:-3].split("/")
                if parts[-1] == "mod":
                    parts = parts[:-1]
                f.root, f.module = "lib.rs", tuple(parts)
                self.modules.setdefault((f.root, f.module), f)

    def walk(self, f, root, module, test_only):
        if f.root is not None:
            return
        f.root, f.module, f.test_only = root, module, test_only
        self.modules[(root, module)] = f
        for m in MOD_DECL.finditer(f.code_all):
            if m.group(2) != ";":
                continue
            name = m.group(1)
            for cand in (f"{f.child_dir()}/{name}.rs", f"{f.child_dir()}/{name}/mod.rs"):
                cand = cand.lstrip("/")
                if cand in self.files:
                    self.walk(self.files[cand], root, module + (name,), test_only or name in f.test_children)
                    break

    def display(self, f):
        return "crate root" if not f.module else "::".join(f.module)


# ---------------------------------------------------------------- edges

USE = re.compile(r"\buse\s+([^;]*);")
PATH = re.compile(r"(?<![\w:])(\$?crate|super|self|[A-Za-z_]\w*)((?:\s*::\s*[A-Za-z_]\w*)+)")


def expand_use(body):
    """`a::{b, c::d as e, self}` -> [(['a','b'], 'b'), (['a','c','d'], 'e'), (['a'], 'a')]."""
    body = re.sub(r"\s+", " ", body).strip()
    m = re.match(r"^(.*?)::\s*\{(.*)\}$", body, re.S)
    if not m:
        alias = None
        am = re.match(r"^(.*?)\s+as\s+(\w+)$", body)
        if am:
            body, alias = am.group(1), am.group(2)
        segs = [s.strip() for s in body.split("::") if s.strip()]
        if segs and segs[-1] == "self":
            segs = segs[:-1]
        if not segs:
            return []
        return [(segs, alias or segs[-1])]
    prefix, inner = m.group(1).strip(), m.group(2)
    items, buf, depth = [], "", 0
    for ch in inner:
        depth += (ch == "{") - (ch == "}")
        if ch == "," and depth == 0:
            items.append(buf)
            buf = ""
        else:
            buf += ch
    items.append(buf)
    out = []
    for it in items:
        it = it.strip()
        if it and it != "*":
            out += expand_use(prefix + "::" + it)
    return out


class Graph:
    def __init__(self, crate):
        self.crate = crate
        self.uses = {}  # File -> {name: (root, absolute segments)}
        self.refs = {}  # File -> [(absolute segments, line, text)]
        for f in crate.files.values():
            self.scan(f)
        self.edges = defaultdict(dict)  # File -> {File: (line, text)}
        for f, refs in self.refs.items():
            for segs, line, text in refs:
                g = self.resolve(f.root, segs, 0)
                if g is None or g is f or g in self.edges[f]:
                    continue
                self.edges[f][g] = (line, text)

    def absolute(self, f, segs, inner=()):
        """Segments of a path written in f (inside its inline modules `inner`), made absolute in
        f's crate root; None when external."""
        module = f.module + tuple(inner)
        head = segs[0]
        if head in ("crate", "$crate"):
            return list(segs[1:])
        if head == "self":
            return list(module) + list(segs[1:])
        if head == "super":
            base = list(module)
            while segs and segs[0] == "super":
                if not base:
                    return None
                base, segs = base[:-1], segs[1:]
            if segs and segs[0] == "self":
                segs = segs[1:]
            return base + list(segs)
        if (f.root, module + (head,)) in self.crate.modules:  # a child module by its name
            return list(module) + list(segs)
        return None

    def scan(self, f):
        if f.test_only:
            self.uses[f], self.refs[f] = {}, []
            return
        code = f.code
        uses, refs = {}, []
        line_at = lambda pos: code.count("\n", 0, pos) + 1
        spans = []  # inline modules: (start, end, name)
        for m in MOD_DECL.finditer(code):
            if m.group(2) == "{":
                depth, j = 0, m.end() - 1
                while j < len(code):
                    depth += (code[j] == "{") - (code[j] == "}")
                    if depth == 0:
                        break
                    j += 1
                spans.append((m.end(), j, m.group(1)))
        inline = lambda pos: tuple(name for s, e, name in spans if s <= pos < e)
        for m in USE.finditer(code):
            inner = inline(m.start())
            for segs, name in expand_use(m.group(1)):
                a = self.absolute(f, segs, inner)
                if not inner:
                    uses[name] = a  # None: an external item, so no edge through it
                if a is not None:
                    refs.append((a, line_at(m.start()), "use " + "::".join(segs)))
        rest = USE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), code)
        rest = MOD_DECL.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), rest)
        for m in PATH.finditer(rest):
            segs = [m.group(1)] + [s.strip() for s in m.group(2).split("::") if s.strip()]
            a = self.absolute(f, segs, inline(m.start()))
            if a is not None:
                refs.append((a, line_at(m.start()), "::".join(segs)))
        self.uses[f], self.refs[f] = uses, refs

    def resolve(self, root, segs, depth):
        """The file holding what the absolute path names (an item or a module)."""
        for k in range(len(segs), -1, -1):
            g = self.crate.modules.get((root, tuple(segs[:k])))
            if g is None:
                continue
            if k < len(segs) and depth < 8 and segs[k] in self.uses.get(g, {}):
                target = self.uses[g][segs[k]]
                if target is None:
                    return None
                if target == list(segs[: k + 1]):
                    return g
                return self.resolve(root, target + list(segs[k + 1 :]), depth + 1)
            return g
        return None


def cycles(nodes, edges):
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for v0 in nodes:
        if v0 in index:
            continue
        work = [(v0, iter(sorted(edges[v0], key=lambda g: g.rel)))]
        index[v0] = low[v0] = counter[0]
        counter[0] += 1
        stack.append(v0)
        on.add(v0)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w], key=lambda g: g.rel))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w is v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp, key=lambda g: g.rel))
    return out


def cycle_path(comp, edges):
    """One cycle through the component's first file, as a list of files (first repeated last)."""
    members, start = set(comp), comp[0]
    prev, queue = {start: None}, [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(edges[v], key=lambda g: g.rel):
            if w is start:
                path = [v]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                return list(reversed(path)) + [start]
            if w in members and w not in prev:
                prev[w] = v
                queue.append(w)
    return comp + [start]


# ---------------------------------------------------------------- functions

FN = re.compile(
    r"^[ \t]*(?:pub(?:\s*\([^)]*\))?\s+)?(?:default\s+)?(?:const\s+)?(?:async\s+)?(?:unsafe\s+)?"
    r'(?:extern\s+(?:"[^"]*"\s+)?)?fn\s+(\w+)'
)


def functions(code):
    """(name, first line, lines) of every function with a body."""
    lines, out = code.split("\n"), []
    for k, line in enumerate(lines):
        m = FN.match(line)
        if not m:
            continue
        depth, started, col = 0, False, m.end()
        for j in range(k, len(lines)):
            seg = lines[j][col:] if j == k else lines[j]
            for ch in seg:
                if ch == "{":
                    depth, started = depth + 1, True
                elif ch == "}":
                    depth -= 1
                elif ch == ";" and not started:
                    break
                if started and depth == 0:
                    break
            else:
                continue
            break
        if started and depth == 0:
            out.append((m.group(1), k + 1, j - k + 1))
    return out


# ---------------------------------------------------------------- the map


class Row:
    def __init__(self, line, layer, paths):
        self.line, self.layer, self.paths = line, layer, paths


def map_tables(path, crate_names):
    """Each row of each table in the map, as (line number, the `##` heading's crate or None, the
    heading's first word, the table's header names lowercased, its cells); the header row itself
    comes with cells None."""
    section, heading, names = None, None, None
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    for no, raw in enumerate(text.split("\n"), 1):
        line = raw.strip()
        if re.match(r"^#{1,2}\s", line):
            words = line.lstrip("#").replace("`", " ").split()
            heading = words[0] if words and line.startswith("## ") else None
            section = heading if heading in crate_names else None
            names = None
            continue
        if not line.startswith("|"):
            names = None
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if names is None:
            names = [c.lower().strip("* ") for c in cells]
            yield no, section, heading, names, None
        elif not re.match(r"^[\s:|-]+$", line):
            yield no, section, heading, names, cells


def read_map(path, crate_names):
    """({crate: [Row]}, [problem])."""
    sections, problems = defaultdict(list), []
    for no, section, heading, names, cells in map_tables(path, crate_names):
        if "layer" not in names or "files" not in names:
            continue
        if cells is None:
            if section is None:
                problems.append(f"{path}:{no}: map: a layer table under `## {heading}`, which names no crate with a src/ directory")
            continue
        if section is None:
            continue
        li, fi = names.index("layer"), names.index("files")
        if max(li, fi) >= len(cells):
            problems.append(f"{path}:{no}: map: row has {len(cells)} cells, the header more")
            continue
        layer = cells[li].strip("` ")
        paths = [p.strip() for p in re.findall(r"`([^`]+)`", cells[fi])]
        if not paths:
            problems.append(f"{path}:{no}: map: no backticked path in the files cell")
            continue
        outside = all(p.startswith("../") for p in paths)
        if not (re.fullmatch(r"\d+", layer) or (layer == "-" and outside)):
            problems.append(
                f"{path}:{no}: map: layer `{cells[li]}` is not a whole number"
                + ("" if outside else " (`-` only for paths outside src/)")
            )
            continue
        sections[section].append(Row(no, None if layer == "-" else int(layer), paths))
    return sections, problems


def read_confined(path, crate_names):
    """({crate: [(line, pattern, [path])]}, [problem]) from the confinement tables."""
    confined, problems = defaultdict(list), []
    for no, section, _, names, cells in map_tables(path, crate_names):
        if cells is None or section is None or "pattern" not in names or "only in" not in names:
            continue
        pi, oi = names.index("pattern"), names.index("only in")
        pattern = re.findall(r"`([^`]+)`", cells[pi]) if pi < len(cells) else []
        allowed = re.findall(r"`([^`]+)`", cells[oi]) if oi < len(cells) else []
        try:
            regex = re.compile(pattern[0]) if pattern else None
        except re.error as e:
            problems.append(f"{path}:{no}: map: the pattern `{pattern[0]}` is no regular expression: {e}")
            continue
        if regex is None or not allowed:
            problems.append(f"{path}:{no}: map: a confinement row needs a backticked pattern and paths")
            continue
        confined[section].append((no, regex, allowed))
    return confined, problems


def confinement_problems(crate, rules, map_path):
    """Matches of each rule's pattern in a file it does not allow (tests aside)."""
    problems = []
    for no, regex, allowed in rules:
        for rel, f in crate.files.items():
            if f.test_only or rel in allowed:
                continue
            for m in regex.finditer(f.code):
                line = f.code.count("\n", 0, m.start()) + 1
                problems.append(
                    f"crates/{crate.name}/src/{rel}:{line}: confined: `{regex.pattern}` stands only in "
                    + ", ".join(allowed) + f" ({map_path}:{no})"
                )
    return problems


def layers_of(crate, rows, map_path):
    """({File: layer}, [problem]) from a crate's rows; a file's own row beats its directory's."""
    exact, by_dir, problems = {}, [], []
    for row in rows:
        for p in row.paths:
            where = f"{map_path}:{row.line}"
            if p.startswith("../"):
                if not os.path.exists(os.path.normpath(os.path.join(crate.dir, "src", p))):
                    problems.append(f"{where}: map: crates/{crate.name}/{p[3:]} is named in the map but missing")
                continue
            if p.endswith("/*.rs") or p.endswith("/"):
                d = p[: -len("*.rs")] if p.endswith("*.rs") else p
                covered = [f for rel, f in crate.files.items() if rel.startswith(d)]
                if not covered:
                    problems.append(f"{where}: map: crates/{crate.name}/src/{p} is named in the map but holds no .rs file")
                by_dir.append((len(d), row.layer, covered))
                continue
            f = crate.files.get(p)
            if f is None:
                problems.append(f"{where}: map: crates/{crate.name}/src/{p} is named in the map but missing")
            elif f in exact:
                problems.append(f"{where}: map: crates/{crate.name}/src/{p} is named twice")
            else:
                exact[f] = row.layer
    layer = dict(exact)
    for _, lay, covered in sorted(by_dir, key=lambda t: t[0]):  # deeper directories last, so they win
        for f in covered:
            if f not in exact:
                layer[f] = lay
    return layer, problems


# ---------------------------------------------------------------- the check


def check(repo, map_path, report=None):
    """Problem lines (sorted). With `report` a list, per-crate summary lines are appended to it."""
    crates_dir = os.path.join(repo, "crates")
    names = sorted(d for d in os.listdir(crates_dir) if os.path.isdir(os.path.join(crates_dir, d, "src")))
    sections, problems = read_map(map_path, set(names))
    mp = os.path.relpath(map_path, repo) if os.path.abspath(map_path).startswith(os.path.abspath(repo)) else map_path
    confined, ps = read_confined(map_path, set(names))
    size = os.path.getsize(map_path)
    if size > MAX_MAP_BYTES:
        ps.append(f"{map_path}: size: {size} bytes (limit {MAX_MAP_BYTES}): a map a newcomer reads in five minutes")
    problems = [p.replace(map_path, mp, 1) for p in problems + ps]
    for name in names:
        crate = Crate(repo, name)
        graph = Graph(crate)
        src = f"crates/{name}/src/"
        problems += confinement_problems(crate, confined.get(name, []), mp)
        if name not in sections:
            problems.append(f"crates/{name}: map: no `## {name}` section with a layer table in {mp}")
            layer = {}
        else:
            layer, ps = layers_of(crate, sections[name], mp)
            problems += ps
            for rel, f in crate.files.items():
                if f not in layer:
                    problems.append(f"{src}{rel}: map: not named in {mp} (## {name})")
        for f, out in graph.edges.items():
            for g, (line, text) in out.items():
                if f in layer and g in layer and layer[g] > layer[f]:
                    problems.append(
                        f"{src}{f.rel}:{line}: layers: {crate.display(f)} (layer {layer[f]}) imports "
                        f"{crate.display(g)} ({g.rel}, layer {layer[g]}) through `{text}`"
                    )
        comps = cycles(list(crate.files.values()), graph.edges)
        for comp in comps:
            path = cycle_path(comp, graph.edges)
            steps = " -> ".join(
                f"{a.rel}:{graph.edges[a][b][0]}" for a, b in zip(path, path[1:])
            ) + f" -> {path[-1].rel}"
            problems.append(f"{src}{comp[0].rel}: cycle: {len(comp)} modules import each other: {steps}")
        longest = (0, "", "")
        for rel, f in crate.files.items():
            if f.test_only:
                continue
            if f.lines > MAX_FILE_LINES:
                problems.append(f"{src}{rel}: size: {f.lines} lines up to its tests (limit {MAX_FILE_LINES})")
            for fn, line, n in functions(f.code):
                if os.path.basename(rel) == "metrics.rs":
                    continue
                if n > MAX_FN_LINES:
                    problems.append(f"{src}{rel}:{line}: size: fn {fn} has {n} lines (limit {MAX_FN_LINES})")
                if n > longest[0]:
                    longest = (n, f"{src}{rel}:{line}", fn)
        if report is not None:
            big = max((f for f in crate.files.values() if not f.test_only), key=lambda f: f.lines, default=None)
            nedges = sum(len(v) for v in graph.edges.values())
            report.append(
                f"{name}: {len(crate.files)} files, {nedges} edges, {len(comps)} cycles"
                + (f" ({'; '.join(', '.join(f.rel for f in c) for c in comps)})" if comps else "")
                + (f"; largest file {src}{big.rel} {big.lines} lines" if big else "")
                + (f"; longest fn {longest[2]} {longest[1]} {longest[0]} lines" if longest[0] else "")
            )
    return sorted(set(problems))


def draft(repo):
    """A map from the code as it is: each file at the lowest layer above everything it imports
    (a cycle's files share one layer), `owns` from the first line of its `//!` doc."""
    out = ["<!-- drafted by check-architecture.py --draft: check each layer and owns -->"]
    crates_dir = os.path.join(repo, "crates")
    for name in sorted(d for d in os.listdir(crates_dir) if os.path.isdir(os.path.join(crates_dir, d, "src"))):
        crate = Crate(repo, name)
        graph = Graph(crate)
        comp_of = {f: (f,) for f in crate.files.values()}
        for comp in cycles(list(crate.files.values()), graph.edges):
            for f in comp:
                comp_of[f] = tuple(comp)
        layer = {}

        def level(f):
            if f not in layer:
                c = comp_of[f]
                outs = {g for m in c for g in graph.edges[m] if g not in c}
                layer.update({m: 1 + max((level(g) for g in outs), default=-1) for m in c})
            return layer[f]

        for f in crate.files.values():
            level(f)
        out += ["", f"## {name}", "", "| layer | files | owns |", "|---|---|---|"]
        for f in sorted(crate.files.values(), key=lambda f: (layer[f], f.rel)):
            with open(f.path, encoding="utf-8", errors="replace") as fh:
                doc = re.match(r"\s*//!\s*([^\n]*)", fh.read())
            owns = (doc.group(1) if doc else "").replace("|", "\\|")
            owns = owns if len(owns) <= 100 else owns[:99] + "…"
            cyc = " (cycle: " + ", ".join(g.rel for g in comp_of[f] if g is not f) + ")" if len(comp_of[f]) > 1 else ""
            out.append(f"| {layer[f]} | `{f.rel}` | {owns}{cyc}{' (test code)' if f.test_only else ''} |")
    return out


def main(argv=None):
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repo", default=os.path.dirname(here), help="the workspace root (default: this script's ..)")
    ap.add_argument("--map", help="the code map (default: REPO/ARCHITECTURE.md)")
    ap.add_argument("--report", action="store_true", help="print per crate: cycles, largest file, longest function")
    ap.add_argument("--draft", action="store_true", help="print a map drafted from the code as it is, and exit")
    args = ap.parse_args(argv)
    if args.draft:
        print("\n".join(draft(args.repo)))
        return 0
    map_path = args.map or os.path.join(args.repo, "ARCHITECTURE.md")
    if not os.path.isfile(map_path) or not os.path.isdir(os.path.join(args.repo, "crates")):
        print(f"check-architecture: no map at {map_path} or no crates/ under {args.repo}", file=sys.stderr)
        return 2
    report = [] if args.report else None
    problems = check(args.repo, map_path, report)
    for line in report or []:
        print(line)
    for p in problems:
        print(p)
    if problems:
        print(f"check-architecture: {len(problems)} problems", file=sys.stderr)
        return 1
    print(f"check-architecture: ok ({map_path} holds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
