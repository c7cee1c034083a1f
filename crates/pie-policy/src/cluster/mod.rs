//! The cluster-plane policy interface: `[cluster] cluster_policies` is an ordered
//! pipeline. Each policy sees the candidate workers left by the ones before it;
//! filters narrow the list (pin, session-affinity), scorers reorder it best first
//! (cache-aware, least-loaded, round-robin). The request goes to the first
//! candidate; the last policy that decided names the reason, and a filter that
//! leaves a single worker ends the pipeline.
//!
//! Actors (`actions.rs`) share the same `cluster_policies` list: they are not
//! asked per request but see a [`ClusterSnapshot`] on a tick and return actions,
//! run by an [`ActorRunner`], which also hands them [`ClusterEvent`]s (the
//! fleet's from [`health_events`]). [`split_policies`] sorts a list into the two.

mod actions;
mod cache_aware;
mod disaggregate;
mod drain_migrate;
mod events;
#[cfg(test)]
mod fixtures;
mod heat;
mod index;
mod least_loaded;
mod masks;
mod pending;
mod persist_prefix;
mod pin;
mod pool_replicate;
mod priority;
mod rebalance;
mod replicate;
mod retain_all;
mod round_robin;
mod runner;
mod scale_by_prop;
mod session_affinity;
mod shortlist;

pub use actions::{
    Action, ActionRecord, ClusterActor, ClusterEvent, ClusterSnapshot, Decision, HotPrefix,
    KvPages, ProcessState, ScaleHint, SessionState, Stage, Tier, WorkerState,
};

pub use cache_aware::{CacheAware, CacheAwareConfig};
pub use disaggregate::{Disaggregate, DisaggregateConfig, PrefillPlacement};
pub use drain_migrate::{DrainMigrate, DrainMigrateConfig};
pub use events::{health_events, WorkerHealth};
pub use heat::{HotChain, PrefixHeat, HEAT_CAPACITY, HOT_PREFIXES};
pub use index::{ClusterIndex, PrefixHolder};
pub use least_loaded::LeastLoaded;
pub use pending::PendingBlocks;
pub use persist_prefix::{PersistPrefix, PersistPrefixConfig};
pub use pin::{Pin, PinConfig};
pub use pool_replicate::{PoolReplicate, PoolReplicateConfig};
pub use priority::{PriorityQueue, QueueOrder, DEFAULT_MAX_QUEUED};
pub use rebalance::{Rebalance, RebalanceConfig, Signal as RebalanceSignal};
pub use replicate::{Replicate, ReplicateConfig};
pub use retain_all::{RetainAll, RetainAllConfig, SPILLS_IN_FLIGHT};
pub use round_robin::RoundRobin;
pub use runner::ActorRunner;
pub use scale_by_prop::{ScaleByProp, ScaleByPropConfig};
pub use session_affinity::{SessionAffinity, SessionAffinityConfig};
pub use shortlist::{decides_on_shortlist, LoadOrder, SHORTLIST_POLICIES};

use pie_core::Props;

/// The routing policies by their names in `[cluster] cluster_policies`.
pub const ROUTING_POLICIES: &[&str] = &[
    "pin",
    "session-affinity",
    "cache-aware",
    "least-loaded",
    "round-robin",
    "disaggregate",
];

/// The configs of the configurable routing policies (`[cluster.<name>]`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RoutingConfigs {
    pub pin: PinConfig,
    pub session_affinity: SessionAffinityConfig,
    pub cache_aware: CacheAwareConfig,
    pub disaggregate: DisaggregateConfig,
}

/// A fresh routing policy by name, as the controller and the simulator build
/// their pipelines; an unknown name is an error listing the known ones.
pub fn routing_policy(
    name: &str,
    configs: &RoutingConfigs,
) -> Result<Box<dyn ClusterPolicy>, String> {
    Ok(match name {
        "pin" => Box::new(Pin::new(configs.pin.clone())),
        "session-affinity" => Box::new(SessionAffinity::new(configs.session_affinity.clone())),
        "cache-aware" => {
            let c = &configs.cache_aware;
            c.validate().map_err(|e| format!("{name}.{e}"))?;
            Box::new(CacheAware::new(c.clone()))
        }
        "least-loaded" => Box::new(LeastLoaded),
        "round-robin" => Box::new(RoundRobin::default()),
        "disaggregate" => Box::new(Disaggregate::new(configs.disaggregate.clone())),
        other => {
            return Err(format!(
                "unknown cluster policy `{other}` (available: {})",
                ROUTING_POLICIES.join(", ")
            ))
        }
    })
}

