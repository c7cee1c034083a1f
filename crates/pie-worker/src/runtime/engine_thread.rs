//! The engine thread: owns the [`Engine`], applies the runtime's commands
//! between steps, steps it, reports each sequence's events to its driver,
//! publishes load, metrics and KV events, and runs under supervision (see
//! [`crate::supervisor`]).
//!
//! Invariant: the thread is the engine's only user; a panic in it fails
//! every sequence it was serving (their drivers hear `Failed`) and leaves
//! the worker unhealthy for good.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pie_core::SeqId;
use pie_policy::keep_session::split_retention_key;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::command::{Command, SeqEvent};
use super::kv_events::KvPublisher;
use super::rate::RateWindow;
use crate::engine::{Engine, EngineCounters, Spill};
use crate::leases::Leases;
use crate::metrics::Metrics;
use crate::step_log::StepLog;
use crate::supervisor::{self, Supervision};
use pie_core::clock::now_ms;

/// Engine load published after every engine iteration, read by offload.
#[derive(Default)]
pub(super) struct Load {
    pub(super) waiting_prefill_tokens: AtomicUsize,
    pub(super) prefill_tokens_per_s: AtomicU64,
}

/// What the engine thread shares with the rest of the runtime.
pub(super) struct EngineThread {
    pub(super) metrics: Arc<Metrics>,
    pub(super) load: Arc<Load>,
    pub(super) supervision: Arc<Supervision>,
    /// Spilled sessions to the runtime, which keeps them (`spill.rs`).
    pub(super) spills: mpsc::UnboundedSender<Spill>,
}

type Subscribers = HashMap<SeqId, mpsc::UnboundedSender<SeqEvent>>;

/// The longest the engine waits, before a step, for the sequences of
/// inferlets whose context's call ended in the step before: a guest that
/// samples its own tokens comes back at once with its next call, and eight
/// guests stepping apart (each missing every other step) made half the
/// tokens eight in lockstep do.
const GATHER_WINDOW: Duration = Duration::from_millis(3);

impl EngineThread {
    /// The engine loop under supervision: a panic fails every sequence it was
    /// serving with the panic's message, and the worker reports it.
    pub(super) fn run(
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
    let mut rate = RateWindow::default();
    let mut prefill_rate = RateWindow::default();
    let mut reported = engine.counters();
    let mut leases = Leases::default();
    let mut expected: usize = 0;
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
                    expected = expected.saturating_sub(usize::from(is_add(&cmd)));
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
        let mut apply = |cmd| apply(&mut engine, subs, &mut kv, &mut leases, cmd);
        gather(commands, expected, &mut apply);
        if engine.has_work() {
            #[cfg(feature = "fault-injection")]
            std::thread::sleep(supervision.step_delay());
            expected = step(&mut engine, subs, step_log.as_mut(), metrics);
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
        Command::Add { req, events, reply } => match engine.add(*req) {
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
        Command::ReleaseSession(session) => engine.release_session(&session),
        Command::TruncateSession { session, len } => engine.truncate_session(&session, len),
        Command::Reloaded(id) => engine.reloaded(id),
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
            let retained: Vec<Value> = engine.retained_sessions().into_iter().map(|(key, pages, expires_ms)| {
                let (client, session) = split_retention_key(&key).unwrap_or(("", &key));
                json!({"client": client, "session": session, "pages": pages, "expires_ms": expires_ms})
            }).collect();
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

/// Every command waiting; then, while fewer than `expected` new sequences
/// came (since the last step), the next ones, for up to [`GATHER_WINDOW`].
fn gather(
    commands: &std_mpsc::Receiver<Command>,
    expected: usize,
    apply: &mut impl FnMut(Command),
) {
    let deadline = Instant::now() + GATHER_WINDOW;
    let mut added = 0;
    loop {
        let cmd = match commands.try_recv() {
            Ok(cmd) => cmd,
            Err(_) if added >= expected => return,
            Err(_) => {
                match commands.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                    Ok(cmd) => cmd,
                    Err(_) => return,
                }
            }
        };
        added += usize::from(is_add(&cmd));
        apply(cmd);
    }
}

fn is_add(cmd: &Command) -> bool {
    matches!(cmd, Command::Add { .. })
}

/// One engine step, its events sent; how many of its finished sequences'
/// owners are likely back at once (see [`GATHER_WINDOW`]).
fn step(
    engine: &mut Engine,
    subs: &mut Subscribers,
    step_log: Option<&mut StepLog>,
    metrics: &Metrics,
) -> usize {
    let started = Instant::now();
    let out = match engine.step(now_ms()) {
        Ok(out) => out,
        Err(e) => {
            // A failed forward leaves no sequence in a known state: fail them all.
            for (id, tx) in subs.drain() {
                let _ = tx.send(SeqEvent::Failed(format!("engine step failed: {e}")));
                engine.abort(id);
            }
            return 0;
        }
    };
    let held_finished = out.held.len();
    if let Some(log) = step_log {
        log.record(started, &out.shape);
    }
    for took in &out.mask_times {
        metrics.constraint_mask_seconds.observe(took.as_secs_f64());
    }
    let mut gone = Vec::new();
    for (id, cached_tokens) in out.started {
        notify(subs, id, SeqEvent::Started { cached_tokens }, &mut gone);
    }
    for id in out.to_reload {
        notify(subs, id, SeqEvent::Reload, &mut gone);
    }
    for (id, scored) in out.scored {
        notify(subs, id, SeqEvent::Scored(scored), &mut gone);
    }
    for (id, logprobs) in out.logprobs {
        notify(subs, id, SeqEvent::Logprobs(logprobs), &mut gone);
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
    // A driver that went away (its process was killed) no longer needs its
    // sequence, nor the pages it held for its owner's next call.
    for id in gone {
        engine.abort(id);
        subs.remove(&id);
        if let Some((_, session)) = out.held.iter().find(|h| h.0 == id) {
            engine.release_session(session);
        }
    }
    held_finished
}

fn notify(subs: &Subscribers, id: SeqId, event: SeqEvent, gone: &mut Vec<SeqId>) {
    if let Some(tx) = subs.get(&id) {
        if tx.send(event).is_err() {
            gone.push(id);
        }
    }
}
