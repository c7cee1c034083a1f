#!/usr/bin/env python3
"""Self-test of check-benchmarks.py: tiny git repos in a temporary directory (so commit hashes are
real), one passing layout and one planted problem per case.  Run: python3 scripts/test_check_benchmarks.py"""
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "check-benchmarks.py")
spec = importlib.util.spec_from_file_location("check_benchmarks", SCRIPT)
cb = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cb)


def git(repo, *args):
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.com",
               GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@example.com")
    return subprocess.run(["git", "-C", repo, "-c", "commit.gpgsign=false", *args], env=env,
                          check=True, capture_output=True, text=True).stdout.strip()


TABLE = """\
# Benchmarks

What the table is.

| What | Figure | Command | Machine | Date, commit |
|---|---|---|---|---|
| Decode beside llama.cpp | 1.86x (189.5 tok/s vs 101.9 tok/s); 11.8x at depth | `ROUNDS=3 scripts/bench.sh` | 2 vCPUs of an AMD EPYC, AVX2 | [2026-12-04, {new}](docs/benchmarks/engine.md#2026-12-04-{new}) |
| Pause of a move | 0.45 ms; 73.5% of the bound; 2,000 tokens; 0.94-1.01 | `scripts/move.py` | not stated | [2026-12-01, {old}](docs/benchmarks/engine.md) |

## Adding a result

Prose, no second table.
"""

HISTORY = """\
# Engine: history

Prose before the entries.

## 2026-12-04, {new}

**Decode beside llama.cpp**

Decode 1.86x.

```sh
## a line in a code block is no heading
```

### A sub-heading is free

## 2026-12-01, {old}

**Pause of a move**

Pause 0.45 ms.
"""

README = """\
# Pie

## How fast

On two vCPUs (`--rounds 3` and [the history](docs/benchmarks/engine.md#2026-12-04-{new}) are not read):

| what | figure |
|---|---|
| decode | 1.86x, 189.5 tok/s |
| pause | 0.45 ms, 73.5%, 2,000 tokens, 0.94-1.01 |

```sh
scripts/bench.sh --rounds 99   # code is not read
```

## Next section

42.5 ms and 3.3x are outside the section.
"""


