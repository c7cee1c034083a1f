//! `disaggregate`: run a long prompt's prefill on a prefill-stage worker and
//! let the decode worker pull its KV pages, so long prefills stop sharing the
//! decode workers' steps.
//!
//! Rule: the rest of the pipeline picks the decode worker (prefill-stage workers
//! are never candidates for it). Then, as NVIDIA Dynamo's conditional
//! disaggregation: the prefill goes remote only when the prompt's part not
//! cached on the decode worker is at least `min_remote_prefill_tokens` and some
//! prefill-stage worker is not saturated (its load, queued + running, below
//! `max_prefill_load`, or below its `max_running` when that is 0);
//! among those, the one chosen is what `cache-aware` would choose (its longest
//! cached prefix, load balanced). Otherwise the prefill stays on the decode
//! worker. Props read: none. Config keys: `[cluster.disaggregate]
//! min_remote_prefill_tokens` (default 512), `max_prefill_load` (default 0:
//! the worker's `max_running`). Invariant (tested): a remote
//! prefill is only ever placed on a prefill-stage worker that is not saturated
//! and never for fewer uncached tokens than the threshold; a decode worker is
//! never a prefill-stage worker.

use serde::{Deserialize, Serialize};

use super::{CacheAware, ClusterPolicy, PrefillPlacement, Reject, RouteRequest, Stage, WorkerView};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DisaggregateConfig {
    /// Uncached prompt tokens below which prefill stays on the decode worker.
    pub min_remote_prefill_tokens: usize,
    /// Processes (queued + running) at which a prefill worker counts as
    /// saturated; 0: its `max_running`.
    pub max_prefill_load: usize,
}

impl Default for DisaggregateConfig {
    fn default() -> Self {
        Self {
            min_remote_prefill_tokens: 512,
            max_prefill_load: 0,
        }
    }
}

#[derive(Debug, Default)]
pub struct Disaggregate {
    config: DisaggregateConfig,
    /// Chooses among the prefill workers as cache-aware chooses among all.
    prefill_choice: CacheAware,
}

impl Disaggregate {
    pub fn new(config: DisaggregateConfig) -> Self {
        Self {
            config,
            prefill_choice: CacheAware::default(),
        }
    }
}

impl DisaggregateConfig {
    fn saturated(&self, w: &WorkerView) -> bool {
        let limit = match self.max_prefill_load {
            0 => w.max_running,
            n => n,
        };
        limit > 0 && w.load >= limit
    }
}

