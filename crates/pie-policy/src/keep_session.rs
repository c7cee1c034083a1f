//! `keep-session`: keep a finished process's KV pages for a follow-up turn.
//!
//! Rule: when a process with a `session` prop finishes, its context's pages stay
//! resident (unevictable) for `keep-ms` (its prop, else `default_keep_ms`), keyed
//! by the session; a newer turn of the same session replaces the retention. Live
//! work always wins over retained pages (they are dropped, soonest expiry first,
//! before any running sequence is preempted), and retained pages win over plain
//! cached pages (LRU eviction never takes them). Expired retention falls back to
//! the ordinary LRU cache.
//! Props read: `session` (string), `keep-ms` (int). Config keys:
//! `[runtime.keep-session] default_keep_ms` (unset: only processes with `keep-ms`).
//! Invariant (tested): retention only with a session and a positive keep time; the
//! prop overrides the default; expiry is finish time plus keep time.

use pie_core::Props;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KeepSessionConfig {
    pub default_keep_ms: Option<u64>,
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

impl KeepSession {
    pub fn new(config: KeepSessionConfig) -> Self {
        Self { config }
    }

    /// Whether a process finishing at `now_ms` with `props` keeps its pages.
    pub fn retention(&self, props: &Props, now_ms: u64) -> Option<Retention> {
        let session = props.str("session")?;
        let keep = props
            .int("keep-ms")
            .map(|k| k.max(0) as u64)
            .or(self.config.default_keep_ms)?;
        (keep > 0).then(|| Retention {
            session: session.to_string(),
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
    fn retention_rules() {
        let none = KeepSession::default();
        let dflt = KeepSession::new(KeepSessionConfig {
            default_keep_ms: Some(500),
        });
        let s = ("session", PropValue::Str("s".into()));
        assert_eq!(
            none.retention(&props(std::slice::from_ref(&s)), 10),
            None,
            "no keep time"
        );
        assert_eq!(
            dflt.retention(&props(std::slice::from_ref(&s)), 10),
            Some(Retention {
                session: "s".into(),
                expires_ms: 510
            })
        );
        assert_eq!(
            dflt.retention(&props(&[("keep-ms", PropValue::Int(5))]), 10),
            None,
            "no session"
        );
        let p = props(&[s.clone(), ("keep-ms", PropValue::Int(100))]);
        assert_eq!(
            dflt.retention(&p, 10).unwrap().expires_ms,
            110,
            "the prop overrides the default"
        );
        assert_eq!(
            dflt.retention(&props(&[s, ("keep-ms", PropValue::Int(0))]), 10),
            None
        );
    }
}
