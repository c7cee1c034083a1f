//! The cluster-action interface: what an actor sees ([`ClusterSnapshot`], a
//! [`ClusterEvent`]) and what it may ask for ([`Action`]). Routing policies decide
//! one request at a time; actors act on the cluster over time (migrate, copy or
//! persist prefixes, drain, publish scale hints). Everything here is plain data
//! so that the controller (over HTTP) and the simulator (with transfer costs)
//! execute the same decisions from the same actor objects.

use pie_core::{BlockHash, Props};
use serde::{Deserialize, Serialize};

/// What a worker serves: both phases, or one side of a disaggregated pair.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Stage {
    #[default]
    Both,
    Prefill,
    Decode,
}

impl std::str::FromStr for Stage {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "both" => Ok(Self::Both),
            "prefill" => Ok(Self::Prefill),
            "decode" => Ok(Self::Decode),
            other => Err(format!("unknown stage `{other}` (both, prefill, decode)")),
        }
    }
}

/// Where pages outlive a worker's memory: its `pie-pool`, its disk tier, or
/// whichever of the two it has (the pool first).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    #[default]
    Any,
    Pool,
    Disk,
}

impl Tier {
    pub fn name(self) -> &'static str {
        match self {
            Tier::Any => "any",
            Tier::Pool => "pool",
            Tier::Disk => "disk",
        }
    }
}

/// Occupancy of a worker's KV page pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvPages {
    pub used: usize,
    pub total: usize,
}

/// One worker as an actor sees it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct WorkerState {
    pub name: String,
    pub stage: Stage,
    /// The operator's `group` label (scale-by-prop counts workers per group);
    /// None falls in the actor's default group.
    pub group: Option<String>,
    pub healthy: bool,
    /// Taking no new work; its processes are to finish or move.
    pub draining: bool,
    /// Queued + running processes.
    pub load: usize,
    /// 0 when the worker does not say.
    pub max_running: usize,
    /// None when the observer does not know (the controller does not poll it).
    pub kv_pages: Option<KvPages>,
    /// Where it spills retained sessions it must evict early (`retain-all`);
    /// None: it drops them.
    pub retain_spill: Option<Tier>,
}

impl WorkerState {
    /// Healthy and not draining: counts as capacity.
    pub fn serving(&self) -> bool {
        self.healthy && !self.draining
    }

    /// Queued + running processes over `max_running`; None when it does not
    /// say its `max_running`.
    pub fn load_level(&self) -> Option<f64> {
        (self.max_running > 0).then(|| self.load as f64 / self.max_running as f64)
    }
}

/// One process (queued or running) with the props a policy reads.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ProcessState {
    /// The observer's id for it: the simulator's request id; in the controller
    /// its own number for a proxied request (it does not learn workers' ids for
    /// OpenAI requests).
    pub id: String,
    /// None while it waits before routing (the controller's cluster-priority queue).
    pub worker: Option<String>,
    pub props: Props,
}

/// A prefix asked for again and again (see `cluster::PrefixHeat`), with
/// where it is. Filled by observers that track prompts (the controller,
/// when an actor that reads it is configured).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct HotPrefix {
    /// The prefix's block hashes, first block first.
    pub blocks: Vec<BlockHash>,
    /// Requests that included each block (never increasing along `blocks`).
    pub hits: Vec<u64>,
    /// Tokens per block.
    pub page_size: usize,
    /// Workers holding a leading part of it (in memory or on disk): how many
    /// of its blocks.
    pub holders: Vec<(String, usize)>,
    /// Workers with a leading part of it on disk (`persist-prefix`): how many
    /// of its blocks.
    pub persisted: Vec<(String, usize)>,
    /// Requests per second for its first block since it was first seen.
    pub requests_per_s: f64,
}

impl HotPrefix {
    /// Its leading blocks asked for at least `min_hits` times: the part
    /// worth keeping (persisting, copying).
    pub fn leading_hot(&self, min_hits: u64) -> &[BlockHash] {
        let n = self.hits.iter().take_while(|&&h| h >= min_hits).count();
        &self.blocks[..n.min(self.blocks.len())]
    }

    /// How many of its blocks `worker` holds (0: none).
    pub fn held_by(&self, worker: &str) -> usize {
        depth_of(&self.holders, worker)
    }

    /// How many of its blocks `worker` has on disk (0: none).
    pub fn persisted_by(&self, worker: &str) -> usize {
        depth_of(&self.persisted, worker)
    }
}

fn depth_of(list: &[(String, usize)], worker: &str) -> usize {
    list.iter()
        .find(|(w, _)| w == worker)
        .map_or(0, |(_, n)| *n)
}

/// A session's processes and the worker they are on.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionState {
    pub session: String,
    pub worker: Option<String>,
    pub processes: Vec<String>,
}

/// What an actor sees at one instant. Built by the observer (controller or
/// simulator); no I/O, so actors stay pure and replayable.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ClusterSnapshot {
    pub workers: Vec<WorkerState>,
    pub processes: Vec<ProcessState>,
    pub hot_prefixes: Vec<HotPrefix>,
}

impl ClusterSnapshot {
    /// Sessions (the `session` prop) with their processes, in order of first
    /// appearance; derived rather than stored so the two views cannot disagree.
    pub fn sessions(&self) -> Vec<SessionState> {
        let mut out: Vec<SessionState> = Vec::new();
        for p in &self.processes {
            let Some(s) = p.props.str("session") else {
                continue;
            };
            match out.iter_mut().find(|x| x.session == s) {
                Some(x) => {
                    x.processes.push(p.id.clone());
                    if x.worker.is_none() {
                        x.worker.clone_from(&p.worker);
                    }
                }
                None => out.push(SessionState {
                    session: s.to_string(),
                    worker: p.worker.clone(),
                    processes: vec![p.id.clone()],
                }),
            }
        }
        out
    }
}

