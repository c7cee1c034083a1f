//! Which sessions hold retained pages, until when (`keep-session`): expired ones
//! are dropped at the start of a step, and under page pressure the soonest to
//! expire goes first (ties by session name, so every run drops the same one).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

#[derive(Default)]
pub struct Retained {
    expires: HashMap<String, u64>,
    /// (expiry, session), checked lazily against `expires` (a session retained
    /// again leaves its older entry behind).
    queue: BinaryHeap<Reverse<(u64, String)>>,
}

impl Retained {
    pub fn insert(&mut self, session: String, expires_ms: u64) {
        self.queue.push(Reverse((expires_ms, session.clone())));
        self.expires.insert(session, expires_ms);
    }

    pub fn remove(&mut self, session: &str) -> bool {
        self.expires.remove(session).is_some()
    }

    /// The session that expires first, if it expires by `by_ms`, with its
    /// expiry; removed.
    pub fn pop_soonest(&mut self, by_ms: u64) -> Option<(String, u64)> {
        while let Some(Reverse((expires, _))) = self.queue.peek() {
            if *expires > by_ms {
                return None;
            }
            let Reverse((expires, session)) = self.queue.pop()?;
            if self.expires.get(&session) == Some(&expires) {
                self.expires.remove(&session);
                return Some((session, expires));
            }
        }
        None
    }

    /// (session, expiry ms), sorted by session.
    pub fn sessions(&self) -> Vec<(String, u64)> {
        let mut v: Vec<_> = self.expires.iter().map(|(s, &e)| (s.clone(), e)).collect();
        v.sort();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn soonest_first_and_a_newer_retention_replaces_the_older() {
        let mut r = Retained::default();
        r.insert("b".into(), 30);
        r.insert("a".into(), 30);
        r.insert("c".into(), 10);
        r.insert("c".into(), 50);
        assert_eq!(r.pop_soonest(20), None, "c's first expiry was replaced");
        assert_eq!(r.pop_soonest(u64::MAX), Some(("a".to_string(), 30)));
        assert!(r.remove("b"));
        assert_eq!(r.sessions(), vec![("c".to_string(), 50)]);
        assert_eq!(r.pop_soonest(u64::MAX), Some(("c".to_string(), 50)));
        assert_eq!(r.pop_soonest(u64::MAX), None);
    }
}
