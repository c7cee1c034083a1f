#!/usr/bin/env python3
"""Check that every config key, route, prop, key limit, metric, OpenAI request
field and CLI flag in the code is named in the reference docs.

usage: check-doc-coverage.py [--repo DIR] [--list]

It reads the Rust source (never the built binaries: CI runs it before
building) and the docs: every `docs/*.md` (not its subdirectories), in inline
code spans only (`like this`; fenced blocks do not count). An item is named
when its text stands in a code span with no letter, digit, `_`, `-` or `/`
directly around it (so `/v1/processes` is not `/v1/processes/{id}`, and
`session` is not `session-affinity`). It prints one line per item missing,
`config key [runtime.inferlets] max_pending_bytes (pie): not in docs/`, and
exits 1 when any is (2 when the source cannot be read as expected). `--list`
prints every item found instead, with its category.

The extractors (source is read up to a file's first `#[cfg(test)] mod`):

config key  The serde structs reachable from each binary's root config struct
            (ROOTS below): every field of a struct that derives Deserialize
            with named fields is a key of the struct's section; a field whose
            type (through Option<>, Vec<>, Box<>) is such a struct opens the
            section `parent.field` (a Vec of tables included:
            `[cluster.workers]`). Names follow `#[serde(rename = "..")]` and the
            struct's `rename_all`; `skip` fields are left out and `flatten`
            fields' keys join the parent's section. A type resolves in its own
            file, then in the crate a `use` of the file names, then in its own
            crate, then anywhere if unique. KeyLimits is not walked (its fields
            are the key limits below). Named when a code span holds the key
            under a heading that holds the code span `[section]` (or
            `[[section]]`), up to the next heading of its level or above; or
            anywhere as `section.key`, or in one span with `[section]`.
route       Every `.route("PATH", ...)` of an axum router (methods read from the
            `get(..).post(..)` chain, for the listing). Named: the path.
prop        The names in `KNOWN_PROPS` (crates/pie-core/src/props.rs) and every
            name read by `props.str/int/float/bool/get("name")`. Named anywhere.
key limit   The fields of the `KeyLimits` struct (a key's `limits = {..}`, or
            `field=value` words in a keys file). Named under a heading holding
            the code span `limits`, or anywhere as `limits.field`.
metric      Every `REGISTRY.register("name", "help", METRIC)` of
            prometheus_client, the name prefixed by the registry's
            `Registry::with_prefix("p")` / `sub_registry_with_prefix("p")` and,
            for a counter, suffixed `_total` (what `/metrics` shows). A name
            given by a loop variable (`for (name, help, v) in LIST`) is each
            tuple's first string of `let LIST = [..]`. The type is read from
            METRIC: `x.field.clone()` (the field's declared type) or
            `ConstGauge::new(..)`. Named anywhere.
openai field  The names of every `const X: &[..] = &[..]` list in
            crates/pie-core/src/openai_fields.rs (a list's entries are strings
            or tuples starting with one: SHARED, CHAT, EXTRAS, ...): the fields
            `/v1/completions` and `/v1/chat/completions` accept. Named anywhere.
cli command / cli flag  The clap derive tree of each `#[derive(Parser)]` struct
            (`#[command(name = "..")]`, else the crate's name): `Subcommand`
            enum variants (kebab-case, or `#[command(name)]`) are commands,
            `#[command(subcommand)]` fields descend, `#[command(flatten)]`
            fields and tuple variants `Serve(ServeArgs)` take the struct's
            fields; a field with `#[arg(long)]` is the flag `--field-name` (or
            `long = "name"`). A command is named as its whole path
            (`pie model fetch`) anywhere; a flag under a heading holding the
            command path as a code span, or in one span with it
            (`pie serve --port`).

EXEMPT lists items that are internal or test-only, each with its reason.
"""
import argparse
import os
import re
import sys
from collections import defaultdict