/// Something that happened between ticks; actors may react at once.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "kebab-case")]
pub enum ClusterEvent {
    WorkerJoined {
        worker: String,
    },
    WorkerLeft {
        worker: String,
    },
    WorkerDraining {
        worker: String,
    },
    /// A process's `pin` prop changed (None: removed).
    PinChanged {
        process: String,
        pin: Option<String>,
    },
    /// An operator asked for a session to move.
    RelocateRequested {
        session: String,
        target: String,
    },
    /// The executor could not carry out an action (a worker refused it, or
    /// did not answer).
    ActionFailed {
        action: Action,
        error: String,
    },
}

/// A published scale recommendation for one group of workers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScaleHint {
    pub group: String,
    /// Serving workers labelled with the group now.
    pub current: usize,
    pub recommended: usize,
    /// The signal's name (e.g. `load`: queued + running processes).
    pub signal: String,
    pub value: f64,
}

/// What an actor asks the executor to do.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "action", rename_all = "kebab-case")]
pub enum Action {
    MigrateProcess {
        process: String,
        from: String,
        to: String,
    },
    CopyPrefix {
        blocks: Vec<BlockHash>,
        from: String,
        to: String,
    },
    CopyPrefixToPool {
        blocks: Vec<BlockHash>,
        from: String,
    },
    PersistPrefix {
        blocks: Vec<BlockHash>,
        worker: String,
    },
    DrainWorker {
        worker: String,
    },
    /// From now on, spill the retained sessions it must evict before their
    /// `keep-ms` passes to `to`, instead of dropping them.
    RetainSpill {
        worker: String,
        to: Tier,
    },
    ScaleHint(ScaleHint),
}

impl Action {
    /// The action's kind, a metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            Action::MigrateProcess { .. } => "migrate-process",
            Action::CopyPrefix { .. } => "copy-prefix",
            Action::CopyPrefixToPool { .. } => "copy-prefix-to-pool",
            Action::PersistPrefix { .. } => "persist-prefix",
            Action::DrainWorker { .. } => "drain-worker",
            Action::RetainSpill { .. } => "retain-spill",
            Action::ScaleHint(_) => "scale-hint",
        }
    }
}

/// An actor's decision: the action and why.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    pub action: Action,
    pub reason: String,
}

/// A decision as the runner hands it to the executor.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ActionRecord {
    pub at_ms: u64,
    pub actor: String,
    pub action: Action,
    pub reason: String,
    /// Recorded only: the executor must not carry it out.
    pub dry_run: bool,
}

/// An actor: sees the cluster on a tick and on events, returns decisions. Pure:
/// time is a parameter, the snapshot is all it knows.
pub trait ClusterActor: Send + Sync {
    fn name(&self) -> &'static str;

    fn on_tick(&mut self, now_ms: u64, snapshot: &ClusterSnapshot) -> Vec<Decision>;

    fn on_event(
        &mut self,
        _now_ms: u64,
        _event: &ClusterEvent,
        _snapshot: &ClusterSnapshot,
    ) -> Vec<Decision> {
        Vec::new()
    }

    /// Its state for operators (`GET /v1/cluster`).
    fn summary(&self) -> serde_json::Value;

    /// Whether it reads the snapshot's `hot_prefixes` (the observer then
    /// counts routed prompts' blocks, which costs on every request).
    fn reads_hot_prefixes(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pie_core::PropValue;

    #[test]
    fn sessions_group_processes_and_kinds_are_distinct() {
        let proc_ = |id: &str, worker: Option<&str>, session: Option<&str>| {
            let mut props = Props::new();
            if let Some(s) = session {
                props
                    .set("session", PropValue::Str(s.into()))
                    .expect("valid");
            }
            ProcessState {
                id: id.into(),
                worker: worker.map(Into::into),
                props,
            }
        };
        let snap = ClusterSnapshot {
            processes: vec![
                proc_("1", None, Some("a")),
                proc_("2", Some("w1"), Some("a")),
                proc_("3", Some("w0"), None),
                proc_("4", Some("w0"), Some("b")),
            ],
            ..ClusterSnapshot::default()
        };
        let s = snap.sessions();
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].worker.as_deref(), Some("w1"));
        assert_eq!(s[0].processes, vec!["1", "2"]);
        assert_eq!(s[1].session, "b");

        let blocks = vec![BlockHash(1)];
        let all = [
            Action::MigrateProcess {
                process: "p".into(),
                from: "a".into(),
                to: "b".into(),
            },
            Action::CopyPrefix {
                blocks: blocks.clone(),
                from: "a".into(),
                to: "b".into(),
            },
            Action::CopyPrefixToPool {
                blocks: blocks.clone(),
                from: "a".into(),
            },
            Action::PersistPrefix {
                blocks,
                worker: "a".into(),
            },
            Action::DrainWorker { worker: "a".into() },
            Action::RetainSpill {
                worker: "a".into(),
                to: Tier::Pool,
            },
            Action::ScaleHint(ScaleHint {
                group: "g".into(),
                current: 1,
                recommended: 2,
                signal: "load".into(),
                value: 3.0,
            }),
        ];
        let mut kinds: Vec<_> = all.iter().map(Action::kind).collect();
        kinds.sort_unstable();
        kinds.dedup();
        assert_eq!(kinds.len(), all.len());
        let json = serde_json::to_value(&all[6]).expect("serialisable");
        assert_eq!(json["action"], "scale-hint");
        assert_eq!(json["recommended"], 2);
    }
}
