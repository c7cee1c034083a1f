//! The OpenAI-shaped error body both binaries answer with, so that clients
//! (the OpenAI SDKs among them) see one shape from a worker and a controller:
//! `{"error": {"message", "type", "param", "code"}}`.

use serde_json::{json, Value};

/// The OpenAI error `type` for an HTTP status.
pub fn error_kind(status: u16) -> &'static str {
    match status {
        401 => "authentication_error",
        404 => "not_found_error",
        429 => "rate_limit_error",
        413 => "request_too_large",
        500..=599 => "server_error",
        _ => "invalid_request_error",
    }
}

pub fn error_body(status: u16, message: &str, param: Option<&str>) -> Value {
    json!({"error": {"message": message, "type": error_kind(status), "param": param, "code": status}})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_and_kinds() {
        let b = error_body(429, "slow down", None);
        assert_eq!(b["error"]["type"], "rate_limit_error");
        assert_eq!(b["error"]["code"], 429);
        assert!(b["error"]["param"].is_null());
        assert_eq!(
            error_body(400, "x", Some("props.priority"))["error"]["param"],
            "props.priority"
        );
        assert_eq!(error_kind(502), "server_error");
    }
}
