#!/usr/bin/env python3
"""Self-test of scripts/pielib.py: python3 scripts/test_pielib.py"""
import json
import os
import subprocess
import sys
import textwrap
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import pielib  # noqa: E402

ZEROS = {"p50": 0.0, "p90": 0.0, "p99": 0.0, "mean": 0.0}


class PercentileTest(unittest.TestCase):
    def test_empty_is_zeros(self):
        self.assertEqual(pielib.percentiles([]), ZEROS)
        self.assertEqual(pielib.percentile([], 50), 0.0)

    def test_one_and_two_values(self):
        self.assertEqual(pielib.percentiles([7.0]), {"p50": 7.0, "p90": 7.0, "p99": 7.0, "mean": 7.0})
        # n = 2: p50 is rank ceil(1.0) = 1, the lower value (not 1.5 as interpolation gives)
        self.assertEqual(pielib.percentiles([2.0, 1.0]), {"p50": 1.0, "p90": 2.0, "p99": 2.0, "mean": 1.5})

    def test_nearest_rank_on_ten_and_a_hundred(self):
        ten = [float(x) for x in range(1, 11)]
        self.assertEqual(pielib.percentiles(ten), {"p50": 5.0, "p90": 9.0, "p99": 10.0, "mean": 5.5})
        hundred = [float(x) for x in range(100, 0, -1)]  # unsorted (descending) input
        self.assertEqual(pielib.percentiles(hundred), {"p50": 50.0, "p90": 90.0, "p99": 99.0, "mean": 50.5})
        self.assertEqual(pielib.percentile(hundred, 99.5), 100.0)
        self.assertEqual(pielib.percentile(hundred, 0), 1.0)  # rank 0 clamps to 1

    def test_ties_and_unsorted(self):
        self.assertEqual(pielib.percentiles([3.0, 1.0, 3.0, 2.0, 3.0]),
                         {"p50": 3.0, "p90": 3.0, "p99": 3.0, "mean": 2.4})
        self.assertEqual(pielib.percentile([5, 1, 4, 2, 3], 40), 2)
        self.assertEqual(pielib.percentile([5, 1, 4, 2, 3], 41), 3)

    def test_input_is_not_modified(self):
        xs = [3.0, 1.0, 2.0]
        pielib.percentiles(xs)
        self.assertEqual(xs, [3.0, 1.0, 2.0])

    def test_rank_rounding_as_rust(self):
        # the rank is ceil((p / 100) * n) in f64, the same operations as Rust's:
        # 90 / 100 * 10 is exactly 9.0, 29 / 100 * 100 is 28.999999999999996
        self.assertEqual(90 / 100 * 10, 9.0)
        self.assertEqual(pielib.percentile(range(1, 11), 90), 9)
        self.assertEqual(29 / 100 * 100, 28.999999999999996)
        self.assertEqual(pielib.percentile(range(1, 101), 29), 29)


class CliTest(unittest.TestCase):
    def run_cli(self, *args, stdin=""):
        return subprocess.run([sys.executable, os.path.join(HERE, "pielib.py"), *args],
                              input=stdin, capture_output=True, text=True, timeout=30)

    def test_percentiles_json(self):
        r = self.run_cli("percentiles", "3", "1", "2")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout.strip(), '{"p50": 2.0, "p90": 3.0, "p99": 3.0, "mean": 2.0}')
        self.assertEqual(json.loads(self.run_cli("percentiles").stdout), ZEROS)
        got = json.loads(self.run_cli("percentiles", *map(str, range(100, 0, -1))).stdout)
        self.assertEqual(got, {"p50": 50.0, "p90": 90.0, "p99": 99.0, "mean": 50.5})

    def test_prom_sum_json(self):
        self.assertEqual(json.loads(self.run_cli("prom-sum", "pie_requests_total", stdin=PROM).stdout), 9.0)
        self.assertIsNone(json.loads(self.run_cli("prom-sum", "absent_total", stdin=PROM).stdout))

    def test_usage(self):
        r = self.run_cli("nonsense")
        self.assertEqual(r.returncode, 2)
        self.assertIn("usage", r.stderr)
        r = self.run_cli("--help")
        self.assertEqual(r.returncode, 0)
        self.assertIn("percentiles VALUE", r.stdout)


