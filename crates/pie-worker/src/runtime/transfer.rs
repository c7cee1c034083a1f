//! The one transfer path for KV pages between workers. A worker pulls the
//! pages of a prompt it lacks from a peer (`POST /v1/internal/kv/pull`),
//! after the peer prefilled them when asked (offload, disaggregate), serves
//! such pulls to its peers, and takes pages a peer pushes
//! (`POST /v1/internal/kv/push`, checked the same way).
//!
//! What a pull guarantees:
//! - nothing moves unless both sides have the same [`PageFormat`] (the peer
//!   answers 409 naming the field; the stream header repeats the check);
//! - every imported page passed its checksum and carries the hash the
//!   puller's own chain (from the prompt's tokens and its cache salt) has at
//!   its place: a peer cannot plant pages under other hashes;
//! - exported pages are pinned under a lease (renewed per page sent, released
//!   at the end or after `[runtime.transfer] lease_ms` of silence), so they are
//!   not evicted mid-transfer;
//! - a pull is bounded in bytes (`max_bytes`) and time (`timeout_ms`); whatever
//!   fails, the pages that arrived whole stay and the rest of the prompt is
//!   prefilled locally: a transfer never fails or hangs a request.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use futures_util::{Stream, StreamExt};
use pie_core::hash::chain_from;
use pie_core::{BlockHash, ModelFingerprint};
use pie_kv::stream::{
    Checked, FrameReader, StreamCheck, StreamError, StreamHeader, END_FRAME, MAX_PUSH_HEADER_BYTES,
};
pub use pie_kv::stream::{PullRequest, PushHeader};
use tokio_stream::wrappers::ReceiverStream;

use super::command::Command;
use super::transfer_errors::{PullError, ServeError};
use super::Runtime;

/// Pages imported per engine command while a stream arrives.
const IMPORT_BATCH: usize = 32;
/// Pages exported per engine command while a stream is sent.
const EXPORT_BATCH: usize = 8;
/// Chunks queued between the exporting task and the HTTP body: enough to
/// keep the socket busy while the engine exports the next batch.
pub(super) const SEND_QUEUE: usize = 2 * EXPORT_BATCH;

/// Where a page stream's frames go, one chunk at a time.
pub(super) type FrameSender = tokio::sync::mpsc::Sender<std::io::Result<Vec<u8>>>;

/// One pull: from whom, for which prompt.
pub struct Pull<'a> {
    pub peer: &'a str,
    pub tokens: &'a [u32],
    pub cache_salt: Option<&'a str>,
    /// The chain by its hashes instead of `tokens` (never with `prefill`).
    pub blocks: Option<&'a [BlockHash]>,
    pub prefill: bool,
    pub timeout_ms: u64,
}

/// Verified pages on their way into the pool, imported in batches.
#[derive(Default)]
struct Arrivals {
    /// The chain the pages belong to (the engine keeps the part it holds).
    chain: Arc<[BlockHash]>,
    batch: Vec<Vec<u8>>,
    bytes: u64,
    held: usize,
}

impl Runtime {
    /// The block hashes of `tokens`' full pages under `salt`, as the engine
    /// computes them.
    pub(crate) fn chain(&self, tokens: &[u32], salt: Option<&str>) -> Vec<BlockHash> {
        let root = ModelFingerprint(self.shape.fingerprint).salted_root(salt);
        chain_from(root, tokens, self.shape.page_size)
    }

