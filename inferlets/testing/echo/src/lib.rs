//! Test inferlet `echo`: receives messages and emits "echo: <msg>\n" for
//! each, until the message "quit", when it returns Ok. No args.

fn run() -> Result<(), String> {
    loop {
        let msg = pie_inferlet::receive();
        if msg == "quit" {
            return Ok(());
        }
        pie_inferlet::emit(&format!("echo: {msg}\n"))?;
    }
}

pie_inferlet::main!(run);
