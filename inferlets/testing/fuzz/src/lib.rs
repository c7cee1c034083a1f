//! Test inferlet `fuzz`: calls every host function with bad input (handles
//! that never existed or were dropped, token ids outside the vocabulary,
//! out-of-range options, the same context twice in one `generate-all`, 2 MiB
//! strings, invalid JSON, bad props; and, of 0.3.0's `passes` and
//! `steering` (`passes.rs`), out-of-range positions, too many tokens,
//! `top-k` 0 and 65, truncation past the end, calls on a context with an
//! operation in flight, a second `take`, a 65th operation in flight, empty
//! or out-of-vocabulary token sets), each of which must be an `err`, never a
//! trap. It emits `{"calls": [{"call": name, "result": error text or
//! "UNEXPECTED OK"}], "unexpected_ok": [name], "checks": [{"check": name,
//! "passed": bool, "detail": text}], "failed_checks": [name]}` with
//! `emit_json` (a check is what must hold after a call: a taken
//! generation's tokens join its context, a cancelled operation leaves it as
//! it was), then makes one small valid generation (emitting its text) to
//! show the process still works. It fails, naming them, if any bad call
//! succeeded or any check failed. No args.
//!
//! Not called: `receive` (it would wait for a message); the infallible
//! functions (`name`, `vocab-size`, `stop-tokens`, `id`, `args`, `props`,
//! `try-receive`, `log`, `now-ms`, `sleep`) are called once each with
//! whatever input they take, to show they do not trap.

mod passes;

use pie_inferlet::bindings::pie::inferlet0_1_0::{inference as inf, model, process};
use pie_inferlet::bindings::pie::inferlet0_2_0::reporting;
use pie_inferlet::serde_json::{Value, json};

pub(crate) const BOGUS: u32 = 0xDEAD_BEEF;

struct Report {
    calls: Vec<Value>,
    unexpected_ok: Vec<String>,
    checks: Vec<Value>,
    failed_checks: Vec<String>,
}

impl Report {
    /// Records a call that must fail.
    fn expect_err<T>(&mut self, call: &str, result: Result<T, String>) {
        let text = match result {
            Ok(_) => {
                self.unexpected_ok.push(call.to_string());
                "UNEXPECTED OK".to_string()
            }
            // Keep the report small even if an error echoes its input.
            Err(e) => e.chars().take(300).collect(),
        };
        self.calls.push(json!({ "call": call, "result": text }));
    }

    /// Records what must hold.
    fn check(&mut self, name: &str, passed: bool, detail: &str) {
        if !passed {
            self.failed_checks.push(name.to_string());
        }
        let detail: String = detail.chars().take(300).collect();
        self.checks
            .push(json!({ "check": name, "passed": passed, "detail": detail }));
    }
}

fn opts(max_tokens: u32) -> inf::GenerateOptions {
    inf::GenerateOptions {
        sampling: inf::Sampling {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            seed: None,
        },
        max_tokens,
        stop: Vec::new(),
        ignore_eos: false,
        stream: false,
    }
}

