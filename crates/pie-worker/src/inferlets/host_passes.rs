//! The host side of what `pie:inferlet@0.3.0` adds: operations started
//! without waiting (`passes`: generations, verification passes, message
//! waits, each a resource with a `wasi:io/poll` pollable), truncation, and
//! token sets (`steering`). Every argument is checked (a bad handle,
//! position, size or id is an `err` naming it, never a trap); what the
//! operations hold is bounded per process (`limits.rs`).
//!
//! Invariant: a context changes only when its operation's result is taken
//! (the tokens a generation made or a pass appended join it then); an
//! operation dropped before is cancelled and leaves the context as it was.

use wasmtime::component::Resource;
use wasmtime_wasi_io::poll::{subscribe, DynPollable};

use pie_model::{SamplingRequest, TokenSets, MAX_TOP_LOGPROBS};

use super::host::{GuestState, ProcessHost};
use super::limits::{MAX_FULL_BYTES, MAX_FULL_BYTES_HELD, MAX_OPS, MAX_PASS_TOKENS};
use super::ops::{GenerationOp, MessageOp, Outcome, PassOp};
use super::world::inference::{GenerateOptions, Generation, TokenLogprob};
use super::world::passes::{self, Distribution, Report};
use super::world::steering;
use crate::engine::{Score, Scored};
use crate::runtime::{Generate, Generated};

impl passes::Host for GuestState {
    fn start_generate(
        &mut self,
        ctx: u32,
        options: GenerateOptions,
    ) -> Result<Resource<GenerationOp>, String> {
        self.host.may_start_op()?;
        let call = self.host.generation(ctx, &options)?;
        let op = GenerationOp {
            ctx,
            outcome: self.host.spawn(call),
        };
        let op = self.hold(op)?;
        self.host.contexts.start_op(ctx)?;
        Ok(op)
    }

    fn start_pass(
        &mut self,
        ctx: u32,
        tokens: Vec<u32>,
        positions: Vec<u32>,
        report: Report,
    ) -> Result<Resource<PassOp>, String> {
        self.host.may_start_op()?;
        let (call, base, full_bytes) = self.host.pass(ctx, &tokens, &positions, report)?;
        let op = PassOp {
            ctx,
            appended: tokens,
            positions,
            base,
            full_bytes,
            outcome: self.host.spawn(call),
        };
        let op = self.hold(op)?;
        self.host.contexts.start_op(ctx)?;
        self.host.full_bytes_held += full_bytes;
        Ok(op)
    }

    fn start_receive(&mut self) -> Result<Resource<MessageOp>, String> {
        self.host.may_start_op()?;
        let host = &self.host;
        let op = MessageOp::start(
            host.inbox.clone(),
            host.max_idle,
            host.rt.clone(),
            host.process.clone(),
        );
        self.hold(op)
    }

    fn truncate(&mut self, ctx: u32, len: u32) -> Result<(), String> {
        let context = self.host.contexts.get_mut(ctx)?;
        let len = len as usize;
        if len > context.tokens.len() {
            return Err(format!(
                "truncate to {len} tokens: context {ctx} holds only {}",
                context.tokens.len()
            ));
        }
        context.tokens.truncate(len);
        context.counted = context.counted.min(len);
        let key = context.retain_as.clone();
        let host = &self.host;
        host.rt.truncate_retained(&host.process.client, &key, len);
        Ok(())
    }
}

impl GuestState {
    /// `op` in the instance's table, counted against [`MAX_OPS`].
    fn hold<T: Send + 'static>(&mut self, op: T) -> Result<Resource<T>, String> {
        let op =
            (self.table.push(op)).map_err(|e| format!("cannot hold another operation: {e}"))?;
        self.host.ops_held += 1;
        Ok(op)
    }

    /// `op` leaves the table; its context is as before if its result was
    /// never taken.
    fn release<T: 'static>(
        &mut self,
        op: Resource<T>,
        ended: impl FnOnce(&T) -> Option<u32>,
    ) -> wasmtime::Result<T> {
        let op = self.table.delete(op)?;
        if let Some(ctx) = ended(&op) {
            self.host.contexts.end_op(ctx);
        }
        self.host.ops_held -= 1;
        Ok(op)
    }
}

impl passes::HostGenerationOp for GuestState {
    fn subscribe(&mut self, op: Resource<GenerationOp>) -> wasmtime::Result<Resource<DynPollable>> {
        subscribe(&mut self.table, op)
    }