class Repo:
    """A git repo with two commits and the three documents filled in with their hashes."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="check-bench-")
        git(self.dir, "init", "-q")
        hashes = []
        for n in (1, 2):
            with open(os.path.join(self.dir, f"f{n}"), "w") as f:
                f.write(str(n))
            git(self.dir, "add", f"f{n}")
            git(self.dir, "commit", "-q", "-m", f"c{n}")
            hashes.append(git(self.dir, "rev-parse", "--short=7", "HEAD"))
        self.old, self.new = hashes
        self.write("BENCHMARKS.md", TABLE)
        self.write("docs/benchmarks/engine.md", HISTORY)
        self.write("README.md", README)

    def fill(self, text):
        return text.replace("{old}", self.old).replace("{new}", self.new)

    def write(self, rel, text):
        path = os.path.join(self.dir, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(self.fill(text))

    def read(self, rel):
        with open(os.path.join(self.dir, rel)) as f:
            return f.read()

    def edit(self, rel, old, new):
        text = self.read(rel)
        old, new = self.fill(old), self.fill(new)
        assert old in text, (rel, old)
        with open(os.path.join(self.dir, rel), "w") as f:
            f.write(text.replace(old, new, 1))

    def run(self):
        r = subprocess.run([sys.executable, SCRIPT, "--repo", self.dir], capture_output=True,
                           text=True)
        return r.returncode, r.stdout

    def close(self):
        shutil.rmtree(self.dir, ignore_errors=True)


class Case(unittest.TestCase):
    def setUp(self):
        self.repo = Repo()

    def tearDown(self):
        self.repo.close()

    def problems(self):
        rc, out = self.repo.run()
        lines = [l for l in out.split("\n") if l]
        self.assertEqual(rc, 1 if lines else 0, out)
        return lines

    def assertProblem(self, fragment, count=None):
        lines = self.problems()
        hits = [l for l in lines if fragment in l]
        self.assertTrue(hits, f"no problem with {fragment!r} in {lines}")
        if count is not None:
            self.assertEqual(len(lines), count, lines)
        return hits


class Passing(Case):
    def test_the_fixture_passes(self):
        self.assertEqual(self.repo.run(), (0, ""))

    def test_a_repeated_heading_is_linked_with_its_suffix(self):
        self.repo.edit("docs/benchmarks/engine.md", "## 2026-12-01, {old}",
                       "## 2026-12-04, {new}\n\n**Again**\n\n## 2026-12-01, {old}")
        self.repo.edit("BENCHMARKS.md", "(docs/benchmarks/engine.md)",
                       "(docs/benchmarks/engine.md#2026-12-01-{old})")
        self.repo.edit("BENCHMARKS.md", "#2026-12-04-{new})", "#2026-12-04-{new}-1)")
        self.assertEqual(self.repo.run(), (0, ""))

    def test_a_full_hash_matches_the_entrys_short_one(self):
        full = git(self.repo.dir, "rev-parse", "HEAD")
        self.repo.edit("BENCHMARKS.md", "[2026-12-04, {new}]", f"[2026-12-04, {full}]")
        self.assertEqual(self.repo.run(), (0, ""))


class TableRule(Case):
    def test_a_second_table(self):
        self.repo.edit("BENCHMARKS.md", "Prose, no second table.", "| a | b |\n|---|---|\n| 1 | 2 |")
        self.assertProblem("2 tables", count=1)

    def test_no_table(self):
        text = "\n".join(l for l in self.repo.read("BENCHMARKS.md").split("\n")
                         if not l.startswith("|"))
        self.repo.write("BENCHMARKS.md", text)
        self.assertProblem("0 tables")

    def test_a_table_in_a_code_block_does_not_count(self):
        self.repo.edit("BENCHMARKS.md", "Prose, no second table.",
                       "```\n| a | b |\n|---|---|\n```")
        self.assertEqual(self.repo.run(), (0, ""))

    def test_wrong_columns(self):
        self.repo.edit("BENCHMARKS.md", "| What | Figure | Command | Machine | Date, commit |",
                       "| What | Figure | Machine | Date, commit |")
        self.assertProblem("the table's columns are")

    def test_a_row_with_a_cell_missing(self):
        self.repo.edit("BENCHMARKS.md", "| `scripts/move.py` | not stated |", "| not stated |")
        self.assertProblem("4 cells, not 5", count=1)

    def test_an_empty_cell(self):
        self.repo.edit("BENCHMARKS.md", "| not stated |", "|  |")
        self.assertProblem("the 'machine' cell is empty", count=1)

    def test_no_date(self):
        self.repo.edit("BENCHMARKS.md", "[2026-12-01, {old}]", "[{old}]")
        self.assertProblem("no date", count=1)

    def test_not_a_real_date(self):
        self.repo.edit("BENCHMARKS.md", "[2026-12-01, {old}]", "[2026-13-40, {old}]")
        self.assertProblem("2026-13-40 is not a real date", count=1)

    def test_no_commit(self):
        self.repo.edit("BENCHMARKS.md", "[2026-12-01, {old}]", "[2026-12-01]")
        self.assertProblem("no commit hash", count=1)

    def test_a_commit_the_repo_lacks(self):
        self.repo.edit("BENCHMARKS.md", "[2026-12-01, {old}]", "[2026-12-01, deadbee]")
        self.assertProblem("commit deadbee not found", count=1)

    def test_no_link(self):
        self.repo.edit("BENCHMARKS.md", "[2026-12-01, {old}](docs/benchmarks/engine.md)",
                       "2026-12-01, {old}")
        self.assertProblem("no link to its entry", count=1)

    def test_a_link_outside_the_history(self):
        self.repo.edit("BENCHMARKS.md", "(docs/benchmarks/engine.md)", "(README.md)")
        self.assertProblem("no link to its entry", count=1)

    def test_a_link_to_a_missing_file(self):
        self.repo.edit("BENCHMARKS.md", "(docs/benchmarks/engine.md)", "(docs/benchmarks/nope.md)")
        self.assertProblem("no such file", count=1)

    def test_an_anchor_naming_no_entry(self):
        self.repo.edit("BENCHMARKS.md", "(docs/benchmarks/engine.md)",
                       "(docs/benchmarks/engine.md#a-sub-heading-is-free)")
        self.assertProblem("names no entry", count=1)

    def test_an_anchor_to_another_entry(self):
        self.repo.edit("BENCHMARKS.md", "(docs/benchmarks/engine.md)",
                       "(docs/benchmarks/engine.md#2026-12-04-{new})")
        self.assertProblem("but its entry", count=1)


class HistoryRule(Case):
    def test_a_heading_that_is_not_date_and_commit(self):
        self.repo.edit("docs/benchmarks/engine.md", "## 2026-12-01, {old}", "## Pause of a move")
        hits = self.assertProblem("is not '## YYYY-MM-DD, <commit>'")
        self.assertIn("engine.md:", hits[0])

    def test_a_title_in_the_heading(self):
        self.repo.edit("docs/benchmarks/engine.md", "## 2026-12-01, {old}",
                       "## 2026-12-01, {old}: pause")
        self.assertProblem("is not '## YYYY-MM-DD, <commit>'")

    def test_not_a_real_date(self):
        self.repo.edit("docs/benchmarks/engine.md", "## 2026-12-01, {old}", "## 2026-02-30, {old}")
        self.assertProblem("2026-02-30 is not a real date", count=1)

    def test_a_commit_the_repo_lacks(self):
        self.repo.edit("docs/benchmarks/engine.md", "## 2026-12-01, {old}",
                       "## 2026-12-01, 0123456")
        self.assertProblem("commit 0123456 not found", count=1)

    def test_oldest_first(self):
        self.repo.edit("docs/benchmarks/engine.md", "## 2026-12-01, {old}", "## 2026-12-05, {old}")
        self.repo.edit("BENCHMARKS.md", "[2026-12-01, {old}]", "[2026-12-05, {old}]")
        self.assertProblem("entries go newest first", count=1)

    def test_no_bold_title(self):
        self.repo.edit("docs/benchmarks/engine.md", "**Pause of a move**\n", "Pause of a move\n")
        self.assertProblem("bold one-line title", count=1)

    def test_a_file_without_entries(self):
        self.repo.write("docs/benchmarks/empty.md", "# Empty\n\nNothing yet.\n")
        self.assertProblem("empty.md: no entry", count=1)

    def test_no_history_at_all(self):
        shutil.rmtree(os.path.join(self.repo.dir, "docs"))
        lines = self.problems()
        self.assertTrue(any("no .md file" in l for l in lines), lines)
        self.assertTrue(any("no such file" in l for l in lines), lines)


class ReadmeRule(Case):
    def test_no_how_fast_section(self):
        self.repo.edit("README.md", "## How fast", "## Speed")
        self.assertProblem("README has no How fast section", count=1)

    def test_no_readme(self):
        os.remove(os.path.join(self.repo.dir, "README.md"))
        self.assertProblem("README has no How fast section", count=1)

    def test_the_heading_may_go_on(self):
        self.repo.edit("README.md", "## How fast", "## How fast is it?")
        self.assertEqual(self.repo.run(), (0, ""))

    def test_a_section_without_a_table(self):
        text = "\n".join(l for l in self.repo.read("README.md").split("\n")
                         if not l.startswith("|"))
        self.repo.write("README.md", text)
        self.assertProblem("the How fast section has no table", count=1)

    def test_a_figure_not_in_the_table(self):
        self.repo.edit("README.md", "| decode | 1.86x,", "| decode | 1.87x,")
        hits = self.assertProblem("figure '1.87x' is not in", count=1)
        self.assertTrue(hits[0].startswith("README.md:9:"), hits)

    def test_a_figure_with_another_unit(self):
        self.repo.edit("README.md", "0.45 ms", "0.45 s")
        self.assertProblem("figure '0.45 s'", count=1)

    def test_a_figure_inside_a_longer_one_is_not_found(self):
        self.repo.edit("README.md", "| decode | 1.86x,", "| decode | 1.8x,")
        self.assertProblem("figure '1.8x'", count=1)

    def test_a_plain_integer_must_be_in_the_table_too(self):
        self.repo.edit("README.md", "2,000 tokens", "2,000 tokens on 7 workers")
        self.assertProblem("figure '7'", count=1)

    def test_a_figure_in_prose_of_the_section(self):
        self.repo.edit("README.md", "On two vCPUs", "On two vCPUs at 64.5%")
        self.assertProblem("figure '64.5%'", count=1)


class Figures(unittest.TestCase):
    def test_what_is_a_figure(self):
        line = ("189.5 tok/s, 1.86x, 73.5%, 0.45 ms, 2,000 tokens, 8 sequences, 30.23 GB/s, "
                "-0.6 ms, 0.94-1.01, 25,708,373,377, on 2026-12-04, a 1B file")
        self.assertEqual(cb.figures(line), [
            "189.5 tok/s", "1.86x", "73.5%", "0.45 ms", "2,000", "8", "30.23 GB/s", "-0.6 ms",
            "0.94-1.01", "25,708,373,377", "2026-12-04", "1B"])

    def test_what_is_not(self):
        line = ("Q4_K pp512 AVX2 Qwen3-0.6B Llama-3.2-1B 6dc8ee4 v0.3.2 0.3.36 tg64 16x16 "
                "`--rounds 3` [text](docs/x.md#2026-12-04-6dc8ee4) https://example.com/1.5 "
                "<!-- 7 -->")
        self.assertEqual(cb.figures(line), [])

    def test_a_link_keeps_its_text(self):
        self.assertEqual(cb.figures("[1.86x](docs/benchmarks/x.md#2026-12-04-abcdef0)"), ["1.86x"])

    def test_found_in_needs_boundaries(self):
        text = "11.8x; 2,000 tokens; 0.45 ms; (3.0)"
        self.assertTrue(cb.found_in("2,000", text))
        self.assertTrue(cb.found_in("0.45 ms", text))
        self.assertTrue(cb.found_in("3.0", text))
        self.assertFalse(cb.found_in("1.8x", text))
        self.assertFalse(cb.found_in("2", text))
        self.assertFalse(cb.found_in("0.4", text))

    def test_slug(self):
        self.assertEqual(cb.slug("2026-12-04, 6dc8ee4"), "2026-12-04-6dc8ee4")
        self.assertEqual(cb.slug("Copying a `replicate` prefix (issue 15)"),
                         "copying-a-replicate-prefix-issue-15")

    def test_cells_keep_a_pipe_in_code(self):
        self.assertEqual(cb.split_cells("| a | `x | y` | b \\| c |"), ["a", "`x | y`", "b | c"])


class NotAGitRepo(unittest.TestCase):
    def test_commits_cannot_be_checked(self):
        d = tempfile.mkdtemp(prefix="check-bench-nogit-")
        try:
            r = subprocess.run([sys.executable, SCRIPT, "--repo", d], capture_output=True,
                               text=True)
            self.assertEqual(r.returncode, 1)
            self.assertIn("not a git repository", r.stdout)
        finally:
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    unittest.main()
