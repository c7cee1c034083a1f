//! The agent's protocol: what a client loop over `/v1/chat/completions`
//! sends to run the same agent (`crates/pie-worker/tests/agent.rs` includes
//! this file; `scripts/agent-bench.py` holds a copy). Each step's output is
//! constrained by one of the expressions; a tool's result comes back as
//! the user turn `Observation: RESULT`.

/// The system prompt.
pub const SYSTEM: &str = "You are an agent that answers questions with tools. Each turn, write \
one line `Thought: ...`, then either `Action: search[QUERY]` or `Action: calculate[EXPRESSION]` \
to use a tool, or `Final Answer: ...` when you know the answer. Tool results come back as \
`Observation: ...`.";

/// A step: a thought, then a tool call or the final answer (printable
/// ASCII, so a step fits its token budget on any vocabulary).
pub const STEP: &str = r"Thought: [ -~]{1,100}\n(Action: (search|calculate)\[[a-zA-Z0-9 +*/.-]{1,40}\]|Final Answer: [ -~]{1,100})";

/// A step that must call a tool (the first `min_actions`).
pub const ACTION: &str =
    r"Thought: [ -~]{1,100}\nAction: (search|calculate)\[[a-zA-Z0-9 +*/.-]{1,40}\]";

/// The last step: a thought, then the final answer.
pub const FINAL: &str = r"Thought: [ -~]{1,100}\nFinal Answer: [ -~]{1,100}";
