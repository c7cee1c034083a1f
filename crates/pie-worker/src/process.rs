//! Inferlet processes: the record of one request (id, client, props, state,
//! timestamps, token counts, output) and the events its watchers receive.
//!
//! Watchers read the stored output by index rather than from a bounded
//! channel, so a slow reader cannot be overrun: it sees every output piece
//! exactly once, however far behind it is. The output is bounded by the
//! process's `max_tokens`, so keeping all of it costs nothing a channel would
//! save.

use pie_core::clock::now_ms;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use futures_util::stream::{self, BoxStream, StreamExt};
use pie_core::{Props, SeqId};
use pie_model::{ChatMessage, TokenLogprobs};
use serde::Serialize;
use tokio::sync::watch;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ProcState {
    Queued,
    Running,
    Finished,
    Failed,
    Killed,
    /// Stopped here to go on on another worker (a controller's migration);
    /// its stream ends with a hand-off, not an error.
    Migrated,
}

impl ProcState {
    pub fn is_final(self) -> bool {
        matches!(
            self,
            ProcState::Finished | ProcState::Failed | ProcState::Killed | ProcState::Migrated
        )
    }

    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "queued" => ProcState::Queued,
            "running" => ProcState::Running,
            "finished" => ProcState::Finished,
            "failed" => ProcState::Failed,
            "killed" => ProcState::Killed,
            "migrated" => ProcState::Migrated,
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
            ProcState::Migrated => "migrated",
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
    /// New output text (possibly empty when a token completes no character)
    /// and the token that produced it (None for text flushed at the end).
    /// With the token's log-probabilities when the request asked for them.
    Text {
        text: String,
        token: Option<u32>,
        logprobs: Option<Arc<TokenLogprobs>>,
    },
    /// A JSON event an inferlet emitted, as compact JSON text (kept as
    /// text, so what it costs to keep is its length).
    Json(Arc<str>),
    /// The process's props after an inferlet changed its own, as compact
    /// JSON text (kept as text: a map of props would take several times
    /// the bytes it is charged).
    Props(Arc<str>),
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
    /// Where each `Text` event's piece of `output` ends: watchers replay the
    /// pieces by index.
    #[serde(skip)]
    piece_ends: Vec<usize>,
    /// What each piece is besides its text (JSON and props events have none).
    #[serde(skip)]
    pieces: Vec<Piece>,
    /// What the record keeps, in bytes (its text and events, each with
    /// [`PIECE_OVERHEAD_BYTES`]).
    #[serde(skip)]
    kept_bytes: usize,
}

/// One event of the stored sequence besides its share of `output`.
#[derive(Clone, Debug)]
enum Piece {
    Text {
        token: Option<u32>,
        logprobs: Option<Arc<TokenLogprobs>>,
    },
    Json(Arc<str>),
    /// The props as compact JSON text.
    Props(Arc<str>),
}

impl Piece {
    /// Its bytes beside its text.
    fn bytes(&self) -> usize {
        PIECE_OVERHEAD_BYTES
            + match self {
                Piece::Text { logprobs, .. } => logprobs.as_ref().map_or(0, |l| {
                    std::mem::size_of::<TokenLogprobs>()
                        + l.top.len() * std::mem::size_of::<(u32, f32)>()
                }),
                Piece::Json(json) | Piece::Props(json) => json.len(),
            }
    }
}

impl ProcData {
    fn push(&mut self, text: &str, piece: Piece) {
        self.output.push_str(text);
        self.piece_ends.push(self.output.len());
        self.kept_bytes += text.len() + piece.bytes();
        self.pieces.push(piece);
    }

    /// Keep the pieces that fit `cap` bytes and a marker saying what went.
    fn cut_to(&mut self, cap: usize) {
        let mut kept = 0;
        let mut start = 0;
        let mut keep = 0;
        for (piece, &end) in self.pieces.iter().zip(&self.piece_ends) {
            let bytes = end - start + piece.bytes();
            if kept + bytes > cap {
                break;
            }
            kept += bytes;
            start = end;
            keep += 1;
        }
        let dropped = self.pieces.len() - keep;
        let dropped_bytes = self.kept_bytes - kept;
        let kept_tokens = self.pieces[..keep]
            .iter()
            .filter(|p| matches!(p, Piece::Text { token: Some(_), .. }))
            .count();
        self.pieces.truncate(keep);
        self.piece_ends.truncate(keep);
        self.output.truncate(start);
        self.output_tokens.truncate(kept_tokens);
        self.kept_bytes = kept;
        let marker = serde_json::json!({"record_truncated": {
            "dropped_events": dropped,
            "dropped_bytes": dropped_bytes,
            "limit": "[server] max_record_bytes",
        }});
        self.push("", Piece::Json(marker.to_string().into()));
    }

