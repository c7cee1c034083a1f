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
mod factory;
#[cfg(test)]
mod fixtures;
mod heat;
mod index;
mod least_loaded;
mod masks;
mod move_plan;
mod pending;
mod persist_prefix;
mod pin;
mod pipeline;
mod policy;
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
pub use disaggregate::{Disaggregate, DisaggregateConfig};
pub use drain_migrate::{DrainMigrate, DrainMigrateConfig};
pub use events::{health_events, WorkerHealth};
pub use factory::{
    actor, routing_policy, split_policies, ActorConfigs, RoutingConfigs, ACTORS, ROUTING_POLICIES,
};
pub use heat::{HotChain, PrefixHeat, HEAT_CAPACITY, HOT_PREFIXES};
pub use index::{ClusterIndex, PrefixHolder};
pub use least_loaded::LeastLoaded;
pub use move_plan::{MovePlan, MoveStep, Progress, RESTAGE_PAGES};
pub use pending::PendingBlocks;
pub use persist_prefix::{PersistPrefix, PersistPrefixConfig};
pub use pin::{Pin, PinConfig};
pub use pipeline::{place_prefill, record, route, route_among};
pub use policy::{ClusterPolicy, PrefillPlacement, Reject, RouteRequest, WorkerView};
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
    use pie_core::Props;

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
