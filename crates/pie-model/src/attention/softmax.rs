//! The online softmax's state: one query's running maximum and sum of
//! exponentials (`Stat`), the merge of two states in chunk order, and what
//! the softmax's scores are (`Scoring`: scale, Gemma 2's soft cap, window).

/// Running softmax state of one query: maximum score and sum of exponentials.
#[derive(Clone, Copy, Debug)]
pub(super) struct Stat {
    pub(super) m: f32,
    pub(super) l: f32,
}

pub(super) const EMPTY: Stat = Stat {
    m: f32::NEG_INFINITY,
    l: 0.0,
};

/// Merge a chunk's state `c` (accumulator `cacc`) into a query's state.
pub(super) fn merge(st: &mut Stat, acc: &mut [f32], c: Stat, cacc: &[f32]) {
    if c.m == f32::NEG_INFINITY {
        return;
    }
    if st.m == f32::NEG_INFINITY {
        *st = c;
        acc.copy_from_slice(cacc);
        return;
    }
    let m = st.m.max(c.m);
    let (a, b) = ((st.m - m).exp(), (c.m - m).exp());
    st.l = st.l * a + c.l * b;
    st.m = m;
    for (x, y) in acc.iter_mut().zip(cacc) {
        *x = *x * a + *y * b;
    }
}

/// How a query scores the keys: `q · k` times `scale`, soft-capped to
/// `cap * tanh(score / cap)` where `softcap` is set (Gemma 2), over the keys
/// of its `window` (its last `w` positions, itself included; `None`: all
/// before it).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Scoring {
    pub scale: f32,
    pub softcap: Option<f32>,
    pub window: Option<usize>,
}

impl Scoring {
    /// The first key a query at `pos` sees.
    pub(super) fn first_key(self, pos: usize) -> usize {
        self.window.map_or(0, |w| (pos + 1).saturating_sub(w))
    }
}
