//! A process's contexts: the token sequences its handles name. A context's
//! KV lives in the engine: each generation over it is a sequence whose
//! prompt is the context's tokens; when the sequence ends, its pages are
//! retained under the context's key for `max_idle_ms` (whatever the worker
//! policy; evictable under pressure like keep-session's retentions), so its
//! next call computes only its new tokens; the full ones also stay in the
//! prefix cache, where a fork's generation finds them. So a fork copies
//! tokens, never pages.
//!
//! Invariant: a handle names one context until it is dropped; handles are
//! never reused within a process, so a stale one is an error, not another
//! context. A context with an operation in flight (`passes`) changes only
//! when that operation's result is taken.

use std::collections::HashMap;

use pie_model::{SamplingRequest, TokenSets};

use super::limits::{MAX_CONTEXTS, MAX_TOKEN_SET_BYTES};

pub struct Context {
    pub tokens: Vec<u32>,
    /// Its pages' retention key in the engine (unique per process and handle).
    pub retain_as: String,
    /// The retentions whose pages its next generation may copy a partial
    /// page from, best first (at most [`RESUME_KEYS`]): its own once it
    /// generated; its parent's for a fresh fork; a fork's, once the fork
    /// generated (a context that takes a fork's text, not its sampled
    /// tokens, still shares most of the fork's last page).
    pub resume_from: Vec<String>,
    /// Its generations report each token's log-probability
    /// (`reporting.report-logprobs`; a fork takes its parent's).
    pub logprobs: bool,
    /// The penalties and biases its generations apply, checked
    /// (`shaping.set-shaping`; a fork takes its parent's).
    pub shaping: SamplingRequest,
    /// Its leading tokens already in the process's usage (as prompt or
    /// completion tokens): the rest are new prompt tokens at its next
    /// generation.
    pub counted: usize,
    /// The context it was forked from.
    parent: Option<u32>,
    /// An operation over it is in flight (`passes`).
    busy: bool,
}

/// Retentions a context's generation looks at for a partial page.
const RESUME_KEYS: usize = 2;

pub struct Contexts {
    owner: String,
    next: u32,
    live: HashMap<u32, Context>,
    /// Bytes of token sets its contexts keep (a fork's count again).
    token_set_bytes: usize,
}

impl Contexts {
    /// The contexts of process `owner`.
    pub fn new(owner: &str) -> Self {
        Self {
            owner: owner.to_string(),
            next: 1,
            live: HashMap::new(),
            token_set_bytes: 0,
        }
    }

    pub fn create(&mut self, tokens: Vec<u32>) -> Result<u32, String> {
        self.insert(tokens, None)
    }

    fn insert(&mut self, tokens: Vec<u32>, parent: Option<u32>) -> Result<u32, String> {
        if self.live.len() >= MAX_CONTEXTS {
            return Err(format!(
                "a process may hold at most {MAX_CONTEXTS} contexts; drop some first"
            ));
        }
        let handle = self.next;
        self.next += 1;
        let retain_as = format!("{}/context-{handle}", self.owner);
        let (resume_from, logprobs, shaping, counted) = match parent.and_then(|p| self.live.get(&p))
        {
            Some(p) => (
                p.resume_from.clone(),
                p.logprobs,
                p.shaping.clone(),
                p.counted,
            ),
            None => (vec![retain_as.clone()], true, SamplingRequest::default(), 0),
        };
        self.charge_token_sets(0, shaping.token_sets.bytes())?;
        let context = Context {
            tokens,
            retain_as,
            resume_from,
            logprobs,
            shaping,
            counted,
            parent,
            busy: false,
        };
        self.live.insert(handle, context);
        Ok(handle)
    }

    pub fn fork(&mut self, handle: u32) -> Result<u32, String> {
        let tokens = self.get(handle)?.tokens.clone();
        self.insert(tokens, Some(handle))
    }

    /// A generation over the context ended: its pages are retained under
    /// its own key now, its parent's next generation looks there first, and
    /// all its tokens are in the usage.
    pub fn generated(&mut self, handle: u32) {
        let Some(c) = self.live.get_mut(&handle) else {
            return;
        };
        c.counted = c.tokens.len();
        c.resume_from = vec![c.retain_as.clone()];
        let (key, parent) = (c.retain_as.clone(), c.parent);
        if let Some(p) = parent.and_then(|p| self.live.get_mut(&p)) {
            p.resume_from.retain(|k| *k != key);
            p.resume_from.insert(0, key);
            p.resume_from.truncate(RESUME_KEYS);
        }
    }

    /// Forget the context; returns its retention key, to release its pages.
    pub fn remove(&mut self, handle: u32) -> Result<String, String> {
        self.get_mut(handle)?;
        let context = self
            .live
            .remove(&handle)
            .ok_or_else(|| no_context(handle))?;
        self.token_set_bytes -= context.shaping.token_sets.bytes();
        Ok(context.retain_as)
    }

    /// The context, to read (even with an operation in flight).
    pub fn get(&self, handle: u32) -> Result<&Context, String> {
        self.live.get(&handle).ok_or_else(|| no_context(handle))
    }

    /// The context, to run over: not while an operation over it is in
    /// flight.
    pub fn idle(&self, handle: u32) -> Result<&Context, String> {
        let context = self.get(handle)?;
        match context.busy {
            true => Err(in_flight(handle)),
            false => Ok(context),
        }
    }

