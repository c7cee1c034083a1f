//! The worker runtime: the engine on its own thread (supervised, see
//! [`crate::supervisor`]), the process table, and the built-in inferlets that
//! drive generation for each process.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::stream::BoxStream;

use pie_core::{BlockHash, KvEventBatch, KvSnapshot, Props, SeqId};
use pie_kv::IndexChange;
use pie_model::{ChatMessage, IncrementalDecoder, Model, SamplingParams};
use pie_policy::{KeepSession, Offload, WorkerPolicy};
use serde_json::{json, Value};
use tokio::sync::{broadcast, mpsc, oneshot};

use crate::engine::{Engine, EngineCounters, FinishReason, Request, SeqInfo, Spill};
use crate::leases::Leases;
use crate::metrics::Metrics;
use crate::process::{now_ms, ProcEvent, ProcState, Process, StateCounts};
use crate::records::{ProcessTable, RecordLimits};
use crate::sessions::Sessions;
use crate::step_log::StepLog;
use crate::supervisor::{self, Supervision};
use pie_kv::transfer::PageFormat;
use pie_policy::cluster::Stage;
use pie_policy::runtime::{TransferConfig, WorkerPolicies};

mod persist;
mod spill;
mod transfer;

pub use persist::{Forget, PersistError, PersistStore, PersistTo, Persisted};
use pie_workload::{TraceInput, TraceRecorder};
use transfer::Pull;
pub use transfer::{PullError, PullRequest, ServeError};

/// What the engine thread reports to one sequence's driver.
#[derive(Debug)]
enum SeqEvent {
    Started { cached_tokens: usize },
    Token(u32),
    Finished(FinishReason, SeqInfo),
    Failed(String),
}

enum Command {
    Add {
        req: Request,
        events: mpsc::UnboundedSender<SeqEvent>,
        reply: oneshot::Sender<SeqId>,
    },
    Abort(SeqId),
    /// Finish the sequence after its next token (a hand-off).
    StopAfterNext(SeqId),
    SetProps(SeqId, Props),
    SetPolicies {
        ordering: Box<dyn WorkerPolicy>,
        keep_session: Option<KeepSession>,
    },
    Summary(oneshot::Sender<Value>),
    KvSnapshot(oneshot::Sender<KvSnapshot>),
    /// How many leading pages of the chain the pool holds.
    CachedPages {
        chain: Vec<BlockHash>,
        reply: oneshot::Sender<usize>,
    },
    /// Pin the pool's leading pages of the chain under a new lease: (lease, pages).
    PinPrefix {
        chain: Vec<BlockHash>,
        ttl: Duration,
        reply: oneshot::Sender<(u64, usize)>,
    },
    /// Pages `from..from + count` of a lease, exported (renews the lease);
    /// None when the lease is gone.
    ExportLeased {
        lease: u64,
        from: usize,
        count: usize,
        reply: oneshot::Sender<Option<Vec<Vec<u8>>>>,
    },
    ReleaseLease(u64),
    ImportPages {
        /// The chain `pages` continue: the pool's leading part of it is kept
        /// while they are imported.
        chain: Arc<[BlockHash]>,
        pages: Vec<Vec<u8>>,
        reply: oneshot::Sender<usize>,
    },
    /// Spill retained sessions evicted early (`retain-all`), or not.
    SetSpill(bool),
    /// The disk tier gained and lost these blocks (for the KV events).
    DiskChanged {
        stored: Vec<BlockHash>,
        removed: Vec<BlockHash>,
    },
    /// `fault-injection`: panic on the engine thread.
    #[cfg(feature = "fault-injection")]
    Panic,
}

/// Engine load published after every engine iteration, read by offload.
#[derive(Default)]
struct Load {
    waiting_prefill_tokens: AtomicUsize,
    prefill_tokens_per_s: AtomicU64,
}

/// A prompt as text or as token ids.
#[derive(Clone, Debug)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

/// `pie_prompt_tokens`: a prompt's token ids as a controller computed them
/// (completions: the prompt; chat: the messages after the chat template),
/// so the worker need not tokenize again. Trusted only from a `worker`-role
/// key (see `api::trusted_prompt_tokens`); checked here against this
/// worker's model fingerprint and vocabulary, so a mismatch is a 400, never
/// other tokens than the text names.
#[derive(Clone, Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PromptTokens {
    pub fingerprint: u64,
    pub ids: Vec<u32>,
}

pub use pie_core::wire::{PROMPT_TOKENS_FIELD, RESUME_FIELD, STREAM_IDS_FIELD};

/// `pie_resume`: a process that ran on another worker goes on here (a
/// controller's migration, or its recovery from a dead worker). Trusted only
/// from a `worker`-role key (see `api::trusted_resume`).
#[derive(Clone, Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Resume {
    /// The ids the process generated so far, in order: the engine continues
    /// after prompt + these, the sampler after as many samples, and the text
    /// they made is not sent again.
    pub tokens: Vec<u32>,
    /// A live worker that holds their pages: pulled from it (never prefilled
    /// there); None after a crash: computed here.
    #[serde(default)]
    pub from: Option<String>,
    /// The tokens are output here too, first (a native process: its client
    /// reads the whole output from the record and its events by index, so
    /// the record here must hold what the source's held); an OpenAI stream's
    /// client has them already.
    #[serde(skip)]
    pub replay: bool,
    /// A native chat resuming a session: the session's turns before this
    /// one, as its first worker had them; they replace this worker's own.
    #[serde(default)]
    pub turns: Option<Vec<ChatMessage>>,
}

/// A built-in inferlet and its input.
#[derive(Clone, Debug)]
pub enum Inferlet {
    TextCompletion {
        prompt: Prompt,
    },
    /// With a `session` prop and `resume_session`, the session's earlier turns are
    /// prepended and this turn's messages and answer are appended to it.
    Chat {
        messages: Vec<ChatMessage>,
        resume_session: bool,
    },
}

impl Inferlet {
    pub fn name(&self) -> &'static str {
        match self {
            Inferlet::TextCompletion { .. } => "text-completion",
            Inferlet::Chat { .. } => "chat",
        }
    }
}

#[derive(Clone, Debug, Default)]
pub struct GenOptions {
    /// None: as many as fit.
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    /// The tenant's cache salt: its KV is shared only with the same salt.
    pub cache_salt: Option<String>,
    /// A peer worker (URL) that prefills the prompt; this worker pulls its
    /// pages (a controller's `disaggregate`, see `api::trusted_prefill_from`).
    pub prefill_from: Option<String>,
    /// The process ran elsewhere until now.
    pub resume: Option<Resume>,
}

