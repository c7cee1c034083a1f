//! Live-instance slots, shared per key: the executor of
//! [`pie_policy::shares`] for `[runtime.inferlets] max_instances`. A launch
//! waits for a slot its key may take; a slot is given back when its
//! instance ends (or the wait is dropped: a process killed while queued).
//! A leaf of `inferlets`.
//!
//! Invariant: at most `capacity` slots are held, and the counts of held
//! and waiting launches per key are exact whatever is dropped when.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use pie_policy::Shares;
use tokio::sync::Notify;

pub struct InstanceSlots {
    capacity: usize,
    holders: Mutex<Holders>,
    changed: Notify,
}

#[derive(Default)]
struct Holders {
    held: HashMap<String, usize>,
    waiting: HashMap<String, usize>,
    total: usize,
}

impl Holders {
    /// Keys holding or waiting for a slot.
    fn active(&self) -> usize {
        let waiting_only = self
            .waiting
            .keys()
            .filter(|k| !self.held.contains_key(*k))
            .count();
        self.held.len() + waiting_only
    }
}

fn add(counts: &mut HashMap<String, usize>, key: &str) {
    *counts.entry(key.to_string()).or_default() += 1;
}

fn remove(counts: &mut HashMap<String, usize>, key: &str) {
    if let Some(n) = counts.get_mut(key) {
        *n -= 1;
        if *n == 0 {
            counts.remove(key);
        }
    }
}

/// One held slot, given back on drop.
pub struct Slot {
    slots: Arc<InstanceSlots>,
    key: String,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut h = self.slots.lock();
        remove(&mut h.held, &self.key);
        h.total -= 1;
        drop(h);
        self.slots.changed.notify_waiters();
    }
}

/// A launch waiting for a slot; its count goes when it does.
struct Waiting<'a> {
    slots: &'a InstanceSlots,
    key: &'a str,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        remove(&mut self.slots.lock().waiting, self.key);
        // One key fewer asking: the others' shares may have grown.
        self.slots.changed.notify_waiters();
    }
}

impl InstanceSlots {
    pub fn new(capacity: usize) -> Arc<Self> {
        Arc::new(Self {
            capacity,
            holders: Mutex::default(),
            changed: Notify::new(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Holders> {
        self.holders.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wait for a slot `key` may take under `shares` (asked again at each
    /// change: whether the worker shares per key is reloadable).
    pub async fn acquire(self: &Arc<Self>, key: &str, shares: impl Fn(usize) -> Shares) -> Slot {
        add(&mut self.lock().waiting, key);
        let _waiting = Waiting { slots: self, key };
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.try_take(key, &shares(self.capacity)) {
                return Slot {
                    slots: self.clone(),
                    key: key.to_string(),
                };
            }
            changed.await;
        }
    }

    fn try_take(&self, key: &str, shares: &Shares) -> bool {
        let mut h = self.lock();
        let mine = h.held.get(key).copied().unwrap_or(0);
        if !shares.may_take(mine, h.total, h.active()) {
            return false;
        }
        add(&mut h.held, key);
        h.total += 1;
        true
    }

    /// Slots held by `key`.
    pub fn held_by(&self, key: &str) -> usize {
        self.lock().held.get(key).copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    async fn within<T>(ms: u64, f: impl std::future::Future<Output = T>) -> Option<T> {
        tokio::time::timeout(Duration::from_millis(ms), f)
            .await
            .ok()
    }

    #[tokio::test]
    async fn a_second_key_gets_a_slot_while_the_first_holds_all_it_may() {
        let slots = InstanceSlots::new(8);
        let mut alice = Vec::new();
        while let Some(slot) = within(50, slots.acquire("alice", Shares::of)).await {
            alice.push(slot);
        }
        assert_eq!(alice.len(), 7, "all but the reserve of one");
        let bob = within(50, slots.acquire("bob", Shares::of)).await;
        assert!(bob.is_some(), "bob is admitted at once");
        assert!(
            within(50, slots.acquire("alice", Shares::of))
                .await
                .is_none(),
            "alice, past her share, waits"
        );
        alice.truncate(3);
        assert!(
            within(50, slots.acquire("alice", Shares::of))
                .await
                .is_some(),
            "under her share again, alice gets one"
        );
        assert_eq!(slots.held_by("bob"), 1);
        drop(bob);
        assert_eq!(slots.held_by("bob"), 0);
        assert_eq!(
            slots.lock().waiting.len(),
            0,
            "dropped waits leave no count"
        );
    }

    #[tokio::test]
    async fn unshared_slots_fill_and_a_freed_one_wakes_a_waiter() {
        let slots = InstanceSlots::new(2);
        let first = slots.acquire("a", Shares::unshared).await;
        let _second = slots.acquire("a", Shares::unshared).await;
        let waiter = tokio::spawn({
            let slots = slots.clone();
            async move { slots.acquire("b", Shares::unshared).await.key.clone() }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished());
        drop(first);
        let key = within(1000, waiter).await.unwrap().unwrap();
        assert_eq!(key, "b");
    }
}
