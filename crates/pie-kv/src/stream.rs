//! A page stream: how pages travel between workers (a peer's answer to a pull,
//! a push), and later to a pool or disk.
//!
//! A stream is frames, each a u32 LE length and that many bytes: first the
//! JSON [`StreamHeader`] (protocol version and [`PageFormat`]), then one frame
//! per page in the `transfer` format, then an empty frame that ends it. A
//! stream that stops before its end frame is torn; the pages before the tear
//! are whole and verified.
//!
//! The receiver checks a stream with [`StreamCheck`] against the block-hash
//! chain it computed from the prompt's own tokens: the header's format must be
//! its own, every page must pass its checksum and header, and page `i` must
//! carry the chain's hash `i`. A sender can therefore not place a page under a
//! hash the prompt does not produce.

use pie_core::BlockHash;
use serde::{Deserialize, Serialize};

use crate::transfer::{page_bytes_len, verify_page_format, PageFormat, TransferError};

/// The version of the stream framing and header.
pub const STREAM_VERSION: u32 = 1;
/// The header frame is a small JSON object; more is a broken stream.
const MAX_HEADER_BYTES: usize = 64 * 1024;

/// What a puller asks a peer (a worker or a page pool) for
/// (`POST /v1/internal/kv/pull`); the answer is a page stream.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PullRequest {
    /// The puller's page format; the peer refuses (409) any other.
    pub format: PageFormat,
    #[serde(default)]
    pub tokens: Vec<u32>,
    /// The chain itself instead of `tokens` (a controller copying a prefix
    /// it knows by its hashes); never with `prefill`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blocks: Option<Vec<u64>>,
    #[serde(default)]
    pub cache_salt: Option<String>,
    /// Leading pages the puller already holds: the stream starts after them.
    #[serde(default)]
    pub skip_pages: usize,
    /// Prefill `tokens` first (offload, disaggregate); otherwise only pages
    /// already cached are sent.
    #[serde(default)]
    pub prefill: bool,
    /// The peer sends no more page bytes than this.
    pub max_bytes: u64,
}

/// The first frame of a push (`POST /v1/internal/kv/push`): the prefix whose
/// pages follow, as a prompt's tokens (under its cache salt) or, to a page
/// pool only, as its block hashes.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PushHeader {
    #[serde(default)]
    pub tokens: Vec<u32>,
    #[serde(default)]
    pub cache_salt: Option<String>,
    /// The chain itself (a pool takes it instead of tokens; workers do not).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blocks: Option<Vec<u64>>,
    /// Keep these pages before others when the pool must evict (soft pin).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pin: bool,
    /// Soft-pin them for this long only (a spilled session's `keep-ms`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep_ms: Option<u64>,
}

/// A push header holds a prompt's token ids: bounded well above any context.
pub const MAX_PUSH_HEADER_BYTES: usize = 4 << 20;

/// The first frame of a stream.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StreamHeader {
    pub version: u32,
    pub format: PageFormat,
}

impl StreamHeader {
    pub fn new(format: PageFormat) -> Self {
        Self {
            version: STREAM_VERSION,
            format,
        }
    }

    /// The header as its frame.
    pub fn frame(&self) -> Vec<u8> {
        frame(&serde_json::to_vec(self).expect("a header serializes"))
    }
}

/// `bytes` as one frame.
pub fn frame(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len() + 4);
    out.extend_from_slice(&frame_length(bytes.len()));
    out.extend_from_slice(bytes);
    out
}

/// The length that starts a frame of `len` bytes (a sender may write it and
/// the bytes separately, without copying them into one frame).
pub fn frame_length(len: usize) -> [u8; 4] {
    (len as u32).to_le_bytes()
}

/// The frame that ends a stream.
pub const END_FRAME: [u8; 4] = [0; 4];

/// Why a stream was refused (or stopped being read); each has a short label
/// for metrics.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum StreamError {
    #[error("frame of {0} bytes is over the {1}-byte limit")]
    FrameTooLarge(usize, usize),
    #[error("bad stream header: {0}")]
    Header(String),
    #[error("stream version {0}, this side speaks {STREAM_VERSION}")]
    Version(u32),
    #[error("handshake refused: {0}")]
    Handshake(String),
    #[error("page {at}: {error}")]
    Page { at: usize, error: TransferError },
    #[error("page {at} carries block hash {got:016x}, the prompt's chain has {want}")]
    Chain { at: usize, got: u64, want: String },
    #[error("stream ended before its end frame (torn)")]
    Torn,
    #[error("bytes after the end frame")]
    AfterEnd,
}

