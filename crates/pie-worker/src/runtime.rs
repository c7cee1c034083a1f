//! The worker runtime: the [`Runtime`] handle (the process table, sessions,
//! policies, health, drain), with the engine on its own thread (supervised,
//! see [`crate::supervisor`]) and the built-in inferlets that drive
//! generation for each process.
//!
//! Its files in layers, bottom to top (imports point down only; the `impl
//! Runtime` blocks call each other's methods as parts of one type):
//! - leaves: `command` (the protocol with the engine thread), `request` (what
//!   a launch asks for), `stop` (stop strings), `rate` (a sliding rate);
//! - the engine's side: `kv_events` (the KV event publisher) and
//!   `engine_thread` (the loop that owns the engine);
//! - `impl Runtime` blocks by job: `transfer` (KV pages between workers),
//!   `offload` (prefill across workers), `persist` (disk tier and pool),
//!   `spill` (retained sessions evicted early);
//! - `builtin` (the built-in inferlets' per-process driver), then `launch`
//!   (admission checks and the start of a process's driver: where another
//!   inferlet runtime starts its own, beside `builtin`);
//! - this file: the [`Runtime`] handle (settings, process table, sessions,
//!   policies, health and the watchdog's tick, drain).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};

use futures_util::stream::BoxStream;

use pie_core::worker_config::TransferConfig;
use pie_core::{KvEventBatch, KvSnapshot, Props};
use pie_kv::transfer::PageFormat;
use pie_model::Model;
use pie_policy::cluster::Stage;
use pie_policy::runtime::WorkerPolicies;
use pie_policy::Offload;
use pie_workload::TraceRecorder;
use serde_json::Value;
use tokio::sync::{broadcast, mpsc, oneshot};

use crate::engine::Engine;
use crate::metrics::Metrics;
use crate::process::{ProcEvent, ProcState, Process, StateCounts};
use crate::records::{ProcessTable, RecordLimits};
use crate::sessions::Sessions;
use crate::step_log::StepLog;
use crate::supervisor::{self, Supervision};
use pie_core::clock::now_ms;

mod builtin;
mod command;
mod disk_tier;
mod engine_thread;
mod generation;
mod kv_events;
mod launch;
mod offload;
mod persist;
mod rate;
mod request;
mod sequence;
mod spill;
mod spill_state;
mod stop;
mod transfer;
mod transfer_errors;

use command::Command;
pub use disk_tier::{Forget, PersistError, PersistStore, PersistTo, Persisted};
use engine_thread::{EngineThread, Load};
use kv_events::KvPublisher;
pub use pie_kv::stream::PullRequest;
pub use request::{
    GenOptions, Generate, Generated, Inferlet, LaunchError, Prompt, PromptTokens, Resume, TextRules,
};
pub use transfer_errors::{PullError, ServeError};

pub use pie_core::wire::{PROMPT_TOKENS_FIELD, RESUME_FIELD, STREAM_IDS_FIELD};

/// The runtime's settings from the configuration (`max_queued` reloadable).
pub struct RuntimeSettings {
    pub model_name: String,
    /// Reloadable: processes waiting to start before the API answers 429.
    pub max_queued: AtomicUsize,
    /// Reloadable: the API keys name two or more tenants, so the queue and
    /// the inferlet instances are shared per key (`pie_policy::shares`).
    pub shared: AtomicBool,
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
    /// `[server] max_finished_processes`, `finished_ttl_ms`,
    /// `max_finished_bytes` and `max_record_bytes`.
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

/// The runtime handle the API and the server share: every process goes
/// through it, and it reaches the engine only by commands.
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
    spill: spill_state::SpillState,
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
        let publisher = KvPublisher::new(
            kv_events.clone(),
            settings
                .persist
                .as_ref()
                .map(|p| p.hashes().into_iter().map(|h| h.0).collect())
                .unwrap_or_default(),
        );
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
        let state_counts = Arc::new(StateCounts::with_record_cap(
            settings.records.max_record_bytes,
        ));
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
            spill: spill_state::SpillState::new(spilled),
        });
        let watched = Arc::downgrade(&rt);
        supervisor::spawn_watchdog(&rt.supervision, move || match watched.upgrade() {
            Some(rt) => {
                rt.supervise();
                true
            }
            None => false,
        });
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
                self.abort_all(p);
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

    /// Add a sequence to the engine: its id and the receiver of its
    /// events, or why it could not be added (the engine is gone).
    async fn add_sequence(
        &self,
        req: crate::engine::Request,
    ) -> Result<(pie_core::SeqId, mpsc::UnboundedReceiver<command::SeqEvent>), String> {
        let (events_tx, events) = mpsc::unbounded_channel();
        let (reply_tx, reply) = oneshot::channel();
        self.send(Command::Add {
            req: Box::new(req),
            events: events_tx,
            reply: reply_tx,
        });
        let seq = reply.await.map_err(|_| self.engine_stopped())?;
        Ok((seq, events))
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
        self.metrics
            .sync_grammar_counts(self.model.grammar_counts());
        self.metrics.encode()
    }

    fn lock_sessions(&self) -> std::sync::MutexGuard<'_, Sessions> {
        self.sessions.lock().unwrap_or_else(|e| e.into_inner())
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
        self.abort_all(process);
        true
    }

    /// Stop every engine sequence of the process.
    fn abort_all(&self, process: &Process) {
        for (seq, _) in process.seqs() {
            self.send(Command::Abort(seq));
        }
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
        limits: Option<(&str, &pie_core::auth::KeyLimits)>,
    ) -> Result<Props, pie_core::PropError> {
        let props = process.update_props(|props| {
            let mut next = props.clone();
            next.patch_json(patch)?;
            if let Some((who, limits)) = limits {
                limits.apply(who, &mut next)?;
            }
            *props = next;
            Ok(())
        })?;
        self.props_changed(process, &props);
        Ok(props)
    }

    /// The process's sequences take `props` from the next engine step.
    pub(crate) fn props_changed(&self, process: &Process, props: &Props) {
        for (seq, session) in process.seqs() {
            let mut props = props.clone();
            if let Some(session) = session {
                // A context's retention key, which the process cannot change.
                let _ = props.set("session", pie_core::PropValue::Str(session));
            }
            self.send(Command::SetProps(seq, props));
        }
    }
}
