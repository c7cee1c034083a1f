//! A full page as bytes, to move it between workers, a pool and disk.
//!
//! Layout (all integers little-endian):
//!
//! | field | bytes |
//! |---|---|
//! | magic `PIEKVPG1` | 8 |
//! | model fingerprint | 8 |
//! | block hash | 8 |
//! | dtype (0 = f32, 1 = f16: [`KvDtype::code`]) | 4 |
//! | layers, page_size, kv_dim | 4 each |
//! | per layer: K then V, `page_size * kv_dim` values of the dtype each | ... |
//! | XXH3-64 of everything above | 8 |
//!
//! A page's address wherever it travels or rests is its [`PageFormat`]
//! (model fingerprint, dtype, layout: page size, layers, KV width) and its block
//! hash, so pages of different models or dtypes never collide. An import checks
//! every header field against the receiving pool and the checksum, so a page
//! from another model or a torn transfer is refused, never used.

use pie_core::{BlockHash, ModelFingerprint};
use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64;

use crate::{KvDtype, KvLayout, KvPool, OutOfPages, PageId};

#[cfg(not(target_endian = "little"))]
compile_error!("the KV page format stores values as little-endian bytes, copied as slices: big-endian hosts are not supported");

const MAGIC: &[u8; 8] = b"PIEKVPG1";
const HEADER_BYTES: usize = 8 + 8 + 8 + 4 * 4;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum TransferError {
    #[error("page bytes are {0} long, expected {1}")]
    Length(usize, usize),
    #[error("not a Pie KV page (bad magic)")]
    Magic,
    #[error("page checksum mismatch (corrupt or truncated transfer)")]
    Checksum,
    #[error("page is for model {got:016x}, this pool serves {want:016x}")]
    Model { got: u64, want: u64 },
    #[error("page layout {got:?} (dtype {dtype}) does not match the pool's {want:?}")]
    Layout {
        got: KvLayout,
        want: KvLayout,
        dtype: u32,
    },
    #[error("page {0:?} is not full and published, so it has no block hash to export")]
    Unpublished(PageId),
    #[error(transparent)]
    OutOfPages(#[from] OutOfPages),
}

/// What a page must match to be used by a pool: the handshake of a page
/// stream (`crate::stream`) and the header of every page.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PageFormat {
    pub fingerprint: ModelFingerprint,
    /// [`KvDtype::code`]: a number, so that a peer's unknown dtype is a
    /// mismatch named like any other, not a parse error.
    pub dtype: u32,
    pub layout: KvLayout,
}

impl PageFormat {
    pub fn of(pool: &KvPool) -> Self {
        Self {
            fingerprint: pool.fingerprint(),
            dtype: pool.dtype().code(),
            layout: pool.layout(),
        }
    }

    /// The first field where `other` differs from this format, named, with
    /// both values; None when they match.
    pub fn mismatch(&self, other: &PageFormat) -> Option<String> {
        let fields = [
            ("model fingerprint", self.fingerprint.0, other.fingerprint.0),
            ("kv dtype", self.dtype as u64, other.dtype as u64),
            (
                "page_size",
                self.layout.page_size as u64,
                other.layout.page_size as u64,
            ),
            (
                "layers",
                self.layout.layers as u64,
                other.layout.layers as u64,
            ),
            (
                "kv_dim",
                self.layout.kv_dim as u64,
                other.layout.kv_dim as u64,
            ),
        ];
        fields
            .into_iter()
            .find(|(_, mine, theirs)| mine != theirs)
            .map(|(name, mine, theirs)| {
                format!("{name} differs: {theirs:#x} there, {mine:#x} here")
            })
    }
}

/// Serialized size of one page of `format` (an unknown dtype is sized as
/// f32: the largest, so a bound computed from it holds).
pub fn page_bytes_len(format: &PageFormat) -> usize {
    let dtype = KvDtype::from_code(format.dtype).unwrap_or(KvDtype::F32);
    HEADER_BYTES + format.layout.page_bytes(dtype) + 8
}

/// Serialize a published page.
pub fn export_page(pool: &KvPool, page: PageId) -> Result<Vec<u8>, TransferError> {
    let hash = pool.hash_of(page).ok_or(TransferError::Unpublished(page))?;
    let layout = pool.layout();
    let mut out = Vec::with_capacity(page_bytes_len(&PageFormat::of(pool)));
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&pool.fingerprint().0.to_le_bytes());
    out.extend_from_slice(&hash.0.to_le_bytes());
    for field in [
        pool.dtype().code(),
        layout.layers as u32,
        layout.page_size as u32,
        layout.kv_dim as u32,
    ] {
        out.extend_from_slice(&field.to_le_bytes());
    }
    for layer in 0..layout.layers {
        let (k, v) = pool.page_bytes(layer, page);
        out.extend_from_slice(k);
        out.extend_from_slice(v);
    }
    let sum = xxh3_64(&out);
    out.extend_from_slice(&sum.to_le_bytes());
    Ok(out)
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Check a serialized page against a pool's format and return its block hash
/// without importing it.
pub fn verify_page(pool: &KvPool, bytes: &[u8]) -> Result<BlockHash, TransferError> {
    verify_page_format(&PageFormat::of(pool), bytes)
}

