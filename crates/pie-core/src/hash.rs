//! Block hashes: the identity of a full KV page.
//!
//! `block_hash(parent, tokens)` is XXH3-64 (seed 0) over the bytes
//! `parent.to_le_bytes() ++ tokens[i].to_le_bytes()...` (tokens as u32 LE).
//! The chain starts at the model fingerprint, so a page's hash names the model,
//! every token before it and its own tokens. XXH3 is fixed and unseeded, so the
//! same prompt has the same hashes across restarts and machines: workers, the
//! controller, the pool and the disk tier all compute the same names.

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::Xxh3;

/// Identity of a model's weights (and tokenizer): the root of every hash chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ModelFingerprint(pub u64);

/// Identity of one full page of tokens, chained over all the tokens before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct BlockHash(pub u64);

impl ModelFingerprint {
    /// Fingerprint from arbitrary identifying bytes (e.g. a digest of the model file's
    /// metadata and tensor layout).
    pub fn from_bytes(bytes: &[u8]) -> Self {
        Self(xxhash_rust::xxh3::xxh3_64(bytes))
    }

    /// The parent of the first page of every context.
    pub fn root(self) -> BlockHash {
        BlockHash(self.0)
    }

    /// The root of a context whose pages may be shared only with contexts of
    /// the same cache salt (a tenant's): no salt is the plain root, and a
    /// salted chain never meets an unsalted or differently salted one.
    pub fn salted_root(self, salt: Option<&str>) -> BlockHash {
        match salt {
            None => self.root(),
            Some(salt) => {
                let mut h = Xxh3::new();
                h.update(b"pie-cache-salt\0");
                h.update(&self.0.to_le_bytes());
                h.update(salt.as_bytes());
                BlockHash(h.digest())
            }
        }
    }
}

/// Hash of the page holding `tokens`, whose preceding page hashed to `parent`.
pub fn block_hash(parent: BlockHash, tokens: &[u32]) -> BlockHash {
    // Feeding the hasher 4 bytes at a time costs more than the hashing itself,
    // so tokens go through a stack buffer, 64 at a time (same bytes, same hash).
    const CHUNK: usize = 64;
    let mut h = Xxh3::new();
    h.update(&parent.0.to_le_bytes());
    let mut buf = [0u8; CHUNK * 4];
    for chunk in tokens.chunks(CHUNK) {
        for (slot, t) in buf.chunks_exact_mut(4).zip(chunk) {
            slot.copy_from_slice(&t.to_le_bytes());
        }
        h.update(&buf[..chunk.len() * 4]);
    }
    BlockHash(h.digest())
}

/// Hashes of every full page of `tokens` (a trailing partial page has none).
pub fn block_hashes(
    fingerprint: ModelFingerprint,
    tokens: &[u32],
    page_size: usize,
) -> Vec<BlockHash> {
    chain_from(fingerprint.root(), tokens, page_size)
}

/// The hashes of the full pages of `tokens`, chained from `root` (see
/// [`ModelFingerprint::salted_root`]).
pub fn chain_from(root: BlockHash, tokens: &[u32], page_size: usize) -> Vec<BlockHash> {
    let mut parent = root;
    tokens
        .chunks_exact(page_size)
        .map(|page| {
            parent = block_hash(parent, page);
            parent
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn salted_chains_share_nothing_with_other_salts() {
        let fp = ModelFingerprint(7);
        let tokens = [1, 2, 3, 4];
        assert_eq!(fp.salted_root(None), fp.root());
        let a = chain_from(fp.salted_root(Some("a")), &tokens, 2);
        assert_eq!(a, chain_from(fp.salted_root(Some("a")), &tokens, 2));
        let b = chain_from(fp.salted_root(Some("b")), &tokens, 2);
        let plain = block_hashes(fp, &tokens, 2);
        assert!(a.iter().all(|h| !b.contains(h) && !plain.contains(h)));
    }

    #[test]
    fn hash_is_fixed_across_runs() {
        // If the hash function or byte layout ever changes, pages written by older
        // workers (pool, disk) would silently stop matching.
        let h = block_hash(ModelFingerprint(7).root(), &[1, 2, 3, 4]);
        assert_eq!(h, block_hash(BlockHash(7), &[1, 2, 3, 4]));
        assert_eq!(
            h.0,
            xxhash_rust::xxh3::xxh3_64(&[
                7, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 4, 0, 0, 0
            ])
        );
        // The value itself, so an XXH3 implementation change is caught too.
        assert_eq!(h.0, 0xa882_bba3_f61e_435a);
    }

    #[test]
    fn long_pages_hash_the_same_byte_layout() {
        // 150 tokens cross the 64-token buffer twice.
        let tokens: Vec<u32> = (0..150u32).map(|t| t.wrapping_mul(2_654_435_761)).collect();
        let mut bytes = 9u64.to_le_bytes().to_vec();
        tokens.iter().for_each(|t| bytes.extend(t.to_le_bytes()));
        assert_eq!(
            block_hash(BlockHash(9), &tokens).0,
            xxhash_rust::xxh3::xxh3_64(&bytes)
        );
    }

    #[test]
    fn chain_depends_on_every_earlier_token() {
        let fp = ModelFingerprint(1);
        let a = block_hashes(fp, &[1, 2, 3, 4, 5, 6], 2);
        let b = block_hashes(fp, &[9, 2, 3, 4, 5, 6], 2);
        assert_eq!(a.len(), 3);
        assert!(a.iter().zip(&b).all(|(x, y)| x != y));
        assert_eq!(block_hashes(fp, &[1, 2, 3], 2).len(), 1);
        assert_ne!(
            block_hashes(ModelFingerprint(2), &[1, 2], 2),
            block_hashes(fp, &[1, 2], 2)
        );
    }
}
