//! The request shape every workload generates: a prompt of token
//! [`Segment`]s (named runs of deterministic tokens, so a million requests
//! with long shared prompts stay small), the output it will generate, props,
//! and its arrival (or the earlier request it follows, closed loop).

use pie_core::{PropValue, Props};
use serde::{Deserialize, Serialize};

/// Token ids are drawn below this.
pub const VOCAB: u64 = 32_000;

/// A run of `len` tokens determined by `key`: equal keys give equal tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Segment {
    pub key: u64,
    pub len: u32,
}

fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

impl Segment {
    /// A segment named by a few integers (e.g. kind, conversation, turn).
    pub fn named(parts: &[u64], len: u32) -> Self {
        let key = parts.iter().fold(0x5eed_u64, |h, p| {
            splitmix64(h ^ p.wrapping_mul(0x100_0000_01b3))
        });
        Self { key, len }
    }

    pub fn push_tokens(&self, out: &mut Vec<u32>) {
        self.push_token_range(0, self.len, out);
    }

    /// Its tokens `from..to` (clamped to its length).
    pub fn push_token_range(&self, from: u32, to: u32, out: &mut Vec<u32>) {
        out.extend((u64::from(from)..u64::from(to.min(self.len))).map(|i| {
            (splitmix64(self.key.wrapping_add(i.wrapping_mul(0x9e37_79b9))) % VOCAB) as u32
        }));
    }
}

/// A later turn: it arrives `think_us` after request `request` finished.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Follow {
    pub request: usize,
    pub think_us: u64,
}

/// One request of a workload.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Request {
    /// Arrival in microseconds since the start (ignored when `follows` is set).
    pub arrival_us: u64,
    pub follows: Option<Follow>,
    /// Who is served (fair share is per client).
    pub client: String,
    /// A label for per-class metrics (e.g. "tight", "high", the client).
    pub class: String,
    pub prompt: Vec<Segment>,
    /// The tokens it generates (fixed, so a later turn can contain them).
    pub output: Segment,
    pub props: Props,
}

impl Request {
    pub fn prompt_len(&self) -> usize {
        self.prompt.iter().map(|s| s.len as usize).sum()
    }

    pub fn output_len(&self) -> usize {
        self.output.len as usize
    }

    /// The prompt's tokens followed by the output's.
    pub fn tokens(&self, out: &mut Vec<u32>) {
        out.clear();
        self.push_token_range(0, usize::MAX, out);
    }

    /// Tokens `from..to` of the prompt followed by the output.
    pub fn push_token_range(&self, from: usize, to: usize, out: &mut Vec<u32>) {
        let mut start = 0;
        for seg in self.prompt.iter().chain(std::iter::once(&self.output)) {
            let end = start + seg.len as usize;
            if end > from && start < to {
                let local = |at: usize| (at.clamp(start, end) - start) as u32;
                seg.push_token_range(local(from), local(to), out);
            }
            start = end;
        }
    }

    /// Whether this request's prompt begins with all of `earlier`'s tokens, its
    /// prompt and then its output (a later turn of the same conversation).
    pub fn continues(&self, earlier: &Request) -> bool {
        let n = earlier.prompt.len();
        self.prompt.len() > n
            && self.prompt[..n] == earlier.prompt[..]
            && self.prompt[n] == earlier.output
    }
}

pub(crate) fn prop(props: &mut Props, key: &str, value: PropValue) {
    // Keys and types here are the documented built-in ones, so `set` cannot fail.
    props
        .set(key, value)
        .expect("built-in prop keys and types are valid");
}