fn run() -> Result<(), String> {
    let big = "x".repeat(2 << 20);
    let big_json = format!("\"{big}\"");
    let vocab = model::vocab_size();
    let mut r = Report {
        calls: Vec::new(),
        unexpected_ok: Vec::new(),
        checks: Vec::new(),
        failed_checks: Vec::new(),
    };

    // The infallible functions: they must simply not trap.
    let _ = (model::name(), model::stop_tokens(), process::id());
    let _ = (process::args(), process::props(), process::try_receive());
    let _ = process::now_ms();
    process::log(process::Level::Debug, &big);
    process::sleep(0);

    // model
    r.expect_err("encode(2 MiB)", model::encode(&big));
    r.expect_err("decode([u32::MAX])", model::decode(&[u32::MAX]));
    r.expect_err("decode([vocab_size])", model::decode(&[vocab]));
    r.expect_err(
        "apply-chat-template(2 MiB content)",
        model::apply_chat_template(&[model::Message {
            role: "user".into(),
            content: big.clone(),
        }]),
    );

    // inference, on a handle that never existed
    r.expect_err("fork(bogus)", inf::fork(BOGUS));
    r.expect_err("drop-context(bogus)", inf::drop_context(BOGUS));
    r.expect_err("append-tokens(bogus)", inf::append_tokens(BOGUS, &[1]));
    r.expect_err("append-text(bogus)", inf::append_text(BOGUS, "hi"));
    r.expect_err("tokens(bogus)", inf::tokens(BOGUS));
    r.expect_err("prefill(bogus)", inf::prefill(BOGUS));
    r.expect_err("generate(bogus)", inf::generate(BOGUS, &opts(4)));
    r.expect_err("forward(bogus)", inf::forward(BOGUS, 1));
    r.expect_err(
        "report-logprobs(bogus)",
        reporting::report_logprobs(BOGUS, false),
    );
    let all = inf::generate_all(&[BOGUS], &opts(4));
    if all.len() != 1 {
        r.expect_err::<()>("generate-all([bogus]) length", Ok(()));
    }
    for (i, res) in all.into_iter().enumerate() {
        r.expect_err(&format!("generate-all([bogus])[{i}]"), res);
    }

    // inference, on a dropped handle
    let dropped = inf::create()?;
    inf::append_text(dropped, "hello")?;
    inf::drop_context(dropped)?;
    r.expect_err("fork(dropped)", inf::fork(dropped));
    r.expect_err("drop-context(dropped)", inf::drop_context(dropped));
    r.expect_err("append-tokens(dropped)", inf::append_tokens(dropped, &[1]));
    r.expect_err("append-text(dropped)", inf::append_text(dropped, "hi"));
    r.expect_err("tokens(dropped)", inf::tokens(dropped));
    r.expect_err("prefill(dropped)", inf::prefill(dropped));
    r.expect_err("generate(dropped)", inf::generate(dropped, &opts(4)));
    r.expect_err("forward(dropped)", inf::forward(dropped, 1));
    r.expect_err(
        "report-logprobs(dropped)",
        reporting::report_logprobs(dropped, false),
    );
    for (i, res) in inf::generate_all(&[dropped], &opts(4))
        .into_iter()
        .enumerate()
    {
        r.expect_err(&format!("generate-all([dropped])[{i}]"), res);
    }

    // inference, on a live context with bad arguments
    let ctx = inf::create()?;
    inf::append_text(ctx, "Hello")?;
    r.expect_err(
        "append-tokens([u32::MAX])",
        inf::append_tokens(ctx, &[u32::MAX]),
    );
    r.expect_err(
        "append-tokens([vocab_size])",
        inf::append_tokens(ctx, &[vocab]),
    );
    r.expect_err("append-text(2 MiB)", inf::append_text(ctx, &big));
    r.expect_err("forward(k=1000)", inf::forward(ctx, 1000));
    r.expect_err("generate(max-tokens=0)", inf::generate(ctx, &opts(0)));
    let mut o = opts(4);
    o.sampling.temperature = -1.0;
    r.expect_err("generate(temperature=-1)", inf::generate(ctx, &o));
    let mut o = opts(4);
    o.sampling.temperature = f32::NAN;
    r.expect_err("generate(temperature=NaN)", inf::generate(ctx, &o));
    let mut o = opts(4);
    o.sampling.top_p = 0.0;
    r.expect_err("generate(top-p=0)", inf::generate(ctx, &o));
    let mut o = opts(4);
    o.stop = vec![big.clone()];
    r.expect_err("generate(stop=[2 MiB])", inf::generate(ctx, &o));
    // Two generations appending to one context at once: ill-defined.
    for (i, res) in inf::generate_all(&[ctx, ctx], &opts(4))
        .into_iter()
        .enumerate()
    {
        r.expect_err(&format!("generate-all([ctx, ctx])[{i}]"), res);
    }
    for (i, res) in inf::generate_all(&[ctx], &opts(0)).into_iter().enumerate() {
        r.expect_err(&format!("generate-all(max-tokens=0)[{i}]"), res);
    }

    // passes and steering (0.3.0)
    passes::fuzz(&mut r, vocab)?;

    // process
    r.expect_err("emit(2 MiB)", process::emit(&big));
    r.expect_err("emit-json(2 MiB)", process::emit_json(&big_json));
    r.expect_err("emit-json(invalid JSON)", process::emit_json("{not json"));
    r.expect_err(
        "set-prop(priority, invalid JSON)",
        process::set_prop("priority", "{not json"),
    );
    r.expect_err(
        "set-prop(priority, \"high\")",
        process::set_prop("priority", "\"high\""),
    );
    r.expect_err(
        "set-prop(unknown prop, [1,2])",
        process::set_prop("no-such-prop", "[1,2]"),
    );
    r.expect_err(
        "set-prop(bad key Bad_Key!)",
        process::set_prop("Bad_Key!", "1"),
    );
    r.expect_err(
        "set-prop(client, 2 MiB)",
        process::set_prop("client", &big_json),
    );
    r.expect_err(
        "set-prop(client, another client's name)",
        process::set_prop("client", "\"victim\""),
    );
    r.expect_err("remove-prop(client)", process::remove_prop("client"));
    r.expect_err(
        "set-prop(deadline-ms, -5)",
        process::set_prop("deadline-ms", "-5"),
    );
    r.expect_err("set-prop(2 MiB key)", process::set_prop(&big, "1"));
    r.expect_err("remove-prop(2 MiB key)", process::remove_prop(&big));

    let unexpected = r.unexpected_ok.clone();
    let failed = r.failed_checks.clone();
    pie_inferlet::emit_json(&json!({
        "calls": r.calls,
        "unexpected_ok": r.unexpected_ok,
        "checks": r.checks,
        "failed_checks": r.failed_checks,
    }))?;

    // Still alive: one small valid generation.
    let mut o = opts(4);
    o.ignore_eos = true;
    let g = inf::generate(ctx, &o)?;
    process::emit(&g.text)?;
    inf::drop_context(ctx)?;

    if !unexpected.is_empty() {
        return Err(format!(
            "bad calls that succeeded: {}",
            unexpected.join(", ")
        ));
    }
    if !failed.is_empty() {
        return Err(format!("failed checks: {}", failed.join(", ")));
    }
    Ok(())
}

pie_inferlet::main!(run);
