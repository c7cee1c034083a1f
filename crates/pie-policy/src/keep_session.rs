//! `keep-session`: keep a finished process's KV pages for a follow-up turn.
//!
//! Rule: when a process with a `session` prop finishes, its context's pages stay
//! resident (unevictable) for `keep-ms` (its prop, else `default_keep_ms`), keyed
//! by the session; a newer turn of the same session replaces the retention
//! (a turn whose `keep-ms` is 0 ends it: a client's last turn frees the
//! conversation's pages at once, as an inferlet's process does when it ends).
//! That turn shares the whole pages and copies the slots of the partial one
//! it continues (`KvAccounting::attach_prefix`), so it computes only what is new.
//! Running work always wins over retained pages (they are dropped, soonest
//! expiry first, before any running sequence is preempted), and retained pages
//! win over plain cached pages (LRU eviction never takes them). A sequence not
//! yet running wins over them too, unless `admission_wait_ms`: then, while any
//! sequence runs, it waits for pages instead, for up to that long after it
//! arrived (the bound keeps a stream of small arrivals from starving it). That
//! keeps an agent's context through its tool call when the pool cannot hold
//! every agent's: the agents whose contexts are held go on, and the others
//! start as pages come free, instead of evicting each other's contexts and
//! computing them again. Expired retention falls back to the ordinary LRU cache.
//! Retention is keyed by the client and the session together
//! ([`retention_key`]): two tenants naming the same session never touch each
//! other's retained pages.
//! Props read: `session` (string), `keep-ms` (int). Config keys:
//! `[runtime.keep-session] default_keep_ms` (unset: only processes with `keep-ms`),
//! `admission_wait_ms` (0: a new sequence never waits).
//! Invariant (tested): retention only with a session and a positive keep time,
//! under a key no other client's session maps to; the
//! prop overrides the default; expiry is finish time plus keep time; a turn
//! that keeps nothing ends its session's retention; with
//! `admission_wait_ms`, a new sequence drops a retention only when nothing runs
//! or its wait is over, and every sequence still finishes (`scheduler/tests.rs`).

use pie_core::Props;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KeepSessionConfig {
    pub default_keep_ms: Option<u64>,
    /// How long after it arrived a sequence not yet running waits for pages
    /// rather than drop a retention while any sequence runs (0: it never
    /// waits).
    pub admission_wait_ms: u64,
}

#[derive(Clone, Debug, Default)]
pub struct KeepSession {
    config: KeepSessionConfig,
}

/// Pages to keep: for which session, until when.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Retention {
    pub session: String,
    pub expires_ms: u64,
}

/// The key `client`'s session `session` is retained under (by the engine,
/// the simulator and a worker's chat sessions): the client's name is
/// length-prefixed, so no two (client, session) pairs share a key.
pub fn retention_key(client: &str, session: &str) -> String {
    format!("{}:{client}{session}", client.len())
}

/// The client and the session of a [`retention_key`].
pub fn split_retention_key(key: &str) -> Option<(&str, &str)> {
    let (len, rest) = key.split_once(':')?;
    let len: usize = len.parse().ok()?;
    (rest.is_char_boundary(len) && len <= rest.len()).then(|| rest.split_at(len))
}

/// The key of the session `props` name, for the client their `client` prop
/// names (what a controller's routing sees: it sets `client` from the key).
pub fn tenant_session(props: &Props) -> Option<String> {
    session_of(props.str("client").unwrap_or_default(), props)
}

/// The retention key of a sequence of `client` with `props`, if it names a
/// session.
pub fn session_of(client: &str, props: &Props) -> Option<String> {
    props.str("session").map(|s| retention_key(client, s))
}

impl KeepSession {
    pub fn new(config: KeepSessionConfig) -> Self {
        Self { config }
    }

    /// How long a sequence not yet running may wait for retained pages
    /// while any sequence runs (0: not at all).
    pub fn admission_wait_ms(&self) -> u64 {
        self.config.admission_wait_ms
    }

    /// Whether a process of `client` finishing at `now_ms` with `props`
    /// keeps its pages.
    pub fn retention(&self, client: &str, props: &Props, now_ms: u64) -> Option<Retention> {
        let session = session_of(client, props)?;
        let keep = props
            .int("keep-ms")
            .map(|k| k.max(0) as u64)
            .or(self.config.default_keep_ms)?;
        (keep > 0).then(|| Retention {
            session,
            expires_ms: now_ms.saturating_add(keep),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pie_core::PropValue;

    fn props(pairs: &[(&str, PropValue)]) -> Props {
        let mut p = Props::new();
        for (k, v) in pairs {
            p.set(k, v.clone()).unwrap();
        }
        p
    }

    #[test]
    fn no_two_clients_sessions_share_a_key() {
        assert_ne!(retention_key("a/b", "c"), retention_key("a", "b/c"));
        assert_ne!(retention_key("1:a", "b"), retention_key("1", ":ab"));
        assert_ne!(retention_key("alice", "s"), retention_key("bob", "s"));
        assert_eq!(retention_key("alice", "s"), retention_key("alice", "s"));
        let key = retention_key("a:b", "c:d");
        assert_eq!(split_retention_key(&key), Some(("a:b", "c:d")));
        assert_eq!(split_retention_key("x"), None);
    }

    #[test]
    fn retention_rules() {
        let none = KeepSession::default();
        let dflt = KeepSession::new(KeepSessionConfig {
            default_keep_ms: Some(500),
            ..Default::default()
        });
        let s = ("session", PropValue::Str("s".into()));
        assert_eq!(
            none.retention("c", &props(std::slice::from_ref(&s)), 10),
            None,
            "no keep time"
        );
        assert_eq!(
            dflt.retention("c", &props(std::slice::from_ref(&s)), 10),
            Some(Retention {
                session: retention_key("c", "s"),
                expires_ms: 510
            })
        );
        assert_eq!(
            dflt.retention("c", &props(&[("keep-ms", PropValue::Int(5))]), 10),
            None,
            "no session"
        );
        let p = props(&[s.clone(), ("keep-ms", PropValue::Int(100))]);
        assert_eq!(
            dflt.retention("c", &p, 10).unwrap().expires_ms,
            110,
            "the prop overrides the default"
        );
        assert_eq!(
            dflt.retention("c", &props(&[s, ("keep-ms", PropValue::Int(0))]), 10),
            None
        );
    }
}