# Each binary's config file schema: (binary, crate dir, file under src/, struct).
ROOTS = [
    ("pie", "pie-worker", "config.rs", "Config"),
    ("pie-controller", "pie-controller", "config.rs", "Config"),
    ("pie-pool", "pie-pool", "config.rs", "Config"),
]
# Structs whose fields are not config keys of their own section.
NOT_WALKED = {"KeyLimits"}
PROPS_FILE = "crates/pie-core/src/props.rs"
OPENAI_FIELDS_FILE = "crates/pie-core/src/openai_fields.rs"

# (category, name) -> reason. Only internal or test-only items.
EXEMPT = {}

EDGE = r"A-Za-z0-9_\-/"


class SourceError(Exception):
    pass


# ---------------------------------------------------------------- reading Rust


def strip_comments(text):
    """Rust text with comments blanked (strings kept; line structure kept)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("".join(ch if ch == "\n" else " " for ch in text[i:j]))
            i = j
        elif c == '"' or (c == "r" and re.match(r'r#*"', text[i:i + 8])
                          and (i == 0 or not re.match(r"\w", text[i - 1]))):
            m = re.match(r'r(#*)"', text[i:i + 8])
            if m:
                end = '"' + m.group(1)
                j = text.find(end, i + len(m.group(0)))
                j = n if j < 0 else j + len(end)
            else:
                j = i + 1
                while j < n and text[j] != '"':
                    j += 2 if text[j] == "\\" else 1
                j += 1
            out.append(text[i:j])
            i = j
        elif c == "'" and re.match(r"'(\\.|[^\\'])'", text[i:i + 4]):
            m = re.match(r"'(\\.|[^\\'])'", text[i:i + 4])
            out.append(m.group(0))
            i += len(m.group(0))
        else:
            out.append(c)
            i += 1
    return "".join(out)


def code_of(text):
    """A file's text up to its first `#[cfg(test)] mod`, comments blanked."""
    text = strip_comments(text)
    m = re.search(r"#\[cfg\(test\)\]\s*(pub\s+)?mod\s+\w+\s*\{", text)
    return text[:m.start()] if m else text


def matching(text, i):
    """Index just past the bracket that closes the one at text[i]."""
    pairs = {"(": ")", "[": "]", "{": "}", "<": ">"}
    stack = [pairs[text[i]]]
    j = i + 1
    while j < len(text) and stack:
        c = text[j]
        if c == '"':
            j += 1
            while j < len(text) and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
        elif c in "([{":
            stack.append(pairs[c])
        elif c == "<" and stack[-1] == ">":
            stack.append(">")
        elif c == ">" and stack[-1] == ">" and text[j - 1] != "=" and text[j - 1] != "-":
            stack.pop()
        elif c in ")]}" and stack[-1] == c:
            stack.pop()
        elif c in ")]}" and stack[-1] == ">":
            # a `<` that was a comparison; unwind to the real bracket
            while stack and stack[-1] == ">":
                stack.pop()
            if stack and stack[-1] == c:
                stack.pop()
        j += 1
    return j


def split_top(text, sep=","):
    """Split at `sep` outside brackets and strings."""
    parts, depth, cur, i = [], 0, [], 0
    while i < len(text):
        c = text[i]
        if c == '"':
            j = i + 1
            while j < len(text) and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            cur.append(text[i:j + 1])
            i = j + 1
            continue
        if c in "([{<":
            depth += 1
        elif c in ")]}" or (c == ">" and text[i - 1] not in "-="):
            depth -= 1
        if c == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
        i += 1
    if "".join(cur).strip():
        parts.append("".join(cur))
    return parts


def take_attrs(text):
    """(attributes' inner texts, rest) of a field or variant's text."""
    attrs = []
    text = text.strip()
    while text.startswith("#["):
        end = matching(text, 1)
        attrs.append(text[2:end - 1].strip())
        text = text[end:].strip()
    return attrs, text


class Item:
    """A struct or an enum: its attributes and its body's members."""

    def __init__(self, kind, name, attrs, body, crate, path, tuple_body=False):
        self.kind, self.name, self.attrs = kind, name, attrs
        self.body, self.crate, self.path = body, crate, path
        self.tuple_body = tuple_body

    def derives(self, what):
        return any(re.match(r"derive\s*\(", a) and re.search(r"\b%s\b" % what, a)
                   for a in self.attrs)

    def members(self):
        """[(attrs, text)] of the body's fields or variants."""
        return [take_attrs(part) for part in split_top(self.body) if part.strip()]


