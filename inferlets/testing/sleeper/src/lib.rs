//! Test inferlet `sleeper`: sleeps `ms` milliseconds, then emits "woke".
//! Args: `{"ms": int}`.

use serde::Deserialize;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Args {
    ms: u64,
}

fn run() -> Result<(), String> {
    let args: Args = pie_inferlet::args()?;
    pie_inferlet::sleep(args.ms);
    pie_inferlet::emit("woke")
}

pie_inferlet::main!(run);