/// A peer worker this process's pages come from before its prefill.
#[derive(Clone, Debug)]
struct PageSource {
    url: String,
    /// The peer computes the prompt first (disaggregate); otherwise it sends
    /// what it holds (a migration's source).
    prefill: bool,
}

/// Why a launch was refused (mapped to HTTP statuses by the API).
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("too many queued processes ({0}); retry later")]
    Overloaded(usize),
    #[error("{0}")]
    BadRequest(String),
    /// The engine panicked or stalls (see `Runtime::health`).
    #[error("the worker is unhealthy: {0}")]
    Unhealthy(String),
    /// Draining: it takes no new processes (see `Runtime::start_drain`).
    #[error("the worker is draining: it takes no new processes")]
    Draining,
}

pub struct RuntimeSettings {
    pub model_name: String,
    /// Reloadable: processes waiting to start before the API answers 429.
    pub max_queued: AtomicUsize,
    /// `[server] trace_file`: finished processes are recorded here.
    pub trace: Option<TraceRecorder>,
    /// `[server] worker_key`: presented to peers (pulls of KV pages).
    pub worker_key: Option<String>,
    /// `[runtime] stage`, reported to the controller.
    pub stage: Stage,
    /// `[runtime.transfer]`.
    pub transfer: TransferConfig,
    /// `[runtime.persist]`: None without a `dir`.
    pub persist: Option<PersistStore>,
    /// `[runtime] pool`: a `pie-pool`'s URL.
    pub pool: Option<String>,
    /// `[server] stall_ms`: the engine is unhealthy after this long without
    /// progress while work is pending.
    pub stall_ms: u64,
    /// `[server] max_sessions`: chat sessions kept (least recently used go).
    pub max_sessions: usize,
    /// `[server] max_finished_processes` and `finished_ttl_ms`.
    pub records: RecordLimits,
    /// `[server] step_log`: taken by the engine thread at start.
    pub step_log: Option<StepLog>,
}

/// Every event of one process, from its start to its final `Done`.
pub type ProcEvents = BoxStream<'static, ProcEvent>;

/// KV event batches kept for slow subscribers; one that falls further behind
/// is disconnected and resubscribes for a fresh snapshot.
const KV_EVENT_BACKLOG: usize = 4096;

/// Engine limits a controller needs, fixed for the runtime's life.
#[derive(Clone, Copy, Debug)]
pub struct EngineShape {
    pub page_size: usize,
    pub fingerprint: u64,
    pub max_running: usize,
}

pub struct Runtime {
    pub model: Arc<Model>,
    pub shape: EngineShape,
    /// What pages must match to be imported here (the transfer handshake).
    pub page_format: PageFormat,
    pub settings: RuntimeSettings,
    pub metrics: Arc<Metrics>,
    /// Tokens one sequence may hold (prompt + output).
    pub max_seq_tokens: usize,
    pub policy_names: Mutex<Vec<String>>,
    /// When the active policies were configured (unix ms).
    pub policies_loaded_ms: AtomicU64,
    offload: Mutex<Option<Offload>>,
    offloads: AtomicU64,
    load: Arc<Load>,
    http: reqwest::Client,
    commands: std_mpsc::Sender<Command>,
    kv_events: broadcast::Sender<Arc<KvEventBatch>>,
    processes: Mutex<ProcessTable>,
    state_counts: Arc<StateCounts>,
    sessions: Mutex<Sessions>,
    next_id: AtomicU64,
    supervision: Arc<Supervision>,
    /// The engine's health the watchdog last acted on (a `Seen`).
    seen: AtomicU8,
    /// Set once by `start_drain`; never cleared (the worker exits drained).
    draining: AtomicBool,
    /// Woken when the drain starts (`drain_started`).
    drain_start: tokio::sync::Notify,
    /// `fault-injection`: a pause before each page this worker sends.
    #[cfg(feature = "fault-injection")]
    transfer_delay_ms: AtomicU64,
    /// Where retained sessions evicted early go (`retain-all`).
    spill: spill::SpillState,
}

/// The engine's health as the watchdog saw it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Seen {
    Healthy,
    Stalled,
    Panicked,
}

impl Runtime {
    /// Start the engine thread; the runtime lives as long as the server.
    pub fn start(
        mut engine: Engine,
        mut settings: RuntimeSettings,
        policies: WorkerPolicies,
        metrics: Arc<Metrics>,
    ) -> Arc<Self> {
        let (tx, rx) = std_mpsc::channel();
        let model = engine.model().clone();
        let max_seq_tokens = engine.max_sequence_tokens().0;
        engine.set_policy(policies.ordering);
        engine.set_keep_session(policies.keep_session);
        engine.pool_mut().record_index_events();
        let shape = EngineShape {
            page_size: engine.config().page_size,
            fingerprint: engine.pool().fingerprint().0,
            max_running: engine.config().max_running,
        };
        let page_format = engine.page_format();
        let load = Arc::new(Load::default());
        let (kv_events, _) = broadcast::channel(KV_EVENT_BACKLOG);
        let publisher = KvPublisher {
            tx: kv_events.clone(),
            seq: 0,
            on_disk: settings
                .persist
                .as_ref()
                .map(|p| p.hashes().into_iter().map(|h| h.0).collect())
                .unwrap_or_default(),
            disk_changes: Vec::new(),
        };
        let supervision = Arc::new(Supervision::new(settings.stall_ms));
        let (spills, spilled) = mpsc::unbounded_channel();
        let thread = EngineThread {
            metrics: metrics.clone(),
            load: load.clone(),
            supervision: supervision.clone(),
            spills,
        };
        let step_log = settings.step_log.take();
        std::thread::Builder::new()
            .name("pie-engine".into())
            .spawn(move || thread.run(engine, rx, publisher, step_log))
            .expect("spawning the engine thread");
        let state_counts = Arc::<StateCounts>::default();
        let rt = Arc::new(Self {
            model,
            shape,
            page_format,
            metrics,
            max_seq_tokens,
            policy_names: Mutex::new(policies.names),
            policies_loaded_ms: AtomicU64::new(now_ms()),
            offload: Mutex::new(policies.offload),
            offloads: AtomicU64::new(0),
            load,
            http: reqwest::Client::new(),
            commands: tx,
            kv_events,
            processes: Mutex::new(ProcessTable::new(settings.records, state_counts.clone())),
            state_counts,
            sessions: Mutex::new(Sessions::new(settings.max_sessions)),
            next_id: AtomicU64::new(1),
            settings,
            supervision,
            seen: AtomicU8::new(Seen::Healthy as u8),
            draining: AtomicBool::new(false),
            drain_start: tokio::sync::Notify::new(),
            #[cfg(feature = "fault-injection")]
            transfer_delay_ms: AtomicU64::new(0),
            spill: spill::SpillState::new(spilled),
        });
        supervisor::spawn_watchdog(Arc::downgrade(&rt), &rt.supervision);
        rt
    }