ITEM = re.compile(r"(?:pub(?:\([^)]*\))?\s+)?(struct|enum)\s+(\w+)(\s*<[^>{;]*>)?\s*([{(;])")


def items_of(code, crate, path):
    """Every struct and enum of a file's code, with the attributes above it."""
    found = []
    for m in ITEM.finditer(code):
        kind, name, opener = m.group(1), m.group(2), m.group(4)
        if opener == ";":
            body, tuple_body = "", False
        else:
            start = m.end() - 1
            body = code[start + 1:matching(code, start) - 1]
            tuple_body = opener == "("
        # attributes: the `#[...]` blocks right above
        attrs, j = [], m.start()
        while True:
            before = code[:j].rstrip()
            if not before.endswith("]"):
                break
            k = before.rfind("#[")
            while k >= 0 and matching(before, k + 1) != len(before):
                k = before.rfind("#[", 0, k)
            if k < 0:
                break
            attrs.insert(0, before[k + 2:-1].strip())
            j = k
        found.append(Item(kind, name, attrs, body, crate, path, tuple_body))
    return found


class Source:
    """The crates' source: files' code, and every struct and enum by name."""

    def __init__(self, repo):
        self.repo = repo
        self.files = {}  # path relative to repo -> code
        self.items = defaultdict(list)
        crates = os.path.join(repo, "crates")
        if not os.path.isdir(crates):
            raise SourceError(f"no crates/ under {repo}")
        for crate in sorted(os.listdir(crates)):
            src = os.path.join(crates, crate, "src")
            for root, _, names in os.walk(src):
                for name in sorted(names):
                    if not name.endswith(".rs"):
                        continue
                    full = os.path.join(root, name)
                    rel = os.path.relpath(full, repo)
                    with open(full, encoding="utf-8") as f:
                        code = code_of(f.read())
                    self.files[rel] = code
                    for item in items_of(code, crate, rel):
                        self.items[item.name].append(item)

    def resolve(self, name, frm):
        """The item `name` as seen from item `frm` (see the docstring)."""
        cands = self.items.get(name, [])
        if len(cands) <= 1:
            return cands[0] if cands else None
        same_file = [c for c in cands if c.path == frm.path]
        if same_file:
            return same_file[0]
        code = self.files.get(frm.path, "")
        for m in re.finditer(r"\buse\s+(\w+)::([^;]*);", code):
            if re.search(r"\b%s\b" % re.escape(name), m.group(2)):
                crate = frm.crate if m.group(1) in ("crate", "self", "super") \
                    else m.group(1).replace("_", "-")
                hit = [c for c in cands if c.crate == crate]
                if len(hit) == 1:
                    return hit[0]
        same_crate = [c for c in cands if c.crate == frm.crate]
        if len(same_crate) == 1:
            return same_crate[0]
        raise SourceError(f"{frm.path}: cannot tell which `{name}` ({len(cands)} found)")


# ---------------------------------------------------------------- config keys


def serde_args(attrs):
    """The comma-separated words of every `serde(...)` attribute."""
    out = []
    for a in attrs:
        m = re.match(r"serde\s*\((.*)\)\s*$", a, re.S)
        if m:
            out += [p.strip() for p in split_top(m.group(1))]
    return out


def serde_value(args, key):
    for a in args:
        m = re.match(r'%s\s*=\s*"([^"]*)"' % key, a)
        if m:
            return m.group(1)
        m = re.match(r'%s\s*\((.*)\)' % key, a, re.S)
        if m:
            d = re.search(r'deserialize\s*=\s*"([^"]*)"', m.group(1))
            if d:
                return d.group(1)
    return None


