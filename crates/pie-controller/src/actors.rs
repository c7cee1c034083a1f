//! Cluster actors in the controller: their state, the snapshot they see, the
//! execution of actions that need no worker, and the record of every action
//! (`actor_loop` ticks them and asks workers).
//!
//! The snapshot's workers come from the registry (health, load, `max_running`,
//! the `group` label). Its processes are the requests this controller has in
//! flight, with their props: workers' `/v1/internal/state` reports counts, not
//! per-process props, and the controller sees every request it routes (those
//! still waiting in its cluster-priority queue have no worker yet). A native
//! `/v1/processes` launch counts only until its response is relayed, since the
//! process then runs on without the controller.
//!
//! Actions: a `scale-hint` is published (the `pie_cluster_scale_*` gauges and
//! `GET /v1/cluster/scale`); `migrate-process` moves a relayed stream
//! (`relay`); `persist-prefix` asks the worker to write the blocks to its disk
//! tier; `copy-prefix` asks the target to pull the blocks from the source;
//! `copy-prefix-to-pool` asks the source to push them to its pool (these
//! three are logged `sent`, then `executed` or `failed` with the worker's
//! answer); a drain has no executor here (workers drain themselves) and is recorded
//! as failed, with the reason, never dropped silently. The snapshot's hot
//! prefixes come from the registry, which counts routed prompts' blocks only
//! while an actor reads them. Dry-run records are kept and counted, not executed. Every record
//! goes into a ring of the last [`ACTION_LOG_LEN`] (`GET /v1/cluster/actions`).

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use pie_core::Props;
use pie_policy::cluster::{
    Action, ActionRecord, ActorRunner, ClusterEvent, ClusterSnapshot, HotPrefix, ProcessState,
    ScaleHint, WorkerState,
};
use serde::Serialize;
use serde_json::{json, Value};

use pie_workload::JsonLines;

use crate::metrics::{ActionLabels, ControllerMetrics, GroupLabels};
use crate::registry::Worker;
use crate::streams::{Reason, Streams};

/// Actions kept for `GET /v1/cluster/actions`.
pub const ACTION_LOG_LEN: usize = 256;

/// What became of an action.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Outcome {
    Executed,
    /// Asked of a worker whose answer is not in yet; replaced by `executed`
    /// or `failed` (with the worker's reason) when it comes.
    Sent,
    /// Recorded only (`[cluster.<actor>] dry_run`).
    DryRun,
    Failed {
        error: String,
    },
}

#[derive(Clone, Debug, Serialize)]
pub struct LoggedAction {
    /// Its number in this controller's log (a later outcome finds it by this).
    pub id: u64,
    /// The action's kind (a metric label), beside the record for readers.
    pub kind: &'static str,
    #[serde(flatten)]
    pub record: ActionRecord,
    pub outcome: Outcome,
}

impl LoggedAction {
    fn new(record: ActionRecord, outcome: Outcome) -> Self {
        Self {
            id: 0,
            kind: record.action.kind(),
            record,
            outcome,
        }
    }
}

/// A published scale hint and who made it why.
#[derive(Clone, Debug, Serialize)]
struct Published {
    #[serde(flatten)]
    hint: ScaleHint,
    actor: String,
    reason: String,
    at_ms: u64,
}

/// Requests in flight with their props, the snapshot's processes.
#[derive(Default)]
struct Demand {
    next: u64,
    requests: BTreeMap<u64, ProcessState>,
}

fn request_id(n: u64) -> String {
    format!("request-{n}")
}

/// A request counted in the snapshot until dropped.
pub struct DemandGuard {
    demand: Arc<Mutex<Demand>>,
    id: u64,
}

impl DemandGuard {
    /// Its id in the actors' snapshot (`ProcessState::id`).
    pub fn process_id(&self) -> String {
        request_id(self.id)
    }

    /// The request's props changed (its process set them): the actors see
    /// these from their next tick.
    pub fn set_props(&self, props: Props) {
        let mut d = self.demand.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = d.requests.get_mut(&self.id) {
            p.props = props;
        }
    }

    /// The request is being sent to `worker`.
    pub fn placed(&self, worker: &str) {
        let mut d = self.demand.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = d.requests.get_mut(&self.id) {
            p.worker = Some(worker.to_string());
        }
    }
}

impl Drop for DemandGuard {
    fn drop(&mut self) {
        let mut d = self.demand.lock().unwrap_or_else(|e| e.into_inner());
        d.requests.remove(&self.id);
    }
}

