//! One live move of a placed request (a drain, a relocation, a rebalance, a
//! patched `pin`), driven by `pie_policy::cluster::MovePlan`, the plan the
//! simulator drives too. A copy stage here is the target's prefetch of the
//! pages the source holds of the tokens so far (the target pulls only what it
//! lacks); the hand-off is asked of the source. The relay and the native
//! follower both hold one while a move is under way.
//!
//! Invariant: a move that fails before its hand-off is counted failed and
//! leaves the process where it was.

use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use pie_policy::cluster::{MovePlan, MoveStep, Progress};
use serde_json::json;

use crate::placed::{count_move_failure, Placed};
use crate::streams::{Move, Reason};

/// What the mover does after the plan was consulted.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Next {
    /// Keep relaying; a stage may be under way.
    Wait,
    /// Ask the source to hand the process off now.
    HandOff,
}

pub(crate) struct LiveMove {
    pub reason: Reason,
    /// The worker it goes to.
    pub target: String,
    target_url: String,
    plan: MovePlan,
    /// The copy stage under way, if one is.
    stage: Option<BoxFuture<'static, Result<(), String>>>,
}

impl LiveMove {
    /// Start move `m` of `placed`, whose source holds the KV of `tokens`
    /// (None: the controller does not know the worker's tokens). None when
    /// there is nowhere to go (counted failed).
    pub fn begin(placed: &Placed, m: Move, tokens: Option<&[u32]>) -> Option<(Self, Next)> {
        let target_url = placed.move_target(&m)?;
        let page_size = placed.ctl.registry.page_size_of(&placed.worker);
        let mut live = LiveMove {
            reason: m.reason,
            target: m.to,
            target_url,
            plan: MovePlan::new(page_size),
            stage: None,
        };
        let step = live.plan.start(tokens.map(progress));
        let next = live.take(placed, step, tokens.unwrap_or_default());
        Some((live, next))
    }

    /// After a stage ended well or a token arrived (`tokens`: the prompt and
    /// every token so far): the plan's next step, taken. Nothing while a
    /// stage is under way.
    pub fn advance(&mut self, placed: &Placed, tokens: &[u32]) -> Next {
        if self.stage.is_some() {
            return Next::Wait;
        }
        let step = self.plan.next(progress(tokens));
        self.take(placed, step, tokens)
    }

    /// The stage under way, or never (for a `select!`).
    pub async fn staged(live: &mut Option<LiveMove>) -> Result<(), String> {
        match live.as_mut().and_then(|m| m.stage.as_mut()) {
            Some(f) => {
                let result = f.await;
                if let Some(m) = live.as_mut() {
                    m.stage = None;
                }
                result
            }
            None => std::future::pending().await,
        }
    }

    /// The move failed before its hand-off: the process goes on where it is.
    pub fn abandon(&self, placed: &Placed, error: &str) {
        tracing::warn!(
            worker = placed.worker,
            target = self.target,
            error,
            "move abandoned; the process goes on where it is"
        );
        count_move_failure(&placed.ctl, self.reason);
    }

    fn take(&mut self, placed: &Placed, step: MoveStep, tokens: &[u32]) -> Next {
        match step {
            MoveStep::Copy(_) => {
                self.stage = Some(self.prefetch(placed, tokens));
                Next::Wait
            }
            MoveStep::Await => Next::Wait,
            MoveStep::HandOff => Next::HandOff,
        }
    }

    /// The target pulls the pages the source holds of `tokens`.
    fn prefetch(&self, placed: &Placed, tokens: &[u32]) -> BoxFuture<'static, Result<(), String>> {
        let url = format!("{}/v1/internal/kv/prefetch", self.target_url);
        let body = json!({"from": placed.url, "tokens": tokens});
        placed
            .post(url.clone(), body)
            .map(move |answer| match answer? {
                (status, _) if status.is_success() => Ok(()),
                (status, answer) => Err(format!("{url}: {status} {answer}")),
            })
            .boxed()
    }
}

/// A streamed process's progress: the source's KV holds `tokens` once the
/// step that sampled the last of them fed it back.
fn progress(tokens: &[u32]) -> Progress {
    Progress {
        kv_tokens: tokens.len(),
        running: true,
    }
}
