//! Test inferlet `flood`: calls one host call `count` times with the
//! smallest input it takes, as a hostile guest would, to show that each is
//! charged: `emit("")`, `emit-json("0")`, `set-prop("n", i)`, or a one-byte
//! `log` line. It returns the first error, or ends when done.
//!
//! Args: `{"kind": "emit" | "json" | "props" | "log", "count": int}`.

use pie_inferlet::serde_json::json;
use pie_inferlet::{Level, emit, emit_json, log, set_prop};
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Args {
    kind: String,
    count: u64,
}

fn run() -> Result<(), String> {
    let args: Args = pie_inferlet::args()?;
    for i in 0..args.count {
        match args.kind.as_str() {
            "emit" => emit("")?,
            "json" => emit_json(&json!(0))?,
            "props" => set_prop("n", &json!(i))?,
            "log" => log(Level::Info, "x"),
            other => return Err(format!("unknown kind {other}")),
        }
    }
    Ok(())
}

pie_inferlet::main!(run);