    /// `Err(reason)` when the engine thread panicked or stalls.
    pub fn health(&self) -> Result<(), String> {
        self.supervision.health()
    }

    /// Why the engine no longer serves a sequence (for processes failed by it).
    fn engine_stopped(&self) -> String {
        self.health()
            .err()
            .unwrap_or_else(|| "the engine stopped".into())
    }

    /// The watchdog's tick: when the engine is first seen panicked or stalled,
    /// count it and fail every live process with the reason (their clients get
    /// an error instead of waiting forever); then drop expired records.
    pub fn supervise(&self) {
        let health = self.health();
        let seen = match &health {
            Ok(()) => Seen::Healthy,
            Err(_) if self.supervision.has_panicked() => Seen::Panicked,
            Err(_) => Seen::Stalled,
        };
        let before = self.seen.swap(seen as u8, Ordering::Relaxed);
        match health {
            Err(reason) if before != seen as u8 => {
                let counter = match seen {
                    Seen::Panicked => &self.metrics.engine_panics,
                    _ => &self.metrics.engine_stalls,
                };
                counter.inc();
                tracing::error!("{reason}: failing every live process");
                self.fail_live(&reason);
            }
            _ => {}
        }
        self.lock_processes().sweep(now_ms());
    }

    /// Fail every live process with `reason`; returns how many there were.
    pub fn fail_live(&self, reason: &str) -> usize {
        let live: Vec<Arc<Process>> = self
            .lock_processes()
            .all()
            .filter(|p| !p.state().is_final())
            .cloned()
            .collect();
        for p in &live {
            if p.finish(ProcState::Failed, None, Some(reason.to_string())) {
                self.metrics.count_request("failed");
                if let Some(seq) = p.seq() {
                    self.send(Command::Abort(seq));
                }
            }
        }
        live.len()
    }

    /// `fault-injection`: make the engine thread panic or stall.
    #[cfg(feature = "fault-injection")]
    pub fn inject_fault(&self, fault: supervisor::Fault, delay_ms: u64) {
        tracing::warn!(?fault, "fault injected");
        match fault {
            supervisor::Fault::Panic => self.send(Command::Panic),
            supervisor::Fault::Stall => self.supervision.set_stall_fault(),
            supervisor::Fault::SlowTransfer => {
                self.transfer_delay_ms.store(delay_ms, Ordering::Relaxed)
            }
            supervisor::Fault::SlowSteps => self.supervision.set_step_delay(delay_ms),
        }
    }

    fn lock_processes(&self) -> std::sync::MutexGuard<'_, ProcessTable> {
        self.processes.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn send(&self, cmd: Command) {
        // The engine thread lives as long as the process; a send can only fail at exit.
        let _ = self.commands.send(cmd);
    }

    /// Swap the worker policies at the engine's next step boundary. The new ordering
    /// policy takes over the old one's state where it is the same kind (fair keeps
    /// its counters); retained sessions stay until they expire.
    pub fn apply_policies(&self, policies: WorkerPolicies) {
        self.send(Command::SetPolicies {
            ordering: policies.ordering,
            keep_session: policies.keep_session,
        });
        *self.offload.lock().unwrap_or_else(|e| e.into_inner()) = policies.offload;
        *self.policy_names.lock().unwrap_or_else(|e| e.into_inner()) = policies.names;
        self.policies_loaded_ms.store(now_ms(), Ordering::Relaxed);
    }

    /// The policies' state: the ordering policy's summary and retained sessions.
    pub async fn policy_state(&self) -> Value {
        let (tx, rx) = oneshot::channel();
        self.send(Command::Summary(tx));
        rx.await.unwrap_or(Value::Null)
    }

    /// A snapshot of the prefix index and the receiver of every change batch
    /// after it (subscribed first, so none falls between the two).
    pub async fn kv_subscribe(
        &self,
    ) -> Option<(KvSnapshot, broadcast::Receiver<Arc<KvEventBatch>>)> {
        let events = self.kv_events.subscribe();
        let (tx, rx) = oneshot::channel();
        self.send(Command::KvSnapshot(tx));
        Some((rx.await.ok()?, events))
    }

    /// Prefill `tokens` (under `cache_salt`) for a peer, which then pulls
    /// their pages.
    async fn prefill_for_peer(
        self: &Arc<Self>,
        tokens: Vec<u32>,
        cache_salt: Option<String>,
    ) -> Result<(), String> {
        let req = Request {
            prompt: tokens,
            max_tokens: 1,
            sampling: SamplingParams::default(),
            stop_tokens: Vec::new(),
            ignore_eos: true,
            arrival_ms: now_ms(),
            client: "peer".into(),
            props: Props::new(),
            cache_salt,
            sampled_before: 0,
        };
        let (events_tx, mut events) = mpsc::unbounded_channel();
        let (reply_tx, reply) = oneshot::channel();
        self.send(Command::Add {
            req,
            events: events_tx,
            reply: reply_tx,
        });
        let seq = reply.await.map_err(|_| self.engine_stopped())?;
        // A puller that gave up (timeout, gone) drops this future: the
        // prefill stops instead of computing for no one.
        let abandoned = AbortOnDrop {
            rt: self,
            seq,
            armed: true,
        };
        while let Some(e) = events.recv().await {
            match e {
                SeqEvent::Finished(..) => return abandoned.done(Ok(())),
                SeqEvent::Failed(err) => return abandoned.done(Err(err)),
                _ => {}
            }
        }
        abandoned.done(Err(self.engine_stopped()))
    }

    /// Before a process's prefill: pull its pages from the prefill worker the
    /// controller chose (`disaggregate`), or from an offload peer when this
    /// worker is busy. Any failure leaves the prefill (of what is missing) here.
    async fn remote_prefill(&self, req: &Request, source: Option<&PageSource>) {
        let (peer, prefill, timeout_ms) = match source {
            Some(s) => (s.url.clone(), s.prefill, self.settings.transfer.timeout_ms),
            None => match self.offload_peer(req.prompt.len()) {
                Some((peer, timeout_ms)) => (peer, true, timeout_ms),
                None => return,
            },
        };
        let pull = Pull {
            peer: &peer,
            tokens: &req.prompt,
            cache_salt: req.cache_salt.as_deref(),
            blocks: None,
            prefill,
            timeout_ms,
        };
        if self.pull_pages(pull).await.is_ok() && source.is_none() {
            self.metrics.offloaded_prefills.inc();
        }
    }

