//! `MaskTable`: one shard of the [`super::ClusterIndex`], block hash -> the
//! bitmask of the shard's slots holding it. Open addressing with linear
//! probing and backward-shift deletion, 16-byte slots, at most 3/4 full.
//!
//! At 1,000 workers the shards hold millions of blocks, far more than any CPU
//! cache, so a lookup is a cache miss: a SwissTable (`std::collections::HashMap`)
//! touches its control bytes and then its bucket, two misses in turn, where a
//! slot here is one, and its address follows from the hash alone, so a prefix
//! walk can prefetch the next block's slots while it reads this one's
//! ([`MaskTable::prefetch`]). A mask of 0 marks a vacant slot: a block no slot
//! holds has no entry.
//!
//! Invariant (tested through the index's proptest against per-worker sets):
//! every stored (hash, non-zero mask) is found from its home slot without
//! crossing a vacant slot.

#[derive(Clone, Copy, Debug, Default)]
struct Entry {
    hash: u64,
    mask: u64,
}

#[derive(Debug)]
pub(crate) struct MaskTable {
    slots: Vec<Entry>,
    len: usize,
    /// 64 minus log2 of the slot count: a hash's home is the top bits of its
    /// product with an odd constant (any key spreads, even small integers).
    shift: u32,
}

const MIN_SLOTS: usize = 16;

impl Default for MaskTable {
    fn default() -> Self {
        Self::with_slots(MIN_SLOTS)
    }
}

impl MaskTable {
    fn with_slots(n: usize) -> Self {
        Self {
            slots: vec![Entry::default(); n],
            len: 0,
            shift: 64 - n.trailing_zeros(),
        }
    }

    /// Blocks with an entry.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    fn home(&self, hash: u64) -> usize {
        (hash.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> self.shift) as usize
    }

    fn next(&self, i: usize) -> usize {
        (i + 1) & (self.slots.len() - 1)
    }

    /// The slot holding `hash`, else the vacant slot where it would go.
    fn find(&self, hash: u64) -> (usize, bool) {
        let mut i = self.home(hash);
        loop {
            let e = &self.slots[i];
            if e.mask == 0 {
                return (i, false);
            }
            if e.hash == hash {
                return (i, true);
            }
            i = self.next(i);
        }
    }

    /// The slots holding `hash`, if any.
    pub(crate) fn get(&self, hash: &u64) -> Option<&u64> {
        match self.find(*hash) {
            (i, true) => Some(&self.slots[i].mask),
            _ => None,
        }
    }

    /// Start loading `hash`'s home slot into the CPU cache.
    pub(crate) fn prefetch(&self, hash: u64) {
        prefetch(&self.slots[self.home(hash)]);
    }

    /// Sets `bit` in `hash`'s mask; true if it was not set.
    pub(crate) fn set_bit(&mut self, hash: u64, bit: u64) -> bool {
        if 4 * (self.len + 1) > 3 * self.slots.len() {
            self.grow();
        }
        let (i, found) = self.find(hash);
        let e = &mut self.slots[i];
        if !found {
            *e = Entry { hash, mask: 0 };
            self.len += 1;
        }
        let new = e.mask & bit == 0;
        e.mask |= bit;
        new
    }

    /// Clears `bit` in `hash`'s mask, dropping the entry at 0; true if it was
    /// set.
    pub(crate) fn clear_bit(&mut self, hash: u64, bit: u64) -> bool {
        let (i, found) = self.find(hash);
        if !found || self.slots[i].mask & bit == 0 {
            return false;
        }
        self.slots[i].mask &= !bit;
        if self.slots[i].mask == 0 {
            self.vacate(i);
        }
        true
    }

    /// Clears `bit` in every mask (a slot forgotten), rebuilding the table
    /// without the entries left at 0.
    pub(crate) fn clear_bits(&mut self, bit: u64) {
        let old = std::mem::take(&mut self.slots);
        *self = Self::with_slots(old.len());
        for e in old.into_iter().filter(|e| e.mask & !bit != 0) {
            let (i, _) = self.find(e.hash);
            self.slots[i] = Entry {
                hash: e.hash,
                mask: e.mask & !bit,
            };
            self.len += 1;
        }
    }

    /// Empties slot `hole`, shifting later entries of its probe run back so
    /// that no lookup stops early.
    fn vacate(&mut self, mut hole: usize) {
        self.len -= 1;
        let last = self.slots.len() - 1;
        let mut j = hole;
        loop {
            j = self.next(j);
            let e = self.slots[j];
            if e.mask == 0 {
                break;
            }
            let home = self.home(e.hash);
            if (j.wrapping_sub(home) & last) >= (j.wrapping_sub(hole) & last) {
                self.slots[hole] = e;
                hole = j;
            }
        }
        self.slots[hole] = Entry::default();
    }

    fn grow(&mut self) {
        let old = std::mem::replace(self, Self::with_slots(2 * self.slots.len()));
        for e in old.slots.into_iter().filter(|e| e.mask != 0) {
            let (i, _) = self.find(e.hash);
            self.slots[i] = e;
            self.len += 1;
        }
    }
}

/// Start loading `value`'s cache line (a hint: nothing is read).
fn prefetch<T>(value: &T) {
    #[cfg(target_arch = "x86_64")]
    {
        let line: *const T = value;
        // SAFETY: a prefetch is a hint; it reads nothing and never faults.
        unsafe {
            std::arch::x86_64::_mm_prefetch(line.cast::<i8>(), std::arch::x86_64::_MM_HINT_T0)
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = value;
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    #[derive(Clone, Debug)]
    enum Op {
        Set(u64, u32),
        Clear(u64, u32),
        ClearBits(u32),
    }

    fn op() -> impl Strategy<Value = Op> {
        // Few keys and bits: growth, long probe runs and deletions within them.
        prop_oneof![
            6 => (0..200u64, 0..3u32).prop_map(|(h, b)| Op::Set(h, b)),
            4 => (0..200u64, 0..3u32).prop_map(|(h, b)| Op::Clear(h, b)),
            1 => (0..3u32).prop_map(Op::ClearBits),
        ]
    }

    proptest! {
        #[test]
        fn agrees_with_a_map(ops in prop::collection::vec(op(), 0..600)) {
            let (mut table, mut want) = (MaskTable::default(), HashMap::<u64, u64>::new());
            for op in ops {
                match op {
                    Op::Set(h, b) => {
                        let mask = want.entry(h).or_insert(0);
                        prop_assert_eq!(table.set_bit(h, 1 << b), *mask & (1 << b) == 0);
                        *mask |= 1 << b;
                    }
                    Op::Clear(h, b) => {
                        let had = want.get(&h).is_some_and(|m| m & (1 << b) != 0);
                        prop_assert_eq!(table.clear_bit(h, 1 << b), had);
                        if let Some(m) = want.get_mut(&h) {
                            *m &= !(1 << b);
                        }
                    }
                    Op::ClearBits(b) => {
                        table.clear_bits(1 << b);
                        want.values_mut().for_each(|m| *m &= !(1 << b));
                    }
                }
                want.retain(|_, m| *m != 0);
                prop_assert_eq!(table.len(), want.len());
            }
            for h in 0..200 {
                prop_assert_eq!(table.get(&h), want.get(&h));
            }
        }
    }
}
