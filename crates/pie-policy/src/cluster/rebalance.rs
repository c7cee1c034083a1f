//! `rebalance`: moves processes from overloaded workers to underloaded ones
//! (Llumnix-style live migration), so that sessions stuck on a hot worker by
//! affinity stop queueing there while other workers idle.
//!
//! Rule, on every tick: a worker's level is its load (queued + running
//! processes) over its `max_running`, or with `signal = "kv"` its KV pages in
//! use over its total pages (when every eligible worker reports its pages; if
//! one does not, the tick uses load for all, so levels stay comparable).
//! Eligible workers are serving (healthy, not draining: a draining worker is
//! drain-migrate's) and not prefill-stage. A worker above `high` is a source, a
//! worker below `low` a target. While the budget lasts, the most loaded source
//! moves a group of its processes to the least loaded target that takes it: a
//! group is a whole session (the source's processes sharing a `session` prop),
//! sessions first, then single processes without a session; a process whose
//! `pin` prop names the worker it is on is never moved, nor its session. A move
//! must leave the target at or below `high` and at or below the source (no
//! overshoot), and must lower the pair's sum of squared levels; with `kv`, a
//! process counts as its source's average pages per process. A worker that
//! sent this tick does not receive, and one that received does not send, so no
//! pair of workers swaps processes in a tick. Each decision is one
//! `MigrateProcess`.
//!
//! The budget is `max_migrations` migrations in flight: a migration this actor
//! started stays in flight while the snapshot still shows its process on the
//! source, up to `pending_timeout_ms` (an executor that refused it, or a dry
//! run, frees the slot then). In-flight migrations count at their targets'
//! levels already, so a tick does not move load again that is on its way.
//!
//! Props read: `session` (string), `pin` (string). Config keys
//! (`[cluster.rebalance]`): `high` (default 0.9) and `low` (0.5), with
//! 0 < low < high <= 1; `max_migrations` (4, >= 1); `signal` ("load" or "kv");
//! `pending_timeout_ms` (30000, > 0); `dry_run` (false; honoured by the runner).
//!
//! Invariant (tested, with a property test): never A -> B and B -> A in one
//! tick; never more than `max_migrations` in flight; a source is above `high`
//! and a target below `low` when chosen; never a process pinned to its worker,
//! never to or from a draining, unhealthy or prefill-stage worker; a session's
//! processes on the source move together; the moves lower the eligible
//! workers' sum of squared levels and never widen their max-min spread.

use std::collections::{BTreeMap, HashSet};

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::actions::{Action, ClusterActor, ClusterSnapshot, Decision, Stage, WorkerState};

/// What a worker's level is measured in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Signal {
    /// Queued + running processes over `max_running`.
    #[default]
    Load,
    /// KV pages in use over total pages.
    Kv,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RebalanceConfig {
    /// Record decisions without executing them (applied by `ActorRunner`).
    pub dry_run: bool,
    /// A worker above this level is a source.
    pub high: f64,
    /// A worker below this level is a target.
    pub low: f64,
    /// Migrations in flight at once (this tick's and earlier ones not done).
    pub max_migrations: usize,
    pub signal: Signal,
    /// A migration whose process still shows on its source after this long
    /// no longer counts as in flight.
    pub pending_timeout_ms: u64,
}

impl Default for RebalanceConfig {
    fn default() -> Self {
        Self {
            dry_run: false,
            high: 0.9,
            low: 0.5,
            max_migrations: 4,
            signal: Signal::Load,
            pending_timeout_ms: 30_000,
        }
    }
}

impl RebalanceConfig {
    /// An error names the offending key.
    pub fn validate(&self) -> Result<(), String> {
        let unit = |x: f64| x.is_finite() && x > 0.0 && x <= 1.0;
        if !unit(self.high) {
            return Err(format!("high: {} is not in (0, 1]", self.high));
        }
        if !unit(self.low) {
            return Err(format!("low: {} is not in (0, 1]", self.low));
        }
        if self.low >= self.high {
            return Err(format!(
                "low: {} must be below high {}",
                self.low, self.high
            ));
        }
        if self.max_migrations == 0 {
            return Err("max_migrations: must be positive".into());
        }
        if self.pending_timeout_ms == 0 {
            return Err("pending_timeout_ms: must be positive".into());
        }
        Ok(())
    }
}

