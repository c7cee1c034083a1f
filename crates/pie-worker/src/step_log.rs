//! `[server] step_log` (`pie serve --step-log`): every engine step a serving
//! worker runs, one JSON line each: when it started, how long it took, how
//! long the engine sat idle before it, and its shape (the simulator's cost
//! terms). `pie bench --calibrate --from-steps` fits a `pie-sim` profile to
//! these lines, so the simulator can be given the speed the machine had while
//! it served, not a calibration's from minutes before or after.

use std::fs::File;
use std::io::{BufRead, BufReader, LineWriter, Write};
use std::path::Path;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use pie_workload::StepShape;
use serde::{Deserialize, Serialize};

/// One served step.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    /// Wall clock at the step's start, ms since the Unix epoch.
    pub start_unix_ms: f64,
    /// The step's duration (the engine's `step`: plan, forward, sampling).
    pub ms: f64,
    /// Time since the previous step ended (ms); None for the first step.
    pub idle_ms: Option<f64>,
    pub batch_tokens: usize,
    pub context_tokens: usize,
    pub attention_pairs: u64,
    pub sequences: usize,
}

impl StepRecord {
    pub fn shape(&self) -> StepShape {
        StepShape {
            batch_tokens: self.batch_tokens,
            context_tokens: self.context_tokens,
            attention_pairs: self.attention_pairs,
            sequences: self.sequences,
        }
    }
}

/// The engine thread's writer: a line per step, written as it ends (a killed
/// worker loses at most the step in progress).
pub struct StepLog {
    out: LineWriter<File>,
    last_end: Option<Instant>,
    failed: bool,
}

impl StepLog {
    /// Create (or truncate) `path`.
    pub fn create(path: &Path) -> Result<Self> {
        let file = File::create(path)
            .with_context(|| format!("server.step_log: cannot create {}", path.display()))?;
        Ok(Self {
            out: LineWriter::new(file),
            last_end: None,
            failed: false,
        })
    }

    /// Record a step that started at `started` and computed `shape`; a step
    /// that computed nothing is not one (and does not end an idle spell).
    pub fn record(&mut self, started: Instant, shape: &StepShape) {
        if shape.batch_tokens == 0 || self.failed {
            return;
        }
        let ended = Instant::now();
        let idle_ms = self.last_end.map(|end| ms_between(end, started.max(end)));
        self.last_end = Some(ended);
        let ms = ms_between(started, ended);
        let record = StepRecord {
            start_unix_ms: unix_ms() - ms,
            ms,
            idle_ms,
            batch_tokens: shape.batch_tokens,
            context_tokens: shape.context_tokens,
            attention_pairs: shape.attention_pairs,
            sequences: shape.sequences,
        };
        let line = serde_json::to_string(&record).expect("a step record serializes");
        if let Err(e) = writeln!(self.out, "{line}") {
            // Said once; serving goes on without the log.
            tracing::warn!("server.step_log: cannot write, no more steps are logged: {e}");
            self.failed = true;
        }
    }
}

fn ms_between(from: Instant, to: Instant) -> f64 {
    to.duration_since(from).as_secs_f64() * 1000.0
}

fn unix_ms() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64() * 1000.0)
}

/// Every step of the logs at `paths`, each file's in its order; a line that
/// does not parse is an error naming the file and line.
pub fn read(paths: &[impl AsRef<Path>]) -> Result<Vec<Vec<StepRecord>>> {
    paths
        .iter()
        .map(|path| {
            let path = path.as_ref();
            let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
            BufReader::new(file)
                .lines()
                .enumerate()
                .filter(|(_, line)| line.as_ref().map_or(true, |l| !l.trim().is_empty()))
                .map(|(i, line)| {
                    let line = line.with_context(|| format!("reading {}", path.display()))?;
                    serde_json::from_str(&line)
                        .with_context(|| format!("{}:{}: not a step record", path.display(), i + 1))
                })
                .collect()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_path(name: &str) -> std::path::PathBuf {
        std::env::temp_dir().join(format!("pie-step-log-{}-{name}", std::process::id()))
    }

    #[test]
    fn records_round_trip_with_idle_time_between_steps() {
        let path = temp_path("round-trip.jsonl");
        let mut log = StepLog::create(&path).expect("created");
        let shape = StepShape::of(&[(256, 32)]);
        log.record(Instant::now(), &shape);
        std::thread::sleep(std::time::Duration::from_millis(30));
        log.record(Instant::now(), &StepShape::of(&[(288, 1)]));
        log.record(Instant::now(), &StepShape::default());
        drop(log);
        let steps = read(&[&path]).expect("read").remove(0);
        assert_eq!(steps.len(), 2, "{steps:?}");
        assert_eq!(steps[0].shape(), shape);
        assert_eq!(steps[0].idle_ms, None);
        assert_eq!((steps[1].batch_tokens, steps[1].sequences), (1, 1));
        let idle = steps[1].idle_ms.expect("second step has an idle time");
        assert!((30.0..1000.0).contains(&idle), "{idle}");
        assert!(steps[1].start_unix_ms >= steps[0].start_unix_ms + 30.0);
        std::fs::remove_file(&path).expect("removed");
    }

    #[test]
    fn a_bad_line_is_named_by_file_and_line() {
        let path = temp_path("bad.jsonl");
        std::fs::write(&path, "\n{\"nope\": 1}\n").expect("written");
        let err = format!("{:#}", read(&[&path]).expect_err("refused"));
        std::fs::remove_file(&path).expect("removed");
        assert!(err.contains("bad.jsonl:2: not a step record"), "{err}");
    }
}
