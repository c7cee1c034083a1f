//! `session-affinity`: keep a session's turns on one worker.
//!
//! Rule: a request with a `session` prop goes to the worker that served the session
//! last, while that worker is healthy; otherwise the rest of the pipeline picks one
//! and the new mapping is kept. Mappings expire after `ttl_ms` without a request.
//! A session is its client's (`keep_session::tenant_session`): two tenants
//! naming the same session are mapped apart.
//! Props read: `session` (string), `client`. Config keys:
//! `[cluster.session-affinity] ttl_ms` (default 600000). Invariant (tested):
//! consecutive turns share a worker until it leaves the candidates; then the
//! session moves and stays moved; another client's same session never moves it.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use super::{ClusterPolicy, Reject, RouteRequest, WorkerView};
use crate::keep_session::tenant_session;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SessionAffinityConfig {
    pub ttl_ms: u64,
}

impl Default for SessionAffinityConfig {
    fn default() -> Self {
        Self { ttl_ms: 600_000 }
    }
}

#[derive(Debug, Default)]
pub struct SessionAffinity {
    config: SessionAffinityConfig,
    /// session -> (worker name, last use ms)
    sessions: HashMap<String, (String, u64)>,
    /// When expired mappings were last dropped: a sweep is O(sessions), so it
    /// runs at most every `ttl_ms / 4`; lookups check expiry themselves.
    swept_ms: u64,
}

impl SessionAffinity {
    pub fn new(config: SessionAffinityConfig) -> Self {
        Self {
            config,
            sessions: HashMap::new(),
            swept_ms: 0,
        }
    }

    fn sweep(&mut self, now_ms: u64) {
        let ttl = self.config.ttl_ms;
        if now_ms.saturating_sub(self.swept_ms) < ttl / 4 {
            return;
        }
        self.swept_ms = now_ms;
        self.sessions
            .retain(|_, (_, last)| now_ms.saturating_sub(*last) <= ttl);
    }
}

impl ClusterPolicy for SessionAffinity {
    fn name(&self) -> &'static str {
        "session-affinity"
    }

    fn route(
        &mut self,
        now_ms: u64,
        req: &RouteRequest,
        workers: &[WorkerView],
        candidates: &mut Vec<usize>,
    ) -> Result<Option<String>, Reject> {
        self.sweep(now_ms);
        let Some(session) = tenant_session(req.props) else {
            return Ok(None);
        };
        let ttl = self.config.ttl_ms;
        let Some((worker, _)) = self
            .sessions
            .get(&session)
            .filter(|(_, last)| now_ms.saturating_sub(*last) <= ttl)
        else {
            return Ok(None);
        };
        match candidates.iter().position(|&i| workers[i].name == *worker) {
            Some(pos) => {
                let named = req.props.str("session").unwrap_or_default();
                let reason = format!("session {named} stays on {worker}");
                *candidates = vec![candidates[pos]];
                Ok(Some(reason))
            }
            None => Ok(None),
        }
    }

    fn named_worker<'a>(&'a self, now_ms: u64, req: &RouteRequest<'a>) -> Option<&'a str> {
        let (worker, last) = self.sessions.get(&tenant_session(req.props)?)?;
        (now_ms.saturating_sub(*last) <= self.config.ttl_ms).then_some(worker.as_str())
    }

    fn sessions(&self) -> Option<usize> {
        Some(self.sessions.len())
    }

    fn routed(&mut self, now_ms: u64, req: &RouteRequest, worker: &str) {
        if let Some(session) = tenant_session(req.props) {
            self.sessions.insert(session, (worker.to_string(), now_ms));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::{record, route, views, ClusterPolicy, LeastLoaded, WorkerView};
    use pie_core::{PropValue, Props};

    #[test]
    fn turns_stick_then_move_and_expire() {
        let mut props = Props::new();
        props.set("session", PropValue::Str("s".into())).unwrap();
        let req = RouteRequest {
            props: &props,
            prompt_tokens: 1,
        };
        let mut pipeline: Vec<Box<dyn ClusterPolicy>> = vec![
            Box::new(SessionAffinity::new(SessionAffinityConfig { ttl_ms: 100 })),
            Box::new(LeastLoaded),
        ];
        let mut place = |now: u64, req: &RouteRequest, w: &[WorkerView]| {
            let out = route(&mut pipeline, now, req, w);
            if let Ok((i, _)) = &out {
                record(&mut pipeline, now, req, &w[*i].name);
            }
            out
        };
        let (first, _) = place(0, &req, &views(&[0, 5, 5], &[0, 0, 0])).unwrap();
        assert_eq!(first, 0);
        // w0 is now the busiest, but the session stays.
        let (second, why) = place(10, &req, &views(&[9, 0, 0], &[0, 0, 0])).unwrap();
        assert_eq!((second, why.starts_with("session-affinity")), (0, true));
        // w0 gone (only w1, w2 healthy): the session moves and stays moved.
        let two = views(&[0, 0], &[0, 0])
            .into_iter()
            .map(|mut w| {
                w.name = if w.name == "w0" {
                    "w1".into()
                } else {
                    "w2".into()
                };
                w
            })
            .collect::<Vec<_>>();
        let (moved, _) = place(20, &req, &two).unwrap();
        assert_eq!(two[moved].name, "w1");
        let (again, _) = place(30, &req, &views(&[0, 9, 0], &[0, 0, 0])).unwrap();
        assert_eq!(again, 1);
        // After the TTL without requests, the mapping is gone.
        let (after, why) = place(1000, &req, &views(&[0, 9, 0], &[0, 0, 0])).unwrap();
        assert_eq!((after, why.starts_with("least-loaded")), (0, true));
    }

    /// Alice's session "s" stays on w0 although bob's "s" was routed to w1
    /// since: two tenants' sessions are mapped apart.
    #[test]
    fn another_clients_same_session_never_moves_it() {
        let props_of = |client: &str| {
            let mut p = Props::new();
            p.set("session", PropValue::Str("s".into())).unwrap();
            p.set("client", PropValue::Str(client.into())).unwrap();
            p
        };
        let (alice, bob) = (props_of("alice"), props_of("bob"));
        let mut pipeline: Vec<Box<dyn ClusterPolicy>> =
            vec![Box::new(SessionAffinity::default()), Box::new(LeastLoaded)];
        let mut place = |now: u64, props: &Props, w: &[WorkerView]| {
            let req = RouteRequest {
                props,
                prompt_tokens: 1,
            };
            let (i, _) = route(&mut pipeline, now, &req, w).unwrap();
            record(&mut pipeline, now, &req, &w[i].name);
            i
        };
        assert_eq!(place(0, &alice, &views(&[0, 5], &[0, 0])), 0);
        assert_eq!(place(1, &bob, &views(&[5, 0], &[0, 0])), 1);
        assert_eq!(place(2, &alice, &views(&[9, 0], &[0, 0])), 0, "alice stays");
    }
}