    /// The offload peer and its timeout when `offload` says a prompt of
    /// `prompt_tokens` should be prefilled elsewhere.
    fn offload_peer(&self, prompt_tokens: usize) -> Option<(String, u64)> {
        let offload = self.offload.lock().unwrap_or_else(|e| e.into_inner());
        let o = offload.as_ref()?;
        let waiting = self.load.waiting_prefill_tokens.load(Ordering::Relaxed) + prompt_tokens;
        let rate = f64::from_bits(self.load.prefill_tokens_per_s.load(Ordering::Relaxed));
        if !o.should_offload(waiting, rate) {
            return None;
        }
        let n = self.offloads.fetch_add(1, Ordering::Relaxed) as usize;
        Some((o.peer(n)?.to_string(), o.config.timeout_ms))
    }

    pub fn process(&self, id: &str) -> Option<Arc<Process>> {
        self.lock_processes().get(id).cloned()
    }

    /// Every process on record, oldest first (ids sort in launch order).
    pub fn processes(&self) -> Vec<Arc<Process>> {
        let mut all: Vec<_> = self.lock_processes().all().cloned().collect();
        all.sort_by(|a, b| a.id.cmp(&b.id));
        all
    }

    /// Queued or running processes (O(1)).
    pub fn count_in(&self, state: ProcState) -> usize {
        self.state_counts.get(state)
    }

    /// Metrics text with the process gauges brought up to date.
    pub fn metrics_text(&self) -> String {
        self.metrics
            .queued
            .set(self.count_in(ProcState::Queued) as i64);
        self.metrics
            .running
            .set(self.count_in(ProcState::Running) as i64);
        self.metrics
            .engine_healthy
            .set(i64::from(self.health().is_ok()));
        self.metrics
            .finished_records
            .set(self.lock_processes().finished() as i64);
        self.metrics
            .chat_sessions
            .set(self.lock_sessions().len() as i64);
        self.metrics.encode()
    }

    fn lock_sessions(&self) -> std::sync::MutexGuard<'_, Sessions> {
        self.sessions.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Start a process; the stream has all its events from the start.
    pub fn launch(
        self: &Arc<Self>,
        inferlet: Inferlet,
        opts: GenOptions,
        props: Props,
        client: String,
        pretokenized: Option<PromptTokens>,
    ) -> Result<(Arc<Process>, ProcEvents), LaunchError> {
        self.health().map_err(LaunchError::Unhealthy)?;
        if self.draining() {
            return Err(LaunchError::Draining);
        }
        let queued = self.count_in(ProcState::Queued);
        if queued >= self.settings.max_queued.load(Ordering::Relaxed) {
            self.metrics.count_request("rejected_overload");
            return Err(LaunchError::Overloaded(queued));
        }
        let mut resume = opts.resume.unwrap_or_default();
        let (mut prompt, session_messages) = self.prompt_tokens(
            &inferlet,
            &props,
            &client,
            pretokenized,
            resume.turns.take(),
        )?;
        if prompt.is_empty() {
            return Err(LaunchError::BadRequest("the prompt is empty".into()));
        }
        let prompt_len = prompt.len();
        self.check_vocab(&format!("{RESUME_FIELD}.tokens"), &resume.tokens)?;
        prompt.extend_from_slice(&resume.tokens);
        if prompt.len() >= self.max_seq_tokens {
            return Err(LaunchError::BadRequest(format!(
                "the prompt has {} tokens but a sequence can hold at most {} (prompt and output, KV pool and context length)",
                prompt.len(),
                self.max_seq_tokens
            )));
        }
        let id = process_id(self.next_id.fetch_add(1, Ordering::Relaxed));
        let process = Arc::new(Process::new(
            id,
            inferlet.name(),
            client,
            props.clone(),
            prompt_len,
            self.state_counts.clone(),
        ));
        if let (Inferlet::Chat { messages, .. }, Some((_, all))) = (&inferlet, &session_messages) {
            let earlier = all.len().saturating_sub(messages.len());
            process.set_earlier_turns(all[..earlier].to_vec());
        }
        let events = process.events();
        self.lock_processes().insert(process.clone());
        let req = Request {
            client: process.client.clone(),
            prompt,
            max_tokens: opts
                .max_tokens
                .unwrap_or(usize::MAX)
                .saturating_sub(resume.tokens.len()),
            sampling: opts.sampling.clone(),
            stop_tokens: Vec::new(),
            ignore_eos: opts.ignore_eos,
            cache_salt: opts.cache_salt.clone(),
            arrival_ms: now_ms(),
            props,
            sampled_before: resume.tokens.len(),
        };
        let trace_input = self
            .settings
            .trace
            .as_ref()
            .map(|_| TraceInput::of(&req.prompt, req.arrival_ms));
        let driver = Driver {
            rt: self.clone(),
            process: process.clone(),
            stop: opts.stop,
            session_messages,
            trace_input,
            pages_from: match (opts.prefill_from, resume.from) {
                (Some(url), _) => Some(PageSource { url, prefill: true }),
                (None, Some(url)) => Some(PageSource {
                    url,
                    prefill: false,
                }),
                (None, None) => None,
            },
            generated_before: resume.tokens,
            replay_before: resume.replay,
        };
        tokio::spawn(driver.run(req));
        Ok((process, events))
    }