    /// The event at `index` of the process's event sequence (its output
    /// pieces, then `Done`), if it has happened yet.
    fn event_at(&self, index: usize) -> Option<ProcEvent> {
        if let Some(&end) = self.piece_ends.get(index) {
            let start = index.checked_sub(1).map_or(0, |i| self.piece_ends[i]);
            return Some(match &self.pieces[index] {
                Piece::Text { token, logprobs } => ProcEvent::Text {
                    text: self.output[start..end].to_string(),
                    token: *token,
                    logprobs: logprobs.clone(),
                },
                Piece::Json(value) => ProcEvent::Json(value.clone()),
                Piece::Props(json) => ProcEvent::Props(json.clone()),
            });
        }
        // A reader past the end of a record cut at its finish gets `Done`.
        (index >= self.piece_ends.len() && self.state.is_final()).then(|| ProcEvent::Done {
            state: self.state,
            finish_reason: self.finish_reason,
            usage: self.usage,
            error: self.error.clone(),
        })
    }
}

/// What the host keeps for one event beyond its text (its entry in the
/// record's index, its enum), counted in a record's bytes.
pub const PIECE_OVERHEAD_BYTES: usize = 64;

/// How many processes are queued and running, queued per client, and the
/// bytes finished records keep, kept up to date by state changes so that
/// load checks, per-key shares, record budgets and scrapes do not scan the
/// process table; and the cap on one finished record's bytes.
#[derive(Debug)]
pub struct StateCounts {
    queued: AtomicUsize,
    running: AtomicUsize,
    queued_by_client: Mutex<HashMap<String, usize>>,
    finished_bytes: AtomicUsize,
    /// `[server] max_record_bytes`: a record past it is cut at its end.
    record_cap: usize,
}

impl Default for StateCounts {
    fn default() -> Self {
        Self::with_record_cap(usize::MAX)
    }
}

impl StateCounts {
    pub fn with_record_cap(record_cap: usize) -> Self {
        Self {
            queued: AtomicUsize::new(0),
            running: AtomicUsize::new(0),
            queued_by_client: Mutex::default(),
            finished_bytes: AtomicUsize::new(0),
            record_cap,
        }
    }

    /// Bytes the finished records in the table keep.
    pub fn finished_bytes(&self) -> usize {
        self.finished_bytes.load(Ordering::Relaxed)
    }

    /// A finished record of `bytes` leaves the table.
    pub fn forget(&self, bytes: usize) {
        self.finished_bytes.fetch_sub(bytes, Ordering::Relaxed);
    }

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

    /// Queued processes of `client`, and how many clients have any.
    pub fn queued_of(&self, client: &str) -> (usize, usize) {
        let by_client = self.lock_by_client();
        (by_client.get(client).copied().unwrap_or(0), by_client.len())
    }

    fn lock_by_client(&self) -> std::sync::MutexGuard<'_, HashMap<String, usize>> {
        self.queued_by_client
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    fn queue(&self, client: &str) {
        self.queued.fetch_add(1, Ordering::Relaxed);
        *self.lock_by_client().entry(client.to_string()).or_default() += 1;
    }

    fn moved(&self, client: &str, from: ProcState, to: ProcState) {
        if let Some(c) = self.counter(from) {
            c.fetch_sub(1, Ordering::Relaxed);
        }
        if let Some(c) = self.counter(to) {
            c.fetch_add(1, Ordering::Relaxed);
        }
        if from == ProcState::Queued && to != ProcState::Queued {
            let mut by_client = self.lock_by_client();
            if let Some(n) = by_client.get_mut(client) {
                *n -= 1;
                if *n == 0 {
                    by_client.remove(client);
                }
            }
        }
    }
}