/// A migration this actor asked for and has not seen done.
#[derive(Clone, Debug, PartialEq, Serialize)]
struct InFlight {
    from: String,
    to: String,
    at_ms: u64,
}

/// One eligible worker during a tick's planning.
#[derive(Clone, Debug)]
struct Node {
    name: String,
    /// Load, or pages in use; moved processes already taken off or added.
    value: f64,
    capacity: f64,
    /// What one of its processes weighs in `value`'s unit.
    per_process: f64,
}

impl Node {
    fn level(&self) -> f64 {
        self.value / self.capacity
    }
}

/// Processes that move together: a session's on one worker, or one process.
struct Group {
    session: Option<String>,
    processes: Vec<String>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    Sent,
    Received,
}

#[derive(Debug)]
pub struct Rebalance {
    config: RebalanceConfig,
    in_flight: BTreeMap<String, InFlight>,
}

impl Rebalance {
    pub fn new(config: RebalanceConfig) -> Self {
        Self {
            config,
            in_flight: BTreeMap::new(),
        }
    }

    /// Drop migrations that are done (the process left its source or ended)
    /// or timed out.
    fn retire(&mut self, now_ms: u64, snapshot: &ClusterSnapshot) {
        let timeout = self.config.pending_timeout_ms;
        self.in_flight.retain(|process, m| {
            now_ms.saturating_sub(m.at_ms) < timeout
                && snapshot
                    .processes
                    .iter()
                    .any(|p| &p.id == process && p.worker.as_deref() == Some(m.from.as_str()))
        });
    }

    /// The eligible workers with their levels in this tick's signal (and its
    /// name), in-flight migrations counted at their targets.
    fn nodes(&self, snapshot: &ClusterSnapshot) -> (Vec<Node>, &'static str) {
        let eligible: Vec<&WorkerState> = snapshot
            .workers
            .iter()
            .filter(|w| w.serving() && w.stage != Stage::Prefill && w.max_running > 0)
            .collect();
        let kv = self.config.signal == Signal::Kv
            && eligible
                .iter()
                .all(|w| w.kv_pages.is_some_and(|k| k.total > 0));
        let mut nodes: Vec<Node> = eligible
            .iter()
            .map(|w| match w.kv_pages.filter(|_| kv) {
                Some(k) => Node {
                    name: w.name.clone(),
                    value: k.used as f64,
                    capacity: k.total as f64,
                    per_process: k.used as f64 / w.load.max(1) as f64,
                },
                None => Node {
                    name: w.name.clone(),
                    value: w.load as f64,
                    capacity: w.max_running as f64,
                    per_process: 1.0,
                },
            })
            .collect();
        for m in self.in_flight.values() {
            let from = nodes.iter().position(|n| n.name == m.from);
            let to = nodes.iter().position(|n| n.name == m.to);
            if let (Some(f), Some(t)) = (from, to) {
                let w = nodes[f].per_process;
                nodes[f].value = (nodes[f].value - w).max(0.0);
                nodes[t].value += w;
            }
        }
        (nodes, if kv { "kv" } else { "load" })
    }

    /// The groups on `worker` this actor may move, sessions first.
    fn groups(&self, snapshot: &ClusterSnapshot, worker: &str) -> Vec<Group> {
        let mut sessions: Vec<Group> = Vec::new();
        let mut pinned: HashSet<&str> = HashSet::new();
        let mut singles = Vec::new();
        for p in &snapshot.processes {
            if p.worker.as_deref() != Some(worker) || self.in_flight.contains_key(&p.id) {
                continue;
            }
            let pinned_here = p.props.str("pin") == Some(worker);
            match p.props.str("session") {
                Some(s) => {
                    if pinned_here {
                        pinned.insert(s);
                    }
                    match sessions
                        .iter_mut()
                        .find(|g| g.session.as_deref() == Some(s))
                    {
                        Some(g) => g.processes.push(p.id.clone()),
                        None => sessions.push(Group {
                            session: Some(s.to_string()),
                            processes: vec![p.id.clone()],
                        }),
                    }
                }
                None if !pinned_here => singles.push(Group {
                    session: None,
                    processes: vec![p.id.clone()],
                }),
                None => {}
            }
        }
        sessions.retain(|g| !g.session.as_deref().is_some_and(|s| pinned.contains(s)));
        sessions.extend(singles);
        sessions
    }