    /// How many leading pages of `chain` the pool holds.
    pub(super) async fn cached_pages(&self, chain: &[BlockHash]) -> Result<usize, String> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.send(Command::CachedPages {
            chain: chain.to_vec(),
            reply: tx,
        });
        rx.await.map_err(|_| self.engine_stopped())
    }

    /// The pages of a prefix (its chain) that `peer` holds, pulled into this pool's prefix cache: the first stage of a
    /// migration (the process keeps running there; its hand-off then pulls
    /// only what came after), or a copy of a hot prefix (`replicate`).
    pub async fn prefetch(&self, peer: &str, chain: &[BlockHash]) -> Result<usize, PullError> {
        self.pull_pages(Pull {
            peer,
            tokens: &[],
            cache_salt: None,
            blocks: Some(chain),
            prefill: false,
            timeout_ms: self.settings.transfer.timeout_ms,
        })
        .await
    }

    /// Pull the prompt's pages this pool lacks; returns how many leading
    /// pages it holds afterwards. Failures are counted (refusal by reason, a
    /// fallback to local prefill) and logged; the caller prefills what is
    /// missing either way.
    pub(crate) async fn pull_pages(&self, pull: Pull<'_>) -> Result<usize, PullError> {
        let chain = match pull.blocks {
            Some(blocks) => blocks.to_vec(),
            None => self.chain(pull.tokens, pull.cache_salt),
        };
        let have = self.cached_pages(&chain).await.map_err(PullError::Peer)?;
        if have >= chain.len() {
            return Ok(have);
        }
        let started = std::time::Instant::now();
        let mut arrivals = Arrivals {
            chain: chain.as_slice().into(),
            held: have,
            ..Arrivals::default()
        };
        let streamed = within(pull.timeout_ms, self.stream_in(&pull, chain, &mut arrivals)).await;
        let settled = self.settle(&mut arrivals, started, streamed).await;
        if let Err(e) = &settled {
            self.metrics.transfer_fallbacks.inc();
            tracing::warn!(peer = pull.peer, error = %e, pages = arrivals.held, "KV pull incomplete; prefilling the rest locally");
        }
        settled
    }

    /// After a stream ended (or was cut): keep the whole pages that arrived,
    /// and count its time and any refusal.
    async fn settle(
        &self,
        arrivals: &mut Arrivals,
        started: std::time::Instant,
        streamed: Result<(), PullError>,
    ) -> Result<usize, PullError> {
        self.import(arrivals).await;
        self.metrics
            .transfer_seconds
            .observe(started.elapsed().as_secs_f64());
        streamed.map(|()| arrivals.held).inspect_err(|e| {
            self.metrics.count_transfer_refusal(e.reason());
        })
    }

    async fn stream_in(
        &self,
        pull: &Pull<'_>,
        chain: Vec<BlockHash>,
        arrivals: &mut Arrivals,
    ) -> Result<(), PullError> {
        let body = PullRequest {
            format: self.page_format,
            tokens: pull.tokens.to_vec(),
            blocks: pull.blocks.map(|b| b.iter().map(|h| h.0).collect()),
            cache_salt: pull.cache_salt.map(str::to_string),
            skip_pages: arrivals.held,
            prefill: pull.prefill,
            max_bytes: self.settings.transfer.max_bytes.0,
        };
        let url = format!("{}/v1/internal/kv/pull", pull.peer.trim_end_matches('/'));
        let mut req = self.http.post(url).json(&body);
        if let Some(key) = &self.settings.worker_key {
            req = req.bearer_auth(key);
        }
        let resp = req
            .send()
            .await
            .map_err(|e| PullError::Peer(e.to_string()))?;
        let status = resp.status();
        if !status.is_success() {
            let message = resp.text().await.unwrap_or_default();
            return Err(if status == reqwest::StatusCode::CONFLICT {
                StreamError::Handshake(message).into()
            } else {
                PullError::Peer(format!("answered {status}: {message}"))
            });
        }
        let mut check = StreamCheck::new(self.page_format, chain, arrivals.held);
        let mut frames = FrameReader::new(check.max_frame());
        let mut body = resp.bytes_stream();
        self.receive(&mut body, &mut frames, &mut check, arrivals)
            .await
    }

    /// Read the page stream in `body` into the pool, batch by batch, up to
    /// its end frame; every page checked by `check`, the bytes bounded by
    /// `[runtime.transfer] max_bytes`.
    async fn receive<S, B, E>(
        &self,
        body: &mut S,
        frames: &mut FrameReader,
        check: &mut StreamCheck,
        arrivals: &mut Arrivals,
    ) -> Result<(), PullError>
    where
        S: Stream<Item = Result<B, E>> + Unpin,
        B: AsRef<[u8]>,
    {
        let max_bytes = self.settings.transfer.max_bytes.0;
        loop {
            while let Some(frame) = frames.next_frame()? {
                if let Checked::Page(_, page) = check.frame(frame)? {
                    arrivals.bytes += page.len() as u64;
                    if arrivals.bytes > max_bytes {
                        return Err(PullError::Bytes(max_bytes));
                    }
                    arrivals.batch.push(page);
                    if arrivals.batch.len() >= IMPORT_BATCH {
                        self.import(arrivals).await;
                    }
                }
            }
            // A connection that breaks mid-body is a torn stream.
            match body.next().await {
                Some(chunk) => frames.push(chunk.map_err(|_| StreamError::Torn)?.as_ref()),
                None => break,
            }
        }
        if !check.ended() {
            return Err(StreamError::Torn.into());
        }
        if frames.pending() > 0 {
            return Err(StreamError::AfterEnd.into());
        }
        Ok(())
    }

    /// Take pages a peer pushes (`POST /v1/internal/kv/push`): the body is a
    /// [`PushHeader`] frame, then a page stream from the prompt's first page,
    /// checked as a pull is. Returns the leading pages held afterwards; on a
    /// refusal the whole pages before it are kept.
    pub(crate) async fn receive_push(&self, body: Body) -> Result<usize, ServeError> {
        let started = std::time::Instant::now();
        let mut body = body.into_data_stream();
        let max_page = pie_kv::transfer::page_bytes_len(&self.page_format);
        let mut frames = FrameReader::new(max_page.max(MAX_PUSH_HEADER_BYTES));
        let header = first_frame(&mut body, &mut frames)
            .await
            .and_then(|bytes| {
                serde_json::from_slice::<PushHeader>(&bytes)
                    .map_err(|e| StreamError::Header(e.to_string()).into())
            })
            .map_err(|e| ServeError::BadTokens(format!("push header: {e}")))?;
        self.check_tokens(&header.tokens)?;
        let chain = self.chain(&header.tokens, header.cache_salt.as_deref());
        let mut check = StreamCheck::new(self.page_format, chain.clone(), 0);
        let mut arrivals = Arrivals {
            chain: chain.as_slice().into(),
            ..Arrivals::default()
        };
        let timeout_ms = self.settings.transfer.timeout_ms;
        let streamed = within(
            timeout_ms,
            self.receive(&mut body, &mut frames, &mut check, &mut arrivals),
        )
        .await;
        self.settle(&mut arrivals, started, streamed)
            .await
            .map_err(|error| ServeError::Refused {
                pages: arrivals.held,
                error,
            })
    }

    /// Tokens a peer names: 1 to `max_seq_tokens - 1` ids of this vocabulary.
    pub(crate) fn check_tokens(&self, tokens: &[u32]) -> Result<(), ServeError> {
        if tokens.is_empty() || tokens.len() >= self.max_seq_tokens {
            return Err(ServeError::BadTokens(format!(
                "tokens: need 1 to {} tokens, got {}",
                self.max_seq_tokens - 1,
                tokens.len()
            )));
        }
        self.check_vocab("tokens", tokens)
            .map_err(|e| ServeError::BadTokens(e.to_string()))
    }

    /// Import the arrived pages into the pool and count them.
    async fn import(&self, arrivals: &mut Arrivals) {
        if arrivals.batch.is_empty() {
            return;
        }
        let pages = std::mem::take(&mut arrivals.batch);
        let bytes: u64 = pages.iter().map(|p| p.len() as u64).sum();
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.send(Command::ImportPages {
            chain: arrivals.chain.clone(),
            pages,
            reply: tx,
        });
        let imported = rx.await.unwrap_or(0);
        arrivals.held += imported;
        self.metrics.count_transfer("in", imported, bytes);
    }

    /// Answer a peer's pull: prefill first if asked, pin the prompt's cached
    /// pages under a lease and stream them. A format mismatch is a 409 naming
    /// the field; bad tokens are a 400.
    pub(crate) async fn serve_pull(self: &Arc<Self>, req: PullRequest) -> Result<Body, ServeError> {
        if let Some(why) = self.page_format.mismatch(&req.format) {
            self.metrics.count_transfer_refusal("handshake");
            return Err(ServeError::Handshake(format!("handshake refused: {why}")));
        }
        let chain = match &req.blocks {
            Some(_) if req.prefill => {
                return Err(ServeError::BadTokens(
                    "a pull by `blocks` cannot ask for a prefill: send `tokens`".into(),
                ))
            }
            Some(blocks) => blocks.iter().copied().map(BlockHash).collect(),
            None => {
                self.check_tokens(&req.tokens)?;
                self.chain(&req.tokens, req.cache_salt.as_deref())
            }
        };
        // Only full pages move: when they are all here, prefilling computes
        // nothing the puller receives.
        if req.prefill
            && self
                .cached_pages(&chain)
                .await
                .map_err(ServeError::Prefill)?
                < chain.len()
        {
            self.prefill_for_peer(req.tokens.clone(), req.cache_salt.clone())
                .await
                .map_err(ServeError::Prefill)?;
        }
        let ttl = Duration::from_millis(self.settings.transfer.lease_ms);
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.send(Command::PinPrefix {
            chain,
            ttl,
            reply: tx,
        });
        let (lease, pages) = rx
            .await
            .map_err(|_| ServeError::Prefill(self.engine_stopped()))?;
        let (out, body) = tokio::sync::mpsc::channel(SEND_QUEUE);
        let rt = self.clone();
        tokio::spawn(async move {
            rt.stream_out(lease, req.skip_pages..pages, req.max_bytes, out)
                .await;
            rt.send(Command::ReleaseLease(lease));
        });
        Ok(Body::from_stream(ReceiverStream::new(body)))
    }

    /// Send the leased pages `range` as a stream; stops early (without the end
    /// frame, so the puller sees a torn stream) when the lease is gone or the
    /// puller went away, and ends the stream before exceeding `max_bytes`.
    pub(super) async fn stream_out(
        &self,
        lease: u64,
        range: std::ops::Range<usize>,
        max_bytes: u64,
        out: FrameSender,
    ) {
        if !self.send_stream_header(&out).await {
            return;
        }
        let mut sent_bytes = 0u64;
        for from in range.clone().step_by(EXPORT_BATCH) {
            let (tx, rx) = tokio::sync::oneshot::channel();
            let count = EXPORT_BATCH.min(range.end - from);
            self.send(Command::ExportLeased {
                lease,
                from,
                count,
                reply: tx,
            });
            let Ok(Some(pages)) = rx.await else {
                return;
            };
            for page in pages {
                if sent_bytes + page.len() as u64 > max_bytes {
                    let _ = out.send(Ok(END_FRAME.to_vec())).await;
                    return;
                }
                sent_bytes += page.len() as u64;
                if !self.send_page(page, &out).await {
                    return;
                }
            }
        }
        let _ = out.send(Ok(END_FRAME.to_vec())).await;
    }

    /// Send `pages` (already exported) as a whole stream.
    pub(super) async fn stream_pages(&self, pages: Vec<Vec<u8>>, out: FrameSender) {
        if !self.send_stream_header(&out).await {
            return;
        }
        for page in pages {
            if !self.send_page(page, &out).await {
                return;
            }
        }
        let _ = out.send(Ok(END_FRAME.to_vec())).await;
    }

    async fn send_stream_header(&self, out: &FrameSender) -> bool {
        let header = StreamHeader::new(self.page_format).frame();
        out.send(Ok(header)).await.is_ok()
    }

    /// One page's frame; false when the receiver went away.
    async fn send_page(&self, page: Vec<u8>, out: &FrameSender) -> bool {
        self.slow_transfer_fault().await;
        self.metrics.count_transfer("out", 1, page.len() as u64);
        // The frame's length, then the page itself (not copied into one).
        let length = pie_kv::stream::frame_length(page.len()).to_vec();
        out.send(Ok(length)).await.is_ok() && out.send(Ok(page)).await.is_ok()
    }

    #[cfg(feature = "fault-injection")]
    async fn slow_transfer_fault(&self) {
        let ms = self
            .transfer_delay_ms
            .load(std::sync::atomic::Ordering::Relaxed);
        if ms > 0 {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
    }

    #[cfg(not(feature = "fault-injection"))]
    async fn slow_transfer_fault(&self) {}
}

/// `work`, or a timeout after `timeout_ms`.
async fn within(
    timeout_ms: u64,
    work: impl std::future::Future<Output = Result<(), PullError>>,
) -> Result<(), PullError> {
    tokio::time::timeout(Duration::from_millis(timeout_ms), work)
        .await
        .unwrap_or(Err(PullError::Timeout(timeout_ms)))
}

/// The first whole frame of `body`.
async fn first_frame<S, B, E>(body: &mut S, frames: &mut FrameReader) -> Result<Vec<u8>, PullError>
where
    S: Stream<Item = Result<B, E>> + Unpin,
    B: AsRef<[u8]>,
{
    loop {
        if let Some(frame) = frames.next_frame()? {
            return Ok(frame);
        }
        match body.next().await {
            Some(chunk) => frames.push(chunk.map_err(|_| StreamError::Torn)?.as_ref()),
            None => return Err(StreamError::Torn.into()),
        }
    }
}
