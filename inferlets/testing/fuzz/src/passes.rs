//! The 0.3.0 interfaces, `passes` and `steering`, called with bad input:
//! bad handles, out-of-range positions, too many tokens or ids, `top-k` 0
//! and 65, a `full` report over its bound, truncation past the end, every
//! kind of call on a context with an operation in flight, a second `take`,
//! a 65th operation in flight, an empty `allowed` set, ids outside the
//! vocabulary. Beside the calls that must fail, `checks` records what must
//! hold after: a taken generation's tokens join its context, a cancelled
//! operation leaves its context as it was.

use pie_inferlet::bindings::pie::inferlet0_1_0::inference as inf;
use pie_inferlet::bindings::pie::inferlet0_3_0::passes::{self, Report as R};
use pie_inferlet::bindings::pie::inferlet0_3_0::steering;

use crate::{BOGUS, Report, opts};

/// A generation that runs a while (256 tokens past the end of turn).
fn long() -> inf::GenerateOptions {
    let mut o = opts(256);
    o.ignore_eos = true;
    o
}

/// A second `take`'s outcome, as a call that must fail: none (nothing to
/// take) counts as a success.
fn second<T>(taken: Option<Result<T, String>>) -> Result<(), String> {
    match taken {
        Some(Err(e)) => Err(e),
        _ => Ok(()),
    }
}

pub fn fuzz(r: &mut Report, vocab: u32) -> Result<(), String> {
    let ctx = inf::create()?;
    inf::append_text(ctx, "Hello")?;
    let token = inf::tokens(ctx)?[0];
    bad_handles(r)?;
    bad_passes(r, ctx, token, vocab)?;
    bad_edits(r, ctx, vocab)?;
    busy(r, ctx, token)?;
    second_takes(r, ctx)?;
    cancels(r, ctx)?;
    too_many_in_flight(r, ctx)?;
    inf::drop_context(ctx)
}

/// Every new function on a handle that never existed and on a dropped one.
fn bad_handles(r: &mut Report) -> Result<(), String> {
    let dropped = inf::create()?;
    inf::append_text(dropped, "hello")?;
    inf::drop_context(dropped)?;
    for (name, h) in [("bogus", BOGUS), ("dropped", dropped)] {
        r.expect_err(
            &format!("start-generate({name})"),
            passes::start_generate(h, &opts(4)),
        );
        r.expect_err(
            &format!("start-pass({name})"),
            passes::start_pass(h, &[], &[0], R::Greedy),
        );
        r.expect_err(&format!("truncate({name}, 0)"), passes::truncate(h, 0));
        r.expect_err(
            &format!("set-token-sets({name})"),
            steering::set_token_sets(h, None, &[]),
        );
    }
    Ok(())
}

/// `start-pass` and `start-generate` with bad arguments on a live context.
fn bad_passes(r: &mut Report, ctx: u32, token: u32, vocab: u32) -> Result<(), String> {
    let pass = |tokens: &[u32], positions: &[u32], report: R| {
        passes::start_pass(ctx, tokens, positions, report)
    };
    r.expect_err(
        "start-pass(129 tokens)",
        pass(&[token; 129], &[0], R::Greedy),
    );
    r.expect_err("start-pass(130 positions)", pass(&[], &[0; 130], R::Greedy));
    r.expect_err(
        "start-pass(no tokens, position 1)",
        pass(&[], &[1], R::Greedy),
    );
    r.expect_err(
        "start-pass(1 token, position 2)",
        pass(&[token], &[0, 2], R::Greedy),
    );
    r.expect_err(
        "start-pass(position u32::MAX)",
        pass(&[token], &[u32::MAX], R::Greedy),
    );
    r.expect_err("start-pass(top-k 0)", pass(&[], &[0], R::TopK(0)));
    r.expect_err("start-pass(top-k 65)", pass(&[], &[0], R::TopK(65)));
    r.expect_err("start-pass([vocab_size])", pass(&[vocab], &[1], R::Greedy));
    r.expect_err("start-pass([u32::MAX])", pass(&[u32::MAX], &[1], R::Greedy));
    // `full` at n positions: n * vocab * 4 bytes, just over 4 MiB, where
    // 129 positions or fewer reach it.
    let n = (4 << 20) / (4 * vocab.max(1)) + 1;
    if n <= 129 {
        let positions: Vec<u32> = (0..n).collect();
        r.expect_err(
            &format!("start-pass(full at {n} positions, over 4 MiB)"),
            pass(&vec![token; n as usize - 1], &positions, R::Full),
        );
    }
    let empty = inf::create()?;
    r.expect_err(
        "start-pass(empty context, no tokens)",
        passes::start_pass(empty, &[], &[0], R::Greedy),
    );
    r.expect_err(
        "start-generate(empty context)",
        passes::start_generate(empty, &opts(4)),
    );
    inf::drop_context(empty)?;
    r.expect_err(
        "start-generate(max-tokens=0)",
        passes::start_generate(ctx, &opts(0)),
    );
    let mut o = opts(4);
    o.sampling.temperature = f32::NAN;
    r.expect_err(
        "start-generate(temperature=NaN)",
        passes::start_generate(ctx, &o),
    );
    Ok(())
}

