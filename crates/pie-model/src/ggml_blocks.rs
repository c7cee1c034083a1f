//! GGML's block formats as GGUF stores them, decoded: a block widened to f32
//! (the token embedding's rows), and a Q4_K super-block as eight 32-value
//! sub-blocks of the `d * q + m` form the 4-bit matmul stores. The rules are
//! ggml's `dequantize_row_*`; the tests hold each to candle's dequantisation.

use candle_core::quantized::GgmlDType;
use half::f16;

/// The block types read without widening the whole tensor at load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BlockType {
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    F16,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
}

/// Values in a K-quant super-block.
const QK_K: usize = 256;

impl BlockType {
    pub(crate) fn of(dtype: GgmlDType) -> Option<Self> {
        match dtype {
            GgmlDType::Q8_0 => Some(Self::Q8_0),
            GgmlDType::Q4_0 => Some(Self::Q4_0),
            GgmlDType::Q4_1 => Some(Self::Q4_1),
            GgmlDType::Q5_0 => Some(Self::Q5_0),
            GgmlDType::Q5_1 => Some(Self::Q5_1),
            GgmlDType::F16 => Some(Self::F16),
            GgmlDType::Q2K => Some(Self::Q2K),
            GgmlDType::Q3K => Some(Self::Q3K),
            GgmlDType::Q4K => Some(Self::Q4K),
            GgmlDType::Q5K => Some(Self::Q5K),
            GgmlDType::Q6K => Some(Self::Q6K),
            _ => None,
        }
    }

    /// Values one block holds.
    pub(crate) fn values(self) -> usize {
        match self {
            Self::Q2K | Self::Q3K | Self::Q4K | Self::Q5K | Self::Q6K => QK_K,
            _ => 32,
        }
    }

    /// Bytes one block takes.
    pub(crate) fn bytes(self) -> usize {
        match self {
            Self::Q8_0 => 34,
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q5_1 => 24,
            Self::F16 => 64,
            Self::Q2K => 84,
            Self::Q3K => 110,
            Self::Q4K => 144,
            Self::Q5K => 176,
            Self::Q6K => 210,
        }
    }

    /// The values of `block`, appended to `out`.
    pub(crate) fn widen(self, block: &[u8], out: &mut Vec<f32>) {
        let half_at = |i: usize| half(&block[i..]);
        match self {
            Self::Q8_0 => {
                let d = half_at(0);
                out.extend(block[2..34].iter().map(|&q| f32::from(q as i8) * d));
            }
            Self::Q4_0 => widen_nibbles(half_at(0), -8.0 * half_at(0), &block[2..18], out),
            Self::Q4_1 => widen_nibbles(half_at(0), half_at(2), &block[4..20], out),
            Self::Q5_0 => widen_five_bits(half_at(0), -16.0 * half_at(0), &block[2..22], out),
            Self::Q5_1 => widen_five_bits(half_at(0), half_at(2), &block[4..24], out),
            Self::F16 => out.extend((0..32).map(|i| half_at(2 * i))),
            Self::Q4K => {
                for sub in q4k_sub_blocks(block) {
                    out.extend(sub.q.iter().map(|&q| sub.d * f32::from(q) + sub.m));
                }
            }
            Self::Q2K => widen_q2k(block, out),
            Self::Q3K => widen_q3k(block, out),
            Self::Q5K => widen_q5k(block, out),
            Self::Q6K => widen_q6k(block, out),
        }
    }
}

fn half(b: &[u8]) -> f32 {
    f16::from_le_bytes([b[0], b[1]]).to_f32()
}

/// GGML's 4-bit block body: element `j` in the low nibble of byte `j`,
/// element `j + 16` in the high one; value `d * q + m`.
fn widen_nibbles(d: f32, m: f32, qs: &[u8], out: &mut Vec<f32>) {
    out.extend(qs.iter().map(|&b| f32::from(b & 0xF) * d + m));
    out.extend(qs.iter().map(|&b| f32::from(b >> 4) * d + m));
}

/// GGML's 5-bit block body (`qh`: a little-endian u32 of fifth bits, then
/// the nibbles as [`widen_nibbles`] reads them); value `d * q + m`.
fn widen_five_bits(d: f32, m: f32, body: &[u8], out: &mut Vec<f32>) {
    let qh = u32::from_le_bytes([body[0], body[1], body[2], body[3]]);
    let qs = &body[4..20];
    let high = |j: usize| ((qh >> j) & 1) as u8 * 16;
    out.extend((0..16).map(|j| f32::from((qs[j] & 0xF) | high(j)) * d + m));
    out.extend((0..16).map(|j| f32::from((qs[j] >> 4) | high(j + 16)) * d + m));
}

/// 32 values `d * q + m`, `q` in `0..16`.
pub(crate) struct SubBlock {
    pub d: f32,
    pub m: f32,
    pub q: [u8; 32],
}

