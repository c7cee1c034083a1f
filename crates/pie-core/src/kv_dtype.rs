//! `KvDtype`: the element type of a worker's KV pages (`[runtime] kv_dtype`).
//! One definition for the config schema (`pie-policy`), the page pool and the
//! page format (`pie-kv`), which carries it as a number in every page header
//! and stream handshake.

use serde::{Deserialize, Serialize};

/// f16 is the default: with linear layers in f32 its rounding keeps the
/// default model's next-token top-1 at every position and moves the logits by
/// under 0.05 of their standard deviation (issue 17's bound); with the
/// engine's 8-bit activations it moves them no more than a change of page
/// size does in f32 (`crates/pie-worker/tests/kv_dtype.rs`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvDtype {
    F32,
    /// IEEE half precision: half the bytes of f32; attention widens it to f32
    /// and accumulates in f32.
    #[default]
    F16,
}

impl KvDtype {
    /// Bytes of one K or V element.
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 => 2,
        }
    }

    /// The number in the page format (headers, handshakes, disk directories):
    /// 0 = f32 (the format's only dtype before f16 existed), 1 = f16.
    pub fn code(self) -> u32 {
        match self {
            KvDtype::F32 => 0,
            KvDtype::F16 => 1,
        }
    }

    pub fn from_code(code: u32) -> Option<Self> {
        [KvDtype::F32, KvDtype::F16]
            .into_iter()
            .find(|d| d.code() == code)
    }

    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
        }
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for KvDtype {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        [KvDtype::F32, KvDtype::F16]
            .into_iter()
            .find(|d| d.name() == s)
            .ok_or_else(|| format!("unknown KV dtype {s:?}: \"f16\" or \"f32\""))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_and_names_round_trip() {
        for d in [KvDtype::F32, KvDtype::F16] {
            assert_eq!(KvDtype::from_code(d.code()), Some(d));
            assert_eq!(d.name().parse::<KvDtype>(), Ok(d));
        }
        assert_eq!(KvDtype::from_code(2), None);
        assert!("bf16".parse::<KvDtype>().is_err());
    }
}
