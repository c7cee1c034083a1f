#!/usr/bin/env python3
"""Self-test of check-architecture.py: tiny fake repos in a temporary directory, one planted problem
each.  Run: python3 scripts/test_check_architecture.py"""
import importlib.util
import os
import subprocess
import sys
import tempfile
import textwrap
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "check-architecture.py")
spec = importlib.util.spec_from_file_location("check_architecture", SCRIPT)
ca = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ca)

MAP = """\
# Architecture

Prose before the crates is ignored, and so is this table:

| crate | what |
|---|---|
| x | the only crate |

## x

| layer | files | owns |
|---|---|---|
| 0 | `low.rs` | the leaf |
| 1 | `high.rs`, `metrics.rs` | above the leaf |
| 1 | `peer.rs` | beside high |
| 1 | `sub/` | a directory of its own |
| 2 | `sub/top.rs` | the directory's upper file |
| 3 | `lib.rs` | the crate root |
| - | `../tests/it.rs` | integration tests (outside src/: only checked to exist) |
"""

LIB = """\
//! The crate root.
pub mod high;
pub mod low;
pub mod metrics;
pub mod peer;
pub mod sub;

pub use high::High;
"""

FILES = {
    "low.rs": "//! The leaf.\npub struct Low;\n\npub fn low() -> u32 {\n    1\n}\n",
    "high.rs": "use crate::low::Low;\n\npub struct High(pub Low);\n\npub fn f() -> u32 {\n    crate::low::low()\n}\n",
    "metrics.rs": "use crate::low;\n\npub fn register() {}\n",
    "peer.rs": "use crate::high::High;\n\npub fn peer(_: High) {}\n",
    "sub/mod.rs": "pub mod leaf;\npub mod top;\n\npub use leaf::Leaf;\n",
    "sub/leaf.rs": "use crate::low::Low;\n\npub struct Leaf(pub Low);\n",
    "sub/top.rs": "use super::leaf::Leaf;\nuse super::Leaf as Again;\n\npub fn top(_: Leaf, _: Again) {}\n",
}


def body(n):
    """A function of exactly n lines (n >= 2)."""
    return "pub fn long() -> u32 {\n" + "    let _x = 1;\n" * (n - 3) + "    1\n}\n"


class Repo:
    """A fake workspace: crates/x/src with FILES and LIB, and ARCHITECTURE.md with MAP."""

    def __init__(self, files=None, arch=MAP):
        self.tmp = tempfile.TemporaryDirectory()
        self.root = self.tmp.name
        src = os.path.join(self.root, "crates", "x", "src")
        all_files = {"lib.rs": LIB, **FILES, **(files or {})}
        for rel, text in all_files.items():
            if text is None:
                continue
            p = os.path.join(src, rel)
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(p, "w") as f:
                f.write(text)
        os.makedirs(os.path.join(self.root, "crates", "x", "tests"), exist_ok=True)
        with open(os.path.join(self.root, "crates", "x", "tests", "it.rs"), "w") as f:
            f.write("use x::high::High;\nfn main() {}\n" + body(300))  # tests/ is not checked
        with open(os.path.join(self.root, "ARCHITECTURE.md"), "w") as f:
            f.write(arch)

    def problems(self, **kw):
        return ca.check(self.root, os.path.join(self.root, "ARCHITECTURE.md"), **kw)

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.tmp.cleanup()