    /// The context, to change: not while an operation over it is in flight.
    pub fn get_mut(&mut self, handle: u32) -> Result<&mut Context, String> {
        let context = self
            .live
            .get_mut(&handle)
            .ok_or_else(|| no_context(handle))?;
        match context.busy {
            true => Err(in_flight(handle)),
            false => Ok(context),
        }
    }

    /// An operation over the context started (it must be idle) ...
    pub fn start_op(&mut self, handle: u32) -> Result<(), String> {
        self.get_mut(handle)?.busy = true;
        Ok(())
    }

    /// ... and ended (its result taken, or the operation dropped): the
    /// context, if the guest has not dropped it meanwhile.
    pub fn end_op(&mut self, handle: u32) -> Option<&mut Context> {
        let context = self.live.get_mut(&handle)?;
        context.busy = false;
        Some(context)
    }

    /// Its later generations sample within `sets`, within the process's
    /// bound on the bytes all its contexts' sets keep.
    pub fn set_token_sets(&mut self, handle: u32, sets: TokenSets) -> Result<(), String> {
        let old = self.get_mut(handle)?.shaping.token_sets.bytes();
        self.charge_token_sets(old, sets.bytes())?;
        self.get_mut(handle)?.shaping.token_sets = sets;
        Ok(())
    }

    fn charge_token_sets(&mut self, freed: usize, added: usize) -> Result<(), String> {
        let total = self.token_set_bytes - freed + added;
        if total > MAX_TOKEN_SET_BYTES {
            return Err(format!(
                "the process's contexts would keep {total} bytes of token sets; \
                 at most {MAX_TOKEN_SET_BYTES}"
            ));
        }
        self.token_set_bytes = total;
        Ok(())
    }

    /// Every live context's retention key (to release them all at the end).
    pub fn drain(&mut self) -> Vec<String> {
        self.live.drain().map(|(_, c)| c.retain_as).collect()
    }
}

fn in_flight(handle: u32) -> String {
    format!("context {handle} has an operation in flight: take or drop it first")
}

fn no_context(handle: u32) -> String {
    format!("no context {handle} in this process (never created, or dropped)")
}

#[cfg(test)]
mod tests {
    use super::*;
    use pie_model::MAX_TOKEN_SET;

    #[test]
    fn handles_are_never_reused_and_forks_copy_tokens() {
        let mut c = Contexts::new("p");
        let a = c.create(vec![1, 2]).unwrap();
        let b = c.fork(a).unwrap();
        assert_eq!(c.get(b).unwrap().tokens, vec![1, 2]);
        assert_ne!(c.get(a).unwrap().retain_as, c.get(b).unwrap().retain_as);
        // A fresh fork resumes its parent's pages; after a generation, its
        // own, and its parent looks at the fork's first.
        let key = |c: &Contexts, h: u32| c.get(h).unwrap().retain_as.clone();
        assert_eq!(c.get(b).unwrap().resume_from, [key(&c, a)]);
        c.generated(b);
        assert_eq!(c.get(b).unwrap().resume_from, [key(&c, b)]);
        assert_eq!(c.get(a).unwrap().resume_from, [key(&c, b), key(&c, a)]);
        c.generated(a);
        assert_eq!(c.get(a).unwrap().resume_from, [key(&c, a)]);
        c.remove(a).unwrap();
        assert!(c.get(a).is_err());
        assert!(c.remove(a).is_err());
        let d = c.create(Vec::new()).unwrap();
        assert!(d != a && d != b);
        assert_eq!(c.drain().len(), 2);
    }

    #[test]
    fn a_context_with_an_operation_in_flight_changes_only_when_it_ends() {
        let mut c = Contexts::new("p");
        let a = c.create(vec![1]).unwrap();
        c.start_op(a).unwrap();
        assert!(c.get_mut(a).err().unwrap().contains("in flight"));
        assert!(c.remove(a).is_err());
        assert!(c.start_op(a).is_err());
        assert_eq!(c.get(a).unwrap().tokens, [1]);
        c.end_op(a).unwrap().tokens.push(2);
        assert_eq!(c.get_mut(a).unwrap().tokens, [1, 2]);
    }

    #[test]
    fn token_sets_are_bounded_across_contexts_and_forks() {
        let mut c = Contexts::new("p");
        let a = c.create(Vec::new()).unwrap();
        let ids: Vec<u32> = (0..MAX_TOKEN_SET as u32).collect();
        let full = TokenSets::new(Some(ids.clone()), ids).unwrap();
        let per_context = full.bytes();
        c.set_token_sets(a, full).unwrap();
        let forks = MAX_TOKEN_SET_BYTES / per_context - 1;
        let mut last = a;
        for _ in 0..forks {
            last = c.fork(a).unwrap();
        }
        assert!(c.fork(a).unwrap_err().contains("token sets"));
        c.remove(last).unwrap();
        c.fork(a).unwrap();
    }

    #[test]
    fn a_process_holds_a_bounded_number_of_contexts() {
        let mut c = Contexts::new("p");
        for _ in 0..MAX_CONTEXTS {
            c.create(Vec::new()).unwrap();
        }
        assert!(c.create(Vec::new()).unwrap_err().contains("at most"));
    }
}