    /// The prompt's tokens and, for a resumed chat session, the messages to record.
    /// A session belongs to its client: another client naming the same session
    /// starts its own. `pretokenized` ids (checked: this model's fingerprint,
    /// every id in the vocabulary) replace tokenizing a text prompt or a chat
    /// without earlier turns on this worker; a session with earlier turns is
    /// tokenized here (the controller cannot know them), and a token-id prompt
    /// is used as sent. `turns` (a resumed session's, from its first worker)
    /// replace the session's earlier turns here.
    fn prompt_tokens(
        &self,
        inferlet: &Inferlet,
        props: &Props,
        client: &str,
        pretokenized: Option<PromptTokens>,
        turns: Option<Vec<ChatMessage>>,
    ) -> Result<(Vec<u32>, Option<SessionTurn>), LaunchError> {
        let bad = |e: anyhow::Error| LaunchError::BadRequest(e.to_string());
        let mut pretokenized = match pretokenized {
            Some(p) => Some(self.checked_prompt_tokens(p)?),
            None => None,
        };
        match inferlet {
            Inferlet::TextCompletion {
                prompt: Prompt::Text(text),
            } => Ok((
                self.ids_or(pretokenized, || {
                    self.model.tokenizer.encode(text).map_err(bad)
                })?,
                None,
            )),
            Inferlet::TextCompletion {
                prompt: Prompt::Tokens(ids),
            } => {
                self.check_vocab("prompt", ids)?;
                Ok((ids.clone(), None))
            }
            Inferlet::Chat {
                messages,
                resume_session,
            } => {
                let session = props
                    .str("session")
                    .filter(|_| *resume_session)
                    .map(|s| session_key(client, s));
                let mut all = match (session.as_deref(), turns) {
                    (Some(_), Some(turns)) => turns,
                    (Some(s), None) => self.lock_sessions().get(s).unwrap_or_default(),
                    (None, _) => Vec::new(),
                };
                if !all.is_empty() {
                    // Earlier turns the controller did not see: the ids lack them.
                    pretokenized = None;
                }
                all.extend(messages.iter().cloned());
                let tokenize = || {
                    let text = self
                        .model
                        .tokenizer
                        .apply_chat_template(&all)
                        .map_err(bad)?;
                    self.model.tokenizer.encode(&text).map_err(bad)
                };
                let ids = self.ids_or(pretokenized, tokenize)?;
                Ok((ids, session.map(|s| (s, all))))
            }
        }
    }

    /// The forwarded ids (counted), or the prompt tokenized here.
    fn ids_or(
        &self,
        pretokenized: Option<Vec<u32>>,
        tokenize: impl FnOnce() -> Result<Vec<u32>, LaunchError>,
    ) -> Result<Vec<u32>, LaunchError> {
        match pretokenized {
            Some(ids) => {
                self.metrics.pretokenized.inc();
                Ok(ids)
            }
            None => tokenize(),
        }
    }

    /// Forwarded ids if they are this model's: its fingerprint, its vocabulary.
    fn checked_prompt_tokens(&self, p: PromptTokens) -> Result<Vec<u32>, LaunchError> {
        let ours = self.shape.fingerprint;
        if p.fingerprint != ours {
            return Err(LaunchError::BadRequest(format!(
                "{PROMPT_TOKENS_FIELD}.fingerprint {:#018x} is not this worker's model ({ours:#018x})",
                p.fingerprint
            )));
        }
        self.check_vocab(&format!("{PROMPT_TOKENS_FIELD}.ids"), &p.ids)?;
        Ok(p.ids)
    }

    /// Every id below the vocabulary size, or a 400 naming `what`.
    fn check_vocab(&self, what: &str, ids: &[u32]) -> Result<(), LaunchError> {
        match ids.iter().find(|t| **t as usize >= self.model.config.vocab) {
            Some(t) => Err(LaunchError::BadRequest(format!(
                "{what} token id {t} is outside the vocabulary ({} tokens)",
                self.model.config.vocab
            ))),
            None => Ok(()),
        }
    }

    /// Kill a process: its sequence stops and its pages are released.
    pub fn kill(&self, process: &Process) -> bool {
        self.stop(process, ProcState::Killed)
    }

    /// Stop a process here for a controller to resume it on another worker:
    /// a running one after its next token (the engine stops it between two
    /// steps, its KV complete up to that token), one not running yet at
    /// once; its stream then ends with a hand-off. Its full pages stay
    /// cached (released, not freed) for the target to pull. False if it
    /// already ended or is being handed off.
    pub fn hand_off(&self, process: &Process) -> bool {
        if process.state().is_final() || !process.begin_hand_off() {
            return false;
        }
        match process.seq() {
            Some(seq) if process.state() == ProcState::Running => {
                self.send(Command::StopAfterNext(seq));
                true
            }
            _ => self.stop(process, ProcState::Migrated),
        }
    }

    fn stop(&self, process: &Process, state: ProcState) -> bool {
        if !process.finish(state, None, None) {
            return false;
        }
        self.metrics.count_request(state.as_str());
        if let Some(seq) = process.seq() {
            self.send(Command::Abort(seq));
        }
        true
    }

    /// Take no new processes from now on (`/health` answers 503 "draining");
    /// the ones here finish or are moved by a controller. Returns false if
    /// it was draining already.
    pub fn start_drain(&self) -> bool {
        let started = !self.draining.swap(true, Ordering::Relaxed);
        if started {
            // A stored permit: the waiter need not be waiting yet.
            self.drain_start.notify_one();
        }
        started
    }

    /// Returns once a drain has started (one waiter: `pie serve`).
    pub async fn drain_started(&self) {
        self.drain_start.notified().await;
    }

    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// Processes not yet in a final state (what a drain waits for).
    pub fn live_processes(&self) -> usize {
        self.count_in(ProcState::Queued) + self.count_in(ProcState::Running)
    }

    pub fn patch_props(
        &self,
        process: &Process,
        patch: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<Props, pie_core::PropError> {
        let props = process.update_props(|p| p.merge_json(patch))?;
        if let Some(seq) = process.seq() {
            self.send(Command::SetProps(seq, props.clone()));
        }
        Ok(props)
    }
}

/// Aborts its sequence when dropped before `done`.
struct AbortOnDrop<'a> {
    rt: &'a Runtime,
    seq: SeqId,
    armed: bool,
}

impl AbortOnDrop<'_> {
    /// The sequence ended by itself: nothing to abort.
    fn done<T>(mut self, result: T) -> T {
        self.armed = false;
        result
    }
}

impl Drop for AbortOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.rt.send(Command::Abort(self.seq));
        }
    }
}

/// A process id: the launch number (fixed-width hex, so ids sort in launch
/// order) and 64 random bits, so that no client can guess another's id.
fn process_id(number: u64) -> String {
    format!("proc-{number:012x}{:016x}", rand::random::<u64>())
}

/// Where a client's chat session is kept: length-prefixed, so no pair of client
/// and session names can spell another pair's key.
fn session_key(client: &str, session: &str) -> String {
    format!("{}:{client}{session}", client.len())
}

/// A resumed chat session's id and the messages of this turn's prompt.
type SessionTurn = (String, Vec<ChatMessage>);

/// Drives one process: submits its sequence, turns tokens into text, applies stop
/// strings, and records the result.
struct Driver {
    rt: Arc<Runtime>,
    process: Arc<Process>,
    stop: Vec<String>,
    /// For a resumed chat session: its id and the messages of this turn's prompt.
    session_messages: Option<SessionTurn>,
    /// Set when the server records a trace.
    trace_input: Option<TraceInput>,
    /// The worker to pull the prompt's pages from first.
    pages_from: Option<PageSource>,
    /// Resumed: the tokens it generated elsewhere (the end of the request's
    /// prompt).
    generated_before: Vec<u32>,
    /// Output `generated_before` again (see [`Resume::replay`]).
    replay_before: bool,
}

