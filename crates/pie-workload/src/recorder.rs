//! Recording live traffic as a trace (`[server] trace_file` of `pie serve` and
//! `pie-controller`): one [`TraceRecord`] line per finished request, appended
//! and flushed so a crash loses at most the line being written. Timestamps are
//! Unix milliseconds, so the traces of several processes merge; `read_trace`
//! sorts records and counts time from the first. Token ids are never written.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::Path;
use std::sync::Mutex;

use pie_core::Props;

use crate::trace::{trace_block_ids, TraceRecord};

/// What a trace line needs from a request's arrival: taken then, written when
/// the request finishes and its output length is known.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceInput {
    pub arrival_unix_ms: u64,
    pub input_length: u32,
    pub hash_ids: Vec<u64>,
}

impl TraceInput {
    pub fn of(prompt: &[u32], arrival_unix_ms: u64) -> Self {
        Self {
            arrival_unix_ms,
            input_length: prompt.len() as u32,
            hash_ids: trace_block_ids(prompt),
        }
    }
}

/// A file of JSON lines, appended and flushed line by line (a crash loses
/// at most the line being written): traces, the controller's scale history.
pub struct JsonLines {
    file: Mutex<BufWriter<File>>,
}

impl JsonLines {
    /// Append to `path` (created if missing).
    pub fn open(path: &Path) -> std::io::Result<Self> {
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        Ok(Self {
            file: Mutex::new(BufWriter::new(file)),
        })
    }

    /// `value` as one line.
    pub fn append(&self, value: &impl serde::Serialize) -> std::io::Result<()> {
        let line = serde_json::to_string(value)?;
        let mut file = self.file.lock().unwrap_or_else(|e| e.into_inner());
        writeln!(file, "{line}")?;
        file.flush()
    }
}

pub struct TraceRecorder {
    lines: JsonLines,
}

impl TraceRecorder {
    /// Append to `path` (created if missing).
    pub fn open(path: &Path) -> std::io::Result<Self> {
        Ok(Self {
            lines: JsonLines::open(path)?,
        })
    }

    /// One line for a finished request.
    pub fn record(
        &self,
        input: TraceInput,
        output_length: usize,
        props: &Props,
    ) -> std::io::Result<()> {
        let record = TraceRecord {
            timestamp: input.arrival_unix_ms,
            input_length: input.input_length,
            output_length: output_length as u32,
            hash_ids: input.hash_ids,
            props: props.clone(),
        };
        self.lines.append(&record)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::read_trace;

    #[test]
    fn recorded_lines_read_back_sorted_from_zero() {
        let path = std::env::temp_dir().join(format!("pie-recorder-{}.jsonl", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let rec = TraceRecorder::open(&path).expect("writable temp dir");
        let prompt: Vec<u32> = (0..600).collect();
        rec.record(TraceInput::of(&prompt, 1_700_000_000_250), 7, &Props::new())
            .expect("write");
        rec.record(
            TraceInput::of(&prompt[..10], 1_700_000_000_000),
            3,
            &Props::new(),
        )
        .expect("write");
        let text = std::fs::read_to_string(&path).expect("read");
        let records = read_trace(text.as_bytes()).expect("valid trace");
        assert_eq!(
            records[0].timestamp, 0,
            "the earliest arrival starts the trace"
        );
        assert_eq!(records[0].input_length, 10);
        assert_eq!(records[1].timestamp, 250);
        assert_eq!(
            (records[1].input_length, records[1].output_length),
            (600, 7)
        );
        assert_eq!(records[1].hash_ids.len(), 2);
        let _ = std::fs::remove_file(&path);
    }
}
