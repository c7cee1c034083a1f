//! The cluster policies by their names in `[cluster] cluster_policies`: the
//! routing policies and the actors, built from their config sections.

use super::actions::ClusterActor;
use super::cache_aware::{CacheAware, CacheAwareConfig};
use super::disaggregate::{Disaggregate, DisaggregateConfig};
use super::drain_migrate::{DrainMigrate, DrainMigrateConfig};
use super::least_loaded::LeastLoaded;
use super::persist_prefix::{PersistPrefix, PersistPrefixConfig};
use super::pin::{Pin, PinConfig};
use super::policy::ClusterPolicy;
use super::pool_replicate::{PoolReplicate, PoolReplicateConfig};
use super::rebalance::{Rebalance, RebalanceConfig};
use super::replicate::{Replicate, ReplicateConfig};
use super::retain_all::{RetainAll, RetainAllConfig};
use super::round_robin::RoundRobin;
use super::scale_by_prop::{ScaleByProp, ScaleByPropConfig};
use super::session_affinity::{SessionAffinity, SessionAffinityConfig};

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