def rename_all(name, rule):
    words = name.split("_")
    if rule is None or rule == "snake_case":
        return name
    return {
        "lowercase": name.lower(),
        "UPPERCASE": name.upper(),
        "kebab-case": "-".join(words),
        "SCREAMING_SNAKE_CASE": name.upper(),
        "SCREAMING-KEBAB-CASE": "-".join(words).upper(),
        "camelCase": words[0] + "".join(w.capitalize() for w in words[1:]),
        "PascalCase": "".join(w.capitalize() for w in words),
    }.get(rule, name)


def field_parts(text):
    """(rust name, type) of a named field's text, or None."""
    m = re.match(r"(?:pub(?:\([^)]*\))?\s+)?(r#)?(\w+)\s*:\s*(.+)$", text.strip(), re.S)
    return (m.group(2), m.group(3).strip()) if m else None


def inner_type(ty):
    """The type a field's tables are of: through Option, Vec, Box; last path segment."""
    ty = ty.strip()
    while True:
        m = re.match(r"(?:[\w:]*::)?(Option|Vec|Box)\s*<(.*)>$", ty, re.S)
        if not m:
            break
        ty = m.group(2).strip()
    return re.sub(r"<.*", "", ty, flags=re.S).split("::")[-1].strip()


def is_table(item):
    return item is not None and item.kind == "struct" and not item.tuple_body \
        and item.derives("Deserialize")


def config_keys(source, roots=None):
    """{(section, key): set of binaries}."""
    keys = defaultdict(set)
    for binary, crate, file, struct in roots or ROOTS:
        path = os.path.join("crates", crate, "src", file)
        root = [i for i in source.items.get(struct, []) if i.path == path]
        if not root:
            raise SourceError(f"{path}: no struct {struct} (ROOTS)")
        walk_struct(source, root[0], "", binary, keys, set())
    return keys


def walk_struct(source, item, section, binary, keys, seen):
    if item.name in seen:
        return
    seen = seen | {item.name}
    rule = serde_value(serde_args(item.attrs), "rename_all")
    for attrs, text in item.members():
        parts = field_parts(text)
        if not parts:
            continue
        name, ty = parts
        args = serde_args(attrs)
        if any(a in ("skip", "skip_deserializing") for a in args):
            continue
        key = serde_value(args, "rename") or rename_all(name, rule)
        target = source.resolve(inner_type(ty), item)
        if "flatten" in args and is_table(target):
            walk_struct(source, target, section, binary, keys, seen)
            continue
        walked = is_table(target) and target.name not in NOT_WALKED
        # a table is a section, named by its keys; an array of tables is a key too
        if section and (not walked or re.match(r"(?:[\w:]*::)?Vec\s*<", ty)):
            keys[(section, key)].add(binary)
        if walked:
            walk_struct(source, target, f"{section}.{key}" if section else key,
                        binary, keys, seen)


# ---------------------------------------------------------------- routes


ROUTE = re.compile(r'\.route\(\s*"(/[^"]*)"\s*,')
METHOD = re.compile(r"\b(get|post|put|patch|delete|head|options)\s*\(")


def routes(source):
    """{path: {binary crate: set of methods}}."""
    found = defaultdict(lambda: defaultdict(set))
    for path, code in source.files.items():
        crate = path.split(os.sep)[1]
        for m in ROUTE.finditer(code):
            end = matching(code, m.start() + len(".route"))
            handlers = code[m.end():end - 1]
            methods = {x.upper() for x in METHOD.findall(handlers)}
            found[m.group(1)][crate] |= methods or {"ANY"}
    return found


# ---------------------------------------------------------------- props


PROP_READ = re.compile(r'\bprops\w*(?:\(\))?\s*\.\s*(?:str|int|float|bool|get)\(\s*"([a-z0-9-]+)"')


def props(source):
    code = source.files.get(PROPS_FILE)
    if code is None:
        raise SourceError(f"no {PROPS_FILE}")
    m = re.search(r"KNOWN_PROPS\s*:[^=]*=\s*&\[", code)
    if not m:
        raise SourceError(f"{PROPS_FILE}: no KNOWN_PROPS")
    start = m.end() - 1
    body = code[start:matching(code, start)]
    found = set(re.findall(r'\(\s*"([a-z0-9-]+)"', body))
    for c in source.files.values():
        found |= set(PROP_READ.findall(c))
    return found


