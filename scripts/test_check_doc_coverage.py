#!/usr/bin/env python3
"""Self-test of check-doc-coverage.py: each extractor on small Rust snippets in
a temporary repository, and the missing/present verdict on small docs."""
import importlib.util
import contextlib
import io
import os
import shutil
import tempfile
import textwrap
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("cdc", os.path.join(HERE, "check-doc-coverage.py"))
cdc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cdc)

PROPS_RS = """
pub const KNOWN_PROPS: &[(&str, PropType)] = &[
    ("priority", PropType::Int),
    ("keep-ms", PropType::Int),
];
"""

WORKER_CONFIG = """
use serde::{Deserialize, Serialize};
pub use other_crate::auth::ApiKey;

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub server: ServerConfig,
    pub runtime: RuntimeConfig,
}

/// The server. `ignored: Type` in a comment.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    pub port: u16,
    // a comment: pub fake: u8,
    pub api_keys: Vec<ApiKey>,
    #[serde(skip)]
    pub internal: u8,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default, rename_all = "kebab-case")]
pub struct RuntimeConfig {
    pub max_running: usize,
    #[serde(rename = "keep-session")]
    pub keep_session: KeepConfig,
    pub pool: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Clone, Debug, Deserialize)]
pub struct Extra {
    pub flat_key: u32,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KeepConfig {
    pub default_keep_ms: Option<u64>,
    #[serde(rename = "wait")]
    pub admission_wait_ms: u64,
}

#[cfg(test)]
mod tests {
    #[derive(serde::Deserialize)]
    struct Config { pub nope: u8 }
}
"""

AUTH_RS = """
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiKey {
    pub name: String,
    #[serde(default)]
    pub limits: KeyLimits,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KeyLimits {
    pub max_priority: Option<i64>,
    #[serde(rename = "salt")]
    pub cache_salt: Option<String>,
}

pub struct ServerConfig { pub unrelated: u8 }
"""

ROUTER_RS = """
pub fn router() -> Router {
    Router::new()
        .route("/health", get(health))
        .route(
            "/v1/processes/{id}",
            get(get_process).patch(patch_process).delete(kill_process),
        )
        .route("/v1/completions", axum::routing::post(completions))
}
fn use_props(p: &Props) { let _ = p.props.str("session"); let x = props.int("deadline-ms"); }
"""

METRICS_RS = """
use prometheus_client::registry::Registry;
pub struct Metrics {
    registry: Registry,
    pub requests: Family<StatusLabel, Counter>,
    pub queued: Gauge,
    pub ttft: Histogram,
}
impl Metrics {
    pub fn new() -> Self {
        let mut m = Self { registry: Registry::with_prefix("pie"), requests: Family::default() };
        m.registry.register("requests", "Requests", m.requests.clone());
        m.registry.register(
            "queue_depth",
            "Waiting",
            m.queued.clone(),
        );
        m.registry.register("ttft_seconds", "TTFT", m.ttft.clone());
        let r = m.registry.sub_registry_with_prefix("ctl");
        r.register("routed", "Routed", Counter::default());
        m
    }
}
pub fn pool() {
    let mut registry = Registry::with_prefix("pie_pool");
    let gauges = [("pages", "Pages", 1), ("bytes", "Bytes", 2)];
    for (name, help, value) in gauges {
        registry.register(name, help, ConstGauge::new(value));
    }
}
"""

OPENAI_RS = """
const SHARED: &[(&str, Rule)] = &[
    ("model", Served),
    ("user", Metadata),
];
const CHAT: &[(&str, Rule)] = &[
    ("messages", Served),
    (
        "function_call",
        UnlessInert(no_tool_call, "\\"none\\" or \\"auto\\""),
    ),
];
const EXTRAS: &[&str] = &["props", "top_k"];
"""

MAIN_RS = """
#[derive(Parser)]
#[command(name = "tool", version)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serve.
    Serve(ServeArgs),
    EngineBench {
        #[arg(long, default_value_t = 512)]
        prompt_tokens: usize,
        #[command(flatten)]
        model: ModelArgs,
        positional: String,
    },
    Model {
        #[command(subcommand)]
        command: ModelCmd,
    },
}

#[derive(clap::Args)]
struct ServeArgs {
    #[arg(long)]
    port: Option<u16>,
    #[arg(long = "worker", value_name = "NAME=URL")]
    workers: Vec<String>,
}

#[derive(Subcommand)]
enum ModelCmd {
    Fetch,
    #[command(name = "make")]
    Synth { #[arg(long)] out: String },
}

#[derive(clap::Args)]
struct ModelArgs {
    #[arg(long)]
    model: Option<String>,
}
"""