pub struct Actors {
    runner: Mutex<ActorRunner>,
    /// Actors are configured: requests are tracked with their props.
    tracking: AtomicBool,
    pub(crate) tick_ms: AtomicU64,
    demand: Arc<Mutex<Demand>>,
    events: Mutex<Vec<ClusterEvent>>,
    pub(crate) wake: tokio::sync::Notify,
    log: Mutex<VecDeque<LoggedAction>>,
    logged: AtomicU64,
    scale: Mutex<BTreeMap<String, Published>>,
    /// `[cluster] scale_history_file`: every hint published, a line each.
    history: Mutex<Option<JsonLines>>,
}

impl Actors {
    pub fn new(runner: ActorRunner, tick_ms: u64, history: Option<JsonLines>) -> Self {
        Self {
            history: Mutex::new(history),
            tracking: AtomicBool::new(!runner.is_empty()),
            runner: Mutex::new(runner),
            tick_ms: AtomicU64::new(tick_ms.max(10)),
            demand: Default::default(),
            events: Mutex::new(Vec::new()),
            wake: tokio::sync::Notify::new(),
            log: Mutex::new(VecDeque::with_capacity(ACTION_LOG_LEN)),
            logged: AtomicU64::new(0),
            scale: Mutex::new(BTreeMap::new()),
        }
    }

    /// A reloaded config: fresh actors (their state restarts), and what the old
    /// ones published is withdrawn until the new ones publish.
    pub fn replace(
        &self,
        runner: ActorRunner,
        tick_ms: u64,
        history: Option<JsonLines>,
        metrics: &ControllerMetrics,
    ) {
        *self.history.lock().unwrap_or_else(|e| e.into_inner()) = history;
        self.tracking.store(!runner.is_empty(), Ordering::Relaxed);
        *self.runner.lock().unwrap_or_else(|e| e.into_inner()) = runner;
        self.tick_ms.store(tick_ms.max(10), Ordering::Relaxed);
        self.scale.lock().unwrap_or_else(|e| e.into_inner()).clear();
        metrics.scale_recommended.clear();
        metrics.scale_current.clear();
    }

    /// Count a request (with its props) as demand until the guard drops; None
    /// when no actor is configured, so routing pays nothing for it.
    pub fn track(&self, props: &Props) -> Option<DemandGuard> {
        if !self.active() {
            return None;
        }
        let mut d = self.demand.lock().unwrap_or_else(|e| e.into_inner());
        d.next += 1;
        let id = d.next;
        d.requests.insert(
            id,
            ProcessState {
                id: request_id(id),
                worker: None,
                props: props.clone(),
            },
        );
        Some(DemandGuard {
            demand: self.demand.clone(),
            id,
        })
    }

    /// Whether any actor is configured.
    pub fn active(&self) -> bool {
        self.tracking.load(Ordering::Relaxed)
    }

    /// Queue events for the actors; they see them before the next tick.
    pub fn notify(&self, events: Vec<ClusterEvent>) {
        if events.is_empty() {
            return;
        }
        self.events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(events);
        self.wake.notify_one();
    }