pub struct Process {
    pub id: String,
    pub inferlet: String,
    pub client: String,
    counts: Arc<StateCounts>,
    data: Mutex<ProcData>,
    /// Bumped after every change of `data` that adds an event; wakes watchers.
    changes: watch::Sender<u64>,
    /// Its engine sequences now (a built-in's one; an inferlet's
    /// generations in flight, each with its context's retention key).
    seqs: Mutex<Vec<(SeqId, Option<String>)>>,
    /// Messages from the client, for an inferlet that takes them.
    inbox: OnceLock<crate::inbox::InboxSender>,
    /// A controller asked to move it: it stops after its next token.
    handing_off: AtomicBool,
    /// A chat resuming a session: the session's turns before this one (what
    /// a controller needs to resume it on another worker).
    earlier_turns: OnceLock<Vec<ChatMessage>>,
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

impl Process {
    pub fn new(
        id: String,
        inferlet: &str,
        client: String,
        props: Props,
        prompt_tokens: usize,
        counts: Arc<StateCounts>,
    ) -> Self {
        counts.queue(&client);
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
            piece_ends: Vec::new(),
            kept_bytes: 0,
            pieces: Vec::new(),
        };
        Self {
            id,
            inferlet: inferlet.to_string(),
            client,
            counts,
            data: Mutex::new(data),
            changes: watch::channel(0).0,
            seqs: Mutex::new(Vec::new()),
            inbox: OnceLock::new(),
            handing_off: AtomicBool::new(false),
            earlier_turns: OnceLock::new(),
        }
    }

    /// A chat resuming a session: its turns before this one (None: not such
    /// a chat).
    pub fn earlier_turns(&self) -> Option<&[ChatMessage]> {
        self.earlier_turns.get().map(Vec::as_slice)
    }