impl Driver {
    async fn run(self, req: Request) {
        let max_tokens = req.max_tokens;
        let chain = self.rt.chain(&req.prompt, req.cache_salt.as_deref());
        self.rt.load_persisted(&chain).await;
        self.rt.pull_from_pool(&req).await;
        self.rt.remote_prefill(&req, self.pages_from.as_ref()).await;
        let mut persist_after_prefill = (req.props.bool("persist") == Some(true)).then_some(chain);
        let mut text = StopScanner::new(&self.stop);
        let mut decoder = IncrementalDecoder::default();
        // What the source held back (a partial character, a possible stop
        // string's start) is held here the same way; what it sent is not
        // sent again, unless replayed: then as the same pieces, one a token.
        for (i, &t) in self.generated_before.iter().enumerate() {
            if let Ok(delta) = decoder.push(&self.rt.model.tokenizer, t) {
                let (emit, _) = text.push(&delta);
                if self.replay_before {
                    self.process.push_text(emit, Some(t), i + 1);
                }
            }
        }
        let mut tokens = self.generated_before.len();
        if req.max_tokens == 0 {
            self.process.push_text(text.flush(), None, tokens);
            self.complete("length");
            return;
        }
        let (events_tx, mut events) = mpsc::unbounded_channel();
        let (reply_tx, reply) = oneshot::channel();
        self.rt.send(Command::Add {
            req,
            events: events_tx,
            reply: reply_tx,
        });
        let Ok(seq) = reply.await else {
            self.fail(self.rt.engine_stopped());
            return;
        };
        self.process.set_seq(seq);
        if self.process.state().is_final() {
            self.rt.send(Command::Abort(seq));
            return;
        }
        // A resumed process's first token here is no first token.
        let mut last_token = (!self.generated_before.is_empty()).then(Instant::now);
        while let Some(event) = events.recv().await {
            match event {
                SeqEvent::Started { cached_tokens } => {
                    self.process.set_cached_tokens(cached_tokens);
                    self.process.mark_running();
                }
                SeqEvent::Token(t) => {
                    if let Some(chain) = persist_after_prefill.take() {
                        self.rt.persist_in_background(chain);
                    }
                    let now = Instant::now();
                    match last_token {
                        None => self.rt.metrics.ttft.observe(
                            (now_ms().saturating_sub(self.process.snapshot().created_ms)) as f64
                                / 1000.0,
                        ),
                        Some(prev) => self
                            .rt
                            .metrics
                            .inter_token
                            .observe(now.duration_since(prev).as_secs_f64()),
                    }
                    last_token = Some(now);
                    tokens += 1;
                    let delta = match decoder.push(&self.rt.model.tokenizer, t) {
                        Ok(delta) => delta,
                        Err(e) => {
                            // This process's output would be wrong; others are unaffected.
                            self.rt.send(Command::Abort(seq));
                            self.fail(format!("cannot detokenize token {t}: {e}"));
                            return;
                        }
                    };
                    let (emit, stopped) = text.push(&delta);
                    self.process.push_text(emit, Some(t), tokens);
                    if stopped {
                        self.rt.send(Command::Abort(seq));
                        self.complete("stop");
                        return;
                    }
                }
                SeqEvent::Finished(FinishReason::Expired, _) => {
                    self.fail("the deadline passed (deadline-ms) and on_miss = \"abort\"".into());
                    return;
                }
                SeqEvent::Finished(FinishReason::Length, info)
                    if self.process.handing_off() && info.generated_tokens < max_tokens =>
                {
                    // Stopped early for a hand-off: what is held back is the
                    // target's to send.
                    self.rt.stop(&self.process, ProcState::Migrated);
                    return;
                }
                SeqEvent::Finished(reason, info) => {
                    self.process.push_text(
                        text.flush(),
                        None,
                        self.generated_before.len() + info.generated_tokens,
                    );
                    self.complete(if reason == FinishReason::Stop {
                        "stop"
                    } else {
                        "length"
                    });
                    return;
                }
                SeqEvent::Failed(e) => {
                    self.fail(e);
                    return;
                }
            }
        }
        // The engine dropped the sequence without a last word: it is gone.
        self.fail(self.rt.engine_stopped());
    }

    fn complete(&self, reason: &'static str) {
        if !self.process.finish(ProcState::Finished, Some(reason), None) {
            return;
        }
        self.rt.metrics.count_request("finished");
        self.count_deadline_miss();
        if let (Some(trace), Some(input)) = (&self.rt.settings.trace, &self.trace_input) {
            let p = self.process.snapshot();
            if let Err(e) = trace.record(input.clone(), p.usage.completion_tokens, &p.props) {
                tracing::warn!("server.trace_file: cannot write: {e}");
            }
        }
        if let Some((session, mut messages)) = self.session_messages.clone() {
            messages.push(ChatMessage {
                role: "assistant".into(),
                content: self.process.snapshot().output,
            });
            // The inferlet records which turn this was as its own prop.
            let turns = messages.iter().filter(|m| m.role == "assistant").count() as i64;
            self.rt.lock_sessions().insert(session, messages);
            let _ = self
                .process
                .update_props(|p| p.set("turn", pie_core::PropValue::Int(turns)));
        }
    }

    fn fail(&self, error: String) {
        if self.process.finish(ProcState::Failed, None, Some(error)) {
            self.rt.metrics.count_request("failed");
            self.count_deadline_miss();
        }
    }

    fn count_deadline_miss(&self) {
        let d = self.process.snapshot();
        if let (Some(deadline), Some(done)) = (d.props.int("deadline-ms"), d.finished_ms) {
            if done > d.created_ms.saturating_add(deadline.max(0) as u64) {
                self.rt.metrics.deadline_misses.inc();
            }
        }
    }
}

/// A driver that ends before its process does (its task panicked or was
/// dropped) fails the process and frees its sequence: a failure in one
/// process's own code never leaves it running forever.
impl Drop for Driver {
    fn drop(&mut self) {
        if self.process.state().is_final() {
            return;
        }
        self.fail("internal error: the process's driver stopped unexpectedly".into());
        if let Some(seq) = self.process.seq() {
            self.rt.send(Command::Abort(seq));
        }
    }
}

/// Finds stop strings in streamed text, holding back a possible stop string's
/// beginning so that no part of a stop string is ever emitted.
struct StopScanner<'a> {
    stops: &'a [String],
    pending: String,
    hold: usize,
}