/// The cluster actors by their names in `[cluster] cluster_policies`.
pub const ACTORS: &[&str] = &[
    "scale-by-prop",
    "rebalance",
    "drain-migrate",
    "persist-prefix",
    "replicate",
    "pool-replicate",
    "retain-all",
];

/// The configs of the actors (`[cluster.<name>]`); each has `dry_run`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ActorConfigs {
    pub scale_by_prop: ScaleByPropConfig,
    pub rebalance: RebalanceConfig,
    pub drain_migrate: DrainMigrateConfig,
    pub persist_prefix: PersistPrefixConfig,
    pub replicate: ReplicateConfig,
    pub pool_replicate: PoolReplicateConfig,
    pub retain_all: RetainAllConfig,
}

impl ActorConfigs {
    /// `[cluster.<name>] dry_run`: record the actor's decisions, execute none.
    pub fn dry_run(&self, name: &str) -> bool {
        match name {
            "scale-by-prop" => self.scale_by_prop.dry_run,
            "rebalance" => self.rebalance.dry_run,
            "drain-migrate" => self.drain_migrate.dry_run,
            "persist-prefix" => self.persist_prefix.dry_run,
            "replicate" => self.replicate.dry_run,
            "pool-replicate" => self.pool_replicate.dry_run,
            "retain-all" => self.retain_all.dry_run,
            _ => false,
        }
    }
}

/// A fresh actor by name, its config validated; errors name the actor and key.
pub fn actor(name: &str, configs: &ActorConfigs) -> Result<Box<dyn ClusterActor>, String> {
    match name {
        "scale-by-prop" => {
            let c = &configs.scale_by_prop;
            c.validate().map_err(|e| format!("{name}.{e}"))?;
            Ok(Box::new(ScaleByProp::new(c.clone())))
        }
        "rebalance" => {
            let c = &configs.rebalance;
            c.validate().map_err(|e| format!("{name}.{e}"))?;
            Ok(Box::new(Rebalance::new(c.clone())))
        }
        "drain-migrate" => {
            let c = &configs.drain_migrate;
            c.validate().map_err(|e| format!("{name}.{e}"))?;
            Ok(Box::new(DrainMigrate::new(c.clone())))
        }
        "persist-prefix" => {
            let c = &configs.persist_prefix;
            c.validate().map_err(|e| format!("{name}.{e}"))?;
            Ok(Box::new(PersistPrefix::new(c.clone())))
        }
        "replicate" => {
            let c = &configs.replicate;
            c.validate().map_err(|e| format!("{name}.{e}"))?;
            Ok(Box::new(Replicate::new(c.clone())))
        }
        "pool-replicate" => {
            let c = &configs.pool_replicate;
            c.validate().map_err(|e| format!("{name}.{e}"))?;
            Ok(Box::new(PoolReplicate::new(c.clone())))
        }
        "retain-all" => {
            let c = &configs.retain_all;
            c.validate().map_err(|e| format!("{name}.{e}"))?;
            Ok(Box::new(RetainAll::new(c.clone())))
        }
        other => Err(format!(
            "unknown cluster actor `{other}` (available: {})",
            ACTORS.join(", ")
        )),
    }
}

/// `cluster_policies` split into routing policies and actors, each in its
/// order; an unknown name is an error listing both sets.
pub fn split_policies(names: &[String]) -> Result<(Vec<&str>, Vec<&str>), String> {
    let (mut routing, mut actors) = (Vec::new(), Vec::new());
    for name in names {
        if ROUTING_POLICIES.contains(&name.as_str()) {
            routing.push(name.as_str());
        } else if ACTORS.contains(&name.as_str()) {
            actors.push(name.as_str());
        } else {
            return Err(format!(
                "unknown cluster policy `{name}` (routing: {}; actors: {})",
                ROUTING_POLICIES.join(", "),
                ACTORS.join(", ")
            ));
        }
    }
    Ok((routing, actors))
}

/// What a cluster policy knows of one worker.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WorkerView {
    pub name: String,
    /// Processes queued or running on it.
    pub load: usize,
    /// Prompt tokens of this request already in its prefix cache.
    pub cached_prefix_tokens: usize,
    /// Prompt tokens in its prefix cache or on their way there (routed to it,
    /// not yet confirmed: see `PendingBlocks`); at least `cached_prefix_tokens`
    /// where the observer anticipates, 0 where it does not.
    pub anticipated_prefix_tokens: usize,
    /// Prefill-stage workers only prefill for others (`disaggregate`).
    pub stage: Stage,
    /// Its running-slot limit; 0 when unknown.
    pub max_running: usize,
    /// Prompt tokens it would pull from the shared page pool (its `[runtime]
    /// pool`) instead of computing; 0 without a pool or when unknown.
    pub pool_prefix_tokens: usize,
}