class Repo:
    """A temporary repository: crates' files and docs."""

    def __init__(self, files):
        self.dir = tempfile.mkdtemp()
        for path, text in files.items():
            full = os.path.join(self.dir, path)
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "w") as f:
                f.write(textwrap.dedent(text))

    def close(self):
        shutil.rmtree(self.dir)


BASE = {
    "crates/pie-worker/src/config.rs": WORKER_CONFIG,
    "crates/other-crate/src/auth.rs": AUTH_RS,
    "crates/pie-worker/src/api.rs": ROUTER_RS,
    "crates/pie-worker/src/metrics.rs": METRICS_RS,
    "crates/pie-core/src/props.rs": PROPS_RS,
    "crates/pie-core/src/openai_fields.rs": OPENAI_RS,
    "crates/pie-worker/src/main.rs": MAIN_RS,
}
ROOTS = [("pie", "pie-worker", "config.rs", "Config")]


class Extractors(unittest.TestCase):
    def setUp(self):
        self.repo = Repo(BASE)
        self.source = cdc.Source(self.repo.dir)

    def tearDown(self):
        self.repo.close()

    def test_config_keys_follow_renames_skip_flatten_and_sections(self):
        keys = cdc.config_keys(self.source, ROOTS)
        self.assertEqual(sorted(keys), [
            ("runtime", "flat_key"),  # flattened: its own names (the parent's rename_all stops)
            ("runtime", "max-running"),  # rename_all = "kebab-case"
            ("runtime", "pool"),
            ("runtime.keep-session", "default_keep_ms"),  # rename on the field
            ("runtime.keep-session", "wait"),
            ("server", "api_keys"),  # an array of tables is a key
            ("server", "port"),
            ("server.api_keys", "limits"),  # KeyLimits itself is not walked
            ("server.api_keys", "name"),  # resolved through `pub use other_crate::auth`
        ])
        self.assertEqual(keys[("server", "port")], {"pie"})

    def test_a_missing_root_is_an_error(self):
        with self.assertRaises(cdc.SourceError):
            cdc.config_keys(self.source, [("x", "pie-worker", "config.rs", "Nope")])

    def test_routes_and_methods(self):
        routes = cdc.routes(self.source)
        self.assertEqual(sorted(routes), ["/health", "/v1/completions", "/v1/processes/{id}"])
        self.assertEqual(routes["/v1/processes/{id}"]["pie-worker"], {"GET", "PATCH", "DELETE"})
        self.assertEqual(routes["/v1/completions"]["pie-worker"], {"POST"})

    def test_props_known_and_read(self):
        self.assertEqual(cdc.props(self.source),
                         {"priority", "keep-ms", "session", "deadline-ms"})

    def test_key_limits_with_rename(self):
        self.assertEqual(cdc.key_limits(self.source), {"max_priority", "salt"})

    def test_metrics_prefixes_kinds_and_loops(self):
        found = cdc.metrics(self.source)
        self.assertEqual({n: k for n, (k, _) in found.items()}, {
            "pie_requests_total": "counter",
            "pie_queue_depth": "gauge",
            "pie_ttft_seconds": "histogram",
            "pie_ctl_routed_total": "counter",  # a sub-registry's prefix joins its parent's
            "pie_pool_pages": "gauge",
            "pie_pool_bytes": "gauge",
        })

    def test_openai_fields(self):
        self.assertEqual(cdc.openai_fields(self.source),
                         {"model", "user", "messages", "function_call", "props", "top_k"})

    def test_cli_tree(self):
        commands, flags = cdc.cli(self.source)
        self.assertEqual(commands, {"tool", "tool serve", "tool engine-bench", "tool model",
                                    "tool model fetch", "tool model make"})
        self.assertEqual(flags, {
            ("tool serve", "--port"), ("tool serve", "--worker"),
            ("tool engine-bench", "--prompt-tokens"), ("tool engine-bench", "--model"),
            ("tool model make", "--out"),
        })


