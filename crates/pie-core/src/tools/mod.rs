//! Tool calling on `/v1/chat/completions`, as pure data both binaries
//! share: the request's tools and choice ([`request`]), the format a chat
//! template speaks and what the output is held to ([`format`]), and the
//! answer read back as text and calls ([`output`]). The worker and the
//! controller render a request's prompt through the same format, so the
//! ids a controller routes by are the ids the worker computes.

mod format;
mod generic;
mod output;
mod request;

pub use format::{ToolConstraint, ToolFormat};
pub use output::{ToolCall, ToolOutput};
pub use request::{Tool, ToolChoice, ToolRequest, MAX_PARALLEL_CALLS};