# The text of crates/pie-client/src/prom.rs's test, and a histogram.
PROM = textwrap.dedent("""\
    # HELP pie_prompt_tokens Prompt tokens computed (prefill).
    # TYPE pie_prompt_tokens counter
    pie_prompt_tokens_total 1200
    pie_prompt_tokens_total_extra 5
    pie_requests_total{status="finished"} 7
    pie_requests_total{status="killed"} 2 1700000000
    x_seconds_bucket{part="a",le="0.1"} 3
    x_seconds_bucket{part="a",le="+Inf"} 4
    x_seconds_bucket{part="b, \\"c\\"",le="+Inf"} 1
    # EOF
    """)


class PromTest(unittest.TestCase):
    def test_sum_over_labels_and_skip_longer_names(self):
        self.assertEqual(pielib.prom_sum(PROM, "pie_prompt_tokens_total"), 1200.0)
        self.assertEqual(pielib.prom_sum(PROM, "pie_prompt_tokens_total_extra"), 5.0)
        self.assertEqual(pielib.prom_sum(PROM, "pie_requests_total"), 9.0)  # timestamp ignored
        self.assertEqual(pielib.prom_sum(PROM, "pie_prompt_tokens"), None)  # shorter: not a metric here
        self.assertEqual(pielib.prom_sum(PROM, "pie_prefix_cache_hit_tokens_total"), None)
        self.assertEqual(pielib.prom_sum(PROM, "pie_prefix_cache_hit_tokens_total", 0.0), 0.0)
        self.assertEqual(pielib.prom_sum("", "pie_requests_total"), None)

    def test_labels_select_one_series(self):
        self.assertEqual(pielib.prom_sum(PROM, 'pie_requests_total{status="killed"}'), 2.0)
        self.assertEqual(pielib.prom_sum(PROM, 'pie_requests_total{status="failed"}'), None)
        self.assertEqual(pielib.prom_sum(PROM, 'x_seconds_bucket{part="a",le="+Inf"}'), 4.0)

    def test_comments_crlf_and_bad_values(self):
        self.assertEqual(pielib.prom_sum("# a_total 5\r\na_total 1\r\na_total 2\r\n", "a_total"), 3.0)
        self.assertEqual(pielib.prom_sum("a_total x\na_total{b=\"c\" 4\n", "a_total"), None)
        self.assertEqual(pielib.prom_sum("a_total 1_0\n", "a_total"), None)

    def test_delta(self):
        after = PROM.replace("1200", "1500") + 'pie_kv_transfer_bytes_total{direction="in"} 64\n'
        self.assertEqual(pielib.prom_delta(PROM, after, "pie_prompt_tokens_total"), 300.0)
        # a series absent before its first increment counts as 0
        self.assertEqual(pielib.prom_delta(PROM, after, 'pie_kv_transfer_bytes_total{direction="in"}'), 64.0)
        self.assertEqual(pielib.prom_delta(PROM, after, "absent_total"), 0.0)

    def test_samples(self):
        got = pielib.prom_samples(PROM, "x_seconds_bucket")
        self.assertEqual(got, [("x_seconds_bucket", {"part": "a", "le": "0.1"}, 3.0),
                               ("x_seconds_bucket", {"part": "a", "le": "+Inf"}, 4.0),
                               ("x_seconds_bucket", {"part": 'b, "c"', "le": "+Inf"}, 1.0)])
        self.assertEqual(len(pielib.prom_samples(PROM)), 7)
        self.assertEqual(pielib.prom_samples(PROM, "pie_prompt_tokens_total"),
                         [("pie_prompt_tokens_total", {}, 1200.0)])


CHILD = ("import sys, time; print('x: listening on http://127.0.0.1:1', flush=True); "
         "print('a log line', file=sys.stderr, flush=True); time.sleep(600)")


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped) counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


