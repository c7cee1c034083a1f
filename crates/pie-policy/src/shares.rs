//! Per-key shares of a pool whose places cannot be taken back once given
//! (inferlet instances, queue places): one tenant using its whole share
//! never stops another tenant's next launch from being admitted.
//!
//! Rule: of a pool of `capacity` places, `reserve` ([`reserve_for`]: an
//! eighth, at least one, none for a pool of one) are kept for keys that
//! hold less than their share. A key's share is `(capacity - reserve)`
//! divided by the keys active now (holding or asking for a place; the
//! asking key counts), rounded up. A key may take a free place while it
//! holds less than its share, or while more than `reserve` places stay
//! free. So a key alone gets all but the reserve; a second key takes a
//! reserved place at once; and a key past its share takes no new place
//! until the others are back under theirs or gone (its places are not
//! taken back: work in progress keeps its place).
//! Props read: none (the key is the request's client).
//! Config keys: none of its own; the pools are `[runtime.inferlets]
//! max_instances` and `[server] max_queued`, and the worker applies shares
//! when its API keys name two or more tenants.
//! Invariant (tested below): the pool is never over-filled; a key past its
//! share never takes one of the last `reserve` places, so a second key is
//! admitted at once whatever the first took (and up to `reserve` newcomers
//! while the keys before them are past their shares).

/// The places of a pool of `capacity` kept for keys under their share.
pub fn reserve_for(capacity: usize) -> usize {
    if capacity < 2 {
        0
    } else {
        capacity.div_ceil(8)
    }
}

/// One pool's shares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shares {
    pub capacity: usize,
    pub reserve: usize,
}

impl Shares {
    /// Shares of a pool of `capacity`, with [`reserve_for`] kept back.
    pub fn of(capacity: usize) -> Self {
        Self {
            capacity,
            reserve: reserve_for(capacity),
        }
    }

    /// No shares: any key may take any free place.
    pub fn unshared(capacity: usize) -> Self {
        Self {
            capacity,
            reserve: 0,
        }
    }

    /// One key's share while `active_keys` keys hold or ask for places.
    pub fn share(&self, active_keys: usize) -> usize {
        (self.capacity - self.reserve).div_ceil(active_keys.max(1))
    }

    /// May a key holding `held` take one more place, with `held_total`
    /// places taken in all and `active_keys` keys active (it included)?
    pub fn may_take(&self, held: usize, held_total: usize, active_keys: usize) -> bool {
        let free = self.capacity.saturating_sub(held_total);
        free > 0 && (held < self.share(active_keys) || free > self.reserve)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_key_alone_gets_all_but_the_reserve_and_a_second_key_gets_in() {
        let pool = Shares::of(16);
        assert_eq!(pool.reserve, 2);
        assert!(pool.may_take(13, 13, 1));
        assert!(!pool.may_take(14, 14, 1), "the reserve stays free");
        assert!(
            pool.may_take(0, 14, 2),
            "a second key gets a reserved place"
        );
        assert!(pool.may_take(1, 15, 2));
        assert!(!pool.may_take(2, 16, 2), "the pool is full");
        assert!(
            !pool.may_take(13, 14, 2),
            "a key past its share waits while the reserve is all that is free"
        );
    }

    #[test]
    fn unshared_pools_and_pools_of_one_keep_nothing_back() {
        assert!(Shares::unshared(4).may_take(3, 3, 5));
        assert!(Shares::of(1).may_take(0, 0, 3));
        assert!(!Shares::of(1).may_take(0, 1, 3));
    }

    proptest! {
        /// Keys arriving one after another, each taking all the rule lets it
        /// (up to what it wants): the pool is never over-filled, a key past
        /// its share never takes one of the last `reserve` places, and the
        /// second key is admitted at once whatever the first took.
        #[test]
        fn the_reserve_admits_newcomers_and_the_pool_never_overfills(
            capacity in 1usize..200,
            wants in proptest::collection::vec(0usize..200, 1..6),
        ) {
            let pool = Shares::of(capacity);
            let mut total = 0;
            for (i, want) in wants.iter().enumerate() {
                let active = i + 1;
                if i == 1 && capacity > 1 {
                    prop_assert!(pool.may_take(0, total, active), "key {i} of {wants:?}");
                }
                let mut mine = 0;
                while mine < *want && pool.may_take(mine, total, active) {
                    let free = capacity - total;
                    prop_assert!(mine < pool.share(active) || free > pool.reserve);
                    mine += 1;
                    total += 1;
                }
            }
            prop_assert!(total <= capacity);
        }
    }
}
