//! The controller's answers of its own (not a worker's): OpenAI-shaped JSON
//! errors, refusals to retry later, and the SSE error event that ends a
//! stream.

use axum::body::Bytes;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;

pub fn error(status: StatusCode, message: impl Into<String>) -> Response {
    let body = pie_core::api_error::error_body(status.as_u16(), &message.into(), None);
    (status, Json(body)).into_response()
}

/// A refusal the client should retry (429, 502, 503): with `Retry-After: 1`.
pub fn retry_later(status: StatusCode, message: impl Into<String>) -> Response {
    let mut resp = error(status, message);
    resp.headers_mut()
        .insert("retry-after", HeaderValue::from_static("1"));
    resp
}

/// An SSE error event (the stream ends after it).
pub fn error_event(message: &str) -> Bytes {
    let event = pie_core::api_error::error_body(502, message, None);
    Bytes::from(format!("data: {event}\n\n"))
}

/// A refusal decided before any worker was asked, answered as [`error`] or,
/// when the client should try again, [`retry_later`].
pub struct Refusal {
    pub status: StatusCode,
    pub message: String,
    pub retry: bool,
    /// The request field at fault (the error's `param`).
    pub param: Option<String>,
}

impl Refusal {
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            retry: false,
            param: None,
        }
    }

    /// A request field refused by the rule worker and controller share.
    pub fn field(e: pie_core::openai_fields::FieldError) -> Self {
        Self {
            param: Some(e.param),
            ..Self::bad_request(e.message)
        }
    }
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        match (self.retry, self.param) {
            (true, _) => retry_later(self.status, self.message),
            (false, None) => error(self.status, self.message),
            (false, Some(param)) => {
                let body = pie_core::api_error::error_body(
                    self.status.as_u16(),
                    &self.message,
                    Some(&param),
                );
                (self.status, Json(body)).into_response()
            }
        }
    }
}