/// What a cluster policy knows of one request.
#[derive(Clone, Debug)]
pub struct RouteRequest<'a> {
    pub props: &'a Props,
    pub prompt_tokens: usize,
}

/// A refusal: HTTP status and message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reject {
    pub status: u16,
    pub message: String,
}

/// One step of the routing pipeline. `candidates` index into `workers` (healthy
/// workers only); a policy may remove or reorder them. Returns the reason when it
/// decided the outcome, None when it left it to the others.
pub trait ClusterPolicy: Send {
    fn name(&self) -> &'static str;

    fn route(
        &mut self,
        now_ms: u64,
        req: &RouteRequest,
        workers: &[WorkerView],
        candidates: &mut Vec<usize>,
    ) -> Result<Option<String>, Reject>;

    /// Where the prefill of a request routed to `decode` runs (`disaggregate`);
    /// None when this policy does not place prefills.
    fn place_prefill(
        &mut self,
        _now_ms: u64,
        _req: &RouteRequest,
        _workers: &[WorkerView],
        _decode: usize,
    ) -> Option<PrefillPlacement> {
        None
    }

    /// The worker this policy would pick by name for this request, if any
    /// (`pin`'s, the session's): a shortlist must hold it (see `LoadOrder`).
    fn named_worker<'a>(&'a self, _now_ms: u64, _req: &RouteRequest<'a>) -> Option<&'a str> {
        None
    }

    /// The request went to `worker` (session-affinity records it).
    fn routed(&mut self, _now_ms: u64, _req: &RouteRequest, _worker: &str) {}

    /// Sessions this policy maps to workers (for `GET /v1/cluster`).
    fn sessions(&self) -> Option<usize> {
        None
    }
}

/// Run the pipeline; returns the chosen worker's index, the deciding policy and
/// its reason. With no policy deciding, the least-loaded candidate wins. Call
/// [`record`] once the request has been placed.
pub fn route(
    policies: &mut [Box<dyn ClusterPolicy>],
    now_ms: u64,
    req: &RouteRequest,
    workers: &[WorkerView],
) -> Result<(usize, String), Reject> {
    if workers.is_empty() {
        return Err(Reject {
            status: 503,
            message: "no healthy worker".into(),
        });
    }
    // Prefill-stage workers only ever prefill for others.
    let candidates: Vec<usize> = (0..workers.len())
        .filter(|&i| workers[i].stage != Stage::Prefill)
        .collect();
    route_among(policies, now_ms, req, workers, candidates)
}

/// [`route`] over the given candidates (indices of `workers`, none of them
/// prefill-stage) instead of every decode-capable worker: with a shortlist
/// (see [`LoadOrder::shortlist`]) and a pipeline of [`SHORTLIST_POLICIES`], the
/// same decision at a cost that follows the shortlist, not the number of workers.
pub fn route_among(
    policies: &mut [Box<dyn ClusterPolicy>],
    now_ms: u64,
    req: &RouteRequest,
    workers: &[WorkerView],
    mut candidates: Vec<usize>,
) -> Result<(usize, String), Reject> {
    if candidates.is_empty() {
        return Err(Reject {
            status: 503,
            message: "no healthy decode worker (every healthy worker has stage = \"prefill\")"
                .into(),
        });
    }
    let mut decided = None;
    for p in policies.iter_mut() {
        if let Some(reason) = p.route(now_ms, req, workers, &mut candidates)? {
            decided = Some(format!("{}: {reason}", p.name()));
        }
        if candidates.is_empty() {
            return Err(Reject {
                status: 503,
                message: format!("no healthy worker left after `{}`", p.name()),
            });
        }
        // A filter that left one worker has decided; later scorers cannot change it.
        if candidates.len() == 1 && decided.is_some() {
            break;
        }
    }
    let chosen = match decided {
        Some(_) => candidates[0],
        None => *candidates
            .iter()
            .min_by_key(|&&i| (workers[i].load, i))
            .expect("non-empty"),
    };
    let reason = decided.unwrap_or_else(|| {
        format!(
            "default: least loaded ({} processes on {})",
            workers[chosen].load, workers[chosen].name
        )
    });
    Ok((chosen, reason))
}

/// Where the prefill of a request routed to `decode` runs: the first policy
/// that places prefills decides; None when no policy does.
pub fn place_prefill(
    policies: &mut [Box<dyn ClusterPolicy>],
    now_ms: u64,
    req: &RouteRequest,
    workers: &[WorkerView],
    decode: usize,
) -> Option<PrefillPlacement> {
    policies
        .iter_mut()
        .find_map(|p| p.place_prefill(now_ms, req, workers, decode))
}