# ---------------------------------------------------------------- key limits


def key_limits(source):
    items = [i for i in source.items.get("KeyLimits", []) if i.kind == "struct"]
    if len(items) != 1:
        raise SourceError(f"{len(items)} structs named KeyLimits (want 1)")
    item = items[0]
    rule = serde_value(serde_args(item.attrs), "rename_all")
    found = set()
    for attrs, text in item.members():
        parts = field_parts(text)
        if parts and not any(a in ("skip", "skip_deserializing") for a in serde_args(attrs)):
            found.add(serde_value(serde_args(attrs), "rename") or rename_all(parts[0], rule))
    return found


# ---------------------------------------------------------------- metrics


PREFIX = re.compile(
    r"\b(\w+)\s*[:=]\s*(?:&?mut\s+)?([\w.]*?)\.?(?:Registry::with_prefix|sub_registry_with_prefix)"
    r"\(\s*\"([^\"]+)\"")
REGISTER = re.compile(r"([\w.]+)\s*\.\s*register\s*\(")


def metric_kind(text):
    for kind in ("Histogram", "Counter", "Gauge", "Info"):
        if kind in text:
            return kind.lower()
    return "unknown"


def metrics(source):
    """{exposed name: (kind, file)}."""
    found = {}
    for path, code in source.files.items():
        if "prometheus_client" not in code:
            continue
        assigned = []  # (position, variable, prefix): the nearest one before a use wins
        for m in PREFIX.finditer(code):
            parent = m.group(2).split(".")[-1] if m.group(2) else ""
            base = prefix_at(assigned, parent, m.start())
            assigned.append((m.start(), m.group(1),
                             f"{base}_{m.group(3)}" if base else m.group(3)))
        fields = {}
        for item in items_of(code, "", path):
            if item.kind == "struct" and not item.tuple_body:
                for _, text in item.members():
                    parts = field_parts(text)
                    if parts:
                        fields[parts[0]] = parts[1]
        for m in REGISTER.finditer(code):
            open_at = m.end() - 1
            args = split_top(code[open_at + 1:matching(code, open_at) - 1])
            if len(args) < 3:
                continue
            prefix = prefix_at(assigned, m.group(1).split(".")[-1], m.start())
            metric = args[-1].strip()
            fm = re.match(r"(?:[\w]+\.)*(\w+)\.clone\(\)$", metric)
            kind = metric_kind(fields.get(fm.group(1), "") if fm else metric)
            first = args[0].strip()
            if first.startswith('"'):
                names = [first.strip('"')]
            else:
                names = loop_names(code[:m.start()], first)
            for name in names:
                full = f"{prefix}_{name}" if prefix else name
                if kind == "counter":
                    full += "_total"
                found[full] = (kind, path)
    return found


def prefix_at(assigned, var, pos):
    """The prefix last given to registry `var` before `pos` ("" if none)."""
    hits = [p for at, v, p in assigned if v == var and at < pos]
    return hits[-1] if hits else ""


def loop_names(before, var):
    """The first strings of the tuples a `for (var, ..) in LIST` loop walks."""
    loops = list(re.finditer(r"for\s*\(\s*%s\b[^)]*\)\s*in\s*&?(\w+)" % re.escape(var), before))
    if not loops:
        raise SourceError(f"a metric named by `{var}`, which no loop binds")
    name = loops[-1].group(1)
    lets = list(re.finditer(r"let\s+%s\s*(?::[^=]*)?=\s*&?\[" % re.escape(name), before))
    if not lets:
        raise SourceError(f"a metric loop over `{name}`, which no `let {name} = [..]` sets")
    start = lets[-1].end() - 1
    body = before[start:matching(before, start)]
    return re.findall(r'\(\s*"([^"]+)"', body)


# ---------------------------------------------------------------- OpenAI fields


