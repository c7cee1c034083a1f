//! The cluster-plane policy interface: `[cluster] cluster_policies` is an ordered
//! pipeline. Each policy sees the candidate workers left by the ones before it;
//! filters narrow the list (pin, session-affinity), scorers reorder it best first
//! (cache-aware, least-loaded, round-robin). The request goes to the first
//! candidate; the last policy that decided names the reason, and a filter that
//! leaves a single worker ends the pipeline.

mod cache_aware;
mod index;
mod least_loaded;
mod pin;
mod priority;
mod round_robin;
mod session_affinity;

pub use cache_aware::{CacheAware, CacheAwareConfig};
pub use index::ClusterIndex;
pub use least_loaded::LeastLoaded;
pub use pin::{Pin, PinConfig};
pub use priority::{PriorityQueue, DEFAULT_MAX_QUEUED};
pub use round_robin::RoundRobin;
pub use session_affinity::{SessionAffinity, SessionAffinityConfig};

use pie_core::Props;

/// The routing policies by their names in `[cluster] cluster_policies`.
pub const ROUTING_POLICIES: &[&str] = &[
    "pin",
    "session-affinity",
    "cache-aware",
    "least-loaded",
    "round-robin",
];

/// The configs of the configurable routing policies (`[cluster.<name>]`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RoutingConfigs {
    pub pin: PinConfig,
    pub session_affinity: SessionAffinityConfig,
    pub cache_aware: CacheAwareConfig,
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
        "cache-aware" => Box::new(CacheAware::new(configs.cache_aware.clone())),
        "least-loaded" => Box::new(LeastLoaded),
        "round-robin" => Box::new(RoundRobin::default()),
        other => {
            return Err(format!(
                "unknown cluster policy `{other}` (available: {})",
                ROUTING_POLICIES.join(", ")
            ))
        }
    })
}

/// What a cluster policy knows of one worker.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerView {
    pub name: String,
    /// Processes queued or running on it.
    pub load: usize,
    /// Prompt tokens of this request already in its prefix cache.
    pub cached_prefix_tokens: usize,
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
    let mut candidates: Vec<usize> = (0..workers.len()).collect();
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