/// Check a serialized page against `format` (no pool needed: a receiver
/// verifies a stream off the thread that owns its pool).
pub fn verify_page_format(format: &PageFormat, bytes: &[u8]) -> Result<BlockHash, TransferError> {
    let want_layout = format.layout;
    let expected = page_bytes_len(format);
    if bytes.len() < HEADER_BYTES + 8 {
        return Err(TransferError::Length(bytes.len(), expected));
    }
    if &bytes[..8] != MAGIC {
        return Err(TransferError::Magic);
    }
    let body = bytes.len() - 8;
    if xxh3_64(&bytes[..body]) != u64_at(bytes, body) {
        return Err(TransferError::Checksum);
    }
    let fingerprint = ModelFingerprint(u64_at(bytes, 8));
    if fingerprint != format.fingerprint {
        return Err(TransferError::Model {
            got: fingerprint.0,
            want: format.fingerprint.0,
        });
    }
    let dtype = u32_at(bytes, 24);
    let got = KvLayout {
        layers: u32_at(bytes, 28) as usize,
        page_size: u32_at(bytes, 32) as usize,
        kv_dim: u32_at(bytes, 36) as usize,
    };
    if got != want_layout || dtype != format.dtype {
        return Err(TransferError::Layout {
            got,
            want: want_layout,
            dtype,
        });
    }
    if bytes.len() != expected {
        return Err(TransferError::Length(bytes.len(), expected));
    }
    Ok(BlockHash(u64_at(bytes, 16)))
}

