//! The token embedding, kept in the file's own blocks (8-bit, 4-bit or f16)
//! and widened one row per token looked up: a 49,152 x 576 table is 30 MB
//! as Q8_0 and was 113 MB widened to f32. Other types are widened at load.

use anyhow::{ensure, Result};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Device;
use half::f16;

/// GGML blocks hold 32 values.
const BLOCK: usize = 32;

pub(crate) struct Embedding {
    hidden: usize,
    rows: Rows,
}

enum Rows {
    /// GGML blocks of one of the compact types, row after row.
    Blocks {
        dtype: Compact,
        data: Vec<u8>,
    },
    F32(Vec<f32>),
}

#[derive(Clone, Copy)]
enum Compact {
    Q8_0,
    Q4_0,
    Q4_1,
    F16,
}

impl Compact {
    fn of(dtype: GgmlDType) -> Option<Self> {
        match dtype {
            GgmlDType::Q8_0 => Some(Compact::Q8_0),
            GgmlDType::Q4_0 => Some(Compact::Q4_0),
            GgmlDType::Q4_1 => Some(Compact::Q4_1),
            GgmlDType::F16 => Some(Compact::F16),
            _ => None,
        }
    }

    /// Bytes of one block of 32 values.
    fn block_bytes(self) -> usize {
        match self {
            Compact::Q8_0 => 34,
            Compact::Q4_0 => 18,
            Compact::Q4_1 => 20,
            Compact::F16 => 64,
        }
    }

    /// The 32 values of `block`, appended to `out`.
    fn widen(self, block: &[u8], out: &mut Vec<f32>) {
        let half_at = |i: usize| f16::from_le_bytes([block[i], block[i + 1]]).to_f32();
        match self {
            Compact::Q8_0 => {
                let d = half_at(0);
                out.extend(block[2..34].iter().map(|&q| f32::from(q as i8) * d));
            }
            Compact::Q4_0 => {
                let d = half_at(0);
                let q = &block[2..18];
                out.extend(q.iter().map(|&b| (f32::from(b & 0xF) - 8.0) * d));
                out.extend(q.iter().map(|&b| (f32::from(b >> 4) - 8.0) * d));
            }
            Compact::Q4_1 => {
                let (d, m) = (half_at(0), half_at(2));
                let q = &block[4..20];
                out.extend(q.iter().map(|&b| f32::from(b & 0xF) * d + m));
                out.extend(q.iter().map(|&b| f32::from(b >> 4) * d + m));
            }
            Compact::F16 => out.extend((0..BLOCK).map(|i| half_at(2 * i))),
        }
    }
}

impl Embedding {
    /// `table` (vocab rows of `hidden`), kept compact where its type allows.
    pub(crate) fn new(table: &QTensor, vocab: usize, hidden: usize) -> Result<Self> {
        ensure!(
            table.shape().elem_count() == vocab * hidden,
            "token_embd.weight has {} values, expected vocab {vocab} x hidden {hidden}",
            table.shape().elem_count()
        );
        let rows = match Compact::of(table.dtype()).filter(|_| hidden.is_multiple_of(BLOCK)) {
            Some(dtype) => Rows::Blocks {
                dtype,
                data: table.data()?.into_owned(),
            },
            None => Rows::F32((table.dequantize(&Device::Cpu)?.flatten_all()?).to_vec1::<f32>()?),
        };
        Ok(Self { hidden, rows })
    }

    /// Token `token`'s row, widened to f32, appended to `out`.
    pub(crate) fn push_row(&self, token: usize, out: &mut Vec<f32>) {
        match &self.rows {
            Rows::F32(values) => {
                out.extend_from_slice(&values[token * self.hidden..][..self.hidden])
            }
            Rows::Blocks { dtype, data } => {
                let row_bytes = self.row_bytes();
                let row = &data[token * row_bytes..][..row_bytes];
                for block in row.chunks_exact(dtype.block_bytes()) {
                    dtype.widen(block, out);
                }
            }
        }
    }

    /// The bytes one row takes.
    pub(crate) fn row_bytes(&self) -> usize {
        match &self.rows {
            Rows::F32(_) => self.hidden * 4,
            Rows::Blocks { dtype, .. } => self.hidden / BLOCK * dtype.block_bytes(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Tensor;

    /// Every row read back equals candle's own dequantisation of the table.
    #[test]
    fn each_compact_type_widens_as_ggml_defines_it() {
        let (vocab, hidden) = (5, 64);
        let values: Vec<f32> = (0..vocab * hidden)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0)
            .collect();
        let dense = Tensor::from_vec(values, (vocab, hidden), &Device::Cpu).unwrap();
        for dtype in [
            GgmlDType::Q8_0,
            GgmlDType::Q4_0,
            GgmlDType::Q4_1,
            GgmlDType::F16,
            GgmlDType::Q8_1,
        ] {
            let table = QTensor::quantize(&dense, dtype).unwrap();
            let want: Vec<f32> = table
                .dequantize(&Device::Cpu)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let embedding = Embedding::new(&table, vocab, hidden).unwrap();
            let mut got = Vec::new();
            for token in 0..vocab {
                embedding.push_row(token, &mut got);
            }
            assert_eq!(got, want, "{dtype:?}");
            let compact = !matches!(dtype, GgmlDType::Q8_1);
            assert_eq!(embedding.row_bytes() < hidden * 4, compact, "{dtype:?}");
        }
    }
}