class Verdict(unittest.TestCase):
    def docs(self, text):
        return cdc.Docs([textwrap.dedent(text)])

    def test_code_spans_only_and_boundaries(self):
        d = self.docs("""
            max_running in prose, `session-affinity`, `GET /v1/processes/{id}/events`
            ```
            `pie_requests_total` in a fence
            ```
            `pie_queue_depth{x}`
            """)
        self.assertFalse(d.anywhere("max_running"))  # not in a code span
        self.assertFalse(d.anywhere("session"))  # part of a longer name
        self.assertFalse(d.anywhere("/v1/processes/{id}"))  # a longer path
        self.assertTrue(d.anywhere("/v1/processes/{id}/events"))
        self.assertFalse(d.anywhere("pie_requests_total"))  # fenced blocks do not count
        self.assertTrue(d.anywhere("pie_queue_depth"))

    def test_scoped_by_heading_or_together(self):
        d = self.docs("""
            ## `[runtime.transfer]`
            | `timeout_ms` | 60000 |
            ### more
            `lease_ms`
            ## `[runtime.offload]`
            `peers`, and `[runtime.persist] budget`, `runtime.priority.aging_ms`
            ## `pie serve`
            `--port`
            """)
        scopes = ["[runtime.transfer]"]
        self.assertTrue(d.scoped_has(scopes, "timeout_ms"))
        self.assertTrue(d.scoped_has(scopes, "lease_ms"))  # a subheading stays in scope
        self.assertFalse(d.scoped_has(scopes, "peers"))  # the next heading of its level ends it
        self.assertFalse(d.scoped_has(["[runtime.offload]"], "timeout_ms"))
        self.assertTrue(d.scoped_has(["[runtime.persist]"], "budget",
                                     together=["[runtime.persist]"]))
        self.assertTrue(d.anywhere("runtime.priority.aging_ms"))
        self.assertTrue(d.scoped_has(["pie serve"], "--port"))
        self.assertFalse(d.scoped_has(["pie run"], "--port"))


class Check(unittest.TestCase):
    """The whole check on a repository: what is missing, then nothing."""

    def setUp(self):
        quiet = contextlib.ExitStack()
        quiet.enter_context(contextlib.redirect_stdout(io.StringIO()))
        quiet.enter_context(contextlib.redirect_stderr(io.StringIO()))
        self.addCleanup(quiet.close)

    def test_missing_then_present(self):
        repo = Repo(dict(BASE, **{"docs/a.md": "`/health`\n"}))
        try:
            old = cdc.ROOTS
            cdc.ROOTS = ROOTS
            try:
                missing = cdc.check(repo.dir)
            finally:
                cdc.ROOTS = old
            labels = {f"{c} {l}" for c, l in missing}
            self.assertIn("config key [server] port (pie)", labels)
            self.assertIn("route POST /v1/completions (pie-worker)", labels)
            self.assertNotIn("route GET /health (pie-worker)", labels)
            self.assertIn("prop keep-ms", labels)
            self.assertIn("key limit salt", labels)
            self.assertIn("metric pie_pool_pages (gauge)", labels)
            self.assertIn("openai field top_k", labels)
            self.assertIn("cli command tool model make", labels)
            self.assertIn("cli flag tool serve --worker", labels)

            full = """
                # Reference
                ## `[server]`
                `port`, `api_keys`
                ## `[server.api_keys]`
                `name`, `limits`
                ## `[runtime]`
                `max-running`, `pool`, `flat_key`, and `runtime.keep-session.wait`,
                `[runtime.keep-session] default_keep_ms`
                ## Routes
                `GET /health`, `POST /v1/completions`, `PATCH /v1/processes/{id}`
                ## Props
                `priority`, `keep-ms`, `session`, `deadline-ms`
                ## Key `limits`
                `max_priority`, `salt`
                ## Metrics
                `pie_requests_total`, `pie_queue_depth`, `pie_ttft_seconds`,
                `pie_ctl_routed_total`, `pie_pool_pages`, `pie_pool_bytes`
                ## Fields
                `model`, `user`, `messages`, `function_call`, `props`, `top_k`
                ## `tool serve`
                `--port`, `--worker`
                ## Others
                `tool`, `tool serve`, `tool model`, `tool model fetch`, `tool engine-bench`,
                `tool engine-bench --prompt-tokens --model`, `tool model make --out`
                """
            with open(os.path.join(repo.dir, "docs", "a.md"), "w") as f:
                f.write(textwrap.dedent(full))
            os.makedirs(os.path.join(repo.dir, "docs", "benchmarks"))
            cdc.ROOTS = ROOTS
            try:
                self.assertEqual(cdc.check(repo.dir), [])
                self.assertEqual(cdc.main(["--repo", repo.dir]), 0)
            finally:
                cdc.ROOTS = old
        finally:
            repo.close()

    def test_exit_status(self):
        repo = Repo(dict(BASE, **{"docs/a.md": "nothing\n"}))
        try:
            old = cdc.ROOTS
            cdc.ROOTS = ROOTS
            try:
                self.assertEqual(cdc.main(["--repo", repo.dir]), 1)
                cdc.ROOTS = [("x", "pie-worker", "config.rs", "Missing")]
                self.assertEqual(cdc.main(["--repo", repo.dir]), 2)
            finally:
                cdc.ROOTS = old
        finally:
            repo.close()


if __name__ == "__main__":
    unittest.main()