impl StreamError {
    /// The metric label of this refusal.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::FrameTooLarge(..) | Self::Header(_) | Self::AfterEnd => "frame",
            Self::Version(_) | Self::Handshake(_) => "handshake",
            Self::Page { error, .. } => match error {
                TransferError::Checksum => "checksum",
                TransferError::Model { .. } => "model",
                TransferError::Layout { .. } => "layout",
                _ => "page",
            },
            Self::Chain { .. } => "chain",
            Self::Torn => "torn",
        }
    }
}

/// Frames out of a byte stream that arrives in arbitrary chunks.
#[derive(Debug)]
pub struct FrameReader {
    buf: Vec<u8>,
    start: usize,
    max_frame: usize,
}

impl FrameReader {
    /// Frames longer than `max_frame` bytes are an error.
    pub fn new(max_frame: usize) -> Self {
        Self {
            buf: Vec::new(),
            start: 0,
            max_frame,
        }
    }

    /// Frames longer than `max_frame` are an error from now on (a receiver
    /// that learns the page size from a stream's header).
    pub fn set_max_frame(&mut self, max_frame: usize) {
        self.max_frame = max_frame;
    }

    pub fn push(&mut self, chunk: &[u8]) {
        if self.start > 0 && self.start >= self.buf.len() / 2 {
            self.buf.drain(..self.start);
            self.start = 0;
        }
        self.buf.extend_from_slice(chunk);
    }

    /// The next whole frame, or None until more bytes arrive.
    pub fn next_frame(&mut self) -> Result<Option<Vec<u8>>, StreamError> {
        let rest = &self.buf[self.start..];
        let Some(len) = rest.get(..4) else {
            return Ok(None);
        };
        let len = u32::from_le_bytes(len.try_into().expect("4 bytes")) as usize;
        if len > self.max_frame {
            return Err(StreamError::FrameTooLarge(len, self.max_frame));
        }
        let Some(body) = rest.get(4..4 + len) else {
            return Ok(None);
        };
        let body = body.to_vec();
        self.start += 4 + len;
        Ok(Some(body))
    }

    /// Bytes received but not yet returned as a frame.
    pub fn pending(&self) -> usize {
        self.buf.len() - self.start
    }
}

/// What one checked frame was.
#[derive(Debug, PartialEq)]
pub enum Checked {
    Header,
    /// A verified page: its index in the chain and its bytes.
    Page(usize, Vec<u8>),
    End,
}

/// The receiver's check of a stream (see the module doc).
#[derive(Debug)]
pub struct StreamCheck {
    format: PageFormat,
    chain: Vec<BlockHash>,
    next: usize,
    header_seen: bool,
    ended: bool,
}

impl StreamCheck {
    /// Pages are expected from `chain[first]` on.
    pub fn new(format: PageFormat, chain: Vec<BlockHash>, first: usize) -> Self {
        Self {
            format,
            chain,
            next: first,
            header_seen: false,
            ended: false,
        }
    }

    /// The largest frame a valid stream has.
    pub fn max_frame(&self) -> usize {
        page_bytes_len(&self.format).max(MAX_HEADER_BYTES)
    }

    pub fn ended(&self) -> bool {
        self.ended
    }

