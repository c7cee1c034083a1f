//! Test inferlet `fs`: reads a file, so the component imports
//! `wasi:filesystem`, which the worker must refuse at upload.

fn run() -> Result<(), String> {
    let text = std::fs::read_to_string("/etc/hostname").map_err(|e| e.to_string())?;
    pie_inferlet::emit(&text)
}

pie_inferlet::main!(run);
