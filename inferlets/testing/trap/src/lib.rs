//! Test inferlet `trap`: panics with the message "deliberate panic from the
//! trap inferlet" (the SDK logs the message, then the component traps); with
//! args `{"overflow": true}` it recurses without end instead, until the wasm
//! call stack is exhausted.

fn run() -> Result<(), String> {
    let args = pie_inferlet::args::<pie_inferlet::serde_json::Value>()?;
    if args["overflow"] == true {
        return Err(format!("recursed to {}", depth(0)));
    }
    panic!("deliberate panic from the trap inferlet");
}

/// Never returns: each call makes another before it adds (no tail call).
#[allow(unconditional_recursion)]
fn depth(n: u64) -> u64 {
    1 + depth(std::hint::black_box(n + 1))
}

pie_inferlet::main!(run);