    /// Check the next frame.
    pub fn frame(&mut self, bytes: Vec<u8>) -> Result<Checked, StreamError> {
        if self.ended {
            return Err(StreamError::AfterEnd);
        }
        if !self.header_seen {
            let header: StreamHeader =
                serde_json::from_slice(&bytes).map_err(|e| StreamError::Header(e.to_string()))?;
            if header.version != STREAM_VERSION {
                return Err(StreamError::Version(header.version));
            }
            if let Some(why) = self.format.mismatch(&header.format) {
                return Err(StreamError::Handshake(why));
            }
            self.header_seen = true;
            return Ok(Checked::Header);
        }
        if bytes.is_empty() {
            self.ended = true;
            return Ok(Checked::End);
        }
        let at = self.next;
        let got = verify_page_format(&self.format, &bytes)
            .map_err(|error| StreamError::Page { at, error })?;
        match self.chain.get(at) {
            Some(&want) if want == got => {
                self.next += 1;
                Ok(Checked::Page(at, bytes))
            }
            want => Err(StreamError::Chain {
                at,
                got: got.0,
                want: want.map_or("no page there".into(), |h| format!("{:016x}", h.0)),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transfer::export_page;
    use crate::{KvDtype, KvLayout, KvPool};
    use pie_core::ModelFingerprint;
    use proptest::prelude::*;

    const LAYOUT: KvLayout = KvLayout {
        layers: 2,
        page_size: 2,
        kv_dim: 3,
    };

    /// A pool holding `n` published pages with the hashes 100, 101, ...
    fn source(n: usize, fingerprint: u64) -> (KvPool, Vec<BlockHash>) {
        source_of(KvDtype::F32, n, fingerprint)
    }

    fn source_of(dtype: KvDtype, n: usize, fingerprint: u64) -> (KvPool, Vec<BlockHash>) {
        let mut pool = KvPool::with_dtype(LAYOUT, dtype, n, ModelFingerprint(fingerprint));
        let mut chain = Vec::new();
        for i in 0..n {
            let page = pool.allocate().expect("room");
            for layer in 0..LAYOUT.layers {
                for slot in 0..LAYOUT.page_size {
                    let x = (i * 7 + layer * 3 + slot) as f32;
                    pool.write(layer, page, slot, &[x, -x, 0.5], &[x; 3]);
                }
            }
            let hash = BlockHash(100 + i as u64);
            pool.publish(page, hash);
            chain.push(hash);
        }
        (pool, chain)
    }

    fn stream_of(pool: &KvPool, hashes: &[BlockHash]) -> Vec<u8> {
        let mut out = StreamHeader::new(PageFormat::of(pool)).frame();
        for &h in hashes {
            let page = pool.lookup(h).expect("published");
            out.extend(frame(&export_page(pool, page).expect("exports")));
        }
        out.extend_from_slice(&END_FRAME);
        out
    }

    /// Feed `bytes` in chunks of `chunk` and check every frame.
    fn receive(
        check: &mut StreamCheck,
        bytes: &[u8],
        chunk: usize,
    ) -> Result<Vec<usize>, StreamError> {
        let mut reader = FrameReader::new(check.max_frame());
        let mut pages = Vec::new();
        for piece in bytes.chunks(chunk.max(1)) {
            reader.push(piece);
            while let Some(f) = reader.next_frame()? {
                if let Checked::Page(at, _) = check.frame(f)? {
                    pages.push(at);
                }
            }
        }
        if !check.ended() {
            return Err(StreamError::Torn);
        }
        Ok(pages)
    }

    proptest! {
        #[test]
        fn any_chunking_gives_every_page_in_order(chunk in 1usize..400, first in 0usize..4) {
            let (pool, chain) = source(4, 9);
            let bytes = stream_of(&pool, &chain[first..]);
            let mut check = StreamCheck::new(PageFormat::of(&pool), chain, first);
            prop_assert_eq!(receive(&mut check, &bytes, chunk)?, (first..4).collect::<Vec<_>>());
        }
    }

    #[test]
    fn a_flipped_byte_a_foreign_model_a_wrong_hash_or_a_tear_is_refused() {
        let (pool, chain) = source(3, 9);
        let format = PageFormat::of(&pool);
        let bytes = stream_of(&pool, &chain);
        let refusal = |bytes: &[u8], chain: Vec<BlockHash>| {
            receive(&mut StreamCheck::new(format, chain, 0), bytes, 64).unwrap_err()
        };

        let mut flipped = bytes.clone();
        let in_second_page = flipped.len() - 40;
        flipped[in_second_page] ^= 0x10;
        let err = refusal(&flipped, chain.clone());
        assert_eq!(
            (err.reason(), err.to_string().starts_with("page 2")),
            ("checksum", true)
        );

        let (foreign, foreign_chain) = source(3, 10);
        let err = refusal(&stream_of(&foreign, &foreign_chain), chain.clone());
        assert_eq!(err.reason(), "handshake");
        assert!(err.to_string().contains("model fingerprint"), "{err}");

        let mut other_chain = chain.clone();
        other_chain[1] = BlockHash(7);
        let err = refusal(&bytes, other_chain);
        assert_eq!(err.reason(), "chain", "{err}");

        let err = refusal(&bytes[..bytes.len() - 4], chain.clone());
        assert_eq!(err, StreamError::Torn);

        let mut huge = StreamHeader::new(format).frame();
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(refusal(&huge, chain).reason(), "frame");
    }

    /// f16 pages stream to an f16 receiver like f32 ones (half the bytes);
    /// a receiver of the other dtype refuses them at the handshake, naming it.
    #[test]
    fn pages_of_another_kv_dtype_are_refused_at_the_handshake() {
        let (half, chain) = source_of(KvDtype::F16, 3, 9);
        let (full, _) = source(3, 9);
        let bytes = stream_of(&half, &chain);
        let saved = stream_of(&full, &chain).len() - bytes.len();
        assert_eq!(
            saved,
            3 * LAYOUT.page_bytes(KvDtype::F16),
            "half of each page's values"
        );
        let mut check = StreamCheck::new(PageFormat::of(&half), chain.clone(), 0);
        assert_eq!(receive(&mut check, &bytes, 50).unwrap(), vec![0, 1, 2]);
        for (from, to) in [(&half, &full), (&full, &half)] {
            let mut check = StreamCheck::new(PageFormat::of(to), chain.clone(), 0);
            let err = receive(&mut check, &stream_of(from, &chain), 50).unwrap_err();
            assert_eq!(err.reason(), "handshake");
            assert!(err.to_string().contains("kv dtype differs"), "{err}");
        }
    }
}