impl<'a> StopScanner<'a> {
    fn new(stops: &'a [String]) -> Self {
        let hold = stops
            .iter()
            .map(String::len)
            .max()
            .unwrap_or(0)
            .saturating_sub(1);
        Self {
            stops,
            pending: String::new(),
            hold,
        }
    }

    /// Text safe to emit now, and whether a stop string was found.
    fn push(&mut self, delta: &str) -> (String, bool) {
        self.pending.push_str(delta);
        if let Some(at) = self
            .stops
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| self.pending.find(s.as_str()))
            .min()
        {
            let emit = self.pending[..at].to_string();
            self.pending.clear();
            return (emit, true);
        }
        let mut cut = self.pending.len().saturating_sub(self.hold);
        while !self.pending.is_char_boundary(cut) {
            cut -= 1;
        }
        let rest = self.pending.split_off(cut);
        (std::mem::replace(&mut self.pending, rest), false)
    }

    fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

/// Generated-token rate over a sliding window.
struct RateWindow {
    samples: VecDeque<(Instant, u64)>,
}

impl RateWindow {
    const SPAN_SECS: f64 = 5.0;

    fn record(&mut self, now: Instant, total: u64) -> f64 {
        self.samples.push_back((now, total));
        while self.samples.len() > 2
            && now.duration_since(self.samples[0].0).as_secs_f64() > Self::SPAN_SECS
        {
            self.samples.pop_front();
        }
        let (t0, n0) = self.samples[0];
        let dt = now.duration_since(t0).as_secs_f64();
        if dt > 0.0 {
            (total - n0) as f64 / dt
        } else {
            0.0
        }
    }
}

/// Numbers and broadcasts the blocks this worker serves without recompute:
/// the engine's prefix-index changes and the disk tier's. A block leaves the
/// published set only when it is in neither.
struct KvPublisher {
    tx: broadcast::Sender<Arc<KvEventBatch>>,
    seq: u64,
    /// The disk tier as the events have told it.
    on_disk: std::collections::HashSet<u64>,
    /// Disk changes since the last batch: (block, stored?).
    disk_changes: Vec<(u64, bool)>,
}

impl KvPublisher {
    fn disk_changed(&mut self, stored: Vec<BlockHash>, removed: Vec<BlockHash>) {
        for h in stored {
            self.on_disk.insert(h.0);
            self.disk_changes.push((h.0, true));
        }
        for h in removed {
            self.on_disk.remove(&h.0);
            self.disk_changes.push((h.0, false));
        }
    }

    fn publish(&mut self, engine: &mut Engine) {
        let changes = engine.pool_mut().take_index_events();
        if changes.is_empty() && self.disk_changes.is_empty() {
            return;
        }
        let on_disk = &self.on_disk;
        let pool = engine.pool();
        let memory = changes.into_iter().filter_map(|c| match c {
            IndexChange::Stored(h) => Some((h.0, true)),
            IndexChange::Removed(h) => (!on_disk.contains(&h.0)).then_some((h.0, false)),
        });
        let disk = self.disk_changes.iter().filter_map(|&(h, stored)| {
            (stored || pool.lookup(BlockHash(h)).is_none()).then_some((h, stored))
        });
        self.seq += 1;
        let mut batch = KvEventBatch::from_changes(self.seq, memory.chain(disk));
        let tier = KvEventBatch::from_changes(self.seq, self.disk_changes.drain(..));
        (batch.persisted, batch.unpersisted) = (tier.stored, tier.removed);
        // No subscriber is fine: a later one starts from a snapshot.
        let _ = self.tx.send(Arc::new(batch));
    }

    /// Everything indexed now; publishes pending changes first so the snapshot's
    /// `seq` covers exactly what it contains.
    fn snapshot(&mut self, engine: &mut Engine) -> KvSnapshot {
        self.publish(engine);
        KvSnapshot {
            seq: self.seq,
            fingerprint: engine.pool().fingerprint().0,
            page_size: engine.config().page_size,
            hashes: engine
                .pool()
                .indexed_hashes()
                .map(|h| h.0)
                .filter(|h| !self.on_disk.contains(h))
                .chain(self.on_disk.iter().copied())
                .collect(),
            persisted: self.on_disk.iter().copied().collect(),
        }
    }
}

/// What the engine thread shares with the rest of the runtime.
struct EngineThread {
    metrics: Arc<Metrics>,
    load: Arc<Load>,
    supervision: Arc<Supervision>,
    /// Spilled sessions to the runtime, which keeps them (`spill.rs`).
    spills: mpsc::UnboundedSender<Spill>,
}

type Subscribers = HashMap<SeqId, mpsc::UnboundedSender<SeqEvent>>;

impl EngineThread {
    /// The engine loop under supervision: a panic fails every sequence it was
    /// serving with the panic's message, and the worker reports it.
    fn run(
        self,
        engine: Engine,
        commands: std_mpsc::Receiver<Command>,
        kv: KvPublisher,
        step_log: Option<StepLog>,
    ) {
        let mut subs = Subscribers::new();
        let looped = supervisor::run_supervised(&self.supervision, || {
            engine_loop(engine, &commands, kv, step_log, &mut subs, &self)
        });
        if let Err(reason) = looped {
            for (_, tx) in subs.drain() {
                let _ = tx.send(SeqEvent::Failed(reason.clone()));
            }
        }
    }
}

