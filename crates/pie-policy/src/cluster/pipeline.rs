//! The routing pipeline: the policies in order over the candidates
//! ([`route`], [`route_among`] over a shortlist), where a request's prefill
//! runs ([`place_prefill`]), and what each policy remembers of a placement
//! ([`record`]).

use super::actions::Stage;
use super::policy::{ClusterPolicy, PrefillPlacement, Reject, RouteRequest, WorkerView};

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