    pub fn names(&self) -> Vec<&'static str> {
        self.runner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .names()
    }

    pub fn summary(&self) -> Value {
        self.runner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .summary()
    }

    /// Whether an actor reads hot prefixes (the registry then counts them).
    pub fn wants_hot_prefixes(&self) -> bool {
        self.runner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .reads_hot_prefixes()
    }

    /// Queued events, then (when `tick`) a tick, over the cluster `cluster`
    /// reads (workers and hot prefixes; read only when there is work): the
    /// actors' records.
    pub fn decide(
        &self,
        tick: bool,
        cluster: impl FnOnce() -> (Vec<Worker>, Vec<HotPrefix>),
        now: u64,
    ) -> Vec<ActionRecord> {
        let events = std::mem::take(&mut *self.events.lock().unwrap_or_else(|e| e.into_inner()));
        if events.is_empty() && !tick {
            return Vec::new();
        }
        let (workers, hot_prefixes) = cluster();
        let snapshot = self.snapshot(workers, hot_prefixes);
        let mut runner = self.runner.lock().unwrap_or_else(|e| e.into_inner());
        let mut records = Vec::new();
        for e in &events {
            records.extend(runner.event(now, e, &snapshot));
        }
        if tick {
            records.extend(runner.tick(now, &snapshot));
        }
        records
    }

    /// Log `record` with its outcome (counted); a failure goes back to the
    /// actors. Its number in the log, for the worker's answer to settle.
    pub fn record(
        &self,
        metrics: &ControllerMetrics,
        record: ActionRecord,
        outcome: Outcome,
    ) -> u64 {
        if let Outcome::Failed { error } = &outcome {
            tracing::error!(actor = record.actor, kind = record.action.kind(), "{error}");
        }
        let action = record.action.clone();
        let id = self.log_action(metrics, LoggedAction::new(record, outcome.clone()));
        self.failed_back(action, &outcome);
        id
    }

    fn snapshot(&self, workers: Vec<Worker>, hot_prefixes: Vec<HotPrefix>) -> ClusterSnapshot {
        let processes: Vec<ProcessState> = self
            .demand
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .requests
            .values()
            .cloned()
            .collect();
        ClusterSnapshot {
            workers: workers
                .into_iter()
                .map(|w| WorkerState {
                    name: w.name,
                    stage: w.stage,
                    group: w.group,
                    healthy: w.healthy,
                    draining: w.draining,
                    load: w.load,
                    max_running: w.max_running,
                    kv_pages: None,
                    retain_spill: w.retain_spill,
                })
                .collect(),
            processes,
            hot_prefixes,
        }
    }

    /// The worker's answer to logged action `id` (if still in the log); a
    /// failure goes back to the actors.
    pub(crate) fn settle(&self, id: u64, action: Action, outcome: Outcome) {
        self.failed_back(action, &outcome);
        let mut log = self.log.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(entry) = log.iter_mut().find(|a| a.id == id) {
            entry.outcome = outcome;
        }
    }

    /// A failed action is an `ActionFailed` event for the actors (replicate
    /// then frees the copy's place and avoids its target).
    fn failed_back(&self, action: Action, outcome: &Outcome) {
        if let Outcome::Failed { error } = outcome {
            self.notify(vec![ClusterEvent::ActionFailed {
                action,
                error: error.clone(),
            }]);
        }
    }

    pub(crate) fn execute(
        &self,
        metrics: &ControllerMetrics,
        streams: &Streams,
        record: &ActionRecord,
    ) -> Outcome {
        if record.dry_run {
            return Outcome::DryRun;
        }
        match &record.action {
            Action::ScaleHint(h) => {
                let labels = GroupLabels {
                    group: h.group.clone(),
                };
                let gauge = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
                metrics
                    .scale_recommended
                    .get_or_create(&labels)
                    .set(gauge(h.recommended));
                metrics
                    .scale_current
                    .get_or_create(&labels)
                    .set(gauge(h.current));
                let published = Published {
                    hint: h.clone(),
                    actor: record.actor.clone(),
                    reason: record.reason.clone(),
                    at_ms: record.at_ms,
                };
                self.write_history(&published);
                self.scale
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(h.group.clone(), published);
                Outcome::Executed
            }
            // Only streams and native processes the controller follows move.
            Action::MigrateProcess { process, to, .. } => {
                let reason = match record.actor.as_str() {
                    "drain-migrate" => Reason::Drain,
                    _ => Reason::Rebalance,
                };
                match streams.move_process(process, to, reason) {
                    Ok(()) => Outcome::Executed,
                    Err(error) => Outcome::Failed { error },
                }
            }
            other => Outcome::Failed {
                error: format!("the controller cannot execute `{}` yet", other.kind()),
            },
        }
    }

    /// A line of the scale history; a failed write is logged, never fatal
    /// (the hint is published all the same).
    fn write_history(&self, published: &Published) {
        let history = self.history.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(Err(e)) = history.as_ref().map(|h| h.append(published)) {
            tracing::warn!(error = %e, "a scale hint was not written to scale_history_file");
        }
    }

    /// Count and keep `logged`; its id.
    fn log_action(&self, metrics: &ControllerMetrics, mut logged: LoggedAction) -> u64 {
        logged.id = self.logged.fetch_add(1, Ordering::Relaxed) + 1;
        let id = logged.id;
        metrics
            .actions
            .get_or_create(&ActionLabels {
                actor: logged.record.actor.clone(),
                kind: logged.kind.to_string(),
                dry_run: logged.record.dry_run.to_string(),
            })
            .inc();
        let mut log = self.log.lock().unwrap_or_else(|e| e.into_inner());
        if log.len() == ACTION_LOG_LEN {
            log.pop_front();
        }
        log.push_back(logged);
        id
    }
}

impl Actors {
    /// `GET /v1/cluster/actions`: the actors and the logged actions, newest first.
    pub fn actions_view(&self) -> Value {
        let log = self.log.lock().unwrap_or_else(|e| e.into_inner());
        let newest_first: Vec<&LoggedAction> = log.iter().rev().collect();
        json!({ "actors": self.names(), "actions": newest_first })
    }

