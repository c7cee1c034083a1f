#!/usr/bin/env python3
"""Self-test of check-guides.py: tiny fake repositories (and git histories) in a temporary
directory, each rule passing and failing.  Run: python3 scripts/test_check_guides.py"""
import contextlib
import importlib.util
import io
import os
import subprocess
import tempfile
import textwrap
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "check-guides.py")
spec = importlib.util.spec_from_file_location("check_guides", SCRIPT)
cg = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cg)

CONTRIBUTING = """\
# Contributing

- [A guide](docs/contributing/guide.md)
- [Another](./docs/contributing/other.md)

Run `cargo test --release -p x --test it` (a command: not a path), see
`ARCHITECTURE.md`, `crates/x/src/lib.rs`, the folder `crates/x/src/`, and
`crates/x/src/lib.rs#L1` (a fragment). Skipped: `crates/x/src/<name>.rs`,
`crates/*/tests`, `{a,b}.rs`, `pie:inferlet/shaping`, `/v1/completions`,
`~/.cache/pie`, `--arch`, `KEY=a/b`, `deadline-ms`, `pie_policy::Scheduler`.

```sh
python3 scripts/not-here-yet.py   # fenced: not checked
see `crates/missing.rs` inside the fence
```
"""

GUIDE = """\
# A guide

Edit `crates/x/src/lib.rs`, then read [the map](../../ARCHITECTURE.md) and
[the other](other.md#anchor) and [upstream](https://example.com/x).
"""

OTHER = "# Other\n\nSee `crates/x/src/lib.rs`.\n"

ARCH = """\
# Architecture

Prose naming `crates/x/src/lib.rs` and [a file](crates/x/src/lib.rs).

## x

| layer | files | owns |
|---|---|---|
| 0 | `lib.rs` | the root |
| - | `../tests/it.rs` | tests, outside src/ but inside the repository |

Routes such as `/health` name no directory.
"""

FILES = {
    "CONTRIBUTING.md": CONTRIBUTING,
    "docs/contributing/guide.md": GUIDE,
    "docs/contributing/other.md": OTHER,
    "ARCHITECTURE.md": ARCH,
    "crates/x/src/lib.rs": "//! The root.\n",
    "crates/x/tests/it.rs": "",
}


def write(root, files):
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)


def git(root, *args):
    cmd = ["git", "-C", root, "-c", "user.name=t", "-c", "user.email=t@example.com",
           "-c", "commit.gpgsign=false", *args]
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


def commit(root, subject, body=None):
    with open(os.path.join(root, "log.txt"), "a", encoding="utf-8") as f:
        f.write(subject + "\n")
    git(root, "add", "log.txt")
    args = ["commit", "-q", "-m", subject] + (["-m", body] if body else [])
    git(root, *args)
    return git(root, "rev-parse", "--short", "HEAD")


