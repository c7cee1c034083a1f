//! `[server] trace_file` on the controller: each routed OpenAI request becomes
//! one trace line (see `pie_workload::recorder`) when its response ends. The
//! prompt's length and block ids come from the controller's own tokenization;
//! the output length is read from the response as it streams through: the
//! `usage` object (non-streamed responses, streams with
//! `stream_options.include_usage`, and the `: pie-usage` comment a Pie worker
//! ends every other stream with), else the number of chunks with choices.

use pie_core::Props;
use pie_workload::TraceInput;

/// How much of the body's end is kept to find the `usage` object in.
const TAIL_BYTES: usize = 512;

const CHOICE: &[u8] = b"\"choices\":[{";
const COMPLETION_TOKENS: &str = "\"completion_tokens\":";

/// A request being traced: what was known at arrival, and what its response
/// has shown so far.
pub struct TracedRequest {
    pub input: TraceInput,
    pub props: Props,
    tail: Vec<u8>,
    choice_chunks: usize,
}

impl TracedRequest {
    pub fn new(input: TraceInput, props: Props) -> Self {
        Self {
            input,
            props,
            tail: Vec::new(),
            choice_chunks: 0,
        }
    }

    /// Look at the next piece of the response body.
    pub fn observe(&mut self, bytes: &[u8]) {
        self.choice_chunks += bytes.windows(CHOICE.len()).filter(|w| *w == CHOICE).count();
        self.tail.extend_from_slice(bytes);
        let excess = self.tail.len().saturating_sub(TAIL_BYTES);
        self.tail.drain(..excess);
    }

    /// Tokens generated, by the best evidence the response gave.
    pub fn output_length(&self) -> usize {
        let tail = String::from_utf8_lossy(&self.tail);
        tail.rfind(COMPLETION_TOKENS)
            .and_then(|at| {
                let digits: String = tail[at + COMPLETION_TOKENS.len()..]
                    .chars()
                    .skip_while(|c| c.is_whitespace())
                    .take_while(char::is_ascii_digit)
                    .collect();
                digits.parse().ok()
            })
            .unwrap_or(self.choice_chunks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn traced() -> TracedRequest {
        TracedRequest::new(TraceInput::of(&[1, 2, 3], 0), Props::new())
    }

    #[test]
    fn usage_wins_over_counting_chunks() {
        let mut t = traced();
        t.observe(
            br#"{"choices":[{"text":"hi"}],"usage":{"completion_tokens": 17,"prompt_tokens":3}}"#,
        );
        assert_eq!(t.output_length(), 17);
    }

    #[test]
    fn a_stream_without_usage_counts_its_token_chunks() {
        let mut t = traced();
        for _ in 0..5 {
            t.observe(b"data: {\"choices\":[{\"text\":\"a\",\"index\":0}]}\n\n");
        }
        t.observe(b"data: [DONE]\n\n");
        assert_eq!(t.output_length(), 5);
    }
}