impl ClusterPolicy for Disaggregate {
    fn name(&self) -> &'static str {
        "disaggregate"
    }

    /// The decode worker is the other policies' choice.
    fn route(
        &mut self,
        _now_ms: u64,
        _req: &RouteRequest,
        _workers: &[WorkerView],
        _candidates: &mut Vec<usize>,
    ) -> Result<Option<String>, Reject> {
        Ok(None)
    }

    fn place_prefill(
        &mut self,
        now_ms: u64,
        req: &RouteRequest,
        workers: &[WorkerView],
        decode: usize,
    ) -> Option<PrefillPlacement> {
        let decoder = &workers[decode].name;
        let uncached = req
            .prompt_tokens
            .saturating_sub(workers[decode].cached_prefix_tokens);
        let min = self.config.min_remote_prefill_tokens;
        if uncached < min {
            return Some(PrefillPlacement::Local(format!(
                "prefill stays on {decoder} ({uncached} uncached tokens < {min})"
            )));
        }
        let mut prefillers: Vec<usize> = (0..workers.len())
            .filter(|&i| workers[i].stage == Stage::Prefill)
            .collect();
        if prefillers.is_empty() {
            return Some(PrefillPlacement::Local(format!(
                "prefill stays on {decoder} (no prefill worker)"
            )));
        }
        prefillers.retain(|&i| !self.config.saturated(&workers[i]));
        if prefillers.is_empty() {
            return Some(PrefillPlacement::Local(format!(
                "prefill stays on {decoder} (prefill workers saturated)"
            )));
        }
        // Cache-aware always decides over a non-empty list and never refuses.
        let _ = self
            .prefill_choice
            .route(now_ms, req, workers, &mut prefillers);
        let worker = prefillers[0];
        Some(PrefillPlacement::Remote {
            worker,
            reason: format!(
                "prefill on {} ({uncached} uncached tokens), decode on {decoder}",
                workers[worker].name
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::{place_prefill, route, views};
    use pie_core::Props;

    fn staged(loads: &[usize], cached: &[usize], stages: &[Stage]) -> Vec<WorkerView> {
        let mut w = views(loads, cached);
        for (view, &stage) in w.iter_mut().zip(stages) {
            view.stage = stage;
            view.max_running = 4;
        }
        w
    }

    fn place(workers: &[WorkerView], prompt_tokens: usize) -> (usize, PrefillPlacement) {
        let mut pipeline: Vec<Box<dyn ClusterPolicy>> = vec![
            Box::new(Disaggregate::default()),
            Box::new(CacheAware::default()),
        ];
        let props = Props::new();
        let req = RouteRequest {
            props: &props,
            prompt_tokens,
        };
        let (decode, _) = route(&mut pipeline, 0, &req, workers).expect("routed");
        let placement = place_prefill(&mut pipeline, 0, &req, workers, decode).expect("decided");
        (decode, placement)
    }

    const P: Stage = Stage::Prefill;
    const D: Stage = Stage::Decode;

    #[test]
    fn long_uncached_prompts_prefill_on_the_best_prefill_worker() {
        // w0, w1 prefill (w1 holds 512 tokens of the prompt), w2 decode.
        let w = staged(&[0, 1, 0], &[0, 512, 0], &[P, P, D]);
        let (decode, placement) = place(&w, 2000);
        assert_eq!(decode, 2, "a prefill worker never decodes");
        assert_eq!(
            placement,
            PrefillPlacement::Remote {
                worker: 1,
                reason: "prefill on w1 (2000 uncached tokens), decode on w2".into()
            }
        );
    }

    #[test]
    fn short_uncached_part_saturation_and_no_prefill_worker_keep_it_local() {
        let w = staged(&[0, 0], &[0, 1700], &[P, D]);
        let (_, placement) = place(&w, 2000);
        assert_eq!(
            placement,
            PrefillPlacement::Local("prefill stays on w1 (300 uncached tokens < 512)".into())
        );
        let w = staged(&[4, 0], &[0, 0], &[P, D]);
        assert_eq!(
            place(&w, 2000).1.reason(),
            "prefill stays on w1 (prefill workers saturated)"
        );
        let mut tight = Disaggregate::new(DisaggregateConfig {
            max_prefill_load: 2,
            ..DisaggregateConfig::default()
        });
        let w = staged(&[2, 0], &[0, 0], &[P, D]);
        let props = Props::new();
        let req = RouteRequest {
            props: &props,
            prompt_tokens: 2000,
        };
        assert_eq!(
            tight.place_prefill(0, &req, &w, 1).unwrap().reason(),
            "prefill stays on w1 (prefill workers saturated)",
            "max_prefill_load 2 is below the worker's max_running 4"
        );
        let w = staged(&[0, 0], &[0, 0], &[D, Stage::Both]);
        assert_eq!(
            place(&w, 2000).1.reason(),
            "prefill stays on w0 (no prefill worker)"
        );
    }

    #[test]
    fn only_prefill_workers_is_a_503() {
        let w = staged(&[0, 0], &[0, 0], &[P, P]);
        let mut pipeline: Vec<Box<dyn ClusterPolicy>> = vec![Box::new(Disaggregate::default())];
        let props = Props::new();
        let req = RouteRequest {
            props: &props,
            prompt_tokens: 10,
        };
        let refused = route(&mut pipeline, 0, &req, &w).unwrap_err();
        assert_eq!(refused.status, 503);
        assert!(refused.message.contains("decode"), "{}", refused.message);
    }
}