    /// Whether moving `k` processes from `s` to `t` is allowed (see the rule).
    fn fits(&self, s: &Node, t: &Node, k: usize) -> bool {
        let moved = k as f64 * s.per_process;
        let (fs, ft) = (s.level(), t.level());
        let fs2 = (s.value - moved) / s.capacity;
        let ft2 = (t.value + moved) / t.capacity;
        ft2 <= self.config.high && ft2 <= fs2 && fs2 * fs2 + ft2 * ft2 < fs * fs + ft * ft
    }
}

impl ClusterActor for Rebalance {
    fn name(&self) -> &'static str {
        "rebalance"
    }

    fn on_tick(&mut self, now_ms: u64, snapshot: &ClusterSnapshot) -> Vec<Decision> {
        self.retire(now_ms, snapshot);
        let mut budget = self
            .config
            .max_migrations
            .saturating_sub(self.in_flight.len());
        let mut out = Vec::new();
        if budget == 0 {
            return out;
        }
        let (high, low) = (self.config.high, self.config.low);
        let (mut nodes, signal) = self.nodes(snapshot);
        let mut roles: Vec<Option<Role>> = vec![None; nodes.len()];
        let mut exhausted = vec![false; nodes.len()];
        let mut groups: Vec<Option<Vec<Group>>> = (0..nodes.len()).map(|_| None).collect();
        let by_level = |a: &(usize, f64), b: &(usize, f64)| a.1.total_cmp(&b.1);
        while budget > 0 {
            let source = (0..nodes.len())
                .filter(|&i| !exhausted[i] && roles[i] != Some(Role::Received))
                .map(|i| (i, nodes[i].level()))
                .filter(|&(_, l)| l > high)
                .max_by(|a, b| by_level(a, b).then(nodes[b.0].name.cmp(&nodes[a.0].name)));
            let Some((s, _)) = source else { break };
            let mut targets: Vec<(usize, f64)> = (0..nodes.len())
                .filter(|&i| roles[i] != Some(Role::Sent))
                .map(|i| (i, nodes[i].level()))
                .filter(|&(_, l)| l < low)
                .collect();
            targets.sort_by(|a, b| by_level(a, b).then(nodes[a.0].name.cmp(&nodes[b.0].name)));
            let candidates = groups[s].get_or_insert_with(|| self.groups(snapshot, &nodes[s].name));
            let chosen = targets.iter().find_map(|&(t, _)| {
                candidates
                    .iter()
                    .position(|g| {
                        g.processes.len() <= budget
                            && self.fits(&nodes[s], &nodes[t], g.processes.len())
                    })
                    .map(|g| (t, g))
            });
            let Some((t, g)) = chosen else {
                exhausted[s] = true;
                continue;
            };
            let group = candidates.remove(g);
            let k = group.processes.len();
            let (from, to) = (nodes[s].name.clone(), nodes[t].name.clone());
            let what = match &group.session {
                Some(session) => format!("session `{session}` ({k} process(es))"),
                None => "a process without a session".to_string(),
            };
            let reason = format!(
                "{signal}: {from} at {:.2} above high {high}, {to} at {:.2} below low {low}: \
                 moving {what}",
                nodes[s].level(),
                nodes[t].level(),
            );
            let moved = k as f64 * nodes[s].per_process;
            nodes[s].value -= moved;
            nodes[t].value += moved;
            roles[s] = Some(Role::Sent);
            roles[t] = Some(Role::Received);
            budget -= k;
            for process in group.processes {
                self.in_flight.insert(
                    process.clone(),
                    InFlight {
                        from: from.clone(),
                        to: to.clone(),
                        at_ms: now_ms,
                    },
                );
                out.push(Decision {
                    action: Action::MigrateProcess {
                        process,
                        from: from.clone(),
                        to: to.clone(),
                    },
                    reason: reason.clone(),
                });
            }
        }
        out
    }

    fn summary(&self) -> serde_json::Value {
        json!({
            "high": self.config.high,
            "low": self.config.low,
            "signal": self.config.signal,
            "max_migrations": self.config.max_migrations,
            "in_flight": self.in_flight,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::actions::{KvPages, ProcessState};
    use pie_core::{PropValue, Props};
    use proptest::prelude::*;

    fn config() -> RebalanceConfig {
        RebalanceConfig {
            high: 0.75,
            low: 0.5,
            max_migrations: 4,
            ..RebalanceConfig::default()
        }
    }

    fn worker(name: &str, load: usize) -> WorkerState {
        WorkerState {
            name: name.into(),
            healthy: true,
            load,
            max_running: 8,
            ..WorkerState::default()
        }
    }

    fn process(id: &str, worker: &str, session: Option<&str>, pin: Option<&str>) -> ProcessState {
        let mut props = Props::new();
        if let Some(s) = session {
            props
                .set("session", PropValue::Str(s.into()))
                .expect("valid");
        }
        if let Some(p) = pin {
            props.set("pin", PropValue::Str(p.into())).expect("valid");
        }
        ProcessState {
            id: id.into(),
            worker: Some(worker.into()),
            props,
        }
    }

    /// Workers with these loads, each load made of processes without props.
    fn snap(loads: &[usize]) -> ClusterSnapshot {
        let mut s = ClusterSnapshot::default();
        for (i, &load) in loads.iter().enumerate() {
            let name = format!("w{i}");
            for j in 0..load {
                s.processes
                    .push(process(&format!("{name}-{j}"), &name, None, None));
            }
            s.workers.push(worker(&name, load));
        }
        s
    }

    fn moves(d: &[Decision]) -> Vec<(String, String, String)> {
        d.iter()
            .filter_map(|d| match &d.action {
                Action::MigrateProcess { process, from, to } => {
                    Some((process.clone(), from.clone(), to.clone()))
                }
                _ => None,
            })
            .collect()
    }

    #[test]
    fn moves_from_the_most_loaded_to_the_least_loaded_without_overshoot() {
        let mut a = Rebalance::new(config());
        // w0 at 12/8 and w1 at 7/8 are above 0.75; w2 at 1/8 and w3 at 3/8 below 0.5.
        let d = a.on_tick(0, &snap(&[12, 7, 1, 3]));
        let m = moves(&d);
        assert_eq!(m.len(), 4, "the budget: {m:?}");
        // w0 is the most loaded; w2 the least loaded target, up to 4/8 < low
        // before its last move, then w3.
        let pairs: Vec<(&str, &str)> = m.iter().map(|(_, f, t)| (f.as_str(), t.as_str())).collect();
        assert_eq!(
            pairs,
            [("w0", "w2"), ("w0", "w2"), ("w0", "w2"), ("w0", "w3")]
        );
        assert!(
            d[0].reason.starts_with("load: w0 at 1.50 above high 0.75"),
            "{}",
            d[0].reason
        );
        // In flight now: the next tick has no budget while the snapshot still
        // shows them on w0.
        assert!(a.on_tick(1, &snap(&[12, 7, 1, 3])).is_empty());
        // Past the timeout they no longer count.
        assert_eq!(moves(&a.on_tick(30_001, &snap(&[12, 7, 1, 3]))).len(), 4);
    }

    #[test]
    fn a_migration_is_in_flight_until_its_process_leaves_the_source() {
        let mut a = Rebalance::new(RebalanceConfig {
            max_migrations: 1,
            ..config()
        });
        let mut s = snap(&[10, 0]);
        let first = moves(&a.on_tick(0, &s));
        assert_eq!(first.len(), 1);
        assert!(a.on_tick(1000, &s).is_empty(), "one in flight");
        // The process moved: w0 has 9, w1 has it.
        s.workers[0].load = 9;
        s.workers[1].load = 1;
        for p in s.processes.iter_mut().filter(|p| p.id == first[0].0) {
            p.worker = Some("w1".into());
        }
        let next = moves(&a.on_tick(2000, &s));
        assert_eq!(next.len(), 1);
        assert_ne!(next[0].0, first[0].0);
    }

    #[test]
    fn sessions_move_whole_and_first_and_pinned_ones_stay() {
        let mut a = Rebalance::new(RebalanceConfig {
            high: 0.6,
            ..config()
        });
        let s = ClusterSnapshot {
            workers: vec![worker("w0", 8), worker("w1", 0)],
            processes: vec![
                process("plain", "w0", None, None),
                process("a1", "w0", Some("a"), Some("w0")),
                process("a2", "w0", Some("a"), None),
                process("b1", "w0", Some("b"), None),
                process("b2", "w0", Some("b"), None),
                process("pinned", "w0", None, Some("w0")),
                process("elsewhere", "w0", None, Some("w1")),
                process("c1", "w0", Some("c"), None),
            ],
            ..ClusterSnapshot::default()
        };
        let m = moves(&a.on_tick(0, &s));
        let ids: Vec<&str> = m.iter().map(|(p, _, _)| p.as_str()).collect();
        // Session a has a process pinned to w0: it stays whole. Sessions b and c
        // first (3 processes), then a single, until w0 is down to 4/8 <= 0.6.
        assert_eq!(ids, ["b1", "b2", "c1", "plain"]);
    }

    #[test]
    fn a_session_larger_than_the_budget_or_the_gap_waits() {
        let mut a = Rebalance::new(RebalanceConfig {
            max_migrations: 2,
            ..config()
        });
        let s = ClusterSnapshot {
            workers: vec![worker("w0", 7), worker("w1", 3)],
            processes: (0..3)
                .map(|i| process(&format!("s{i}"), "w0", Some("big"), None))
                .chain((0..4).map(|i| process(&format!("p{i}"), "w0", None, None)))
                .collect(),
            ..ClusterSnapshot::default()
        };
        // 7/8 vs 3/8: one process evens them (6 vs 4), two would overshoot.
        let m = moves(&a.on_tick(0, &s));
        let ids: Vec<&str> = m.iter().map(|(p, _, _)| p.as_str()).collect();
        assert_eq!(ids, ["p0"]);
    }

    #[test]
    fn draining_unhealthy_and_prefill_workers_are_neither_sources_nor_targets() {
        let mut a = Rebalance::new(config());
        let mut s = snap(&[12, 12, 0, 0, 0, 12]);
        s.workers[0].draining = true;
        s.workers[2].healthy = false;
        s.workers[3].stage = Stage::Prefill;
        s.workers[5].stage = Stage::Decode;
        let m = moves(&a.on_tick(0, &s));
        assert!(!m.is_empty());
        for (_, from, to) in &m {
            assert!(from == "w1" || from == "w5", "{from}");
            assert_eq!(to, "w4");
        }
    }

    #[test]
    fn kv_signal_reads_pages_and_falls_back_to_load_when_one_is_unknown() {
        let mut a = Rebalance::new(RebalanceConfig {
            signal: Signal::Kv,
            ..config()
        });
        // By load w0 would be the source (8/8 > 0.75); by pages w1 is.
        let mut s = snap(&[8, 4, 1]);
        let pages = [(50, 100), (90, 100), (10, 100)];
        for (w, (used, total)) in s.workers.iter_mut().zip(pages) {
            w.kv_pages = Some(KvPages { used, total });
        }
        let d = a.on_tick(0, &s);
        let m = moves(&d);
        assert_eq!(m[0].1, "w1");
        assert_eq!(m[0].2, "w2");
        assert!(d[0].reason.starts_with("kv:"), "{}", d[0].reason);
        // 22.5 pages a process: after one move (90 -> 67.5) w1 is no source.
        assert_eq!(m.len(), 1);
        let mut b = Rebalance::new(RebalanceConfig {
            signal: Signal::Kv,
            ..config()
        });
        s.workers[2].kv_pages = None;
        let d = b.on_tick(0, &s);
        assert_eq!(moves(&d)[0].1, "w0");
        assert!(d[0].reason.starts_with("load:"), "{}", d[0].reason);
    }

    #[test]
    fn bad_configs_name_the_key() {
        let bad = |c: RebalanceConfig, key: &str| {
            let e = c.validate().unwrap_err();
            assert!(e.starts_with(key), "{e}");
        };
        bad(
            RebalanceConfig {
                high: 1.5,
                ..config()
            },
            "high",
        );
        bad(
            RebalanceConfig {
                high: 0.0,
                ..config()
            },
            "high",
        );
        bad(
            RebalanceConfig {
                low: f64::NAN,
                ..config()
            },
            "low",
        );
        bad(
            RebalanceConfig {
                low: 0.75,
                ..config()
            },
            "low",
        );
        bad(
            RebalanceConfig {
                max_migrations: 0,
                ..config()
            },
            "max_migrations",
        );
        bad(
            RebalanceConfig {
                pending_timeout_ms: 0,
                ..config()
            },
            "pending_timeout_ms",
        );
        assert_eq!(config().validate(), Ok(()));
        assert_eq!(RebalanceConfig::default().validate(), Ok(()));
    }

    /// Levels of the eligible workers after applying `moves` to `s`.
    fn levels_after(s: &ClusterSnapshot, m: &[(String, String, String)]) -> Vec<f64> {
        s.workers
            .iter()
            .filter(|w| w.serving() && w.stage != Stage::Prefill)
            .map(|w| {
                let out = m.iter().filter(|x| x.1 == w.name).count();
                let inn = m.iter().filter(|x| x.2 == w.name).count();
                (w.load + inn - out) as f64 / w.max_running as f64
            })
            .collect()
    }

    fn spread(levels: &[f64]) -> f64 {
        let max = levels.iter().copied().fold(f64::MIN, f64::max);
        let min = levels.iter().copied().fold(f64::MAX, f64::min);
        max - min
    }

    proptest! {
        #[test]
        fn invariant_holds_for_any_cluster(
            workers in prop::collection::vec(
                (0usize..20, 0u8..10, prop::option::of(0u8..4), prop::option::of(0usize..6)),
                2..8),
            cap in 1usize..6,
        ) {
            let c = RebalanceConfig { max_migrations: cap, ..config() };
            let mut a = Rebalance::new(c.clone());
            let mut s = ClusterSnapshot::default();
            for (i, &(load, kind, session, pin)) in workers.iter().enumerate() {
                let name = format!("w{i}");
                let mut w = worker(&name, load);
                match kind {
                    0 => w.draining = true,
                    1 => w.healthy = false,
                    2 => w.stage = Stage::Prefill,
                    _ => {}
                }
                s.workers.push(w);
                for j in 0..load {
                    // A session per worker and slot of 4; some pinned here or
                    // elsewhere.
                    let sess = session.map(|k| format!("{name}-s{}", (j as u8 + k) % 4));
                    let pinned = pin.filter(|_| j % 3 == 0).map(|p| format!("w{p}"));
                    s.processes.push(process(
                        &format!("{name}-{j}"), &name, sess.as_deref(), pinned.as_deref()));
                }
            }
            let before: Vec<f64> = levels_after(&s, &[]);
            let m = moves(&a.on_tick(0, &s));
            prop_assert!(m.len() <= cap, "cap");
            let state = |n: &str| s.workers.iter().find(|w| w.name == n).expect("known");
            let mut seen = HashSet::new();
            for (p, from, to) in &m {
                prop_assert!(seen.insert(p.clone()), "a process moved twice");
                prop_assert!(!m.iter().any(|x| &x.1 == to && &x.2 == from), "both directions");
                let (f, t) = (state(from), state(to));
                for w in [f, t] {
                    prop_assert!(w.serving() && w.stage != Stage::Prefill, "{}", w.name);
                }
                prop_assert!(f.load as f64 / 8.0 > c.high, "source below high");
                prop_assert!((t.load as f64) / 8.0 < c.low, "target above low");
                let proc_ = s.processes.iter().find(|x| &x.id == p).expect("known");
                prop_assert_eq!(proc_.worker.as_deref(), Some(from.as_str()));
                prop_assert!(proc_.props.str("pin") != Some(from.as_str()), "pinned moved");
                // Its session's processes on the source move with it, to one place.
                if let Some(sess) = proc_.props.str("session") {
                    for q in s.processes.iter().filter(|q| {
                        q.props.str("session") == Some(sess) && q.worker == proc_.worker
                    }) {
                        prop_assert!(m.iter().any(|x| x.0 == q.id && &x.2 == to), "split");
                    }
                }
            }
            if !m.is_empty() {
                let after = levels_after(&s, &m);
                let squares = |l: &[f64]| l.iter().map(|x| x * x).sum::<f64>();
                prop_assert!(squares(&after) < squares(&before));
                prop_assert!(spread(&after) <= spread(&before));
            }
            // The moves are in flight: a second look at the same cluster adds
            // at most what the cap leaves.
            let again = moves(&a.on_tick(1, &s));
            prop_assert!(m.len() + again.len() <= cap, "cap across ticks");
        }
    }
}
