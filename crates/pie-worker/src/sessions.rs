//! Chat sessions of the native `chat` inferlet (its earlier turns, by session
//! id), bounded: clients choose session ids freely, so past `max` sessions the
//! least recently used one is forgotten (its next turn starts a fresh history).

use std::collections::{BTreeMap, HashMap};

use pie_model::ChatMessage;

pub struct Sessions {
    max: usize,
    /// Session -> (its messages, its last use).
    by_id: HashMap<String, (Vec<ChatMessage>, u64)>,
    /// Last use -> session: the least recently used first.
    by_use: BTreeMap<u64, String>,
    clock: u64,
}

impl Sessions {
    pub fn new(max: usize) -> Self {
        Self {
            max,
            by_id: HashMap::new(),
            by_use: BTreeMap::new(),
            clock: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    fn touch(&mut self, id: &str) {
        self.clock += 1;
        if let Some((_, used)) = self.by_id.get_mut(id) {
            self.by_use.remove(used);
            *used = self.clock;
            self.by_use.insert(self.clock, id.to_string());
        }
    }

    /// A session's messages (a use: it becomes the most recently used).
    pub fn get(&mut self, id: &str) -> Option<Vec<ChatMessage>> {
        self.touch(id);
        self.by_id.get(id).map(|(messages, _)| messages.clone())
    }

    /// Store a session's messages; past `max`, forget the least recently used.
    pub fn insert(&mut self, id: String, messages: Vec<ChatMessage>) {
        if let Some((old, _)) = self.by_id.get_mut(&id) {
            *old = messages;
            self.touch(&id);
            return;
        }
        while self.by_id.len() >= self.max {
            let Some((_, oldest)) = self.by_use.pop_first() else {
                break;
            };
            self.by_id.remove(&oldest);
        }
        if self.max == 0 {
            return;
        }
        self.clock += 1;
        self.by_use.insert(self.clock, id.clone());
        self.by_id.insert(id, (messages, self.clock));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn said(text: &str) -> Vec<ChatMessage> {
        vec![ChatMessage::text("user", text.into())]
    }

    #[test]
    fn past_the_bound_the_least_recently_used_session_goes() {
        let mut s = Sessions::new(2);
        s.insert("a".into(), said("1"));
        s.insert("b".into(), said("2"));
        assert_eq!(s.get("a"), Some(said("1")), "a is now the most recent");
        s.insert("c".into(), said("3"));
        assert_eq!(s.len(), 2);
        assert_eq!(s.get("b"), None, "b was the least recently used");
        assert_eq!(s.get("a"), Some(said("1")));
        s.insert("c".into(), said("3 again"));
        assert_eq!(s.len(), 2, "updating a session adds none");
        s.insert("d".into(), said("4"));
        assert_eq!(s.get("a"), None);
        assert_eq!(s.get("c"), Some(said("3 again")));
        assert_eq!(s.get("d"), Some(said("4")));
    }

    #[test]
    fn a_bound_of_zero_keeps_nothing() {
        let mut s = Sessions::new(0);
        s.insert("a".into(), said("1"));
        assert!(s.is_empty());
    }
}