    /// `GET /v1/cluster/scale`: the newest scale hint of each group.
    pub fn scale_view(&self) -> Value {
        let scale = self.scale.lock().unwrap_or_else(|e| e.into_inner());
        let groups: Vec<&Published> = scale.values().collect();
        json!({ "groups": groups })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pie_core::BlockHash;
    use pie_policy::cluster::{ActorConfigs, ScaleByPropConfig};

    fn hint(dry_run: bool, action: Action) -> ActionRecord {
        ActionRecord {
            at_ms: 1,
            actor: "a".into(),
            action,
            reason: "why".into(),
            dry_run,
        }
    }

    #[test]
    fn hints_publish_unless_dry_run_and_unexecutable_actions_fail_loudly() {
        let metrics = ControllerMetrics::default();
        let actors = Actors::new(ActorRunner::default(), 1000, None);
        let h = Action::ScaleHint(ScaleHint {
            group: "gold".into(),
            current: 2,
            recommended: 3,
            signal: "load".into(),
            value: 9.0,
        });
        assert_eq!(
            actors.execute(&metrics, &Streams::default(), &hint(true, h.clone())),
            Outcome::DryRun
        );
        assert!(!metrics.encode().contains("pie_cluster_scale_recommended{"));
        assert_eq!(
            actors.execute(&metrics, &Streams::default(), &hint(false, h)),
            Outcome::Executed
        );
        let text = metrics.encode();
        assert!(
            text.contains("pie_cluster_scale_recommended{group=\"gold\"} 3"),
            "{text}"
        );
        assert!(
            text.contains("pie_cluster_scale_current{group=\"gold\"} 2"),
            "{text}"
        );
        let drain = hint(
            false,
            Action::DrainWorker {
                worker: "w0".into(),
            },
        );
        assert!(matches!(
            actors.execute(&metrics, &Streams::default(), &drain),
            Outcome::Failed { error } if error.contains("drain-worker")
        ));
        for _ in 0..ACTION_LOG_LEN + 5 {
            actors.log_action(&metrics, LoggedAction::new(drain.clone(), Outcome::DryRun));
        }
        assert_eq!(actors.log.lock().expect("lock").len(), ACTION_LOG_LEN);
        assert!(metrics.encode().contains(
            "pie_cluster_actions_total{actor=\"a\",kind=\"drain-worker\",dry_run=\"false\"} 261"
        ));
        actors.replace(ActorRunner::default(), 50, None, &metrics);
        assert!(!metrics.encode().contains("pie_cluster_scale_recommended{"));
    }

    #[test]
    fn a_failed_action_goes_back_to_the_actors_as_an_event() {
        let actors = Actors::new(ActorRunner::default(), 1000, None);
        let copy = Action::CopyPrefix {
            blocks: vec![BlockHash(1)],
            from: "w0".into(),
            to: "w1".into(),
        };
        actors.settle(0, copy.clone(), Outcome::Executed);
        assert!(actors.events.lock().expect("lock").is_empty());
        let refused = Outcome::Failed {
            error: "the worker answered 409".into(),
        };
        actors.settle(0, copy.clone(), refused);
        let events = actors.events.lock().expect("lock").clone();
        assert_eq!(
            events,
            vec![ClusterEvent::ActionFailed {
                action: copy,
                error: "the worker answered 409".into(),
            }]
        );
    }

    #[test]
    fn tracked_requests_are_the_snapshot_processes_until_dropped() {
        let runner = ActorRunner::new(
            &["scale-by-prop"],
            &ActorConfigs {
                scale_by_prop: ScaleByPropConfig::default(),
                ..ActorConfigs::default()
            },
        )
        .expect("known");
        let actors = Actors::new(runner, 1000, None);
        let props = Props::new();
        let a = actors.track(&props).expect("tracking");
        let b = actors.track(&props).expect("tracking");
        b.placed("w1");
        let snap = actors.snapshot(Vec::new(), Vec::new());
        assert_eq!(snap.processes.len(), 2);
        assert_eq!(snap.processes[1].worker.as_deref(), Some("w1"));
        drop((a, b));
        assert!(actors.snapshot(Vec::new(), Vec::new()).processes.is_empty());
        let none = Actors::new(ActorRunner::default(), 1000, None);
        assert!(none.track(&props).is_none(), "no actor: no tracking");
    }
}
