//! The process itself: its args, props, output, messages, log and time.

use crate::Level;
use crate::bindings::pie::inferlet0_1_0::process;

/// The process's id.
pub fn process_id() -> String {
    process::id()
}

/// The launch's `args`, raw JSON.
pub fn args_json() -> String {
    process::args()
}

/// The launch's `args` deserialized; missing or `null` args read as `{}`.
pub fn args<T: serde::de::DeserializeOwned>() -> Result<T, String> {
    let raw = process::args();
    let raw = raw.trim();
    let raw = if raw.is_empty() || raw == "null" {
        "{}"
    } else {
        raw
    };
    serde_json::from_str(raw).map_err(|e| format!("bad args: {e}"))
}

/// The process's props, a JSON object.
pub fn props() -> serde_json::Value {
    serde_json::from_str(&process::props())
        .unwrap_or_else(|_| serde_json::Value::Object(Default::default()))
}

/// Sets one of the process's own props; applies from the next engine step.
pub fn set_prop(name: &str, value: &serde_json::Value) -> Result<(), String> {
    process::set_prop(name, &value.to_string())
}

/// Removes one of the process's own props.
pub fn remove_prop(name: &str) -> Result<(), String> {
    process::remove_prop(name)
}

/// Text to the process's output and event stream.
pub fn emit(text: &str) -> Result<(), String> {
    process::emit(text)
}

/// A JSON event to the process's event stream.
pub fn emit_json(value: &serde_json::Value) -> Result<(), String> {
    process::emit_json(&value.to_string())
}

/// The next message a client sent (waits for one).
pub fn receive() -> String {
    process::receive()
}

/// The next message if one is waiting.
pub fn try_receive() -> Option<String> {
    process::try_receive()
}

/// A line in the worker's log, tagged with the process.
pub fn log(level: Level, message: &str) {
    process::log(level, message)
}

/// Unix time in milliseconds.
pub fn now_ms() -> u64 {
    process::now_ms()
}

/// Waits `ms` milliseconds; other processes run meanwhile.
pub fn sleep(ms: u64) {
    process::sleep(ms)
}
