//! The token embedding, kept in the file's own blocks (Q8_0, Q4_0, Q4_1,
//! Q5_0, Q5_1, F16, Q4_K, Q5_K, Q6_K: see `ggml_blocks`) and widened one
//! row per token looked up: a 49,152 x 576 table is 30 MB as Q8_0 and was
//! 113 MB widened to f32; a Llama-3.2-1B-shaped Q6_K table is 83 MB against
//! 403 MB. Other types are widened at load.

use anyhow::{ensure, Result};
use candle_core::quantized::QTensor;
use candle_core::Device;

use crate::ggml_blocks::BlockType;

pub(crate) struct Embedding {
    hidden: usize,
    rows: Rows,
}

enum Rows {
    /// The file's blocks, row after row.
    Blocks {
        kind: BlockType,
        data: Vec<u8>,
    },
    F32(Vec<f32>),
}

impl Embedding {
    /// `table` (vocab rows of `hidden`), kept compact where its type allows.
    pub(crate) fn new(table: &QTensor, vocab: usize, hidden: usize) -> Result<Self> {
        ensure!(
            table.shape().elem_count() == vocab * hidden,
            "token_embd.weight has {} values, expected vocab {vocab} x hidden {hidden}",
            table.shape().elem_count()
        );
        let kind = BlockType::of(table.dtype()).filter(|k| hidden.is_multiple_of(k.values()));
        let rows = match kind {
            Some(kind) => Rows::Blocks {
                kind,
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
            Rows::Blocks { kind, data } => {
                let row_bytes = self.row_bytes();
                let row = &data[token * row_bytes..][..row_bytes];
                for block in row.chunks_exact(kind.bytes()) {
                    kind.widen(block, out);
                }
            }
        }
    }

    /// The bytes one row takes.
    pub(crate) fn row_bytes(&self) -> usize {
        match &self.rows {
            Rows::F32(_) => self.hidden * 4,
            Rows::Blocks { kind, .. } => self.hidden / kind.values() * kind.bytes(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ggml_blocks::reference::{quantized, worst, BLOCK_TYPES};
    use candle_core::quantized::GgmlDType;

    /// Every row read back equals candle's own dequantisation of the table
    /// (up to f32 rounding), and only types without a block rule take f32.
    #[test]
    fn each_compact_type_widens_as_ggml_defines_it() {
        let (vocab, hidden) = (5, 256);
        let values: Vec<f32> = (0..vocab * hidden)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0)
            .collect();
        // Q8_1 has no block rule here: widened at load.
        for dtype in BLOCK_TYPES.into_iter().chain([GgmlDType::Q8_1]) {
            let (table, want) = quantized(dtype, values.clone(), vocab, hidden);
            let embedding = Embedding::new(&table, vocab, hidden).unwrap();
            let mut got = Vec::new();
            for token in 0..vocab {
                embedding.push_row(token, &mut got);
            }
            let worst = worst(&got, &want);
            assert!(worst <= 1e-5, "{dtype:?}: {worst}");
            let compact = !matches!(dtype, GgmlDType::Q8_1);
            assert_eq!(embedding.row_bytes() < hidden * 4, compact, "{dtype:?}");
        }
    }
}
