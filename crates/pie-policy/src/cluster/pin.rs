//! `pin`: the `pin` prop names the worker.
//!
//! Rule: a request with `pin` goes to that worker. If it is unknown or unhealthy
//! the request is refused with 503 naming it, or (with `strict = false`) the pin is
//! ignored. Props read: `pin` (string). Config keys: `[cluster.pin] strict`
//! (default true). Invariant (tested): a pinned request never lands elsewhere
//! while strict.

use serde::{Deserialize, Serialize};

use super::{ClusterPolicy, Reject, RouteRequest, WorkerView};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PinConfig {
    pub strict: bool,
}

impl Default for PinConfig {
    fn default() -> Self {
        Self { strict: true }
    }
}

#[derive(Debug, Default)]
pub struct Pin {
    config: PinConfig,
}

impl Pin {
    pub fn new(config: PinConfig) -> Self {
        Self { config }
    }
}

impl ClusterPolicy for Pin {
    fn name(&self) -> &'static str {
        "pin"
    }

    fn named_worker<'a>(&'a self, _now_ms: u64, req: &RouteRequest<'a>) -> Option<&'a str> {
        req.props.str("pin")
    }

    fn route(
        &mut self,
        _now_ms: u64,
        req: &RouteRequest,
        workers: &[WorkerView],
        candidates: &mut Vec<usize>,
    ) -> Result<Option<String>, Reject> {
        let Some(name) = req.props.str("pin") else {
            return Ok(None);
        };
        match candidates.iter().position(|&i| workers[i].name == name) {
            Some(pos) => {
                *candidates = vec![candidates[pos]];
                Ok(Some(format!("pinned to {name}")))
            }
            None if self.config.strict => Err(Reject {
                status: 503,
                message: format!("pinned worker `{name}` is unknown or unhealthy"),
            }),
            None => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::views;
    use pie_core::{PropValue, Props};

    #[test]
    fn pins_or_refuses() {
        let w = views(&[0, 0], &[0, 0]);
        let mut props = Props::new();
        props.set("pin", PropValue::Str("w1".into())).unwrap();
        let req = RouteRequest {
            props: &props,
            prompt_tokens: 1,
        };
        let mut c = vec![0, 1];
        assert_eq!(
            Pin::default().route(0, &req, &w, &mut c).unwrap(),
            Some("pinned to w1".into())
        );
        assert_eq!(c, vec![1]);
        let mut c = vec![0];
        assert_eq!(
            Pin::default()
                .route(0, &req, &w, &mut c)
                .unwrap_err()
                .status,
            503
        );
        let mut c = vec![0];
        assert_eq!(
            Pin::new(PinConfig { strict: false })
                .route(0, &req, &w, &mut c)
                .unwrap(),
            None
        );
        assert_eq!(c, vec![0]);
    }
}
