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

/// Where value `j` of vector `v` of a run of `g` blocks lies in the run's
/// packed nibbles, as (byte, shift). A single block keeps GGML's layout
/// (value `j` low, `j + 16` high). A pair of vectors shares 32 bytes, the
/// first in the low nibbles. Longer runs go by quads of vectors `v0..v3` in
/// 64 bytes: `v0` and `v1` in the low nibbles, `v2` and `v3` in the high
/// ones, so one 64-byte load and two masks give `(v0, v1)` and `(v2, v3)`
/// as the activations are stored.
fn nibble(g: usize, v: usize, j: usize) -> (usize, u32) {
    match g {
        1 => (j % 16, 4 * (j / 16) as u32),
        2 => (j, 4 * v as u32),
        _ => (
            v / 4 * 2 * BLOCK + v % 2 * BLOCK + j,
            4 * (v % 4 / 2) as u32,
        ),
    }
}

/// Pack one row of 4-bit values (in kernel order) at two per byte, run by
/// run (see [`nibble`]).
pub(super) fn pack_q4(q: &[u8], out: &mut Vec<u8>) {
    fn vector(run: &[u8], v: usize) -> &[u8] {
        &run[v * BLOCK..][..BLOCK]
    }
    let pack = |out: &mut Vec<u8>, low: &[u8], high: &[u8]| {
        out.extend(low.iter().zip(high).map(|(l, h)| l & 0xf | (h & 0xf) << 4));
    };
    // The same places as `nibble` gives, a byte at a time.
    for (start, g) in runs(q.len() / BLOCK) {
        let run = &q[start * BLOCK..(start + g) * BLOCK];
        match g {
            1 => pack(out, &run[..16], &run[16..]),
            2 => pack(out, vector(run, 0), vector(run, 1)),
            _ => {
                for quad in run.chunks_exact(4 * BLOCK) {
                    pack(out, vector(quad, 0), vector(quad, 2));
                    pack(out, vector(quad, 1), vector(quad, 3));
                }
            }
        }
    }
}

/// A row packed by [`pack_q4`], back to one value per position (kernel order):
/// its inverse, for a whole row at once.
pub(super) fn unpack_row_q4(row: &[u8], q: &mut [i32]) {
    for (start, g) in runs(q.len() / BLOCK) {
        let packed = &row[start * BLOCK / 2..];
        for (p, q) in q[start * BLOCK..(start + g) * BLOCK].iter_mut().enumerate() {
            let (byte, shift) = nibble(g, p / BLOCK, p % BLOCK);
            *q = (packed[byte] >> shift & 0xf) as i32;
        }
    }
}

/// The 4-bit value at kernel-order position `pos` of a row packed by [`pack_q4`].
pub(super) fn unpack_q4(row: &[u8], pos: usize) -> u8 {
    let (start, g) = runs(row.len() * 2 / BLOCK)
        .into_iter()
        .find(|&(s, g)| pos < (s + g) * BLOCK)
        .expect("position inside the row");
    let p = pos - start * BLOCK;
    let (byte, shift) = nibble(g, p / BLOCK, p % BLOCK);
    row[start * BLOCK / 2 + byte] >> shift & 0xf
}

/// Values per quad of vectors: the unit [`pack_q6`] packs.
const QUAD: usize = 4 * BLOCK;

/// Pack one row of 6-bit values (in kernel order, a whole number of groups
/// of eight blocks) as [`pack_q4`] packs their low four bits, and their high
/// bit pairs quad by quad (four 32-byte vectors `v0..v3`) in 32 bytes, byte
/// `j` holding `v0[j] .. v3[j]`'s at bits 0, 2, 4 and 6.
pub(super) fn pack_q6(q: &[u8], lo: &mut Vec<u8>, hi: &mut Vec<u8>) {
    assert!(
        q.len().is_multiple_of(GROUP * BLOCK),
        "6-bit rows are whole groups"
    );
    pack_q4(q, lo);
    for quad in q.chunks_exact(QUAD) {
        let v = |u: usize, j: usize| quad[u * BLOCK + j];
        hi.extend((0..BLOCK).map(|j| (0..4).fold(0, |b, u| b | (v(u, j) >> 4) << (2 * u))));
    }
}

/// The 6-bit value at kernel-order position `pos` of a row packed by
/// [`pack_q6`] (`lo`, `hi`: that row's parts).
pub(super) fn unpack_q6(lo: &[u8], hi: &[u8], pos: usize) -> u8 {
    let (quad, u, j) = (pos / QUAD, pos % QUAD / BLOCK, pos % BLOCK);
    unpack_q4(lo, pos) | (hi[quad * BLOCK + j] >> (2 * u) & 3) << 4
}

/// A Q6_K row of whole groups, packed by [`pack_q6`] (`lo`, `hi`) to one signed byte
/// `q - 32` per value (kernel order): each 32 bytes of `hi` hold a quad of
/// vectors' high bit pairs, vector `i`'s at bits `2 i`.
pub(super) fn unpack_q6_groups(lo: &[u8], hi: &[u8], out: &mut [u8]) {
    unpack_q4_groups(lo, out);
    for (quad, bits) in out.chunks_exact_mut(4 * BLOCK).zip(hi.chunks_exact(BLOCK)) {
        for (i, vector) in quad.chunks_exact_mut(BLOCK).enumerate() {
            for (v, &b) in vector.iter_mut().zip(bits) {
                *v = ((*v | (b >> (2 * i) & 3) << 4) as i8 - 32) as u8;
            }
        }
    }
}

/// A 4-bit row of whole groups, packed by [`pack_q4`], to one byte per
/// value (kernel order), a whole row at a time as the AMX kernel reads it
/// (where [`unpack_row_q4`] takes any runs): each 64 packed bytes hold vectors `v0, v1` in their
/// low nibbles and `v2, v3` in their high ones.
pub(super) fn unpack_q4_groups(packed: &[u8], out: &mut [u8]) {
    for (quad, dst) in packed
        .chunks_exact(2 * BLOCK)
        .zip(out.chunks_exact_mut(4 * BLOCK))
    {
        let (low, high) = dst.split_at_mut(2 * BLOCK);
        for ((l, h), &p) in low.iter_mut().zip(high.iter_mut()).zip(quad) {
            (*l, *h) = (p & 0xf, p >> 4);
        }
    }
}