/// Tell the pipeline where the request actually went (the chosen worker, or the
/// one that took it after a connection failure).
pub fn record(
    policies: &mut [Box<dyn ClusterPolicy>],
    now_ms: u64,
    req: &RouteRequest,
    worker: &str,
) {
    for p in policies.iter_mut() {
        p.routed(now_ms, req, worker);
    }
}

#[cfg(test)]
pub(crate) fn views(loads: &[usize], cached: &[usize]) -> Vec<WorkerView> {
    loads
        .iter()
        .zip(cached)
        .enumerate()
        .map(|(i, (&load, &c))| WorkerView {
            name: format!("w{i}"),
            load,
            cached_prefix_tokens: c,
            ..WorkerView::default()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_known_name_builds_and_an_unknown_one_is_named() {
        for name in ROUTING_POLICIES {
            let p = routing_policy(name, &RoutingConfigs::default()).expect("known");
            assert_eq!(p.name(), *name);
        }
        let err = routing_policy("telepathy", &RoutingConfigs::default()).err();
        assert!(err.is_some_and(|e| e.contains("`telepathy`") && e.contains("cache-aware")));
    }

    #[test]
    fn policies_split_into_routing_and_actors_and_unknown_names_list_both() {
        let names: Vec<String> = ["cache-aware", "scale-by-prop", "pin"]
            .map(String::from)
            .to_vec();
        let (routing, actors) = split_policies(&names).expect("known");
        assert_eq!(
            (routing, actors),
            (vec!["cache-aware", "pin"], vec!["scale-by-prop"])
        );
        let err = split_policies(&["retain-none".to_string()]).unwrap_err();
        assert!(err.contains("`retain-none`") && err.contains("pin") && err.contains("rebalance"));
        let bad = ActorConfigs {
            scale_by_prop: ScaleByPropConfig {
                hysteresis: 2.0,
                ..ScaleByPropConfig::default()
            },
            rebalance: RebalanceConfig {
                low: 0.95,
                dry_run: true,
                ..RebalanceConfig::default()
            },
            drain_migrate: DrainMigrateConfig {
                pending_timeout_ms: 0,
                ..DrainMigrateConfig::default()
            },
            persist_prefix: PersistPrefixConfig {
                min_hits: 1,
                ..PersistPrefixConfig::default()
            },
            replicate: ReplicateConfig {
                max_replicas: 0,
                ..ReplicateConfig::default()
            },
            pool_replicate: PoolReplicateConfig {
                hot_rps: -1.0,
                ..PoolReplicateConfig::default()
            },
            retain_all: RetainAllConfig {
                retry_ms: 0,
                ..RetainAllConfig::default()
            },
        };
        let err = actor("drain-migrate", &bad).err();
        assert!(err.is_some_and(|e| e.starts_with("drain-migrate.pending_timeout_ms")));
        let err = actor("persist-prefix", &bad).err();
        assert!(err.is_some_and(|e| e.starts_with("persist-prefix.min_hits")));
        let err = actor("replicate", &bad).err();
        assert!(err.is_some_and(|e| e.starts_with("replicate.max_replicas")));
        let err = actor("pool-replicate", &bad).err();
        assert!(err.is_some_and(|e| e.starts_with("pool-replicate.hot_rps")));
        let err = actor("retain-all", &bad).err();
        assert!(err.is_some_and(|e| e.starts_with("retain-all.retry_ms")));
        let err = actor("scale-by-prop", &bad).err();
        assert!(err.is_some_and(|e| e.starts_with("scale-by-prop.hysteresis")));
        let err = actor("rebalance", &bad).err();
        assert!(err.is_some_and(|e| e.starts_with("rebalance.low")));
        assert!(bad.dry_run("rebalance") && !bad.dry_run("scale-by-prop"));
        for name in ACTORS {
            let a = actor(name, &ActorConfigs::default()).expect("defaults are valid");
            assert_eq!(a.name(), *name);
        }
    }

    #[test]
    fn no_healthy_worker_is_a_503_for_every_policy() {
        let mut pipeline: Vec<Box<dyn ClusterPolicy>> = ROUTING_POLICIES
            .iter()
            .map(|n| routing_policy(n, &RoutingConfigs::default()).expect("known"))
            .collect();
        let props = Props::new();
        let req = RouteRequest {
            props: &props,
            prompt_tokens: 10,
        };
        let refused = route(&mut pipeline, 0, &req, &[]).unwrap_err();
        assert_eq!(refused.status, 503);
        assert!(refused.message.contains("no healthy worker"));
    }
}
