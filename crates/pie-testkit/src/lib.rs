//! Support for the workspace's integration tests, one copy for every crate:
//! the workspace's binaries run as child processes that die with their
//! handle ([`Proc`]), the synthesized test model ([`test_model`]), polling
//! with a deadline ([`wait_for`]), readers of SSE bodies and Prometheus
//! text built on the production parsers (`pie_client::sse`,
//! `pie_client::prom`), so a test reads a stream as a client does, and the
//! OpenAI Python SDK's scripts ([`python_report`]), and the guest
//! inferlets built for WebAssembly ([`inferlet_wasm`]).
//!
//! Finding binaries: cargo sets `CARGO_BIN_EXE_<name>` only for the package
//! under test, so [`workspace_bin`] looks beside the running test executable
//! instead (`target/<profile>/deps/..`), where `cargo test --workspace` (or
//! `cargo build --bins`) puts every package's binaries.

mod inferlets;
mod model;
mod process;
mod python;
mod read;

pub use inferlets::inferlet_wasm;
pub use model::test_model;
pub use process::{spawn, spawn_unannounced, workspace_bin, Proc};
pub use python::{openai_sdk_available, python_module_available, python_report};
pub use read::{metric_value, sse_data, wait_for};