fn engine_loop(
    mut engine: Engine,
    commands: &std_mpsc::Receiver<Command>,
    mut kv: KvPublisher,
    mut step_log: Option<StepLog>,
    subs: &mut Subscribers,
    shared: &EngineThread,
) {
    let (metrics, load, supervision) = (&*shared.metrics, &*shared.load, &*shared.supervision);
    let mut rate = RateWindow {
        samples: VecDeque::new(),
    };
    let mut prefill_rate = RateWindow {
        samples: VecDeque::new(),
    };
    let mut reported = engine.counters();
    let mut leases = Leases::default();
    loop {
        engine.unpin(&leases.expire(Instant::now()));
        metrics.transfer_leased_pages.set(leases.pinned() as i64);
        report(&engine, metrics, &mut reported, &mut rate);
        load.waiting_prefill_tokens
            .store(engine.waiting_prefill_tokens(), Ordering::Relaxed);
        let prefill_per_s = prefill_rate.record(Instant::now(), engine.counters().prefill_tokens);
        load.prefill_tokens_per_s
            .store(prefill_per_s.to_bits(), Ordering::Relaxed);
        if !engine.has_work() {
            metrics.tokens_per_second.set(0.0);
            supervision.idle();
            // Idle, it still wakes to expire a lease.
            let wait = leases
                .next_expiry()
                .map(|at| at.saturating_duration_since(Instant::now()));
            let received = match wait {
                None => commands
                    .recv()
                    .map_err(|_| std_mpsc::RecvTimeoutError::Disconnected),
                Some(wait) => commands.recv_timeout(wait),
            };
            match received {
                Ok(cmd) => {
                    supervision.progress();
                    apply(&mut engine, subs, &mut kv, &mut leases, cmd)
                }
                Err(std_mpsc::RecvTimeoutError::Timeout) => continue,
                Err(std_mpsc::RecvTimeoutError::Disconnected) => return,
            }
        }
        #[cfg(feature = "fault-injection")]
        if supervision.stall_fault() && engine.has_work() {
            std::thread::sleep(std::time::Duration::from_millis(10));
            continue;
        }
        supervision.progress();
        while let Ok(cmd) = commands.try_recv() {
            apply(&mut engine, subs, &mut kv, &mut leases, cmd);
        }
        if engine.has_work() {
            #[cfg(feature = "fault-injection")]
            std::thread::sleep(supervision.step_delay());
            step(&mut engine, subs, step_log.as_mut());
        }
        for spill in engine.take_spills() {
            let _ = shared.spills.send(spill);
        }
        kv.publish(&mut engine);
    }
}

/// Bring the engine's counters and page gauges into the metrics.
fn report(
    engine: &Engine,
    metrics: &Metrics,
    reported: &mut EngineCounters,
    rate: &mut RateWindow,
) {
    let c = engine.counters();
    metrics
        .prefix_hit_tokens
        .inc_by(c.prefix_hit_tokens - reported.prefix_hit_tokens);
    metrics
        .prompt_tokens
        .inc_by(c.prefill_tokens - reported.prefill_tokens);
    metrics
        .generated_tokens
        .inc_by(c.generated_tokens - reported.generated_tokens);
    metrics
        .preemptions
        .inc_by(c.preemptions - reported.preemptions);
    *reported = c;
    metrics
        .tokens_per_second
        .set(rate.record(Instant::now(), c.generated_tokens));
    let stats = engine.pool_stats();
    metrics.pages_used.set(stats.used as i64);
    metrics.pages_cached.set(stats.cached as i64);
    metrics.pages_free.set(stats.free as i64);
    metrics.policy_clients.set(engine.policy_clients() as i64);
}

fn apply(
    engine: &mut Engine,
    subs: &mut Subscribers,
    kv: &mut KvPublisher,
    leases: &mut Leases,
    cmd: Command,
) {
    match cmd {
        Command::Add { req, events, reply } => match engine.add(req) {
            Ok(id) => {
                subs.insert(id, events);
                if reply.send(id).is_err() {
                    engine.abort(id);
                    subs.remove(&id);
                }
            }
            Err(e) => {
                let _ = events.send(SeqEvent::Failed(e.to_string()));
            }
        },
        Command::Abort(id) => {
            engine.abort(id);
            subs.remove(&id);
        }
        Command::StopAfterNext(id) => {
            engine.stop_after_next(id);
        }
        Command::SetProps(id, props) => {
            engine.set_props(id, props);
        }
        Command::SetPolicies {
            ordering,
            keep_session,
        } => {
            engine.set_policy(ordering);
            engine.set_keep_session(keep_session);
        }
        Command::KvSnapshot(reply) => {
            let _ = reply.send(kv.snapshot(engine));
        }
        Command::Summary(reply) => {
            let retained: Vec<Value> = engine.retained_sessions().into_iter().map(|(session, pages, expires_ms)| json!({"session": session, "pages": pages, "expires_ms": expires_ms})).collect();
            let _ = reply.send(json!({"ordering": engine.policy_name(), "sequences": engine.len(), "ordering_state": engine.policy_summary(), "retained_sessions": retained}));
        }
        Command::CachedPages { chain, reply } => {
            let _ = reply.send(engine.cached_pages(&chain));
        }
        Command::PinPrefix { chain, ttl, reply } => {
            let pages = engine.pin_prefix(&chain);
            let n = pages.len();
            let lease = leases.grant(pages, ttl, Instant::now());
            if reply.send((lease, n)).is_err() {
                engine.unpin(&leases.release(lease));
            }
        }
        Command::ExportLeased {
            lease,
            from,
            count,
            reply,
        } => {
            let pages = leases
                .renew(lease, from, count, Instant::now())
                .map(|pages| engine.export_pages(pages));
            let _ = reply.send(pages);
        }
        Command::ReleaseLease(lease) => engine.unpin(&leases.release(lease)),
        Command::ImportPages {
            chain,
            pages,
            reply,
        } => {
            let _ = reply.send(engine.import_pages(&chain, &pages));
        }
        Command::SetSpill(on) => engine.set_spill(on),
        Command::DiskChanged { stored, removed } => kv.disk_changed(stored, removed),
        #[cfg(feature = "fault-injection")]
        Command::Panic => panic!("fault injected: engine panic"),
    }
}

fn step(engine: &mut Engine, subs: &mut Subscribers, step_log: Option<&mut StepLog>) {
    let started = Instant::now();
    let out = match engine.step(now_ms()) {
        Ok(out) => out,
        Err(e) => {
            // A failed forward leaves no sequence in a known state: fail them all.
            for (id, tx) in subs.drain() {
                let _ = tx.send(SeqEvent::Failed(format!("engine step failed: {e}")));
                engine.abort(id);
            }
            return;
        }
    };
    if let Some(log) = step_log {
        log.record(started, &out.shape);
    }
    let mut gone = Vec::new();
    for (id, cached_tokens) in out.started {
        notify(subs, id, SeqEvent::Started { cached_tokens }, &mut gone);
    }
    for (id, token) in out.tokens {
        notify(subs, id, SeqEvent::Token(token), &mut gone);
    }
    for (id, reason, info) in out.finished {
        notify(subs, id, SeqEvent::Finished(reason, info), &mut gone);
        subs.remove(&id);
    }
    for (id, error) in out.failed {
        notify(subs, id, SeqEvent::Failed(error), &mut gone);
        subs.remove(&id);
    }
    // A driver that went away (its process was killed) no longer needs its sequence.
    for id in gone {
        engine.abort(id);
        subs.remove(&id);
    }
}

fn notify(subs: &Subscribers, id: SeqId, event: SeqEvent, gone: &mut Vec<SeqId>) {
    if let Some(tx) = subs.get(&id) {
        if tx.send(event).is_err() {
            gone.push(id);
        }
    }
}
