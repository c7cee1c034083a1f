//! What the scheduler asks of a worker's KV pages. `pie-worker`'s engine answers
//! over its real page pool (`pie-kv`), `pie-sim` over its page model; the
//! scheduler never sees pages, only these answers, so both plan alike.

use pie_core::SeqId;

/// A worker's KV accounting, per sequence, as the scheduler needs it.
///
/// Every method names a sequence the scheduler holds as a candidate (or, for
/// `retain`, one it is finishing); an implementation may treat any other id as a
/// bug.
pub trait KvAccounting {
    /// The sequence holds pages now (it is running).
    fn holds_pages(&self, seq: SeqId) -> bool;

    /// Prompt tokens whose KV is not computed yet (0 while decoding).
    fn prefill_remaining(&self, seq: SeqId) -> usize;

    /// Tokens still to compute before the sequence samples its next token.
    fn uncomputed(&self, seq: SeqId) -> usize;

    /// Tokens the sequence could compute now: the free room of the pages it
    /// holds plus every page the pool could give it (free pages and unreferenced
    /// cached pages it would evict).
    fn room(&self, seq: SeqId) -> usize;

    /// Share the longest cached prefix of the sequence's tokens, always leaving
    /// at least one token to compute; a sequence continuing a retained
    /// session also copies the slots of that session's partial page it
    /// continues. Returns the tokens it covers.
    fn attach_prefix(&mut self, seq: SeqId) -> usize;

    /// Another sequence holding pages is computing the first page of this
    /// one's tokens that the prefix cache lacks (the page with the same block
    /// hash, not yet computed there): admitted now, this one would compute
    /// that page a second time, so the scheduler admits it once the page is
    /// cached. Only full pages of the tokens before the last count, as for
    /// `attach_prefix`.
    fn prefix_in_flight(&self, seq: SeqId) -> bool;

    /// The sequence is about to be admitted (again): true holds it back
    /// while pages it lacks are on their way (the engine has the runtime
    /// load them from its disk tier after a preemption). Never by default.
    fn hold_for_pages(&mut self, _seq: SeqId) -> bool {
        false
    }

    /// Hold pages for the next `tokens` tokens (at most `room`), evicting
    /// unreferenced cached pages as needed.
    fn reserve(&mut self, seq: SeqId, tokens: usize);

    /// Free the sequence's pages; full pages stay in the prefix cache.
    fn release(&mut self, seq: SeqId);

    /// The scheduler preempted the sequence (after releasing its pages): it
    /// will be admitted again later. Nothing by default.
    fn preempted(&mut self, _seq: SeqId) {}

    /// The sequence was admitted with `cached_tokens` from the prefix cache
    /// (called again after every preemption; the first call is its cache hit).
    fn admitted(&mut self, seq: SeqId, cached_tokens: usize);

    /// Keep a finishing sequence's pages under `session` (unevictable) instead
    /// of freeing them. The session holds no other pages (the scheduler drops
    /// them first).
    fn retain(&mut self, seq: SeqId, session: &str);

    /// Free the pages retained under `session`, if any.
    fn drop_retained(&mut self, session: &str);

    /// Free the pages retained under `session` before its retention ends at
    /// `expires_ms`, because other sequences need them. An accounting that
    /// spills (`retain-all`) keeps them elsewhere until then; by default they
    /// are dropped.
    fn evict_retained(&mut self, session: &str, _expires_ms: u64) {
        self.drop_retained(session);
    }

    /// A hint before the scheduler visits these sequences in this order (the
    /// simulator prefetches their state); nothing by default.
    fn will_visit(&self, _seqs: &[crate::Candidate]) {}
}
