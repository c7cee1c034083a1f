//! The element order a weight row is stored in, which every kernel reads, and
//! the packing of 4-bit rows.

/// Elements per block (one scale each).
pub(super) const BLOCK: usize = 32;
/// Blocks per scale vector: scales are stored padded (with zeros) to a multiple
/// of this, so the kernel loads and converts eight at once.
pub(super) const GROUP: usize = 8;

/// The runs of blocks the kernel works in, as `(first block, blocks)`: groups of
/// eight, then the rest as at most one run each of four, two and one.
pub(super) fn runs(nb: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut b = 0;
    for g in [8, 4, 2, 1] {
        while nb - b >= g {
            out.push((b, g));
            b += g;
        }
    }
    out
}

/// For each position of a row in kernel order, the element it holds. A run of
/// `g` blocks is `g` vectors of 32 bytes in which byte `j` of vector `v` is
/// element `v * w + j % w` of the run's block `j / w`, with `w = 32 / g`. Summing
/// byte quads (maddubs, then madd) leaves i32 lane `l` of every vector with the
/// single block `l * g / 8`, so the run's dot products sit side by side.
pub(super) fn kernel_order(k: usize) -> Vec<u32> {
    let mut order = Vec::with_capacity(k);
    for (start, g) in runs(k / BLOCK) {
        let w = BLOCK / g;
        for v in 0..g {
            order.extend((0..BLOCK).map(|j| ((start + j / w) * BLOCK + v * w + j % w) as u32));
        }
    }
    order
}

/// Pack one row of 4-bit values (in kernel order) at two per byte, run by run:
/// in a run of two or more blocks each 32 bytes hold a pair of vectors (the first
/// in the low nibbles), so one load and two masks unpack 64 values; a single block
/// keeps GGML's layout (element `j` low, element `j + 16` high).
pub(super) fn pack_q4(q: &[u8], out: &mut Vec<u8>) {
    for (start, g) in runs(q.len() / BLOCK) {
        let run = &q[start * BLOCK..(start + g) * BLOCK];
        if g == 1 {
            out.extend((0..16).map(|j| run[j] | run[j + 16] << 4));
        } else {
            for pair in run.chunks_exact(2 * BLOCK) {
                out.extend((0..BLOCK).map(|j| pair[j] | pair[j + BLOCK] << 4));
            }
        }
    }
}

/// A row packed by [`pack_q4`], back to one value per position (kernel order):
/// its inverse, for a whole row at once.
pub(super) fn unpack_row_q4(row: &[u8], q: &mut [i32]) {
    let mut at = 0;
    for (start, g) in runs(q.len() / BLOCK) {
        let run = &mut q[start * BLOCK..(start + g) * BLOCK];
        if g == 1 {
            for (j, &byte) in row[at..at + 16].iter().enumerate() {
                run[j] = (byte & 0xf) as i32;
                run[j + 16] = (byte >> 4) as i32;
            }
            at += 16;
        } else {
            for pair in run.chunks_exact_mut(2 * BLOCK) {
                for (j, &byte) in row[at..at + BLOCK].iter().enumerate() {
                    pair[j] = (byte & 0xf) as i32;
                    pair[j + BLOCK] = (byte >> 4) as i32;
                }
                at += BLOCK;
            }
        }
    }
}

/// The 4-bit value at kernel-order position `pos` of a row packed by [`pack_q4`].
pub(super) fn unpack_q4(row: &[u8], pos: usize) -> u8 {
    let (start, g) = runs(row.len() * 2 / BLOCK)
        .into_iter()
        .find(|&(s, g)| pos < (s + g) * BLOCK)
        .expect("position inside the row");
    let (v, j) = ((pos - start * BLOCK) / BLOCK, pos % BLOCK);
    let base = &row[start * BLOCK / 2..];
    let byte = if g == 1 {
        base[j % 16] >> (4 * (j / 16))
    } else {
        base[v / 2 * BLOCK + j] >> (4 * (v % 2))
    };
    byte & 0xf
}

/// Values per quad of vectors: the unit [`pack_q6`] packs.
const QUAD: usize = 4 * BLOCK;

/// Pack one row of 6-bit values (in kernel order, a whole number of groups
/// of eight blocks) as low nibbles and high bit pairs, quad by quad (four
/// 32-byte vectors `v0..v3`): 64 bytes of nibbles, byte `j` holding `v0[j]`
/// low and `v2[j]` high, byte `32 + j` `v1[j]` and `v3[j]`, so one 64-byte
/// load and two masks give `(v0, v1)` and `(v2, v3)` as the activations are
/// stored; and 32 bytes of pairs, byte `j` holding `v0[j] .. v3[j]`'s at bits
/// 0, 2, 4 and 6.
pub(super) fn pack_q6(q: &[u8], lo: &mut Vec<u8>, hi: &mut Vec<u8>) {
    assert!(
        q.len().is_multiple_of(GROUP * BLOCK),
        "6-bit rows are whole groups"
    );
    for quad in q.chunks_exact(QUAD) {
        let v = |u: usize, j: usize| quad[u * BLOCK + j];
        lo.extend((0..BLOCK).map(|j| v(0, j) & 0xF | (v(2, j) & 0xF) << 4));
        lo.extend((0..BLOCK).map(|j| v(1, j) & 0xF | (v(3, j) & 0xF) << 4));
        hi.extend((0..BLOCK).map(|j| (0..4).fold(0, |b, u| b | (v(u, j) >> 4) << (2 * u))));
    }
}

/// The 6-bit value at kernel-order position `pos` of a row packed by
/// [`pack_q6`] (`lo`, `hi`: that row's parts).
pub(super) fn unpack_q6(lo: &[u8], hi: &[u8], pos: usize) -> u8 {
    let (quad, u, j) = (pos / QUAD, pos % QUAD / BLOCK, pos % BLOCK);
    let nibble = lo[quad * 2 * BLOCK + u % 2 * BLOCK + j] >> (4 * (u / 2)) & 0xF;
    let pair = hi[quad * BLOCK + j] >> (2 * u) & 3;
    nibble | pair << 4
}