def openai_fields(source):
    code = source.files.get(OPENAI_FIELDS_FILE)
    if code is None:
        return set()
    found = set()
    for m in re.finditer(r"\bconst\s+\w+\s*:\s*&\[[^=]*=\s*&\[", code):
        start = m.end() - 1
        for entry in split_top(code[start + 1:matching(code, start) - 1]):
            lit = re.match(r'\s*\(?\s*"([^"]+)"', entry)
            if lit:
                found.add(lit.group(1))
    return found


# ---------------------------------------------------------------- CLI


def arg_words(attrs, name):
    """The words of `name(...)` attributes (`arg`, `command`, `clap`)."""
    out = []
    for a in attrs:
        m = re.match(r"%s\s*\((.*)\)\s*$" % name, a, re.S)
        if m:
            out += [p.strip() for p in split_top(m.group(1))]
    return out


def kebab(name):
    return re.sub(r"(?<!^)(?=[A-Z])", "-", name).lower().replace("_", "-")


def cli(source):
    """({command path}, {(command path, --flag)})."""
    commands, flags = set(), set()
    for items in source.items.values():
        for item in items:
            if item.kind != "struct" or not item.derives("Parser"):
                continue
            named = [w for w in arg_words(item.attrs, "command") + arg_words(item.attrs, "clap")
                     if w.startswith("name")]
            m = re.search(r'"([^"]+)"', named[0]) if named else None
            binary = m.group(1) if m else item.crate
            commands.add(binary)
            cli_struct(source, item, binary, commands, flags)
    return commands, flags


def cli_struct(source, item, path, commands, flags):
    for attrs, text in item.members():
        parts = field_parts(text)
        if parts:
            cli_field(source, item, attrs, parts, path, commands, flags)


def cli_field(source, frm, attrs, parts, path, commands, flags):
    name, ty = parts
    words = arg_words(attrs, "arg") + arg_words(attrs, "clap")
    cmd = arg_words(attrs, "command") + arg_words(attrs, "clap")
    target = source.resolve(inner_type(ty), frm)
    if "flatten" in cmd and target is not None:
        cli_struct(source, target, path, commands, flags)
    elif "subcommand" in cmd and target is not None:
        cli_enum(source, target, path, commands, flags)
    else:
        for w in words:
            m = re.match(r'long\s*(?:=\s*"([^"]+)")?$', w)
            if m:
                flags.add((path, "--" + (m.group(1) or name.replace("_", "-"))))


def cli_enum(source, item, path, commands, flags):
    for attrs, text in item.members():
        m = re.match(r"(\w+)\s*(.*)$", text.strip(), re.S)
        if not m:
            continue
        named = [w for w in arg_words(attrs, "command") if w.startswith("name")]
        nm = re.search(r'"([^"]+)"', named[0]) if named else None
        sub = f"{path} {nm.group(1) if nm else kebab(m.group(1))}"
        commands.add(sub)
        rest = m.group(2).strip()
        if rest.startswith("{"):
            body = rest[1:matching(rest, 0) - 1]
            for fattrs, ftext in (take_attrs(p) for p in split_top(body) if p.strip()):
                parts = field_parts(ftext)
                if parts:
                    cli_field(source, item, fattrs, parts, sub, commands, flags)
        elif rest.startswith("("):
            target = source.resolve(inner_type(rest[1:matching(rest, 0) - 1]), item)
            if target is not None and target.kind == "struct":
                cli_struct(source, target, sub, commands, flags)
            elif target is not None:
                cli_enum(source, target, sub, commands, flags)


# ---------------------------------------------------------------- the docs


