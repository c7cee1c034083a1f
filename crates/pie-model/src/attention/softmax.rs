//! The online softmax's state: one query's running maximum and sum of
//! exponentials (`Stat`), and the merge of two states in chunk order.

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
