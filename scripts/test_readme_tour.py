#!/usr/bin/env python3
"""Self-test of scripts/readme-tour.py (no server): python3 scripts/test_readme_tour.py"""
import importlib.util
import os
import subprocess
import sys
import tempfile
import textwrap
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
TOUR = os.path.join(HERE, "readme-tour.py")
spec = importlib.util.spec_from_file_location("readme_tour", TOUR)
tour = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tour)

README = textwrap.dedent("""\
    # Title

    ```sh
    echo untagged-sh
    ```

    ```sh tour
    echo one
    ```

    ```python
    print("not a tour block")
    ```

    ````markdown
    ```sh tour
    echo quoted
    ```
    ````

    ```
    echo plain
    ```

    ```sh tour
    echo two
    echo two-b
    ```

    ```sh tour-ish
    echo no
    ```

    ~~~sh tour
    echo three
    ~~~
    """)


def alive(pid):
    """Running: not gone and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:].split()[0] != "Z"


class ExtractTest(unittest.TestCase):
    def test_only_tour_blocks_in_order(self):
        blocks = tour.extract(README)
        self.assertEqual([b.text for b in blocks], ["echo one\n", "echo two\necho two-b\n", "echo three\n"])
        self.assertEqual([b.number for b in blocks], [1, 2, 3])
        self.assertEqual([b.first_line() for b in blocks], ["echo one", "echo two", "echo three"])

    def test_line_numbers_are_the_fences(self):
        lines = README.splitlines()
        for b in tour.extract(README):
            self.assertIn("tour", lines[b.line - 1])
            self.assertEqual(lines[b.line], b.text.splitlines()[0])

    def test_none(self):
        self.assertEqual(tour.extract("```sh\necho x\n```\n"), [])

    def test_script_names_each_block(self):
        text = tour.script(tour.extract(README), "README.md", "/tmp/state")
        self.assertTrue(text.startswith("set -euo pipefail\n"))
        self.assertIn("== tour block 2 (README.md:", text)
        self.assertLess(text.index("echo one"), text.index("echo two"))


class RunTest(unittest.TestCase):
    def tour(self, markdown, *extra, env=None):
        with tempfile.TemporaryDirectory() as d:
            readme = os.path.join(d, "README.md")
            with open(readme, "w") as f:
                f.write(markdown)
            return subprocess.run(
                [sys.executable, TOUR, "--readme", readme, "--bin-dir", d, *extra],
                capture_output=True, text=True, timeout=120, env=env)

    def test_list_runs_nothing(self):
        r = self.tour("```sh tour\ntouch /nonexistent-dir/x\n```\n", "--list")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("== tour block 1 (README.md:1)", r.stdout)
        self.assertIn("touch /nonexistent-dir/x", r.stdout)

    def test_passes_in_an_empty_dir_with_bin_dir_on_path(self):
        r = self.tour("```sh tour\ntest -z \"$(ls -A)\"\nx=1\n```\n\n"
                      "```sh tour\necho \"x=$x\"; echo \"path=$PATH\"\n```\n")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("x=1", r.stdout)  # one script: the blocks share their shell
        self.assertIn("== tour block 2", r.stdout)
        path = [line for line in r.stdout.splitlines() if line.startswith("path=")][0]
        self.assertTrue(os.path.isabs(path[len("path="):].split(os.pathsep)[0]))
        self.assertIn("2 blocks passed", r.stdout)

    def test_failing_block_is_named(self):
        md = ("```sh tour\necho fine\n```\n\n"
              "```sh tour\necho about to fail\nfalse\necho not-reached\n```\n\n"
              "```sh tour\necho never\n```\n")
        r = self.tour(md)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("block 2 (README.md:5, `echo about to fail`) failed", r.stderr)
        self.assertNotIn("not-reached", r.stdout)
        self.assertNotIn("never", r.stdout)

    def test_failure_in_a_pipe_is_caught(self):
        r = self.tour("```sh tour\nfalse | cat\necho not-reached\n```\n")
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("block 1", r.stderr)
        self.assertNotIn("not-reached", r.stdout)

    def test_timeout_is_named(self):
        r = self.tour("```sh tour\ntrue\n```\n\n```sh tour\nsleep 30\n```\n", "--timeout", "1")
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("block 2", r.stderr)
        self.assertIn("timed out", r.stderr)

    def test_background_processes_are_killed(self):
        for last in ("true", "false"):
            with tempfile.TemporaryDirectory() as d:
                pidfile = os.path.join(d, "pid")
                env = dict(os.environ, PIDFILE=pidfile)
                md = ("```sh tour\nsleep 1000 &\necho $! > \"$PIDFILE\"\n```\n\n"
                      f"```sh tour\n{last}\n```\n")
                r = self.tour(md, env=env)
                self.assertEqual(r.returncode, 0 if last == "true" else 1, r.stdout + r.stderr)
                with open(pidfile) as f:
                    pid = int(f.read())
                deadline = time.monotonic() + 5
                while alive(pid) and time.monotonic() < deadline:
                    time.sleep(0.05)
                self.assertFalse(alive(pid), f"sleep {pid} survived the tour")

    def test_work_dir_is_removed(self):
        r = self.tour("```sh tour\npwd\n```\n")
        self.assertEqual(r.returncode, 0, r.stderr)
        work = [line for line in r.stdout.splitlines() if line.startswith("/")][0]
        self.assertFalse(os.path.exists(work))


if __name__ == "__main__":
    unittest.main()