/// Import a serialized page into the pool as a cached (unreferenced, published)
/// page. A page whose hash is already indexed is not duplicated.
pub fn import_page(pool: &mut KvPool, bytes: &[u8]) -> Result<PageId, TransferError> {
    let hash = verify_page(pool, bytes)?;
    if let Some(page) = pool.lookup(hash) {
        return Ok(page);
    }
    let page = pool.allocate()?;
    let half = pool.layout().page_floats() * pool.dtype().bytes();
    // Verified above: exactly `layers` x (K, V) of `half` bytes each.
    let mut values = bytes[HEADER_BYTES..bytes.len() - 8].chunks_exact(half);
    for layer in 0..pool.layout().layers {
        let (k, v) = pool.page_bytes_mut(layer, page);
        for dst in [k, v] {
            dst.copy_from_slice(values.next().expect("verified length"));
        }
    }
    pool.publish(page, hash);
    pool.release(page);
    Ok(page)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(fp: u64) -> KvPool {
        KvPool::new(
            KvLayout {
                layers: 2,
                page_size: 2,
                kv_dim: 3,
            },
            4,
            ModelFingerprint(fp),
        )
    }

    /// The K and V `published_page` writes at `layer`, `slot`.
    fn pool_values(layer: usize, slot: usize) -> (Vec<f32>, Vec<f32>) {
        let x = (layer * 10 + slot) as f32;
        (vec![x, x + 0.5, -x], vec![x * 2.0; 3])
    }

    fn published_page(p: &mut KvPool) -> PageId {
        let page = p.allocate().unwrap();
        for layer in 0..2 {
            for slot in 0..2 {
                let (k, v) = pool_values(layer, slot);
                p.write(layer, page, slot, &k, &v);
            }
        }
        p.publish(page, BlockHash(42));
        page
    }

    #[test]
    fn round_trip_preserves_every_value() {
        let mut a = pool(1);
        let page = published_page(&mut a);
        let bytes = export_page(&a, page).unwrap();
        assert_eq!(bytes.len(), page_bytes_len(&PageFormat::of(&a)));
        let mut b = pool(1);
        let imported = import_page(&mut b, &bytes).unwrap();
        assert_eq!(b.lookup(BlockHash(42)), Some(imported));
        assert_eq!(b.refcount(imported), 0);
        for layer in 0..2 {
            assert_eq!(a.page_kv(layer, page), b.page_kv(layer, imported));
        }
        assert_eq!(
            import_page(&mut b, &bytes).unwrap(),
            imported,
            "no duplicate"
        );
        assert_eq!(b.stats().cached, 1);
    }

    #[test]
    fn f16_pages_round_trip_in_half_the_bytes_and_only_into_f16_pools() {
        let f16_pool =
            || KvPool::with_dtype(pool(1).layout(), KvDtype::F16, 4, ModelFingerprint(1));
        let mut a = f16_pool();
        let page = published_page(&mut a);
        let bytes = export_page(&a, page).unwrap();
        assert_eq!(bytes.len(), page_bytes_len(&PageFormat::of(&a)));
        let f32_len = page_bytes_len(&PageFormat::of(&pool(1)));
        assert_eq!(f32_len - bytes.len(), a.layout().page_bytes(KvDtype::F16));
        let mut b = f16_pool();
        let imported = import_page(&mut b, &bytes).unwrap();
        for layer in 0..2 {
            assert_eq!(a.page_kv(layer, page), b.page_kv(layer, imported));
            // The test values are exact in f16.
            assert_eq!(b.read(layer, imported, 1), pool_values(layer, 1));
        }
        assert!(matches!(
            verify_page(&pool(1), &bytes),
            Err(TransferError::Layout { dtype: 1, .. })
        ));
        let f32_bytes = export_page(
            &{
                let mut p = pool(1);
                published_page(&mut p);
                p
            },
            PageId(0),
        );
        assert!(matches!(
            verify_page(&b, &f32_bytes.unwrap()),
            Err(TransferError::Layout { dtype: 0, .. })
        ));
        let why = PageFormat::of(&a).mismatch(&PageFormat::of(&pool(1)));
        assert_eq!(
            why.as_deref(),
            Some("kv dtype differs: 0x0 there, 0x1 here")
        );
    }

    #[test]
    fn corrupt_or_foreign_pages_are_refused() {
        let mut a = pool(1);
        let page = published_page(&mut a);
        let bytes = export_page(&a, page).unwrap();
        let mut flipped = bytes.clone();
        flipped[50] ^= 1;
        assert_eq!(verify_page(&a, &flipped), Err(TransferError::Checksum));
        assert!(matches!(
            verify_page(&pool(2), &bytes),
            Err(TransferError::Model { .. })
        ));
        assert!(matches!(
            verify_page(&a, &bytes[..10]),
            Err(TransferError::Length(10, _))
        ));
        let other = KvPool::new(
            KvLayout {
                layers: 1,
                page_size: 2,
                kv_dim: 3,
            },
            1,
            ModelFingerprint(1),
        );
        assert!(matches!(
            verify_page(&other, &bytes),
            Err(TransferError::Layout { .. })
        ));
        let unpublished = a.allocate().unwrap();
        assert_eq!(
            export_page(&a, unpublished),
            Err(TransferError::Unpublished(unpublished))
        );
    }

    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        /// How a page's bytes are damaged.
        #[derive(Clone, Debug)]
        enum Damage {
            /// XOR the byte at an offset with a non-zero mask.
            Flip(prop::sample::Index, u8),
            Truncate(prop::sample::Index),
            Extend(Vec<u8>),
        }

        fn damage() -> impl Strategy<Value = Damage> {
            prop_oneof![
                (any::<prop::sample::Index>(), 1u8..=255).prop_map(|(i, m)| Damage::Flip(i, m)),
                any::<prop::sample::Index>().prop_map(Damage::Truncate),
                proptest::collection::vec(any::<u8>(), 1..16).prop_map(Damage::Extend),
            ]
        }

        /// The error an import must give for `damage` (None: it imports).
        fn expected(damage: &Damage, len: usize, rechecksum: bool) -> Option<TransferError> {
            let want = page_bytes_len(&PageFormat::of(&pool(1)));
            let checksum = || (!rechecksum).then_some(TransferError::Checksum);
            match damage {
                Damage::Flip(i, _) => match i.index(len) {
                    0..8 => Some(TransferError::Magic),
                    _ if !rechecksum => Some(TransferError::Checksum),
                    8..16 => Some(TransferError::Model { got: 0, want: 1 }),
                    24..40 => Some(TransferError::Layout {
                        got: pool(1).layout(),
                        want: pool(1).layout(),
                        dtype: 0,
                    }),
                    _ => None,
                },
                Damage::Truncate(i) if i.index(len) < HEADER_BYTES + 8 => {
                    Some(TransferError::Length(i.index(len), want))
                }
                Damage::Truncate(i) => {
                    checksum().or(Some(TransferError::Length(i.index(len), want)))
                }
                Damage::Extend(extra) => {
                    checksum().or(Some(TransferError::Length(len + extra.len(), want)))
                }
            }
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(512))]

            /// Damaged page bytes never panic an import: each is refused with
            /// the cause its damage implies (magic, checksum, model, layout or
            /// length), or imports when only the hash or values changed under
            /// a valid checksum.
            #[test]
            fn damaged_pages_are_refused_with_their_cause(d in damage(), rechecksum in any::<bool>()) {
                let mut a = pool(1);
                let page = published_page(&mut a);
                let mut bytes = export_page(&a, page).unwrap();
                let len = bytes.len();
                match &d {
                    Damage::Flip(i, mask) => bytes[i.index(len)] ^= mask,
                    Damage::Truncate(i) => bytes.truncate(i.index(len)),
                    Damage::Extend(extra) => bytes.extend_from_slice(extra),
                }
                if rechecksum && bytes.len() >= 8 {
                    let body = bytes.len() - 8;
                    let sum = xxh3_64(&bytes[..body]).to_le_bytes();
                    bytes[body..].copy_from_slice(&sum);
                }
                let result = import_page(&mut pool(1), &bytes);
                prop_assert_eq!(
                    result.as_ref().err().map(std::mem::discriminant),
                    expected(&d, len, rechecksum).as_ref().map(std::mem::discriminant),
                    "{:?}", result
                );
                if let Err(TransferError::Length(got, want)) = result {
                    prop_assert_eq!((got, want), (bytes.len(), len));
                }
            }
        }
    }
}
