//! Why a transfer of KV pages stopped short: what a pull brings back
//! ([`PullError`]) and why a pull was not served or a push not taken
//! ([`ServeError`]); the transfers themselves are `transfer.rs`.

use pie_kv::stream::StreamError;

/// Why a pull brought fewer pages than the prompt has.
#[derive(Debug, thiserror::Error)]
pub enum PullError {
    #[error("peer failed: {0}")]
    Peer(String),
    #[error(transparent)]
    Refused(#[from] StreamError),
    #[error("over the {0}-byte bound of one transfer")]
    Bytes(u64),
    #[error("not done within {0} ms")]
    Timeout(u64),
}

impl PullError {
    /// The `reason` label of `pie_kv_transfer_refusals_total`.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Peer(_) => "peer",
            Self::Refused(e) => e.reason(),
            Self::Bytes(_) => "bytes",
            Self::Timeout(_) => "timeout",
        }
    }
}

/// Why a pull was not served or a push not taken (mapped to HTTP by the API).
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("{0}")]
    Handshake(String),
    #[error("{0}")]
    BadTokens(String),
    #[error("prefill for the peer failed: {0}")]
    Prefill(String),
    #[error("push refused after {pages} pages: {error}")]
    Refused { pages: usize, error: PullError },
}
