//! The command protocol between the [`Runtime`](super::Runtime) handle and the
//! engine thread: the commands the runtime sends (one channel, applied in
//! order between two engine steps) and the events the engine thread reports
//! to each sequence's driver.
//!
//! Invariant: the engine thread is the only owner of the engine; everything
//! else reaches it through a [`Command`], so no lock is held across a step.

use std::sync::Arc;
use std::time::Duration;

use pie_core::{BlockHash, KvSnapshot, Props, SeqId};
use pie_policy::{KeepSession, WorkerPolicy};
use serde_json::Value;
use tokio::sync::{mpsc, oneshot};

use crate::engine::{FinishReason, Request, Scored, SeqInfo};

/// What the engine thread reports to one sequence's driver.
#[derive(Debug)]
pub(super) enum SeqEvent {
    Started {
        cached_tokens: usize,
    },
    /// Preempted earlier, it waits for its prompt's pages from disk until
    /// `Command::Reloaded`.
    Reload,
    /// The log-probabilities of the sample that follows (a `Token`, or the
    /// stop token that ends it); only for a request that asked.
    Logprobs(pie_model::TokenLogprobs),
    /// A distribution a pass asked for (`Request::score`).
    Scored(Scored),
    Token(u32),
    Finished(FinishReason, SeqInfo),
    Failed(String),
}

/// What the runtime asks of the engine thread.
pub(super) enum Command {
    Add {
        req: Box<Request>,
        events: mpsc::UnboundedSender<SeqEvent>,
        reply: oneshot::Sender<SeqId>,
    },
    Abort(SeqId),
    /// End a retained session's retention (its owner, a context, is gone).
    ReleaseSession(String),
    /// Keep only the first `len` tokens of a retained session's pages (its
    /// context was truncated).
    TruncateSession {
        session: String,
        len: usize,
    },
    /// A preempted sequence's pages are loaded from disk again (or given up on).
    Reloaded(SeqId),
    /// Finish the sequence after its next token (a hand-off).
    StopAfterNext(SeqId),
    SetProps(SeqId, Props),
    SetPolicies {
        ordering: Box<dyn WorkerPolicy>,
        keep_session: Option<KeepSession>,
    },
    Summary(oneshot::Sender<Value>),
    KvSnapshot(oneshot::Sender<KvSnapshot>),
    /// How many leading pages of the chain the pool holds.
    CachedPages {
        chain: Vec<BlockHash>,
        reply: oneshot::Sender<usize>,
    },
    /// Pin the pool's leading pages of the chain under a new lease: (lease, pages).
    PinPrefix {
        chain: Vec<BlockHash>,
        ttl: Duration,
        reply: oneshot::Sender<(u64, usize)>,
    },
    /// Pages `from..from + count` of a lease, exported (renews the lease);
    /// None when the lease is gone.
    ExportLeased {
        lease: u64,
        from: usize,
        count: usize,
        reply: oneshot::Sender<Option<Vec<Vec<u8>>>>,
    },
    ReleaseLease(u64),
    ImportPages {
        /// The chain `pages` continue: the pool's leading part of it is kept
        /// while they are imported.
        chain: Arc<[BlockHash]>,
        pages: Vec<Vec<u8>>,
        reply: oneshot::Sender<usize>,
    },
    /// Spill retained sessions evicted early (`retain-all`), or not.
    SetSpill(bool),
    /// The disk tier gained and lost these blocks (for the KV events).
    DiskChanged {
        stored: Vec<BlockHash>,
        removed: Vec<BlockHash>,
    },
    /// `fault-injection`: panic on the engine thread.
    #[cfg(feature = "fault-injection")]
    Panic,
}
