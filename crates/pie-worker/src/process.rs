//! Inferlet processes: the record of one request (id, client, props, state,
//! timestamps, token counts, output) and the events its watchers receive.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use pie_core::{Props, SeqId};
use serde::Serialize;
use tokio::sync::broadcast;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ProcState {
    Queued,
    Running,
    Finished,
    Failed,
    Killed,
}

impl ProcState {
    pub fn is_final(self) -> bool {
        matches!(
            self,
            ProcState::Finished | ProcState::Failed | ProcState::Killed
        )
    }

    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "queued" => ProcState::Queued,
            "running" => ProcState::Running,
            "finished" => ProcState::Finished,
            "failed" => ProcState::Failed,
            "killed" => ProcState::Killed,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ProcState::Queued => "queued",
            ProcState::Running => "running",
            ProcState::Finished => "finished",
            ProcState::Failed => "failed",
            ProcState::Killed => "killed",
        }
    }
}

/// Token accounting in OpenAI's `usage` shape.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: CachedTokens,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct CachedTokens {
    pub cached_tokens: usize,
}

impl Usage {
    pub fn new(prompt: usize, completion: usize, cached: usize) -> Self {
        Self {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt + completion,
            prompt_tokens_details: CachedTokens {
                cached_tokens: cached,
            },
        }
    }
}

/// What watchers of a process see.
#[derive(Clone, Debug, PartialEq)]
pub enum ProcEvent {
    /// New output text (possibly empty when a token completes no character).
    Text(String),
    /// The final state; no event follows.
    Done {
        state: ProcState,
        finish_reason: Option<&'static str>,
        usage: Usage,
        error: Option<String>,
    },
}

/// The mutable part of a process.
#[derive(Clone, Debug, Serialize)]
pub struct ProcData {
    pub props: Props,
    pub state: ProcState,
    pub created_ms: u64,
    pub first_token_ms: Option<u64>,
    pub finished_ms: Option<u64>,
    pub usage: Usage,
    pub finish_reason: Option<&'static str>,
    pub output: String,
    /// Generated token ids (stop strings do not trim these).
    pub output_tokens: Vec<u32>,
    pub error: Option<String>,
}

/// How many processes are queued and running, kept up to date by their state
/// changes so that load checks and scrapes do not scan the process table.
#[derive(Debug, Default)]
pub struct StateCounts {
    queued: AtomicUsize,
    running: AtomicUsize,
}

impl StateCounts {
    pub fn get(&self, state: ProcState) -> usize {
        match state {
            ProcState::Queued => self.queued.load(Ordering::Relaxed),
            ProcState::Running => self.running.load(Ordering::Relaxed),
            _ => 0,
        }
    }

    fn counter(&self, state: ProcState) -> Option<&AtomicUsize> {
        match state {
            ProcState::Queued => Some(&self.queued),
            ProcState::Running => Some(&self.running),
            _ => None,
        }
    }

    fn moved(&self, from: ProcState, to: ProcState) {
        if let Some(c) = self.counter(from) {
            c.fetch_sub(1, Ordering::Relaxed);
        }
        if let Some(c) = self.counter(to) {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }
}

pub struct Process {
    pub id: String,
    pub inferlet: String,
    pub client: String,
    counts: Arc<StateCounts>,
    data: Mutex<ProcData>,
    /// Dropped once the process is final, so that a finished record does not
    /// keep its event buffer (`EVENT_BUFFER` slots) while it stays listed.
    events: Mutex<Option<broadcast::Sender<ProcEvent>>>,
    seq: OnceLock<SeqId>,
}

/// A process as the API shows it.
#[derive(Serialize)]
pub struct ProcView<'a> {
    pub id: &'a str,
    pub inferlet: &'a str,
    pub client: &'a str,
    #[serde(flatten)]
    pub data: ProcData,
}

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

const EVENT_BUFFER: usize = 4096;