    fn take(&mut self, op: Resource<GenerationOp>) -> Option<Result<Generation, String>> {
        let op = match self.table.get_mut(&op) {
            Ok(op) => op,
            Err(e) => return Some(Err(format!("no such generation-op: {e}"))),
        };
        if !op.outcome.pending() {
            return Some(Err(TAKEN.into()));
        }
        let ctx = op.ctx;
        let done = op.outcome.take()?;
        self.host.contexts.end_op(ctx);
        Some(done.and_then(|g| self.host.finish_generation(ctx, g)))
    }

    fn drop(&mut self, op: Resource<GenerationOp>) -> wasmtime::Result<()> {
        self.release(op, |op| op.outcome.pending().then_some(op.ctx))?;
        Ok(())
    }
}

impl passes::HostPassOp for GuestState {
    fn subscribe(&mut self, op: Resource<PassOp>) -> wasmtime::Result<Resource<DynPollable>> {
        subscribe(&mut self.table, op)
    }

    fn take(&mut self, op: Resource<PassOp>) -> Option<Result<Vec<Distribution>, String>> {
        let op = match self.table.get_mut(&op) {
            Ok(op) => op,
            Err(e) => return Some(Err(format!("no such pass-op: {e}"))),
        };
        if !op.outcome.pending() {
            return Some(Err(TAKEN.into()));
        }
        let done = op.outcome.take()?;
        self.host.full_bytes_held -= std::mem::take(&mut op.full_bytes);
        let contexts = &mut self.host.contexts;
        if let Some(context) = contexts.end_op(op.ctx).filter(|_| done.is_ok()) {
            context.tokens.extend_from_slice(&op.appended);
            contexts.generated(op.ctx);
        }
        Some(done.and_then(|mut generated| distributions(op, &mut generated)))
    }

    fn drop(&mut self, op: Resource<PassOp>) -> wasmtime::Result<()> {
        let op = self.release(op, |op| op.outcome.pending().then_some(op.ctx))?;
        self.host.full_bytes_held -= op.full_bytes;
        Ok(())
    }
}

impl passes::HostMessageOp for GuestState {
    fn subscribe(&mut self, op: Resource<MessageOp>) -> wasmtime::Result<Resource<DynPollable>> {
        subscribe(&mut self.table, op)
    }

    fn take(&mut self, op: Resource<MessageOp>) -> Option<String> {
        let op = self.table.get_mut(&op).ok()?;
        op.outcome.take()?.ok()
    }

    fn drop(&mut self, op: Resource<MessageOp>) -> wasmtime::Result<()> {
        self.release(op, |_| None)?;
        Ok(())
    }
}

impl steering::Host for GuestState {
    fn set_token_sets(
        &mut self,
        ctx: u32,
        allowed: Option<Vec<u32>>,
        banned: Vec<u32>,
    ) -> Result<(), String> {
        let sets = TokenSets::new(allowed, banned)?;
        let checked = SamplingRequest {
            token_sets: sets.clone(),
            ..SamplingRequest::default()
        };
        (checked.check(self.host.rt.model.config.vocab)).map_err(|e| e.message)?;
        self.host.contexts.set_token_sets(ctx, sets)
    }
}

/// A second take's answer (the result is given out once).
const TAKEN: &str = "the operation's result was taken already";

/// The distributions a pass asked for, in the guest's order of positions.
fn distributions(op: &PassOp, generated: &mut Generated) -> Result<Vec<Distribution>, String> {
    let mut out = Vec::with_capacity(op.positions.len());
    for &p in &op.positions {
        let at = op.base + p as usize - 1;
        let scored = generated
            .scored
            .remove(&at)
            .ok_or_else(|| format!("the pass reported no distribution after position {p}"))?;
        out.push(distribution(p, scored));
    }
    Ok(out)
}

fn distribution(position: u32, s: Scored) -> Distribution {
    let token_logprob = |(token, logprob)| TokenLogprob { token, logprob };
    Distribution {
        position,
        greedy: token_logprob(s.greedy),
        top: s.top.into_iter().map(token_logprob).collect(),
        full: s.full,
    }
}

impl ProcessHost {
    /// Another operation fits [`MAX_OPS`].
    fn may_start_op(&self) -> Result<(), String> {
        if self.ops_held >= MAX_OPS {
            return Err(format!(
                "the process holds {MAX_OPS} operations already, the most it may: \
                 take and drop some first"
            ));
        }
        Ok(())
    }