/// `truncate` past the end, and token sets out of bounds.
fn bad_edits(r: &mut Report, ctx: u32, vocab: u32) -> Result<(), String> {
    let len = inf::tokens(ctx)?.len() as u32;
    r.expect_err("truncate(len + 1)", passes::truncate(ctx, len + 1));
    r.expect_err("truncate(u32::MAX)", passes::truncate(ctx, u32::MAX));
    let sets =
        |allowed: Option<&[u32]>, banned: &[u32]| steering::set_token_sets(ctx, allowed, banned);
    let many: Vec<u32> = (0..8193).map(|t| t % vocab.max(1)).collect();
    r.expect_err("set-token-sets(allowed [])", sets(Some(&[]), &[]));
    r.expect_err(
        "set-token-sets(allowed [vocab_size])",
        sets(Some(&[vocab]), &[]),
    );
    r.expect_err("set-token-sets(banned [u32::MAX])", sets(None, &[u32::MAX]));
    r.expect_err("set-token-sets(8193 allowed)", sets(Some(&many), &[]));
    r.expect_err("set-token-sets(8193 banned)", sets(None, &many));
    Ok(())
}

/// Everything that must wait for a context's operation, while one is in
/// flight; then its result, whose tokens the context gains.
fn busy(r: &mut Report, ctx: u32, token: u32) -> Result<(), String> {
    let before = inf::tokens(ctx)?.len();
    let op = passes::start_generate(ctx, &long())?;
    r.expect_err(
        "busy: start-generate",
        passes::start_generate(ctx, &opts(4)),
    );
    r.expect_err(
        "busy: start-pass",
        passes::start_pass(ctx, &[token], &[1], R::Greedy),
    );
    r.expect_err("busy: append-tokens", inf::append_tokens(ctx, &[token]));
    r.expect_err("busy: append-text", inf::append_text(ctx, "x"));
    r.expect_err("busy: truncate(0)", passes::truncate(ctx, 0));
    r.expect_err("busy: drop-context", inf::drop_context(ctx));
    let pollable = op.subscribe();
    pollable.block();
    drop(pollable);
    let generated = match op.take() {
        Some(Ok(g)) => g.tokens.len(),
        other => {
            r.check("busy: the generation's take", false, &format!("{other:?}"));
            0
        }
    };
    r.expect_err("generation-op: second take", second(op.take()));
    drop(op);
    let after = inf::tokens(ctx)?.len();
    r.check(
        "the context gains a taken generation's tokens",
        after == before + generated && generated > 0,
        &format!("{before} + {generated} tokens -> {after}"),
    );
    passes::truncate(ctx, before as u32)
}

/// A pass's result taken twice.
fn second_takes(r: &mut Report, ctx: u32) -> Result<(), String> {
    let op = passes::start_pass(ctx, &[], &[0], R::Greedy)?;
    let pollable = op.subscribe();
    pollable.block();
    drop(pollable);
    let first = op.take();
    r.check(
        "pass-op: first take",
        matches!(&first, Some(Ok(d)) if d.len() == 1),
        &format!("{first:?}"),
    );
    r.expect_err("pass-op: second take", second(op.take()));
    Ok(())
}

/// Operations dropped at once: cancelled, the context as before and free.
fn cancels(r: &mut Report, ctx: u32) -> Result<(), String> {
    let before = inf::tokens(ctx)?;
    drop(passes::start_generate(ctx, &long())?);
    let token = before[0];
    drop(passes::start_pass(ctx, &[token; 4], &[4], R::Greedy)?);
    drop(passes::start_receive()?);
    let message = passes::start_receive()?;
    let nothing = message.take();
    drop(message);
    let after = inf::tokens(ctx)?;
    r.check(
        "cancelled operations leave the context as it was",
        after == before,
        &format!("{} tokens -> {}", before.len(), after.len()),
    );
    r.check(
        "message-op: no message, nothing to take",
        nothing.is_none(),
        &format!("{nothing:?}"),
    );
    let free =
        inf::append_tokens(ctx, &[token]).and_then(|()| passes::truncate(ctx, before.len() as u32));
    r.check(
        "a context takes appends after a cancel",
        free.is_ok(),
        &format!("{free:?}"),
    );
    Ok(())
}

/// 64 operations in flight, then a 65th.
fn too_many_in_flight(r: &mut Report, ctx: u32) -> Result<(), String> {
    inf::prefill(ctx)?;
    let forks = (0..65)
        .map(|_| inf::fork(ctx))
        .collect::<Result<Vec<u32>, String>>()?;
    let ops = forks[..64]
        .iter()
        .map(|&f| passes::start_generate(f, &long()))
        .collect::<Result<Vec<_>, String>>()?;
    r.expect_err(
        "65th operation in flight: start-generate",
        passes::start_generate(forks[64], &long()),
    );
    r.expect_err(
        "65th operation in flight: start-pass",
        passes::start_pass(forks[64], &[], &[0], R::Greedy),
    );
    r.expect_err(
        "65th operation in flight: start-receive",
        passes::start_receive(),
    );
    drop(ops);
    for f in forks {
        inf::drop_context(f)?;
    }
    Ok(())
}
