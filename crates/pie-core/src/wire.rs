//! Names in the bodies and streams `pie-controller` and `pie serve` exchange:
//! one definition for both binaries, which talk over HTTP only.

/// Request field: the prompt's token ids as the controller computed them.
pub const PROMPT_TOKENS_FIELD: &str = "pie_prompt_tokens";
/// Request field: the prefill worker of a disaggregated request.
pub const PREFILL_FROM_FIELD: &str = "pie_prefill_from";
/// Request field: a process that ran elsewhere goes on here.
pub const RESUME_FIELD: &str = "pie_resume";
/// Request field: stream each token's id.
pub const STREAM_IDS_FIELD: &str = "pie_stream_ids";
/// Chunk field (with `STREAM_IDS_FIELD`): the token ids of the chunk.
pub const TOKEN_IDS_KEY: &str = "pie_token_ids";
/// SSE comment opening a stream with ids: `pie-process ID`.
pub const PROCESS_COMMENT: &str = "pie-process";
/// SSE comment ending a stream whose process was handed off.
pub const HANDOFF_COMMENT: &str = "pie-handoff";
/// Launch-answer field (with `STREAM_IDS_FIELD`): a native chat's session
/// turns before this one.
pub const SESSION_TURNS_FIELD: &str = "pie_session_turns";
