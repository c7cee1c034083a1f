//! One routing decision as the proxy makes it: every serving worker's view
//! of the prompt (its cached, anticipated and pooled prefix), the routing
//! pipeline, the prefill placement, and the prompt anticipated on the chosen
//! worker. The views, the decision and the anticipation happen under the
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
    /// Time spent hashing the prompt and looking up its prefix.
    pub hashing: Duration,
    /// Time spent in the pipeline (and anticipating), after hashing.
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
    let mut policies = pipeline.lock().unwrap_or_else(|e| e.into_inner());
    let hash_started = Instant::now();
    let views = registry.views(tokens, salt, with_free_slot);
    let route_started = Instant::now();
    let worker_views: Vec<_> = views.iter().map(|(v, _)| v.clone()).collect();
    let choice = route(&mut policies, now_ms(), req, &worker_views).map(|(chosen, reason)| {
        let placement = place_prefill(&mut policies, now_ms(), req, &worker_views, chosen);
        registry.anticipate(&worker_views[chosen].name, tokens, salt);
        (chosen, reason, placement)
    });
    Decided {
        views,
        choice,
        hashing: route_started - hash_started,
        routing: route_started.elapsed(),
    }
}
