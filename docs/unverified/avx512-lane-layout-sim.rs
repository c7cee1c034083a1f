const BLOCK: usize = 32;


/// The runs of blocks the kernel works in, as `(first block, blocks)`: groups of
/// eight, then the rest as at most one run each of four, two and one.
fn runs(nb: usize) -> Vec<(usize, usize)> {
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
fn kernel_order(k: usize) -> Vec<u32> {
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
fn pack_q4(q: &[u8], out: &mut Vec<u8>) {
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

/// The 4-bit value at kernel-order position `pos` of a row packed by [`pack_q4`].
fn unpack_q4(row: &[u8], pos: usize) -> u8 {
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

// Scalar models of the intrinsics avx512.rs uses, on 64-byte registers.
type Z = [u8; 64];
fn shuffle_i64x2(a: &Z, b: &Z, imm: u8) -> Z {
    let mut o = [0u8; 64];
    for lane in 0..4 {
        let sel = ((imm >> (2 * lane)) & 3) as usize;
        let src = if lane < 2 { a } else { b };
        o[lane * 16..lane * 16 + 16].copy_from_slice(&src[sel * 16..sel * 16 + 16]);
    }
    o
}
fn dpbusd(acc: &mut [i32; 16], a: &Z, b: &Z) {
    for i in 0..16 {
        for t in 0..4 {
            acc[i] += a[4 * i + t] as i32 * (b[4 * i + t] as i8) as i32;
        }
    }
}
fn dpbusd256(acc: &mut [i32; 8], a: &[u8], b: &[u8]) {
    for i in 0..8 {
        for t in 0..4 {
            acc[i] += a[4 * i + t] as i32 * (b[4 * i + t] as i8) as i32;
        }
    }
}
fn fold(s: &[i32; 16]) -> [i32; 8] {
    std::array::from_fn(|l| s[l] + s[l + 8])
}
fn lo4(z: &Z) -> Z { z.map(|b| b & 15) }
fn hi4(z: &Z) -> Z { z.map(|b| b >> 4) }
fn load(p: &[u8]) -> Z { p[..64].try_into().unwrap() }

// dots_q4 of avx512.rs for one row and one column.
fn dots_q4(wrow: &[u8], arow: &[u8], g: usize) -> [i32; 8] {
    if g == 1 {
        let raw = &wrow[..16];
        let wv: Vec<u8> = raw.iter().map(|b| b & 15).chain(raw.iter().map(|b| b >> 4)).collect();
        let mut s = [0; 8];
        dpbusd256(&mut s, &wv, &arow[..32]);
        return s;
    }
    let mut sums = [0i32; 16];
    if g == 2 {
        let raw = &wrow[..32];
        let mut both = [0u8; 64];
        both[..32].copy_from_slice(&raw.iter().map(|b| b & 15).collect::<Vec<_>>());
        both[32..].copy_from_slice(&raw.iter().map(|b| b >> 4).collect::<Vec<_>>());
        dpbusd(&mut sums, &both, &load(arow));
    } else {
        for quad in 0..g / 4 {
            let raw = load(&wrow[quad * 2 * BLOCK..]);
            let (lo, hi) = (lo4(&raw), hi4(&raw));
            let w0 = shuffle_i64x2(&lo, &hi, 0x44);
            let w1 = shuffle_i64x2(&lo, &hi, 0xee);
            dpbusd(&mut sums, &w0, &load(&arow[quad * 4 * BLOCK..]));
            dpbusd(&mut sums, &w1, &load(&arow[quad * 4 * BLOCK + 2 * BLOCK..]));
        }
    }
    fold(&sums)
}

fn dots_q8(wrow: &[i8], arow: &[i8], g: usize) -> [i32; 8] {
    let u = |x: &[i8]| -> Vec<u8> { x.iter().map(|&v| v as u8).collect() };
    if g == 1 {
        let wabs: Vec<u8> = wrow[..32].iter().map(|v| v.unsigned_abs()).collect();
        let signed: Vec<u8> = (0..32).map(|i| {
            let (a, w) = (arow[i], wrow[i]);
            (if w < 0 { -a } else if w == 0 { 0 } else { a }) as u8
        }).collect();
        let mut s = [0; 8];
        dpbusd256(&mut s, &wabs, &signed);
        return s;
    }
    let mut sums = [0i32; 16];
    for v in (0..g).step_by(2) {
        let at = v * BLOCK;
        let wv = &wrow[at..at + 64];
        let wabs: Z = std::array::from_fn(|i| wv[i].unsigned_abs());
        let av = u(&arow[at..at + 64]);
        let signed: Z = std::array::from_fn(|i| if wv[i] < 0 { (av[i] as i8).wrapping_neg() as u8 } else { av[i] });
        dpbusd(&mut sums, &wabs, &signed);
    }
    fold(&sums)
}

fn main() {
    let mut seed = 12345u64;
    let mut rnd = move || { seed ^= seed << 13; seed ^= seed >> 7; seed ^= seed << 17; seed };
    for nb in [1usize, 2, 3, 5, 7, 8, 10, 15, 18, 48] {
        let k = nb * BLOCK;
        let order = kernel_order(k);
        let q: Vec<u8> = (0..k).map(|_| (rnd() % 16) as u8).collect();
        let w8: Vec<i8> = (0..k).map(|_| (rnd() % 255) as i64 as i8).map(|v| v.clamp(-127, 127)).collect();
        let a: Vec<i8> = (0..k).map(|_| ((rnd() % 255) as i64 - 127) as i8).collect();
        let qo: Vec<u8> = order.iter().map(|&i| q[i as usize]).collect();
        let mut packed = Vec::new();
        pack_q4(&qo, &mut packed);
        let w8o: Vec<i8> = order.iter().map(|&i| w8[i as usize]).collect();
        let ao: Vec<i8> = order.iter().map(|&i| a[i as usize]).collect();
        let ao_u: Vec<u8> = ao.iter().map(|&v| v as u8).collect();
        for (start, g) in runs(nb) {
            let d4 = dots_q4(&packed[start * BLOCK / 2..], &ao_u[start * BLOCK..], g);
            let d8 = dots_q8(&w8o[start * BLOCK..], &ao[start * BLOCK..], g);
            for b in start..start + g {
                let want4: i32 = (b * BLOCK..(b + 1) * BLOCK).map(|i| q[i] as i32 * a[i] as i32).sum();
                let want8: i32 = (b * BLOCK..(b + 1) * BLOCK).map(|i| w8[i] as i32 * a[i] as i32).sum();
                let lanes = |d: &[i32; 8]| -> i32 { (0..8).filter(|l| start + l * g / 8 == b).map(|l| d[l]).sum() };
                assert_eq!(lanes(&d4), want4, "q4 nb {nb} run ({start}, {g}) block {b}");
                assert_eq!(lanes(&d8), want8, "q8 nb {nb} run ({start}, {g}) block {b}");
            }
        }
    }
    println!("ok: the AVX-512 kernel's lane layout gives every block's dot product");
}