    pub fn set_earlier_turns(&self, turns: Vec<ChatMessage>) {
        let _ = self.earlier_turns.set(turns);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ProcData> {
        self.data.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wake the watchers (called after a change that adds an event).
    fn changed(&self) {
        self.changes.send_modify(|n| *n += 1);
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

    /// Mark it as being handed off; false if it already was.
    pub fn begin_hand_off(&self) -> bool {
        !self.handing_off.swap(true, Ordering::Relaxed)
    }

    pub fn handing_off(&self) -> bool {
        self.handing_off.load(Ordering::Relaxed)
    }

    fn lock_seqs(&self) -> std::sync::MutexGuard<'_, Vec<(SeqId, Option<String>)>> {
        self.seqs.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Its first engine sequence, once the engine admitted it.
    pub fn seq(&self) -> Option<SeqId> {
        self.lock_seqs().first().map(|s| s.0)
    }

    /// Every engine sequence it has now, with the `session` its props carry
    /// there instead of the process's (an inferlet context's retention key).
    pub fn seqs(&self) -> Vec<(SeqId, Option<String>)> {
        self.lock_seqs().clone()
    }

    pub fn set_seq(&self, seq: SeqId) {
        self.lock_seqs().push((seq, None));
    }

    /// An inferlet's sequence, retained as `session` when it ends.
    pub fn add_context_seq(&self, seq: SeqId, session: String) {
        self.lock_seqs().push((seq, Some(session)));
    }

    /// The sequence ended (an inferlet's generation).
    pub fn remove_seq(&self, seq: SeqId) {
        self.lock_seqs().retain(|s| s.0 != seq);
    }

    /// Where the client's messages go (an inferlet that takes them).
    pub fn set_inbox(&self, inbox: crate::inbox::InboxSender) {
        let _ = self.inbox.set(inbox);
    }

    pub fn inbox(&self) -> Option<&crate::inbox::InboxSender> {
        self.inbox.get()
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

    /// Every event of the process from its start: one `Text` per output piece,
    /// then the final `Done`, after which the stream ends. Read from the stored
    /// output by index, so no reader misses or repeats a piece however slowly
    /// it reads.
    pub fn events(self: &Arc<Self>) -> BoxStream<'static, ProcEvent> {
        let start = (self.clone(), self.changes.subscribe(), 0);
        stream::unfold(Some(start), |state| async move {
            let (process, mut changes, index) = state?;
            loop {
                // Marked seen before reading, so a change after the read wakes us.
                changes.borrow_and_update();
                let event = process.lock().event_at(index);
                match event {
                    Some(done @ ProcEvent::Done { .. }) => return Some((done, None)),
                    Some(text) => return Some((text, Some((process, changes, index + 1)))),
                    None => changes.changed().await.ok()?,
                }
            }
        })
        .boxed()
    }

    /// Returns once the process is in a final state.
    pub async fn ended(&self) {
        let mut changes = self.changes.subscribe();
        while !self.state().is_final() {
            if changes.changed().await.is_err() {
                return;
            }
        }
    }

    pub fn mark_running(&self) {
        let mut d = self.lock();
        if d.state == ProcState::Queued {
            d.state = ProcState::Running;
            self.counts
                .moved(&self.client, ProcState::Queued, ProcState::Running);
        }
    }

    /// Append output and count the tokens generated so far.
    pub fn push_text(&self, text: String, token: Option<u32>, completion_tokens: usize) {
        self.push_text_counted(text, token, None, |_| completion_tokens);
    }

    /// [`Self::push_text`] of a token with its log-probabilities.
    pub fn push_scored(
        &self,
        text: String,
        token: u32,
        logprobs: TokenLogprobs,
        completion_tokens: usize,
    ) {
        self.push_text_counted(text, Some(token), Some(Arc::new(logprobs)), |_| {
            completion_tokens
        });
    }

    /// An inferlet's generated text (a token counted when it came with one).
    pub fn push_generated(&self, text: String, token: Option<u32>) {
        if token.is_some() || !text.is_empty() {
            self.push_text_counted(text, token, None, |n| n + usize::from(token.is_some()));
        }
    }

    /// An inferlet's prompt tokens, `cached` of them found cached, join the
    /// usage.
    pub fn count_prompt(&self, prompt: usize, cached: usize) {
        let mut d = self.lock();
        if !d.state.is_final() {
            let u = d.usage;
            d.usage = Usage::new(
                u.prompt_tokens + prompt,
                u.completion_tokens,
                u.prompt_tokens_details.cached_tokens + cached,
            );
        }
    }

    /// A token generated without output (an inferlet's unstreamed generation).
    pub fn count_generated(&self) {
        let mut d = self.lock();
        if !d.state.is_final() {
            let u = d.usage;
            d.usage = Usage::new(
                u.prompt_tokens,
                u.completion_tokens + 1,
                u.prompt_tokens_details.cached_tokens,
            );
        }
    }

    /// Text an inferlet emitted itself (no token).
    pub fn push_emitted(&self, text: String) {
        self.push_text_counted(text, None, None, |n| n);
    }

    /// Append output, the completion tokens counted from the old count.
    fn push_text_counted(
        &self,
        text: String,
        token: Option<u32>,
        logprobs: Option<Arc<TokenLogprobs>>,
        completion_tokens: impl FnOnce(usize) -> usize,
    ) {
        let mut d = self.lock();
        if d.state.is_final() {
            return;
        }
        let completion_tokens = completion_tokens(d.usage.completion_tokens);
        if d.first_token_ms.is_none() {
            d.first_token_ms = Some(now_ms());
        }
        d.push(&text, Piece::Text { token, logprobs });
        d.output_tokens.extend(token);
        d.usage = Usage::new(
            d.usage.prompt_tokens,
            completion_tokens,
            d.usage.prompt_tokens_details.cached_tokens,
        );
        drop(d);
        self.changed();
    }

    /// A JSON event to the watchers (no output text): `json` is compact
    /// JSON text.
    pub fn push_json(&self, json: String) {
        self.push_piece(Piece::Json(json.into()));
    }

    /// Change props under the lock with `f`, and tell the watchers the result.
    pub fn update_props_announced<E>(
        &self,
        f: impl FnOnce(&mut Props) -> Result<(), E>,
    ) -> Result<Props, E> {
        let props = self.update_props(f)?;
        let json = serde_json::to_string(&props).unwrap_or_default();
        self.push_piece(Piece::Props(json.into()));
        Ok(props)
    }

    fn push_piece(&self, piece: Piece) {
        let mut d = self.lock();
        if d.state.is_final() {
            return;
        }
        d.push("", piece);
        drop(d);
        self.changed();
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
        self.counts.moved(&self.client, d.state, state);
        d.state = state;
        d.finish_reason = finish_reason;
        d.finished_ms = Some(now_ms());
        d.error = error;
        if d.kept_bytes > self.counts.record_cap {
            d.cut_to(self.counts.record_cap);
        }
        self.counts
            .finished_bytes
            .fetch_add(d.kept_bytes, Ordering::Relaxed);
        drop(d);
        self.changed();
        true
    }

    /// The bytes its record keeps.
    pub fn kept_bytes(&self) -> usize {
        self.lock().kept_bytes
    }

    /// When it reached its final state (unix ms), if it has.
    pub fn finished_ms(&self) -> Option<u64> {
        self.lock().finished_ms
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn process() -> Arc<Process> {
        Arc::new(Process::new(
            "proc-1".into(),
            "text-completion",
            "c".into(),
            Props::new(),
            3,
            Arc::default(),
        ))
    }

    fn text_of(events: &[ProcEvent]) -> String {
        events
            .iter()
            .filter_map(|e| match e {
                ProcEvent::Text { text, .. } => Some(text.as_str()),
                _ => None,
            })
            .collect()
    }

    /// A reader that reads nothing until 10,000 pieces are out (the old
    /// 4,096-slot broadcast dropped the first ones and still ended normally).
    #[tokio::test]
    async fn a_reader_far_behind_sees_every_piece_once_then_done() {
        let p = process();
        let events = p.events();
        for i in 0..10_000u32 {
            p.push_text(format!("{i},"), Some(i), i as usize + 1);
        }
        p.finish(ProcState::Finished, Some("length"), None);
        let all: Vec<ProcEvent> = events.collect().await;
        assert_eq!(all.len(), 10_001);
        assert_eq!(
            all[4096],
            ProcEvent::Text {
                text: "4096,".into(),
                token: Some(4096),
                logprobs: None,
            }
        );
        assert_eq!(text_of(&all), p.snapshot().output);
        match all.last() {
            Some(ProcEvent::Done { state, usage, .. }) => {
                assert_eq!(*state, ProcState::Finished);
                assert_eq!(usage.completion_tokens, 10_000);
            }
            other => panic!("last event {other:?}"),
        }
    }

    /// A record past `max_record_bytes` is cut at its finish to the events
    /// that fit, with a marker saying what went; a reader already past the
    /// cut gets `Done`, and the finished bytes count what is kept.
    #[tokio::test]
    async fn a_record_past_its_cap_is_cut_with_a_marker() {
        let counts = Arc::new(StateCounts::with_record_cap(
            10 * (10 + PIECE_OVERHEAD_BYTES),
        ));
        let p = Arc::new(Process::new(
            "proc-1".into(),
            "flood",
            "c".into(),
            Props::new(),
            0,
            counts.clone(),
        ));
        let mut ahead = p.events();
        for i in 0..100u32 {
            p.push_text("0123456789".into(), Some(i), i as usize + 1);
        }
        for _ in 0..50 {
            ahead.next().await;
        }
        p.finish(ProcState::Finished, Some("stop"), None);
        let kept: Vec<ProcEvent> = p.events().collect().await;
        assert_eq!(kept.len(), 12, "10 pieces, the marker, Done");
        assert_eq!(p.snapshot().output, "0123456789".repeat(10));
        assert_eq!(p.snapshot().output_tokens.len(), 10);
        match &kept[10] {
            ProcEvent::Json(marker) => {
                assert!(marker.contains("\"dropped_events\":90"), "{marker}");
                assert!(marker.contains("max_record_bytes"), "{marker}");
            }
            other => panic!("no marker: {other:?}"),
        }
        assert!(matches!(ahead.next().await, Some(ProcEvent::Done { .. })));
        assert_eq!(counts.finished_bytes(), p.kept_bytes());
    }

    /// A live reader, woken piece by piece while the writer runs, sees the same
    /// events as one that subscribes after the end; empty pieces included.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn live_and_late_readers_see_the_same_events() {
        let p = process();
        let live = tokio::spawn(p.events().collect::<Vec<_>>());
        let writer = p.clone();
        tokio::spawn(async move {
            for i in 0..500u32 {
                let piece = if i % 7 == 0 {
                    String::new()
                } else {
                    "é".repeat(1 + i as usize % 3)
                };
                writer.push_text(piece, Some(i), i as usize + 1);
                if i % 50 == 0 {
                    tokio::task::yield_now().await;
                }
            }
            writer.finish(ProcState::Failed, None, Some("boom".into()));
        })
        .await
        .unwrap();
        let live = live.await.unwrap();
        let late: Vec<ProcEvent> = p.events().collect().await;
        assert_eq!(live.len(), 501);
        assert_eq!(live, late);
        assert!(matches!(
            live.last(),
            Some(ProcEvent::Done { state: ProcState::Failed, error: Some(e), .. }) if e == "boom"
        ));
        assert_eq!(text_of(&live), p.snapshot().output);
    }
}