    /// `call` run as its own task: it goes on while the guest does.
    fn spawn(&self, call: Generate) -> Outcome<Generated> {
        let (rt, process) = (self.rt.clone(), self.process.clone());
        Outcome::spawn(async move { rt.generate(&process, call).await })
    }

    /// A pass over `ctx` checked: its generation (one token after the
    /// context and `tokens`, reporting the positions asked), the context's
    /// length before it, and the bytes of full distributions it returns.
    fn pass(
        &self,
        ctx: u32,
        tokens: &[u32],
        positions: &[u32],
        report: Report,
    ) -> Result<(Generate, usize, usize), String> {
        self.check_tokens("start-pass", tokens)?;
        if tokens.len() > MAX_PASS_TOKENS {
            return Err(format!(
                "a pass appends at most {MAX_PASS_TOKENS} tokens, got {}",
                tokens.len()
            ));
        }
        let mut call = self.probe(ctx, None)?;
        let base = call.tokens.len();
        let positions = checked_positions(positions, base, tokens.len())?;
        let (top, full) = match report {
            Report::Greedy => (0, false),
            Report::TopK(k) if k == 0 || k as usize > MAX_TOP_LOGPROBS => {
                return Err(format!("top-k must be 1 to {MAX_TOP_LOGPROBS}, got {k}"))
            }
            Report::TopK(k) => (k as usize, false),
            Report::Full => (0, true),
        };
        let full_bytes = match full {
            true => positions.len() * self.rt.model.config.vocab * 4,
            false => 0,
        };
        self.may_hold_full(full_bytes)?;
        if base + tokens.len() >= self.rt.max_seq_tokens {
            return Err(format!(
                "context {ctx} would hold {} tokens; a sequence holds at most {}",
                base + tokens.len(),
                self.rt.max_seq_tokens - 1
            ));
        }
        call.tokens.extend_from_slice(tokens);
        call.score = Some(Score {
            positions,
            top,
            full,
        });
        Ok((call, base, full_bytes))
    }

    /// `bytes` more of full distributions fit one pass and the process.
    fn may_hold_full(&self, bytes: usize) -> Result<(), String> {
        if bytes > MAX_FULL_BYTES {
            return Err(format!(
                "the pass's full distributions take {bytes} bytes; one pass returns at most \
                 {MAX_FULL_BYTES} (ask for fewer positions)"
            ));
        }
        if self.full_bytes_held + bytes > MAX_FULL_BYTES_HELD {
            return Err(format!(
                "the process's operations would hold {} bytes of full distributions; at \
                 most {MAX_FULL_BYTES_HELD} (take some first)",
                self.full_bytes_held + bytes
            ));
        }
        Ok(())
    }
}

/// The prompt positions (ascending) whose rows report `positions`: each
/// from 0 to `appended`, none twice, 0 only after a token.
fn checked_positions(
    positions: &[u32],
    base: usize,
    appended: usize,
) -> Result<Vec<usize>, String> {
    if positions.len() > appended + 1 {
        return Err(format!(
            "a pass of {appended} tokens has {} positions; {} were asked for",
            appended + 1,
            positions.len()
        ));
    }
    let mut at = Vec::with_capacity(positions.len());
    for &p in positions {
        if p as usize > appended {
            return Err(format!("position {p} is past the pass's {appended} tokens"));
        }
        if p == 0 && base == 0 {
            return Err("position 0 follows the context's last token: the context is empty".into());
        }
        at.push(base + p as usize - 1);
    }
    at.sort_unstable();
    if at.windows(2).any(|w| w[0] == w[1]) {
        return Err("a position is listed twice".into());
    }
    Ok(at)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_are_checked_and_mapped_to_the_tokens_they_follow() {
        assert_eq!(checked_positions(&[2, 0, 1], 5, 2), Ok(vec![4, 5, 6]));
        assert!(checked_positions(&[3], 5, 2).unwrap_err().contains("past"));
        assert!(checked_positions(&[0], 0, 2).unwrap_err().contains("empty"));
        assert!(checked_positions(&[1, 1], 5, 2)
            .unwrap_err()
            .contains("twice"));
        assert!(checked_positions(&[0, 1, 2, 2], 5, 2)
            .unwrap_err()
            .contains("positions"));
        assert_eq!(checked_positions(&[1], 0, 1), Ok(vec![0]));
    }
}
