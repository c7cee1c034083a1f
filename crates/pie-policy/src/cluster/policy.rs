//! What a routing policy is: [`ClusterPolicy`], what it sees of a worker
//! ([`WorkerView`]) and of a request ([`RouteRequest`]), and a refusal
//! ([`Reject`]).

use pie_core::Props;

use super::actions::Stage;

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

/// Where a request's prefill runs, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PrefillPlacement {
    /// On the decode worker itself.
    Local(String),
    /// On `worker` (an index into the views); the decode worker pulls its pages.
    Remote { worker: usize, reason: String },
}

impl PrefillPlacement {
    pub fn reason(&self) -> &str {
        match self {
            Self::Local(reason) | Self::Remote { reason, .. } => reason,
        }
    }

    pub fn remote_worker(&self) -> Option<usize> {
        match self {
            Self::Local(_) => None,
            Self::Remote { worker, .. } => Some(*worker),
        }
    }
}