impl Process {
    pub fn new(
        id: String,
        inferlet: &str,
        client: String,
        props: Props,
        prompt_tokens: usize,
        counts: Arc<StateCounts>,
    ) -> Self {
        counts.queued.fetch_add(1, Ordering::Relaxed);
        let data = ProcData {
            props,
            state: ProcState::Queued,
            created_ms: now_ms(),
            first_token_ms: None,
            finished_ms: None,
            usage: Usage::new(prompt_tokens, 0, 0),
            finish_reason: None,
            output: String::new(),
            output_tokens: Vec::new(),
            error: None,
        };
        Self {
            id,
            inferlet: inferlet.to_string(),
            client,
            counts,
            data: Mutex::new(data),
            events: Mutex::new(Some(broadcast::channel(EVENT_BUFFER).0)),
            seq: OnceLock::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ProcData> {
        self.data.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Callers hold the data lock, so events and state changes stay in order.
    fn events(&self) -> std::sync::MutexGuard<'_, Option<broadcast::Sender<ProcEvent>>> {
        self.events.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn send(&self, event: ProcEvent) {
        if let Some(tx) = self.events().as_ref() {
            let _ = tx.send(event);
        }
    }

    pub fn snapshot(&self) -> ProcData {
        self.lock().clone()
    }

    pub fn view(&self) -> ProcView<'_> {
        ProcView {
            id: &self.id,
            inferlet: &self.inferlet,
            client: &self.client,
            data: self.snapshot(),
        }
    }

    /// The engine sequence, once the engine admitted it.
    pub fn seq(&self) -> Option<SeqId> {
        self.seq.get().copied()
    }

    pub fn set_seq(&self, seq: SeqId) {
        let _ = self.seq.set(seq);
    }

    pub fn state(&self) -> ProcState {
        self.lock().state
    }

    pub fn props(&self) -> Props {
        self.lock().props.clone()
    }

    /// Change props under the lock with `f`; returns the new props.
    pub fn update_props<E>(&self, f: impl FnOnce(&mut Props) -> Result<(), E>) -> Result<Props, E> {
        let mut d = self.lock();
        f(&mut d.props)?;
        Ok(d.props.clone())
    }

    /// The output so far and a receiver for everything after it, with no gap and no
    /// duplicate between the two.
    pub fn watch(&self) -> (ProcData, broadcast::Receiver<ProcEvent>) {
        let d = self.lock();
        let rx = match self.events().as_ref() {
            Some(tx) => tx.subscribe(),
            // Final: the snapshot says everything; the receiver is closed.
            None => broadcast::channel(1).1,
        };
        (d.clone(), rx)
    }

    pub fn mark_running(&self) {
        let mut d = self.lock();
        if d.state == ProcState::Queued {
            d.state = ProcState::Running;
            self.counts.moved(ProcState::Queued, ProcState::Running);
        }
    }

    /// Append output and count the tokens generated so far.
    pub fn push_text(&self, text: String, token: Option<u32>, completion_tokens: usize) {
        let mut d = self.lock();
        if d.state.is_final() {
            return;
        }
        if d.first_token_ms.is_none() {
            d.first_token_ms = Some(now_ms());
        }
        d.output.push_str(&text);
        d.output_tokens.extend(token);
        d.usage = Usage::new(
            d.usage.prompt_tokens,
            completion_tokens,
            d.usage.prompt_tokens_details.cached_tokens,
        );
        self.send(ProcEvent::Text(text));
    }

    pub fn set_cached_tokens(&self, cached: usize) {
        let mut d = self.lock();
        d.usage.prompt_tokens_details.cached_tokens = cached;
    }

    /// Enter a final state once; later calls are ignored. Returns whether it did.
    pub fn finish(
        &self,
        state: ProcState,
        finish_reason: Option<&'static str>,
        error: Option<String>,
    ) -> bool {
        let mut d = self.lock();
        if d.state.is_final() {
            return false;
        }
        self.counts.moved(d.state, state);
        d.state = state;
        d.finish_reason = finish_reason;
        d.finished_ms = Some(now_ms());
        d.error = error.clone();
        self.send(ProcEvent::Done {
            state,
            finish_reason,
            usage: d.usage,
            error,
        });
        self.events().take();
        true
    }
}