class CheckArchitecture(unittest.TestCase):
    def assertOne(self, problems, *parts):
        """Exactly one problem, holding every part."""
        self.assertEqual(len(problems), 1, "\n".join(problems))
        for p in parts:
            self.assertIn(p, problems[0])

    def assertRule(self, problems, rule, *parts):
        """Exactly one problem of the rule, holding every part (a back edge is often a cycle too)."""
        self.assertOne([p for p in problems if f" {rule}: " in p], *parts)

    def test_confined_pattern_outside_its_files(self):
        table = "\n| pattern | only in | why |\n|---|---|---|\n| `\\bLow\\s*\\{` | `low.rs` | one constructor |\n"
        arch = MAP + table
        with Repo(arch=arch) as r:
            self.assertEqual(r.problems(), [])
        planted = {"peer.rs": FILES["peer.rs"] + "pub fn make() {\n    let _low = crate::low::Low {};\n}\n"}
        with Repo(planted, arch=arch) as r:
            self.assertRule(r.problems(), "confined", "crates/x/src/peer.rs:5:", "only in low.rs")
        commented = {"peer.rs": FILES["peer.rs"] + "// Low { } in a comment\n"}
        with Repo(commented, arch=arch) as r:
            self.assertEqual(r.problems(), [])
        with Repo(arch=MAP + table.replace("`low.rs`", "")) as r:
            self.assertRule(r.problems(), "map", "needs a backticked pattern and paths")

    def test_map_over_20480_bytes_fails(self):
        with Repo(arch=MAP + "x" * (ca.MAX_MAP_BYTES - len(MAP))) as r:
            self.assertEqual(r.problems(), [])
        with Repo(arch=MAP + "x" * (ca.MAX_MAP_BYTES - len(MAP) + 1)) as r:
            self.assertRule(r.problems(), "size", "20481 bytes (limit 20480)")

    def test_clean_tree_passes(self):
        with Repo() as r:
            self.assertEqual(r.problems(), [])

    def test_back_edge_through_use(self):
        with Repo({"low.rs": FILES["low.rs"] + "use crate::high::High;\n"}) as r:
            self.assertRule(r.problems(), "layers", "crates/x/src/low.rs:7:", "low (layer 0)", "high (high.rs, layer 1)", "use crate::high::High")

    def test_back_edge_through_grouped_use(self):
        with Repo({"low.rs": "use crate::{high::High};\n" + FILES["low.rs"]}) as r:
            self.assertRule(r.problems(), "layers", "crates/x/src/low.rs:1:", "high.rs, layer 1")
        with Repo({"low.rs": "use crate::{\n    peer,\n    sub::{top::top},\n};\n" + FILES["low.rs"]}) as r:
            ps = [p for p in r.problems() if " layers: " in p]
            self.assertEqual(len(ps), 2, ps)
            self.assertIn("peer.rs, layer 1", ps[0])
            self.assertIn("sub/top.rs, layer 2", ps[1])

    def test_back_edge_through_inline_path(self):
        low = "pub struct Low;\n\npub fn low() -> u32 {\n    crate::high::f()\n}\n"
        with Repo({"low.rs": low}) as r:
            self.assertRule(r.problems(), "layers", "crates/x/src/low.rs:4:", "through `crate::high::f`")

    def test_back_edge_through_super(self):
        # sub/leaf.rs (layer 1, from `sub/`) to its higher sibling sub/top.rs (layer 2)
        leaf = FILES["sub/leaf.rs"] + "\npub fn g() {\n    super::top::top(todo!(), todo!())\n}\n"
        with Repo({"sub/leaf.rs": leaf}) as r:
            self.assertRule(r.problems(), "layers", "crates/x/src/sub/leaf.rs:6:", "sub::leaf (layer 1)", "sub::top (sub/top.rs, layer 2)", "super::top::top")
        with Repo({"sub/leaf.rs": "use super::top;\n" + FILES["sub/leaf.rs"]}) as r:
            self.assertRule(r.problems(), "layers", "crates/x/src/sub/leaf.rs:1:", "use super::top")

    def test_super_inside_an_inline_module(self):
        # `super::` in `mod inner { .. }` of low.rs is low itself, not the crate root
        low = FILES["low.rs"] + "mod inner {\n    use super::Low;\n    pub fn g(_: Low) {}\n}\n"
        with Repo({"low.rs": low, "lib.rs": LIB + "pub struct Root;\n"}) as r:
            self.assertEqual(r.problems(), [])
        # and two levels up from an inline module of sub/leaf.rs is sub/mod.rs's parent, the root
        leaf = FILES["sub/leaf.rs"] + "mod inner {\n    pub fn g() {\n        super::super::super::high::f();\n    }\n}\n"
        with Repo({"sub/leaf.rs": leaf}) as r:
            self.assertEqual(r.problems(), [])
        leaf = leaf.replace("super::super::super::high::f()", "super::super::top::top(todo!(), todo!())")
        with Repo({"sub/leaf.rs": leaf}) as r:
            self.assertRule(r.problems(), "layers", "sub/leaf.rs:6:", "sub/top.rs, layer 2", "super::super::top::top")

    def test_reexport_resolves_to_the_defining_module(self):
        # `crate::High` is lib.rs's `pub use high::High`: an edge to high.rs, not to the root
        with Repo({"low.rs": FILES["low.rs"] + "pub fn h(_: crate::High) {}\n"}) as r:
            self.assertRule(r.problems(), "layers", "low.rs:7:", "high.rs, layer 1", "crate::High")
        with Repo({"peer.rs": "use crate::High;\n\npub fn peer(_: High) {}\n"}) as r:
            self.assertEqual(r.problems(), [])

    def test_edge_to_the_root_counts(self):
        lib = LIB + "\npub fn root_item() {}\n"
        with Repo({"lib.rs": lib, "high.rs": FILES["high.rs"] + "pub fn r() {\n    crate::root_item()\n}\n"}) as r:
            ps = r.problems()
            self.assertTrue(any("high.rs:9:" in p and "crate root (lib.rs, layer 3)" in p for p in ps), ps)

    def test_cycle_in_one_layer(self):
        high = FILES["high.rs"] + "pub fn back() {\n    crate::peer::peer(todo!())\n}\n"
        with Repo({"high.rs": high}) as r:
            self.assertOne(r.problems(), "crates/x/src/high.rs:", "cycle: 2 modules", "high.rs:9 -> peer.rs:1 -> high.rs")

    def test_missing_mapped_file(self):
        with Repo({"peer.rs": None}) as r:
            ps = [p for p in r.problems() if "peer" in p]
            self.assertTrue(any("ARCHITECTURE.md:15: map: crates/x/src/peer.rs is named in the map but missing" in p for p in ps), ps)

    def test_missing_file_outside_src(self):
        with Repo(arch=MAP.replace("`../tests/it.rs`", "`../tests/gone.rs`")) as r:
            self.assertOne(r.problems(), "ARCHITECTURE.md:19: map: crates/x/tests/gone.rs is named in the map but missing")
        with Repo(arch=MAP + "| - | `low.rs` | a layer for a source file |\n") as r:
            self.assertOne(r.problems(), "ARCHITECTURE.md:20: map: layer `-` is not a whole number (`-` only for paths outside src/)")

    def test_unmapped_source_file(self):
        with Repo({"stray.rs": "pub fn s() {}\n"}) as r:
            self.assertOne(r.problems(), "crates/x/src/stray.rs: map: not named in ARCHITECTURE.md (## x)")

    def test_directory_row_covers_new_files(self):
        with Repo({"sub/more.rs": "use crate::low::Low;\n"}) as r:
            self.assertEqual(r.problems(), [])

    def test_crate_without_section(self):
        with Repo(arch=MAP.replace("## x", "## y")) as r:
            ps = r.problems()
            self.assertIn("crates/x: map: no `## x` section with a layer table in ARCHITECTURE.md", ps)
            self.assertTrue(any("a layer table under `## y`" in p for p in ps), ps)

    def test_bad_layer_cell(self):
        with Repo(arch=MAP.replace("| 3 | `lib.rs`", "| top | `lib.rs`")) as r:
            ps = r.problems()
            self.assertTrue(any("layer `top` is not a whole number" in p for p in ps), ps)

    def test_file_of_801_lines_fails_800_passes(self):
        with Repo({"low.rs": FILES["low.rs"] + "\n" * (800 - 6)}) as r:
            self.assertEqual(r.problems(), [])
        with Repo({"low.rs": FILES["low.rs"] + "\n" * (801 - 6)}) as r:
            self.assertOne(r.problems(), "crates/x/src/low.rs: size: 801 lines")

    def test_function_of_121_lines_fails_120_passes(self):
        with Repo({"low.rs": FILES["low.rs"] + body(120)}) as r:
            self.assertEqual(r.problems(), [])
        with Repo({"low.rs": FILES["low.rs"] + body(121)}) as r:
            self.assertOne(r.problems(), "crates/x/src/low.rs:7: size: fn long has 121 lines")

    def test_long_function_in_metrics_rs_passes(self):
        with Repo({"metrics.rs": FILES["metrics.rs"] + body(300)}) as r:
            self.assertEqual(r.problems(), [])

    def test_test_module_does_not_count(self):
        tests = "\n#[cfg(test)]\nmod tests {\n    use crate::high::High;\n" + body(200) + "\n" * 900 + "}\n"
        with Repo({"low.rs": FILES["low.rs"] + tests}) as r:
            self.assertEqual(r.problems(), [])
        # a test-only file (`#[cfg(test)] mod t;`) has no edges and no limits
        with Repo({"low.rs": "#[cfg(test)]\nmod t;\n" + FILES["low.rs"], "low/t.rs": "use crate::high::High;\n" + body(200)}) as r:
            self.assertOne(r.problems(), "crates/x/src/low/t.rs: map: not named")
        # `#[cfg(test)]` on a function is ordinary code, counted
        with Repo({"low.rs": FILES["low.rs"] + "#[cfg(test)]\nfn t() {\n    crate::high::f();\n}\n"}) as r:
            self.assertRule(r.problems(), "layers", "low.rs:9:", "crate::high::f")

    def test_comments_and_strings_do_not_count(self):
        low = FILES["low.rs"] + textwrap.dedent(
            """\
            // use crate::high::High;
            /// Calls `crate::high::f()`.
            /* use crate::high::High;
               /* nested */ crate::high::f() */
            pub fn s() -> &'static str {
                let _c = '{';
                let _r = r#"use crate::high::High; "{"#;
                "crate::high::f() {"
            }
            """
        )
        with Repo({"low.rs": low}) as r:
            self.assertEqual(r.problems(), [])
        # and the braces inside them do not change a function's length
        with Repo({"low.rs": FILES["low.rs"] + "pub fn q() -> char {\n    '}'\n}\n" + body(121)}) as r:
            self.assertOne(r.problems(), "fn long has 121 lines")

    def test_an_edge_to_the_parent_counts(self):
        # sub/mod.rs holding an item its child imports, while it imports the child: a cycle
        sub = FILES["sub/mod.rs"] + "pub struct Shared;\n"
        leaf = "use super::Shared;\n" + FILES["sub/leaf.rs"]
        with Repo({"sub/mod.rs": sub, "sub/leaf.rs": leaf}) as r:
            self.assertOne(r.problems(), "cycle: 2 modules", "sub/leaf.rs:1 -> sub/mod.rs:4 -> sub/leaf.rs")

    def test_drafted_map_passes_and_keeps_the_order(self):
        with Repo() as r:
            lines = ca.draft(r.root)
            self.assertIn("| 0 | `low.rs` | The leaf. |", lines)
            self.assertLess(lines.index("| 0 | `low.rs` | The leaf. |"), [i for i, l in enumerate(lines) if "`high.rs`" in l][0])
            draft = os.path.join(r.root, "draft.md")
            with open(draft, "w") as f:
                f.write("\n".join(lines) + "\n")
            self.assertEqual(ca.check(r.root, draft), [])

    def test_cli_exit_codes_and_map_option(self):
        with Repo() as r:
            run = lambda *a: subprocess.run([sys.executable, SCRIPT, "--repo", r.root, *a], capture_output=True, text=True)
            ok = run("--report")
            self.assertEqual(ok.returncode, 0, ok.stdout + ok.stderr)
            self.assertIn("x: 8 files", ok.stdout)
            self.assertIn("0 cycles", ok.stdout)
            draft = os.path.join(r.root, "draft.md")
            with open(draft, "w") as f:
                f.write(MAP.replace("| 0 | `low.rs`", "| 5 | `low.rs`"))
            bad = run("--map", draft)
            self.assertEqual(bad.returncode, 1)
            self.assertIn("crates/x/src/high.rs:1: layers: high (layer 1) imports low (low.rs, layer 5)", bad.stdout)
            self.assertEqual(run("--map", os.path.join(r.root, "nope.md")).returncode, 2)


if __name__ == "__main__":
    unittest.main()
