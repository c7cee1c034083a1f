//! Routing decisions, one entry point ([`decide`]) for a request's first
//! placement and for a stream or process that resumes elsewhere
//! ([`resume_target`]): every serving worker's view of the prompt (its cached,
//! anticipated and pooled prefix), the routing pipeline, the prefill placement
//! (first placements only), and the prompt anticipated on the chosen worker.
//! The prompt is hashed (once, for views and anticipation alike) and every
//! worker's held prefix looked up outside any lock; only the anticipated
//! prefixes, the decision and the anticipation happen under the pipeline's
//! lock, so a request routed right after this one sees this one's prefix as
//! pending on its worker.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use pie_core::clock::now_ms;
use pie_core::Props;
use pie_policy::cluster::{
    place_prefill, route, ClusterPolicy, PrefillPlacement, Reject, RouteRequest, Stage, WorkerView,
};

use crate::registry::Registry;

pub type Pipeline = Mutex<Vec<Box<dyn ClusterPolicy>>>;

/// The chosen view's index, why, and where its prefill runs.
pub type Choice = (usize, String, Option<PrefillPlacement>);

/// What one decision is asked.
pub struct Ask<'a> {
    pub req: &'a RouteRequest<'a>,
    /// The prompt's tokens (for a resume: prompt and output so far).
    pub tokens: &'a [u32],
    /// The client's cache salt (its blocks hash apart from other clients').
    pub salt: Option<&'a str>,
    /// Only workers with a free running slot, while any has one
    /// (`cluster-priority`).
    pub with_free_slot: bool,
    /// Workers not to choose (a resume's tried ones).
    pub exclude: &'a [String],
    /// A first placement also places its prefill (`disaggregate`); a resume
    /// continues where its prefill is done.
    pub place_prefill: bool,
}

pub struct Decided {
    pub views: Vec<(WorkerView, String)>,
    pub choice: Result<Choice, Reject>,
    pub hashing: Duration,
    pub routing: Duration,
}

/// Route `ask` through the pipeline.
pub fn decide(registry: &Registry, pipeline: &Pipeline, ask: &Ask) -> Decided {
    let hash_started = Instant::now();
    let chains = registry.chains(ask.tokens, ask.salt);
    let route_started = Instant::now();
    let mut views = registry.held_views(&chains, ask.with_free_slot);
    if !ask.exclude.is_empty() {
        views.retain(|w| !ask.exclude.contains(&w.name));
    }
    let choice = {
        let mut policies = pipeline.lock().unwrap_or_else(|e| e.into_inner());
        registry.add_pending(&chains, &mut views);
        let workers = &views.workers;
        route(&mut policies, now_ms(), ask.req, workers).map(|(chosen, reason)| {
            let placement = ask
                .place_prefill
                .then(|| place_prefill(&mut policies, now_ms(), ask.req, workers, chosen))
                .flatten();
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

/// A serving worker for a process of `tokens` (prompt and output so far)
/// that resumes elsewhere, not one of `exclude`: the pipeline's choice
/// (cache-aware finds the pages, session-affinity the session), else the
/// least loaded. Its name and URL.
pub fn resume_target(
    registry: &Registry,
    pipeline: &Pipeline,
    tokens: &[u32],
    props: &Props,
    salt: Option<&str>,
    exclude: &[String],
) -> Option<(String, String)> {
    let req = RouteRequest {
        props,
        prompt_tokens: tokens.len(),
    };
    let ask = Ask {
        req: &req,
        tokens,
        salt,
        with_free_slot: false,
        exclude,
        place_prefill: false,
    };
    let Decided { views, choice, .. } = decide(registry, pipeline, &ask);
    let chosen = match choice {
        Ok((i, _, _)) => i,
        Err(_) => (0..views.len())
            .filter(|&i| views[i].0.stage != Stage::Prefill)
            .min_by_key(|&i| views[i].0.load)?,
    };
    let (view, url) = &views[chosen];
    Some((view.name.clone(), url.clone()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::RegisterLimits;
    use pie_policy::cluster::CacheAware;

    const PAGE: usize = 16;

    fn registry(workers: usize) -> Registry {
        let r = Registry::default();
        r.set_anticipate_ms(60_000);
        let limits = RegisterLimits {
            max_registered: workers,
            may_rebind: true,
        };
        for i in 0..workers {
            let name = format!("w{i}");
            let url = format!("http://127.0.0.1:{}", 9000 + i);
            r.register(&name, &url, None, None, limits).expect("room");
            r.update(&name, |w| {
                w.healthy = true;
                w.fingerprint = 42;
                w.page_size = PAGE;
                w.max_running = 8;
            });
        }
        r
    }

    fn cache_aware() -> Pipeline {
        Mutex::new(vec![Box::new(CacheAware::new(Default::default()))])
    }

    /// A resume goes through the one entry point: it skips the workers
    /// tried, and its tokens are anticipated on its target as a first
    /// placement's are, so the next decision sees them there.
    #[test]
    fn a_resume_is_anticipated_on_its_target_and_skips_the_tried() {
        let (r, pipeline) = (registry(2), cache_aware());
        // Four full pages before the last token (whose page the worker computes).
        let tokens: Vec<u32> = (0..4 * PAGE as u32 + 1).collect();
        let props = Props::new();
        let tried = ["w0".to_string()];
        let (name, url) =
            resume_target(&r, &pipeline, &tokens, &props, None, &tried).expect("w1 is left");
        assert_eq!(
            (name.as_str(), url.as_str()),
            ("w1", "http://127.0.0.1:9001")
        );
        assert_eq!(
            r.pending_blocks(),
            4,
            "the resumed blocks are pending on w1"
        );
        let (again, _) =
            resume_target(&r, &pipeline, &tokens, &props, None, &[]).expect("a worker");
        assert_eq!(again, "w1", "cache-aware follows the anticipated prefix");
        let everyone = ["w0".to_string(), "w1".to_string()];
        assert_eq!(
            resume_target(&r, &pipeline, &tokens, &props, None, &everyone),
            None
        );
    }
}
