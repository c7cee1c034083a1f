//! `[server] trace_file` on the controller: each routed OpenAI request becomes
//! one trace line (see `pie_workload::recorder`) when its response ends. The
//! prompt's length and block ids come from the controller's own tokenization;
//! the output length from the response's [`crate::usage::UsageMeter`].

use pie_core::Props;
use pie_workload::TraceInput;

/// A request being traced: what was known at arrival.
pub struct TracedRequest {
    pub input: TraceInput,
    pub props: Props,
}