class SpawnTest(unittest.TestCase):
    def test_url_from_the_first_line_and_killed_at_the_end_of_the_block(self):
        with pielib.Procs() as procs:
            proc, url = procs.spawn([sys.executable, "-c", CHILD], "x: listening on ")
            self.assertEqual(url, "http://127.0.0.1:1")
            self.assertIsNone(proc.poll())
            deadline = time.time() + 10
            while "a log line\n" not in proc.tail and time.time() < deadline:
                time.sleep(0.05)
            self.assertIn("a log line\n", proc.tail)
        self.assertIsNotNone(proc.poll())
        self.assertFalse(alive(proc.pid))
        self.assertNotIn(proc, pielib._LIVE)

    def test_killed_when_an_exception_leaves_the_block(self):
        with self.assertRaises(KeyboardInterrupt):
            with pielib.Procs() as procs:
                proc, _ = procs.spawn([sys.executable, "-c", CHILD], "x: listening on ")
                raise KeyboardInterrupt
        self.assertIsNotNone(proc.poll())

    def test_wrong_first_line_fails_naming_it(self):
        procs = pielib.Procs()
        with self.assertRaises(SystemExit) as e:
            procs.spawn([sys.executable, "-c", "print('hello'); import sys; sys.exit(3)"],
                        "x: listening on ", name="child")
        self.assertIn("child: unexpected first line 'hello'", str(e.exception))
        procs.stop_all()

    def test_killed_at_interpreter_exit(self):
        # A script that spawns a child and then dies of an exception, of
        # Ctrl-C, of SIGTERM: the child must not outlive it.
        for how in ("raise RuntimeError('boom')", "raise KeyboardInterrupt",
                    "import os, signal; os.kill(os.getpid(), signal.SIGTERM); time.sleep(30)"):
            script = textwrap.dedent(f"""\
                import sys, time
                sys.path.insert(0, {HERE!r})
                import pielib
                procs = pielib.Procs()
                proc, url = procs.spawn([sys.executable, "-c", {CHILD!r}], "x: listening on ")
                print(proc.pid, flush=True)
                {how}
                """)
            r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
            self.assertNotEqual(r.returncode, 0, how)
            pid = int(r.stdout.split()[0])
            deadline = time.time() + 5
            while alive(pid) and time.time() < deadline:
                time.sleep(0.05)
            self.assertFalse(alive(pid), f"the child outlived a script ending with {how}")


class HttpTest(unittest.TestCase):
    def test_wait_healthy_fails_on_an_exited_process_and_on_timeout(self):
        procs = pielib.Procs()
        proc, _ = procs.spawn([sys.executable, "-c", "import sys; print('x: listening on u'); "
                               "print('dying', file=sys.stderr)"], "x: listening on ")
        proc.wait()
        with self.assertRaises(SystemExit) as e:
            pielib.wait_healthy("http://127.0.0.1:9", 5, proc=proc, what="the child")
        self.assertIn("the child exited (0)", str(e.exception))
        t = time.monotonic()
        with self.assertRaises(SystemExit) as e:
            pielib.wait_healthy("http://127.0.0.1:9", 0.3, what="nobody")
        self.assertIn("nobody never became healthy", str(e.exception))
        self.assertLess(time.monotonic() - t, 10)

    def test_json_calls_against_a_tiny_server(self):
        import http.server
        import threading

        class H(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                body = {"/health": b"{}", "/v1/cluster":
                        b'{"workers": [{"name": "w0", "healthy": true}, {"name": "w1", "healthy": false}]}'}
                b = body.get(self.path)
                self.send_response(200 if b else 404)
                self.end_headers()
                self.wfile.write(b or b"missing")

            def do_POST(self):
                n = int(self.headers["content-length"])
                got = json.loads(self.rfile.read(n))
                self.send_response(200)
                self.send_header("x-auth", self.headers.get("authorization", ""))
                self.end_headers()
                self.wfile.write(json.dumps({"echo": got}).encode())

        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        try:
            pielib.wait_healthy(url, 5)
            pielib.wait_healthy(url, 5, workers=1)
            with self.assertRaises(SystemExit):
                pielib.wait_healthy(url, 0.5, workers=2)
            self.assertEqual(pielib.get_json(url, "/v1/cluster")["workers"][0]["name"], "w0")
            self.assertEqual(pielib.post_json(url, "/x", {"a": 1}), {"echo": {"a": 1}})
            r = pielib.request(url, "POST", "/x", {"b": 2}, key="sk")
            self.assertEqual((r.status, r.json(), r.headers["x-auth"]), (200, {"echo": {"b": 2}}, "Bearer sk"))
            with self.assertRaises(pielib.HttpError) as e:
                pielib.get_text(url, "/nope")
            self.assertEqual(e.exception.reply.status, 404)
        finally:
            srv.shutdown()
            srv.server_close()


if __name__ == "__main__":
    unittest.main()
