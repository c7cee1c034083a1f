//! Operations in flight (`pie:inferlet/passes@0.3.0`): a [`Pending`] is a
//! started generation, pass or message wait; the engine runs every one in
//! flight, of this process and of others, in the same steps. Wait for one
//! ([`Pending::wait`]), for all ([`wait_all`]) or for the first done
//! ([`wait_any`]); all three block on `wasi:io/poll`.

use std::marker::PhantomData;

use crate::bindings::pie::inferlet0_3_0::passes;
use crate::bindings::wasi::io::poll::{self, Pollable};

/// The result of a started operation, once it is done.
///
/// Dropping it before it is done cancels the operation (its context is then
/// as before it started). `'a` is the borrow of the context it runs on (a
/// context with an operation in flight can be neither dropped nor changed),
/// `'static` for [`start_receive`].
pub struct Pending<'a, T> {
    // Declared first, so dropped first: a pollable must go before the
    // resource it watches (the component model refuses a parent dropped
    // while a child lives).
    pollable: Pollable,
    take: Box<dyn FnMut() -> Option<Result<T, String>> + 'a>,
    _context: PhantomData<&'a ()>,
}

impl<'a, T: 'a> Pending<'a, T> {
    /// One watched by `pollable`, its result read by `take` (none while it
    /// runs). `take` owns the operation's resource.
    pub(crate) fn new(
        pollable: Pollable,
        take: impl FnMut() -> Option<Result<T, String>> + 'a,
    ) -> Self {
        Pending {
            pollable,
            take: Box::new(take),
            _context: PhantomData,
        }
    }

    /// Whether it is done (waiting would not block).
    pub fn is_ready(&self) -> bool {
        self.pollable.ready()
    }

    /// Its `wasi:io/poll` pollable, to wait on it together with others of
    /// any kind through [`bindings::wasi::io::poll::poll`](crate::bindings::wasi::io::poll::poll).
    pub fn pollable(&self) -> &Pollable {
        &self.pollable
    }

    /// Blocks until it is done; its result (the context gains a
    /// generation's or a pass's tokens now).
    pub fn wait(mut self) -> Result<T, String> {
        self.pollable.block();
        self.take_ready()
    }

    /// Its result if it is done, without blocking; none while it runs.
    /// Once taken, it is spent: take no more and drop it.
    pub fn try_take(&mut self) -> Option<Result<T, String>> {
        if self.is_ready() {
            Some(self.take_ready())
        } else {
            None
        }
    }

    /// The same operation with `f` applied to its result.
    pub fn map<U: 'a>(self, mut f: impl FnMut(T) -> Result<U, String> + 'a) -> Pending<'a, U> {
        let Pending {
            pollable, mut take, ..
        } = self;
        Pending::new(pollable, move || take().map(|r| r.and_then(&mut f)))
    }

    /// The result of one whose pollable fired.
    fn take_ready(&mut self) -> Result<T, String> {
        (self.take)().unwrap_or_else(|| Err("an operation ready but without its result".into()))
    }
}

impl<T> std::fmt::Debug for Pending<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pending")
            .field("ready", &self.pollable.ready())
            .finish()
    }
}

/// Waits for every one; their results in the same order. They run
/// together whatever order they finish in.
pub fn wait_all<'a, T: 'a>(pending: Vec<Pending<'a, T>>) -> Vec<Result<T, String>> {
    let mut results: Vec<Option<Result<T, String>>> = pending.iter().map(|_| None).collect();
    let mut left: Vec<(usize, Pending<'a, T>)> = pending.into_iter().enumerate().collect();
    while !left.is_empty() {
        for i in ready_indices(left.iter().map(|(_, p)| p)).into_iter().rev() {
            let (index, mut p) = left.swap_remove(i);
            results[index] = Some(p.take_ready());
        }
    }
    results
        .into_iter()
        .map(|r| r.unwrap_or_else(|| Err("an operation without its result".into())))
        .collect()
}

/// Waits for the first one done, removes it from `pending` and returns its
/// index there (before the removal) and its result; none if `pending` is
/// empty. The others keep running.
pub fn wait_any<'a, T: 'a>(
    pending: &mut Vec<Pending<'a, T>>,
) -> Option<(usize, Result<T, String>)> {
    if pending.is_empty() {
        return None;
    }
    let first = ready_indices(pending.iter())[0];
    let mut p = pending.remove(first);
    Some((first, p.take_ready()))
}

/// The indices, ascending, of those of `pending` that are ready, after
/// blocking until at least one is (`pending` not empty).
fn ready_indices<'p, 'a: 'p, T: 'a>(
    pending: impl Iterator<Item = &'p Pending<'a, T>>,
) -> Vec<usize> {
    let pollables: Vec<&Pollable> = pending.map(|p| &p.pollable).collect();
    let mut ready: Vec<usize> = poll::poll(&pollables)
        .into_iter()
        .map(|i| i as usize)
        .collect();
    ready.sort_unstable();
    ready.dedup();
    ready
}

/// Waits for the next message a client sends, started now: the
/// [`Pending`] counterpart of [`receive`](crate::receive), to wait for a
/// message together with operations. The message is consumed when taken;
/// dropping the wait before one came consumes none. An error when the
/// process already has as many operations in flight as it may (64).
/// Waiting on it alone for the worker's `max_idle_ms` with nothing arriving
/// fails the process, as [`receive`](crate::receive) does.
pub fn start_receive() -> Result<Pending<'static, String>, String> {
    let op = passes::start_receive()?;
    let pollable = op.subscribe();
    Ok(Pending::new(pollable, move || op.take().map(Ok)))
}

/// A started generation's [`Pending`].
pub(crate) fn generation<'a>(op: passes::GenerationOp) -> Pending<'a, crate::Generation> {
    let pollable = op.subscribe();
    Pending::new(pollable, move || op.take())
}

/// A started pass's [`Pending`].
pub(crate) fn pass<'a>(op: passes::PassOp) -> Pending<'a, Vec<crate::Distribution>> {
    let pollable = op.subscribe();
    Pending::new(pollable, move || op.take())
}
