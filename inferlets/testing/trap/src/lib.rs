//! Test inferlet `trap`: panics with the message "deliberate panic from the
//! trap inferlet" (the SDK logs the message, then the component traps). No
//! args.

fn run() -> Result<(), String> {
    panic!("deliberate panic from the trap inferlet");
}

pie_inferlet::main!(run);