def quiet(fn, *args):
    """fn(*args) with its stderr captured: (result, stderr text)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        result = fn(*args)
    return result, err.getvalue()


class Case(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.root = os.path.realpath(self.tmp.name)
        write(self.root, FILES)

    def tearDown(self):
        self.tmp.cleanup()

    def edit(self, rel, old, new):
        path = os.path.join(self.root, rel)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        self.assertIn(old, text)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text.replace(old, new))


class Paths(Case):
    def test_the_fixture_passes(self):
        self.assertEqual(cg.check_paths(self.root), [])
        self.assertEqual(cg.check_architecture_links(self.root), [])

    def test_a_missing_backticked_path_is_named_with_its_line(self):
        self.edit("docs/contributing/guide.md", "`crates/x/src/lib.rs`", "`crates/x/src/gone.rs`")
        self.assertEqual(cg.check_paths(self.root),
                         ["docs/contributing/guide.md:3: path `crates/x/src/gone.rs` does not exist"])

    def test_a_bare_file_name_is_taken_from_the_root(self):
        self.edit("docs/contributing/other.md", "`crates/x/src/lib.rs`", "`lib.rs`")
        self.assertEqual(cg.check_paths(self.root),
                         ["docs/contributing/other.md:3: path `lib.rs` does not exist"])

    def test_a_file_named_as_a_folder_fails(self):
        self.edit("CONTRIBUTING.md", "`crates/x/src/`", "`crates/x/src/lib.rs/`")
        problems = cg.check_paths(self.root)
        self.assertEqual(len(problems), 1, problems)
        self.assertIn("is no directory", problems[0])

    def test_a_path_leaving_the_repository_fails(self):
        self.edit("docs/contributing/other.md", "`crates/x/src/lib.rs`", "`../shared/notes.md`")
        self.assertEqual(cg.check_paths(self.root),
                         ["docs/contributing/other.md:3: path `../shared/notes.md` points outside the repository"])

    def test_a_broken_relative_link_fails_and_links_resolve_from_their_file(self):
        self.edit("docs/contributing/guide.md", "(other.md#anchor)", "(others.md)")
        self.assertEqual(cg.check_paths(self.root),
                         ["docs/contributing/guide.md:4: link `others.md` does not exist"])

    def test_a_guide_not_linked_from_contributing_fails(self):
        write(self.root, {"docs/contributing/third.md": "# Third\n"})
        self.assertEqual(cg.check_paths(self.root),
                         ["docs/contributing/third.md: not linked from CONTRIBUTING.md"])

    def test_a_missing_contributing_fails(self):
        os.remove(os.path.join(self.root, "CONTRIBUTING.md"))
        problems = cg.check_paths(self.root)
        self.assertIn("CONTRIBUTING.md: missing", problems)

    def test_what_reads_as_a_path(self):
        for span in ["crates/x/src/lib.rs", "ARCHITECTURE.md", "wit/0.2.0/inferlet.wit", "docs/", "a.py#L3"]:
            self.assertIsNotNone(cg.path_of_span(span), span)
        for span in ["cargo test -p x", "crates/<name>.rs", "crates/*/tests", "{a,b}.rs", "a/.../b",
                     "pie:inferlet/shaping", "/v1/completions", "~/.cache/pie", "--arch", "KEY=a/b",
                     "deadline-ms", "pie_policy::Scheduler", "config", "0.2.0"]:
            self.assertIsNone(cg.path_of_span(span), span)


class ArchitectureLinks(Case):
    def test_an_http_link_fails(self):
        self.edit("ARCHITECTURE.md", "[a file](crates/x/src/lib.rs)", "[a page](https://example.com/p)")
        self.assertEqual(cg.check_architecture_links(self.root),
                         ["ARCHITECTURE.md:3: links outside the repository: https://example.com/p"])

    def test_a_bare_url_fails(self):
        self.edit("ARCHITECTURE.md", "Routes such", "See http://example.com. Routes such")
        problems = cg.check_architecture_links(self.root)
        self.assertEqual(len(problems), 1, problems)
        self.assertIn("http://example.com", problems[0])

    def test_a_link_leaving_the_root_fails(self):
        self.edit("ARCHITECTURE.md", "(crates/x/src/lib.rs)", "(../shared/DESIGN.md)")
        self.assertEqual(cg.check_architecture_links(self.root),
                         ["ARCHITECTURE.md:3: link leaves the repository: ../shared/DESIGN.md"])

    def test_a_file_scheme_link_fails(self):
        self.edit("ARCHITECTURE.md", "(crates/x/src/lib.rs)", "(file:///etc/hosts)")
        self.assertEqual(len(cg.check_architecture_links(self.root)), 1)

    def test_a_backticked_path_leaving_the_root_fails(self):
        self.edit("ARCHITECTURE.md", "Prose naming `crates/x/src/lib.rs`", "Prose naming `../shared/DESIGN.md`")
        self.assertEqual(cg.check_architecture_links(self.root),
                         ["ARCHITECTURE.md:3: names a path outside the repository: `../shared/DESIGN.md`"])

    def test_a_crate_relative_path_resolves_from_its_crates_src(self):
        # From crates/x/src, `../../../y` is the root's y/ (inside), `../../../../y` is not;
        # from the root (no crate section) `../tests/it.rs` would leave it.
        self.edit("ARCHITECTURE.md", "`../tests/it.rs`", "`../../../y/it.rs`, `../../../../y/it.rs`")
        problems = cg.check_architecture_links(self.root)
        self.assertEqual(len(problems), 1, problems)
        self.assertIn("`../../../../y/it.rs`", problems[0])
        self.edit("ARCHITECTURE.md", "Prose naming `crates/x/src/lib.rs`", "Prose naming `../tests/it.rs`")
        problems = cg.check_architecture_links(self.root)
        self.assertEqual(len(problems), 2, problems)
        self.assertIn("ARCHITECTURE.md:3:", problems[0])

    def test_an_absolute_path_to_an_existing_directory_fails(self):
        outside = tempfile.gettempdir() + "/elsewhere.md"
        self.edit("ARCHITECTURE.md", "Routes such", f"A note at `{outside}`. Routes such")
        problems = cg.check_architecture_links(self.root)
        self.assertEqual(len(problems), 1, problems)
        self.assertIn(outside, problems[0])


class Commits(Case):
    def setUp(self):
        super().setUp()
        git(self.root, "init", "-q")
        self.base = commit(self.root, "base")

    def test_short_subjects_pass_and_a_long_one_fails(self):
        commit(self.root, "x" * 72, "a body may be as long as it likes " * 5)
        self.assertEqual(quiet(cg.check_commits, self.root, self.base)[0], [])
        long = commit(self.root, "y" * 73)
        problems, _ = quiet(cg.check_commits, self.root, self.base)
        self.assertEqual(len(problems), 1, problems)
        self.assertTrue(problems[0].startswith(f"commit {long}: subject is 73 characters"), problems[0])

    def test_the_since_commit_itself_is_not_checked(self):
        base = commit(self.root, "z" * 80)
        self.assertEqual(quiet(cg.check_commits, self.root, base)[0], [])

    def test_characters_not_bytes_are_counted(self):
        commit(self.root, "\u00e9" * 72)
        self.assertEqual(quiet(cg.check_commits, self.root, self.base)[0], [])

    def test_a_since_that_is_not_an_ancestor_is_skipped_on_stderr(self):
        git(self.root, "checkout", "-q", "-b", "side")
        side = commit(self.root, "on a side branch")
        git(self.root, "checkout", "-q", "-")
        commit(self.root, "w" * 90)
        problems, err = quiet(cg.check_commits, self.root, side)
        self.assertEqual(problems, [])
        self.assertIn("not an ancestor", err)

    def test_an_unknown_since_is_skipped_on_stderr(self):
        problems, err = quiet(cg.check_commits, self.root, "0123456789abcdef0123")
        self.assertEqual(problems, [])
        self.assertIn("not in this clone", err)

    def test_no_git_checkout_is_skipped_on_stderr(self):
        with tempfile.TemporaryDirectory() as bare:
            problems, err = quiet(cg.check_commits, bare, "d79d21d")
        self.assertEqual(problems, [])
        self.assertIn("no git checkout", err)


class Main(Case):
    def run_main(self):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            code = cg.main(["--repo", self.root, "--since", "HEAD"])
        return code, out.getvalue()

    def test_exit_0_when_clean_and_1_with_one_line_per_problem(self):
        code, out = self.run_main()
        self.assertEqual(code, 0, out)
        self.edit("docs/contributing/guide.md", "`crates/x/src/lib.rs`", "`crates/x/src/gone.rs`")
        self.edit("ARCHITECTURE.md", "(crates/x/src/lib.rs)", "(http://example.com)")
        code, out = self.run_main()
        self.assertEqual(code, 1)
        self.assertEqual(len(out.strip().split("\n")), 2, out)


class Fences(unittest.TestCase):
    def test_fences_are_blanked_keeping_offsets(self):
        text = textwrap.dedent("""\
            a `x.rs`
            ```
            `in.rs`
            ```
            b `y.rs`
            """)
        body = cg.blank_fences(text)
        self.assertEqual(len(body), len(text))
        self.assertEqual([(line, s) for _, line, s in cg.code_spans(text)], [(1, "x.rs"), (5, "y.rs")])


if __name__ == "__main__":
    unittest.main()