def code_spans(text):
    """Inline code spans of markdown text (fenced blocks left out)."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.S | re.M)
    return [m.group(2).strip() for m in
            re.finditer(r"(`+)((?:(?!\n[ \t]*\n)[\s\S])+?)(?<!`)\1(?!`)", text)]


class Docs:
    """The docs' code spans, and the spans under each heading's scope."""

    def __init__(self, texts):
        self.spans = []
        self.scoped = []  # (heading's spans, spans of its scope)
        for text in texts:
            text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.S | re.M)
            self.spans += code_spans(text)
            heads = [(len(m.group(1)), m.start(), m.group(2))
                     for m in re.finditer(r"^(#{1,6})\s+(.*)$", text, re.M)]
            for i, (level, start, title) in enumerate(heads):
                end = len(text)
                for lv, st, _ in heads[i + 1:]:
                    if lv <= level:
                        end = st
                        break
                self.scoped.append(({s for s in code_spans(title)},
                                    code_spans(text[start:end])))

    @staticmethod
    def has(span, token):
        return re.search(r"(?<![%s])%s(?![%s])" % (EDGE, re.escape(token), EDGE), span) is not None

    def anywhere(self, token):
        return any(self.has(s, token) for s in self.spans)

    def scoped_has(self, scopes, token, together=()):
        """`token` under a heading holding one of `scopes`, or in one span with
        one of `together`."""
        for heads, spans in self.scoped:
            if heads & set(scopes) and any(self.has(s, token) for s in spans):
                return True
        return any(self.has(s, token) and any(t in s for t in together) for s in self.spans)


def read_docs(repo):
    folder = os.path.join(repo, "docs")
    texts = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if name.endswith(".md") and os.path.isfile(os.path.join(folder, name)):
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                texts.append(f.read())
    return Docs(texts)


# ---------------------------------------------------------------- the check


def items(source):
    """[(category, label, present(docs) -> bool)] of everything the code has."""
    out = []
    for (section, key), bins in sorted(config_keys(source).items()):
        label = f"[{section}] {key} ({', '.join(sorted(bins))})"
        out.append(("config key", label, key, lambda d, s=section, k=key: (
            d.scoped_has([f"[{s}]", f"[[{s}]]"], k, together=[f"[{s}]"])
            or d.anywhere(f"{s}.{k}"))))
    for path, by in sorted(routes(source).items()):
        methods = sorted({m for ms in by.values() for m in ms})
        label = f"{'|'.join(methods)} {path} ({', '.join(sorted(by))})"
        out.append(("route", label, path, lambda d, p=path: d.anywhere(p)))
    for name in sorted(props(source)):
        out.append(("prop", name, name, lambda d, n=name: d.anywhere(n)))
    for name in sorted(key_limits(source)):
        out.append(("key limit", name, name, lambda d, n=name: (
            d.scoped_has(["limits"], n) or d.anywhere(f"limits.{n}"))))
    for name, (kind, path) in sorted(metrics(source).items()):
        out.append(("metric", f"{name} ({kind})", name, lambda d, n=name: d.anywhere(n)))
    for name in sorted(openai_fields(source)):
        out.append(("openai field", name, name, lambda d, n=name: d.anywhere(n)))
    commands, flags = cli(source)
    for path in sorted(commands):
        out.append(("cli command", path, path, lambda d, p=path: d.anywhere(p)))
    for path, flag in sorted(flags):
        out.append(("cli flag", f"{path} {flag}", flag,
                    lambda d, p=path, f=flag: d.scoped_has([p], f, together=[p + " "])))
    return out


def check(repo):
    """[(category, label)] of the items missing from the docs."""
    source = Source(repo)
    docs = read_docs(repo)
    return [(cat, label) for cat, label, name, present in items(source)
            if (cat, name) not in EXEMPT and not present(docs)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repo", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    ap.add_argument("--list", action="store_true", help="print every item found, and stop")
    args = ap.parse_args(argv)
    try:
        if args.list:
            counts = defaultdict(int)
            for cat, label, name, _ in items(Source(args.repo)):
                exempt = f"  (exempt: {EXEMPT[(cat, name)]})" if (cat, name) in EXEMPT else ""
                print(f"{cat} {label}{exempt}")
                counts[cat] += 1
            print(", ".join(f"{n} {c}s" for c, n in counts.items()), file=sys.stderr)
            return 0
        missing = check(args.repo)
    except (SourceError, OSError) as e:
        print(f"check-doc-coverage: {e}", file=sys.stderr)
        return 2
    for cat, label in missing:
        print(f"{cat} {label}: not in docs/")
    if missing:
        print(f"{len(missing)} items missing from docs/*.md", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
