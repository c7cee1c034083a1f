//! Leases on pages exported to peers: a page being sent is pinned (it cannot
//! be evicted mid-transfer), each page sent renews the lease, and the pins go
//! when the transfer ends or when the lease expires (a peer that stopped
//! reading cannot hold pages forever). Owned by the engine thread.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use pie_kv::PageId;

struct Lease {
    pages: Vec<PageId>,
    ttl: Duration,
    expires: Instant,
}

#[derive(Default)]
pub struct Leases {
    next: u64,
    held: HashMap<u64, Lease>,
}

impl Leases {
    /// A lease on `pages` (already pinned) for `ttl`.
    pub fn grant(&mut self, pages: Vec<PageId>, ttl: Duration, now: Instant) -> u64 {
        self.next += 1;
        self.held.insert(
            self.next,
            Lease {
                pages,
                ttl,
                expires: now + ttl,
            },
        );
        self.next
    }

    /// Pages `from..from + count` of a live lease, renewing it; None when the
    /// lease is gone (released or expired).
    pub fn renew(&mut self, id: u64, from: usize, count: usize, now: Instant) -> Option<&[PageId]> {
        let lease = self.held.get_mut(&id)?;
        lease.expires = now + lease.ttl;
        let end = (from + count).min(lease.pages.len());
        Some(&lease.pages[from.min(end)..end])
    }

    /// End a lease; its pages are to be unpinned.
    pub fn release(&mut self, id: u64) -> Vec<PageId> {
        self.held.remove(&id).map(|l| l.pages).unwrap_or_default()
    }

    /// End every lease past its expiry; their pages are to be unpinned.
    pub fn expire(&mut self, now: Instant) -> Vec<PageId> {
        let gone: Vec<u64> = self
            .held
            .iter()
            .filter(|(_, l)| l.expires <= now)
            .map(|(&id, _)| id)
            .collect();
        gone.into_iter().flat_map(|id| self.release(id)).collect()
    }

    /// When the next lease expires.
    pub fn next_expiry(&self) -> Option<Instant> {
        self.held.values().map(|l| l.expires).min()
    }

    /// Pages pinned by leases.
    pub fn pinned(&self) -> usize {
        self.held.values().map(|l| l.pages.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renewal_extends_and_expiry_or_release_returns_the_pages_once() {
        let t0 = Instant::now();
        let ttl = Duration::from_millis(100);
        let mut leases = Leases::default();
        let a = leases.grant(vec![PageId(1), PageId(2), PageId(3)], ttl, t0);
        let b = leases.grant(vec![PageId(9)], ttl, t0);
        assert_eq!(leases.pinned(), 4);
        let later = t0 + Duration::from_millis(80);
        assert_eq!(
            leases.renew(a, 1, 5, later),
            Some(&[PageId(2), PageId(3)][..])
        );
        assert_eq!(leases.renew(a, 7, 1, later), Some(&[][..]));
        // b expired at t0 + 100; a was renewed until later + 100.
        assert_eq!(
            leases.expire(t0 + Duration::from_millis(120)),
            vec![PageId(9)]
        );
        assert_eq!(leases.renew(b, 0, 1, later), None);
        assert_eq!(leases.next_expiry(), Some(later + ttl));
        assert_eq!(leases.release(a).len(), 3);
        assert!(leases.release(a).is_empty());
        assert_eq!((leases.pinned(), leases.next_expiry()), (0, None));
    }
}
