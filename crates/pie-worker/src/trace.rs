//! Recording live traffic as a trace (`[server] trace_file`, opt-in): one
//! Mooncake-format JSON line per finished process (arrival, prompt length,
//! output length, chained 512-token block ids, props), so an operator can
//! replay their own traffic in `pie-sim` or `pie bench --trace` under other
//! policies. Token ids never leave the machine. Lines are written when a
//! process finishes, so they are ordered by finish, not arrival; trace readers
//! order records by `timestamp`.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::Path;
use std::sync::Mutex;

use pie_core::Props;
use pie_workload::{trace_block_ids, TraceRecord};

use crate::process::now_ms;

pub struct TraceWriter {
    file: Mutex<BufWriter<File>>,
    /// Timestamps count from here (the server's start).
    start_ms: u64,
}

/// What a trace line needs from a process's launch.
#[derive(Clone, Debug)]
pub struct TraceInput {
    pub arrival_ms: u64,
    pub input_length: u32,
    pub hash_ids: Vec<u64>,
}

impl TraceInput {
    pub fn of(prompt: &[u32], arrival_ms: u64) -> Self {
        Self {
            arrival_ms,
            input_length: prompt.len() as u32,
            hash_ids: trace_block_ids(prompt),
        }
    }
}

impl TraceWriter {
    /// Append to `path` (created if missing).
    pub fn open(path: &Path) -> std::io::Result<Self> {
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        Ok(Self {
            file: Mutex::new(BufWriter::new(file)),
            start_ms: now_ms(),
        })
    }

    /// One line for a finished process; a write error is logged, never fatal.
    pub fn record(&self, input: TraceInput, output_length: usize, props: &Props) {
        let record = TraceRecord {
            timestamp: input.arrival_ms.saturating_sub(self.start_ms),
            input_length: input.input_length,
            output_length: output_length as u32,
            hash_ids: input.hash_ids,
            props: props.clone(),
        };
        let Ok(line) = serde_json::to_string(&record) else {
            return;
        };
        let mut file = self.file.lock().unwrap_or_else(|e| e.into_inner());
        if let Err(e) = writeln!(file, "{line}").and_then(|_| file.flush()) {
            tracing::warn!("trace_file: cannot write: {e}");
        }
    }
}