/// A Q4_K super-block (`d`, `dmin`: f16; twelve bytes of 6-bit scales and
/// minimums; 128 bytes of nibbles) as its eight sub-blocks, sub-block `i`
/// being `d * sc_i * q - dmin * m_i`.
pub(crate) fn q4k_sub_blocks(block: &[u8]) -> [SubBlock; 8] {
    let steps = Q4kSteps::of(block);
    let (d, dmin) = (steps.d.to_f32(), steps.dmin.to_f32());
    std::array::from_fn(|i| SubBlock {
        d: d * f32::from(steps.sc[i]),
        m: -dmin * f32::from(steps.m[i]),
        q: q4k_nibbles(block, i),
    })
}

/// A Q4_K super-block's scales as the file has them: sub-block `i`'s scale
/// is `d * sc[i]` and its minimum `-dmin * m[i]`.
pub(crate) struct Q4kSteps {
    pub d: f16,
    pub dmin: f16,
    pub sc: [u8; 8],
    pub m: [u8; 8],
}

impl Q4kSteps {
    pub(crate) fn of(block: &[u8]) -> Self {
        let scales = &block[4..16];
        let pairs: [(u8, u8); 8] = std::array::from_fn(|i| scale_min_k4(i, scales));
        Self {
            d: f16::from_le_bytes([block[0], block[1]]),
            dmin: f16::from_le_bytes([block[2], block[3]]),
            sc: pairs.map(|(sc, _)| sc),
            m: pairs.map(|(_, m)| m),
        }
    }
}

/// Sub-block `i`'s 32 nibbles of a Q4_K super-block: sub-blocks `2j` and
/// `2j + 1` share 32 bytes, low nibbles then high.
pub(crate) fn q4k_nibbles(block: &[u8], i: usize) -> [u8; 32] {
    let bytes = &block[16 + i / 2 * 32..][..32];
    let shift = 4 * (i % 2);
    std::array::from_fn(|l| (bytes[l] >> shift) & 0xF)
}

/// Sub-block `j`'s 6-bit scale and minimum, packed as ggml's
/// `get_scale_min_k4` reads them.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// The 2-bit fields of a Q2_K/Q3_K super-block's `qs` (64 bytes), in value
/// order: in each 128-value half, four 32-byte rounds at shifts 0, 2, 4, 6,
/// each two 16-value sub-blocks (bytes `0..16`, then `16..32`); with each
/// value its sub-block (`0..16`), its round in the super-block (`0..8`)
/// and its byte within the 32.
fn two_bit_fields(qs: &[u8]) -> impl Iterator<Item = (u8, usize, usize, usize)> + '_ {
    (0..QK_K).map(move |i| {
        let (half_block, round, l) = (i / 128, i % 128 / 32, i % 32);
        let q = (qs[half_block * 32 + l] >> (2 * round)) & 3;
        (q, i / 16, half_block * 4 + round, l)
    })
}

/// A Q2_K super-block (16 bytes of 4-bit scales and minimums, 64 of 2-bit
/// values, `d` and `dmin`): sub-block `s` of 16 values is `d * (sc_s & 15)
/// * q - dmin * (sc_s >> 4)`.
fn widen_q2k(block: &[u8], out: &mut Vec<f32>) {
    let (scales, qs) = (&block[..16], &block[16..80]);
    let (d, dmin) = (half(&block[80..]), half(&block[82..]));
    out.extend(two_bit_fields(qs).map(|(q, s, _, _)| {
        let sc = scales[s];
        d * f32::from(sc & 0xF) * f32::from(q) - dmin * f32::from(sc >> 4)
    }));
}

/// A Q3_K super-block (32 bytes of high bits, 64 of 2-bit values, twelve
/// bytes of sixteen 6-bit scales, `d`): value `d * (sc_s - 32) * (q - 4h)`,
/// `h` 1 where its high bit (bit `round` of `hmask[l]`) is clear. Scale
/// `s`'s low four bits are a nibble of bytes `0..8` (low for `s < 8`), its
/// top two bits bits `2 * (s / 4)` of byte `8 + s % 4`.
fn widen_q3k(block: &[u8], out: &mut Vec<f32>) {
    let (hmask, qs, scales) = (&block[..32], &block[32..96], &block[96..108]);
    let d = half(&block[108..]);
    let scale = |s: usize| {
        let low = (scales[s % 8] >> (4 * (s / 8))) & 0xF;
        let high = (scales[8 + s % 4] >> (2 * (s / 4))) & 3;
        i32::from(low | (high << 4)) - 32
    };
    out.extend(two_bit_fields(qs).map(|(q, s, round, l)| {
        let missing_high = if hmask[l] >> round & 1 == 1 { 0 } else { 4 };
        d * scale(s) as f32 * f32::from(q as i8 - missing_high)
    }));
}

