//! One routing decision as the proxy makes it: every serving worker's view
//! of the prompt (its cached, anticipated and pooled prefix), the routing
//! pipeline, the prefill placement, and the prompt anticipated on the chosen
//! worker. The prompt is hashed (once, for views and anticipation alike) and
//! every worker's held prefix looked up outside any lock; only the
//! anticipated prefixes, the decision and the anticipation happen under the
//! pipeline's lock, so a request routed right after this one sees this one's
//! prefix as pending on its worker.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use pie_policy::cluster::{
    place_prefill, route, ClusterPolicy, PrefillPlacement, Reject, RouteRequest, WorkerView,
};

use crate::proxy::now_ms;
use crate::registry::Registry;

/// The routing pipeline (`[cluster] cluster_policies`, routing half).
pub type Pipeline = Mutex<Vec<Box<dyn ClusterPolicy>>>;

/// The chosen worker (an index into `views`), why, and where its prefill runs.
pub type Choice = (usize, String, Option<PrefillPlacement>);

pub struct Decided {
    /// Serving workers as routing saw them, with their URLs.
    pub views: Vec<(WorkerView, String)>,
    pub choice: Result<Choice, Reject>,
    /// Time spent hashing the prompt.
    pub hashing: Duration,
    /// Time spent on the views, in the pipeline and anticipating (the lock's
    /// wait included).
    pub routing: Duration,
}

/// Route `tokens` (under `salt`); `with_free_slot`: only workers with a free
/// running slot, when any has one (cluster-priority).
pub fn decide(
    registry: &Registry,
    pipeline: &Pipeline,
    req: &RouteRequest,
    tokens: &[u32],
    salt: Option<&str>,
    with_free_slot: bool,
) -> Decided {
    let hash_started = Instant::now();
    let chains = registry.chains(tokens, salt);
    let route_started = Instant::now();
    let mut views = registry.held_views(&chains, with_free_slot);
    let choice = {
        let mut policies = pipeline.lock().unwrap_or_else(|e| e.into_inner());
        registry.add_pending(&chains, &mut views);
        let workers = &views.workers;
        route(&mut policies, now_ms(), req, workers).map(|(chosen, reason)| {
            let placement = place_prefill(&mut policies, now_ms(), req, workers, chosen);
            registry.anticipate(&workers[chosen].name, &chains);
            (chosen, reason, placement)
        })
    };
    Decided {
        views: views.workers.into_iter().zip(views.urls).collect(),
        choice,
        hashing: route_started - hash_started,
        routing: route_started.elapsed(),
    }
}