/// A Q5_K super-block (`d`, `dmin`, twelve bytes of scales and minimums as
/// Q4_K's, 32 bytes of fifth bits, 128 of nibbles): sub-block `i` is
/// `d * sc_i * q - dmin * m_i`, its fifth bits bit `i` of each `qh` byte.
fn widen_q5k(block: &[u8], out: &mut Vec<f32>) {
    let (d, dmin) = (half(block), half(&block[2..]));
    let (scales, qh, qs) = (&block[4..16], &block[16..48], &block[48..176]);
    for i in 0..8 {
        let (sc, m) = scale_min_k4(i, scales);
        let (scale, min) = (d * f32::from(sc), dmin * f32::from(m));
        let bytes = &qs[i / 2 * 32..][..32];
        let shift = 4 * (i % 2);
        out.extend((0..32).map(|l| {
            let q = ((bytes[l] >> shift) & 0xF) | (((qh[l] >> i) & 1) << 4);
            scale * f32::from(q) - min
        }));
    }
}

/// A Q6_K super-block (128 bytes of low nibbles, 64 of high bit pairs, 16
/// signed 8-bit scales, `d`: f16) as its parts: value `i` is
/// `d * sc[i / 16] * (q[i] - 32)`, `q` in `0..64`.
pub(crate) struct Q6kParts {
    pub d: f16,
    pub sc: [i8; 16],
    pub q: [u8; QK_K],
}

impl Q6kParts {
    pub(crate) fn of(block: &[u8]) -> Self {
        let (ql, qh, scales) = (&block[..128], &block[128..192], &block[192..208]);
        let mut q = [0u8; QK_K];
        for half_block in 0..2 {
            let (ql, qh) = (&ql[half_block * 64..], &qh[half_block * 32..]);
            let q = &mut q[half_block * 128..];
            for l in 0..32 {
                q[l] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
                q[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
                q[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                q[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
            }
        }
        Self {
            d: f16::from_le_bytes([block[208], block[209]]),
            sc: std::array::from_fn(|i| scales[i] as i8),
            q,
        }
    }
}

fn widen_q6k(block: &[u8], out: &mut Vec<f32>) {
    let parts = Q6kParts::of(block);
    let d = parts.d.to_f32();
    out.extend(
        (parts.q.iter().enumerate())
            .map(|(i, &q)| d * f32::from(parts.sc[i / 16]) * f32::from(q as i8 - 32)),
    );
}

/// What the tests of this crate's block readers compare against: candle's
/// own quantisation and dequantisation (ggml's rules).
#[cfg(test)]
pub(crate) mod reference {
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};

    /// Every type with a block rule here.
    pub(crate) const BLOCK_TYPES: [GgmlDType; 11] = [
        GgmlDType::Q8_0,
        GgmlDType::Q4_0,
        GgmlDType::Q4_1,
        GgmlDType::Q5_0,
        GgmlDType::Q5_1,
        GgmlDType::F16,
        GgmlDType::Q2K,
        GgmlDType::Q3K,
        GgmlDType::Q4K,
        GgmlDType::Q5K,
        GgmlDType::Q6K,
    ];

    /// `values` (`rows x cols`) quantised to `dtype`, and the values its
    /// blocks dequantise to.
    pub(crate) fn quantized(
        dtype: GgmlDType,
        values: Vec<f32>,
        rows: usize,
        cols: usize,
    ) -> (QTensor, Vec<f32>) {
        let dense = Tensor::from_vec(values, (rows, cols), &Device::Cpu).unwrap();
        let t = QTensor::quantize(&dense, dtype).unwrap();
        let deq = t.dequantize(&Device::Cpu).unwrap();
        let deq = deq.flatten_all().unwrap().to_vec1().unwrap();
        (t, deq)
    }

    /// The largest difference between `got` and `want` (infinite when their
    /// lengths differ).
    pub(crate) fn worst(got: &[f32], want: &[f32]) -> f32 {
        if got.len() != want.len() {
            return f32::INFINITY;
        }
        (got.iter().zip(want)).fold(0f32, |m, (g, w)| m.max((g - w).abs()))
    }
}

#[cfg(test)]
mod tests {
    use super::reference::{quantized, worst, BLOCK_TYPES};
    use super::*;

    /// Every type widens a tensor's blocks to what candle's dequantisation
    /// gives (ggml's rule), on rows of varied scale and offset.
    #[test]
    fn each_block_type_widens_as_ggml_defines_it() {
        let values: Vec<f32> = (0..4 * QK_K)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0 * (1 + i / 200) as f32 + 0.3)
            .collect();
        for dtype in BLOCK_TYPES {
            let (t, want) = quantized(dtype, values.clone(), 4, QK_K);
            let kind = BlockType::of(dtype).unwrap();
            let data = t.data().unwrap();
            assert_eq!(data.len(), want.len() / kind.values() * kind.bytes());
            let mut got = Vec::new();
            for block in data.chunks_exact(kind.bytes()) {
                kind.widen(block, &mut got);
            }
            // The same rule; only f32 operation order may differ.
            let worst = worst(&got, &want);
            assert!(worst <= 1e-5, "{dtype:?}: off by {worst}");
        }
    }
}
