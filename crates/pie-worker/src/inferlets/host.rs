//! The host side of `pie:inferlet@0.2.0` (and so of 0.1.0; 0.3.0's additions
//! are `host_passes.rs`): what each import does for the
//! calling process, with every argument checked (a bad handle, an id
//! outside the vocabulary, an oversized string, a prop beyond the key's
//! limits: an `err` naming it, never a trap), and the linker that offers
//! exactly these imports and the WASI ones of [`ALLOWED_IMPORTS`].
//!
//! Invariant: a host call touches only its own process (its contexts,
//! props, messages and output); generation goes through the runtime's one
//! scheduler like any sequence.
//!
//! [`ALLOWED_IMPORTS`]: super::world::ALLOWED_IMPORTS

use std::sync::Arc;
use std::time::Duration;

use pie_core::auth::KeyLimits;
use pie_model::{
    check_token_ids, Grammar, GrammarSpec, SamplingParams, SamplingRequest, MAX_TOP_LOGPROBS,
};
use serde_json::Value;
use wasmtime::component::{HasData, HasSelf, Linker, ResourceTable};
use wasmtime_wasi::p2::bindings::{cli, clocks, random};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use super::contexts::Contexts;
use super::end::fail;
use super::host_work::HostWork;
use super::limits::{
    bounded, bounded_to, max_text_bytes, CpuMeter, MemoryCap, TokenBucket, EVENT_OVERHEAD_BYTES,
    MAX_GRAMMAR_BYTES, MAX_PARALLEL, TEXT_BYTES_PER_TOKEN,
};
use super::world::inference::{FinishReason, GenerateOptions, Generation, Sampling, TokenLogprob};
use super::world::shaping::LogitShaping;
use super::world::structured::OutputFormat;
use super::world::{inference, model, passes, process, reporting, shaping, steering, structured};
use crate::inbox::InboxReceiver;
use crate::process::Process;
use crate::runtime::{Generate, Generated, Runtime, TextRules};
use pie_core::clock::now_ms;

/// The longest one `sleep` waits.
const MAX_SLEEP: Duration = Duration::from_secs(24 * 3600);

/// The most stop strings one generation takes.
const MAX_STOP_STRINGS: usize = 16;

/// What one instance's store holds.
pub struct GuestState {
    pub wasi: WasiCtx,
    pub table: ResourceTable,
    pub memory: MemoryCap,
    pub host: ProcessHost,
}

/// The process an instance serves, and what its imports reach.
pub struct ProcessHost {
    pub rt: Arc<Runtime>,
    pub process: Arc<Process>,
    pub contexts: Contexts,
    /// The launch's `args`, as JSON text.
    pub args: String,
    /// The launching key's name and limits (props it sets are bounded by them).
    pub key: Option<(String, KeyLimits)>,
    pub cache_salt: Option<String>,
    /// Shared with its `message-op`s: each message goes to one waiter.
    pub inbox: Arc<tokio::sync::Mutex<InboxReceiver>>,
    /// Operations (`passes`) it holds, and the bytes of full distributions
    /// they may return.
    pub ops_held: usize,
    pub full_bytes_held: usize,
    /// The guest's CPU time, and the pool its heavy host calls run on.
    pub meter: Arc<CpuMeter>,
    pub work: Arc<HostWork>,
    /// How long one `receive` or `sleep` may wait with nothing arriving
    /// (`max_idle_ms`, the key's or the worker's).
    pub max_idle: Duration,
    pub output_bytes: usize,
    pub max_output_bytes: usize,
    /// This process's log rate.
    pub logs: TokenBucket,
    /// All processes' log rate (the worker's one bucket).
    pub all_logs: Arc<std::sync::Mutex<TokenBucket>>,
    /// A dropped log line was noted already.
    pub logs_dropped: bool,
}

impl WasiView for GuestState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

struct HasTable;

impl HasData for HasTable {
    type Data<'a> = &'a mut ResourceTable;
}

/// The linker every instance is made with: the world's imports, and the
/// allowed WASI ones (served with no files, variables or sockets).
pub fn linker(engine: &wasmtime::Engine) -> wasmtime::Result<Linker<GuestState>> {
    use wasmtime_wasi::cli::{WasiCli, WasiCliView};
    use wasmtime_wasi::clocks::{WasiClocks, WasiClocksView};
    use wasmtime_wasi::random::{WasiRandom, WasiRandomView};
    use wasmtime_wasi_io::bindings::wasi::io;
    let mut l = Linker::new(engine);
    // Interface by interface: the world's own would want WASI's poll served
    // by `GuestState`; the table serves it below.
    model::add_to_linker::<_, HasSelf<GuestState>>(&mut l, |s| s)?;
    inference::add_to_linker::<_, HasSelf<GuestState>>(&mut l, |s| s)?;
    process::add_to_linker::<_, HasSelf<GuestState>>(&mut l, |s| s)?;
    structured::add_to_linker::<_, HasSelf<GuestState>>(&mut l, |s| s)?;
    reporting::add_to_linker::<_, HasSelf<GuestState>>(&mut l, |s| s)?;
    shaping::add_to_linker::<_, HasSelf<GuestState>>(&mut l, |s| s)?;
    passes::add_to_linker::<_, HasSelf<GuestState>>(&mut l, |s| s)?;
    steering::add_to_linker::<_, HasSelf<GuestState>>(&mut l, |s| s)?;
    io::error::add_to_linker::<_, HasTable>(&mut l, |s| &mut s.table)?;
    io::poll::add_to_linker::<_, HasTable>(&mut l, |s| &mut s.table)?;
    io::streams::add_to_linker::<_, HasTable>(&mut l, |s| &mut s.table)?;
    clocks::wall_clock::add_to_linker::<_, WasiClocks>(&mut l, GuestState::clocks)?;
    clocks::monotonic_clock::add_to_linker::<_, WasiClocks>(&mut l, GuestState::clocks)?;
    random::random::add_to_linker::<_, WasiRandom>(&mut l, GuestState::random)?;
    random::insecure::add_to_linker::<_, WasiRandom>(&mut l, GuestState::random)?;
    random::insecure_seed::add_to_linker::<_, WasiRandom>(&mut l, GuestState::random)?;
    cli::exit::add_to_linker::<_, WasiCli>(&mut l, GuestState::cli)?;
    cli::environment::add_to_linker::<_, WasiCli>(&mut l, GuestState::cli)?;
    cli::stdin::add_to_linker::<_, WasiCli>(&mut l, GuestState::cli)?;
    cli::stdout::add_to_linker::<_, WasiCli>(&mut l, GuestState::cli)?;
    cli::stderr::add_to_linker::<_, WasiCli>(&mut l, GuestState::cli)?;
    cli::terminal_input::add_to_linker::<_, WasiCli>(&mut l, GuestState::cli)?;
    cli::terminal_output::add_to_linker::<_, WasiCli>(&mut l, GuestState::cli)?;
    cli::terminal_stdin::add_to_linker::<_, WasiCli>(&mut l, GuestState::cli)?;
    cli::terminal_stdout::add_to_linker::<_, WasiCli>(&mut l, GuestState::cli)?;
    cli::terminal_stderr::add_to_linker::<_, WasiCli>(&mut l, GuestState::cli)?;
    Ok(l)
}

impl model::Host for GuestState {
    fn name(&mut self) -> String {
        self.host.rt.settings.model_name.clone()
    }

    fn vocab_size(&mut self) -> u32 {
        self.host.rt.model.config.vocab as u32
    }

    async fn encode(&mut self, text: String) -> Result<Vec<u32>, String> {
        self.host.check_text("the text", &text)?;
        let model = self.host.rt.model.clone();
        let size = text.len();
        self.host
            .work(size, move || {
                (model.tokenizer.encode_continuation(&text)).map_err(|e| e.to_string())
            })
            .await
    }

    async fn decode(&mut self, tokens: Vec<u32>) -> Result<String, String> {
        self.host.check_tokens("decode", &tokens)?;
        let context = self.host.rt.model.config.context_length;
        if tokens.len() > context {
            return Err(format!(
                "decode has {} tokens; it takes at most the model's context of {context}",
                tokens.len()
            ));
        }
        let model = self.host.rt.model.clone();
        let size = tokens.len() * TEXT_BYTES_PER_TOKEN;
        self.host
            .work(size, move || {
                (model.tokenizer.decode(&tokens)).map_err(|e| e.to_string())
            })
            .await
    }

    async fn apply_chat_template(
        &mut self,
        messages: Vec<model::Message>,
    ) -> Result<String, String> {
        let size: usize = messages
            .iter()
            .map(|m| m.role.len() + m.content.len())
            .sum();
        let max = self.host.max_text_bytes();
        if size > max {
            return Err(format!(
                "the messages have {size} bytes; apply-chat-template takes at most {max}"
            ));
        }
        let messages: Vec<pie_model::ChatMessage> = messages
            .into_iter()
            .map(|m| pie_model::ChatMessage::text(&m.role, m.content))
            .collect();
        let model = self.host.rt.model.clone();
        self.host
            .work(size, move || {
                (model.tokenizer.apply_chat_template(&messages, None)).map_err(|e| e.to_string())
            })
            .await
    }

    fn stop_tokens(&mut self) -> Vec<u32> {
        self.host.rt.model.tokenizer.stop_tokens().to_vec()
    }
}

impl inference::Host for GuestState {
    async fn create(&mut self) -> Result<u32, String> {
        self.host.contexts.create(Vec::new())
    }

    async fn fork(&mut self, ctx: u32) -> Result<u32, String> {
        self.host.contexts.fork(ctx)
    }

    async fn drop_context(&mut self, ctx: u32) -> Result<(), String> {
        let key = self.host.contexts.remove(ctx)?;
        self.host
            .rt
            .release_retained(&self.host.process.client, &key);
        Ok(())
    }

    async fn append_tokens(&mut self, ctx: u32, tokens: Vec<u32>) -> Result<(), String> {
        self.host.check_tokens("append-tokens", &tokens)?;
        self.host.append(ctx, &tokens)
    }

    async fn append_text(&mut self, ctx: u32, text: String) -> Result<u32, String> {
        self.host.check_text("the text", &text)?;
        // The model's BOS begins a context, never the middle of one.
        let first = self.host.contexts.get(ctx)?.tokens.is_empty();
        let model = self.host.rt.model.clone();
        let size = text.len();
        let tokens = self
            .host
            .work(size, move || {
                let tokenizer = &model.tokenizer;
                if first {
                    tokenizer.encode(&text)
                } else {
                    tokenizer.encode_continuation(&text)
                }
                .map_err(|e| e.to_string())
            })
            .await?;
        self.host.append(ctx, &tokens)?;
        Ok(tokens.len() as u32)
    }

    async fn tokens(&mut self, ctx: u32) -> Result<Vec<u32>, String> {
        Ok(self.host.contexts.get(ctx)?.tokens.clone())
    }

    async fn prefill(&mut self, ctx: u32) -> Result<(), String> {
        let call = self.host.probe(ctx, None)?;
        self.host.run(call).await?;
        self.host.contexts.generated(ctx);
        Ok(())
    }

    async fn generate(&mut self, ctx: u32, options: GenerateOptions) -> Result<Generation, String> {
        let call = self.host.generation(ctx, &options)?;
        let done = self.host.run(call).await?;
        self.host.finish_generation(ctx, done)
    }

    async fn generate_all(
        &mut self,
        ctxs: Vec<u32>,
        options: GenerateOptions,
    ) -> Vec<Result<Generation, String>> {
        if ctxs.len() > MAX_PARALLEL {
            let why = format!("generate-all takes at most {MAX_PARALLEL} contexts");
            return ctxs.iter().map(|_| Err(why.clone())).collect();
        }
        let calls: Vec<Result<Generate, String>> = ctxs
            .iter()
            .enumerate()
            .map(|(i, &ctx)| {
                if ctxs.iter().filter(|&&c| c == ctx).count() > 1 {
                    return Err(format!("context {ctx} is listed more than once"));
                }
                let mut call = self.host.generation(ctx, &options)?;
                // Each context its own draws: seed + its position.
                call.sampling.seed = options.sampling.seed.map(|s| s.wrapping_add(i as u64));
                Ok(call)
            })
            .collect();
        let rt = self.host.rt.clone();
        let process = self.host.process.clone();
        let runs = calls.into_iter().map(|call| {
            let (rt, process) = (rt.clone(), process.clone());
            async move { rt.generate(&process, call?).await }
        });
        let results = futures_util::future::join_all(runs).await;
        ctxs.iter()
            .zip(results)
            .map(|(&ctx, done)| self.host.finish_generation(ctx, done?))
            .collect()
    }

    async fn forward(&mut self, ctx: u32, k: u32) -> Result<Vec<TokenLogprob>, String> {
        if k == 0 || k as usize > MAX_TOP_LOGPROBS {
            return Err(format!("k must be 1 to {MAX_TOP_LOGPROBS}, got {k}"));
        }
        let call = self.host.probe(ctx, Some(k as usize))?;
        let done = self.host.run(call).await?;
        self.host.contexts.generated(ctx);
        Ok(done
            .first_top
            .into_iter()
            .map(|(token, logprob)| TokenLogprob { token, logprob })
            .collect())
    }
}

impl structured::Host for GuestState {
    async fn generate_constrained(
        &mut self,
        ctx: u32,
        options: GenerateOptions,
        format: OutputFormat,
    ) -> Result<Generation, String> {
        let mut call = self.host.generation(ctx, &options)?;
        call.grammar = Some(self.host.compile(format).await?);
        let done = self.host.run(call).await?;
        self.host.finish_generation(ctx, done)
    }
}

impl reporting::Host for GuestState {
    fn report_logprobs(&mut self, ctx: u32, on: bool) -> Result<(), String> {
        self.host.contexts.get_mut(ctx)?.logprobs = on;
        Ok(())
    }
}

impl shaping::Host for GuestState {
    fn set_shaping(&mut self, ctx: u32, shaping: LogitShaping) -> Result<(), String> {
        let request = SamplingRequest {
            frequency_penalty: Some(shaping.frequency_penalty),
            presence_penalty: Some(shaping.presence_penalty),
            repetition_penalty: Some(shaping.repetition_penalty),
            logit_bias: shaping.logit_bias,
            token_sets: self.host.contexts.get(ctx)?.shaping.token_sets.clone(),
            ..SamplingRequest::default()
        };
        (request.clone().check(self.host.rt.model.config.vocab))
            .map_err(|e| e.message.replace('_', "-"))?;
        self.host.contexts.get_mut(ctx)?.shaping = request;
        Ok(())
    }
}

impl process::Host for GuestState {
    fn id(&mut self) -> String {
        self.host.process.id.clone()
    }

    fn args(&mut self) -> String {
        self.host.args.clone()
    }

    fn props(&mut self) -> String {
        serde_json::to_string(&self.host.process.props()).unwrap_or_else(|_| "{}".into())
    }

    fn set_prop(&mut self, name: String, value: String) -> Result<(), String> {
        let value: Value = serde_json::from_str(bounded("the value", &value)?)
            .map_err(|e| format!("the value of `{name}` is not JSON: {e}"))?;
        if value.is_null() {
            return Err(format!(
                "remove `{name}` with remove-prop, not a null value"
            ));
        }
        self.host.patch_props(name, value)
    }

    fn remove_prop(&mut self, name: String) -> Result<(), String> {
        self.host.patch_props(name, Value::Null)
    }

    fn emit(&mut self, text: String) -> Result<(), String> {
        bounded("the text", &text)?;
        self.host.spend_output(text.len() + EVENT_OVERHEAD_BYTES)?;
        self.host.process.push_emitted(text);
        Ok(())
    }

    fn emit_json(&mut self, json: String) -> Result<(), String> {
        bounded("the event", &json)?;
        let value: Value =
            serde_json::from_str(&json).map_err(|e| format!("emit-json: not JSON: {e}"))?;
        // Kept as compact text: what it costs to keep is what it is charged.
        let compact = value.to_string();
        self.host
            .spend_output(compact.len() + EVENT_OVERHEAD_BYTES)?;
        self.host.process.push_json(compact);
        Ok(())
    }

    async fn receive(&mut self) -> String {
        let idle = self.host.max_idle;
        let inbox = self.host.inbox.clone();
        let next = async move { inbox.lock().await.recv().await };
        match tokio::time::timeout(idle, next).await {
            Ok(Some(message)) => message,
            // The inbox lives as long as the process: never reached.
            Ok(None) => std::future::pending().await,
            Err(_) => self.host.idle_past_limit("receive").await,
        }
    }

    /// None too while a `message-op` waits for the next one.
    fn try_receive(&mut self) -> Option<String> {
        self.host.inbox.try_lock().ok()?.try_recv()
    }

    fn log(&mut self, level: process::Level, message: String) {
        let message: String = message.chars().take(4096).collect();
        if !self.host.may_log(message.len()) {
            return;
        }
        let id = &self.host.process.id;
        match level {
            process::Level::Debug => tracing::debug!(process = %id, "inferlet: {message}"),
            process::Level::Info => tracing::info!(process = %id, "inferlet: {message}"),
            process::Level::Warn => tracing::warn!(process = %id, "inferlet: {message}"),
            process::Level::Error => tracing::error!(process = %id, "inferlet: {message}"),
        }
    }

    fn now_ms(&mut self) -> u64 {
        now_ms()
    }

    async fn sleep(&mut self, ms: u64) {
        let asked = Duration::from_millis(ms).min(MAX_SLEEP);
        tokio::time::sleep(asked.min(self.host.max_idle)).await;
        if asked > self.host.max_idle {
            self.host.idle_past_limit("sleep").await
        }
    }
}

impl ProcessHost {
    /// The process fails naming `max_idle_ms`; its task then drops the
    /// guest (it waits on the process's end), so this never returns.
    pub(super) async fn idle_past_limit(&self, call: &str) -> ! {
        fail(
            &self.rt,
            &self.process,
            format!(
                "the inferlet waited in `{call}` for {} ms with nothing arriving, \
                 past max_idle_ms",
                self.max_idle.as_millis()
            ),
        );
        std::future::pending().await
    }

    /// One generation of this process (see [`Runtime::generate`]).
    async fn run(&self, call: Generate) -> Result<Generated, String> {
        self.rt.clone().generate(&self.process, call).await
    }

    /// Heavy work for this process, off its guest's thread when large
    /// (see [`HostWork`]), charged to its `max_cpu_ms`.
    async fn work<T: Send + 'static>(
        &self,
        size: usize,
        work: impl FnOnce() -> Result<T, String> + Send + 'static,
    ) -> Result<T, String> {
        self.work.run(size, &self.meter, work).await
    }

    /// The most text one call tokenizes or templates, for this model.
    fn max_text_bytes(&self) -> usize {
        max_text_bytes(self.rt.model.config.context_length)
    }

    fn check_text(&self, what: &str, text: &str) -> Result<(), String> {
        bounded_to(what, text, self.max_text_bytes()).map(|_| ())
    }

    /// `format` compiled for the model, always on the host-work pool (a
    /// compile's cost is not its text's length); an `err` names what the
    /// library could not use.
    async fn compile(&self, format: OutputFormat) -> Result<Grammar, String> {
        let (what, text) = match &format {
            OutputFormat::JsonSchema(text) => ("a JSON schema", text.as_str()),
            OutputFormat::JsonObject => ("", ""),
            OutputFormat::Regex(rx) => ("a regex", rx.as_str()),
            OutputFormat::Grammar(lark) => ("a grammar", lark.as_str()),
        };
        bounded_to(what, text, MAX_GRAMMAR_BYTES)?;
        let model = self.rt.model.clone();
        self.work(usize::MAX, move || {
            let spec = match format {
                OutputFormat::JsonSchema(text) => GrammarSpec::JsonSchema(
                    serde_json::from_str(&text)
                        .map_err(|e| format!("the JSON schema is not JSON: {e}"))?,
                ),
                OutputFormat::JsonObject => GrammarSpec::JsonObject,
                OutputFormat::Regex(rx) => GrammarSpec::Regex(rx),
                OutputFormat::Grammar(lark) => GrammarSpec::Lark(lark),
            };
            model.grammars()?.compile(&spec)
        })
        .await
    }

    /// Every id below the vocabulary size.
    pub(super) fn check_tokens(&self, what: &str, tokens: &[u32]) -> Result<(), String> {
        check_token_ids(tokens, self.rt.model.config.vocab).map_err(|e| format!("{what}: {e}"))
    }

    /// Append to a context, keeping it within what one sequence holds.
    pub(super) fn append(&mut self, ctx: u32, tokens: &[u32]) -> Result<(), String> {
        let limit = self.rt.max_seq_tokens;
        let context = self.contexts.get_mut(ctx)?;
        if context.tokens.len() + tokens.len() >= limit {
            return Err(format!(
                "context {ctx} would hold {} tokens; a sequence holds at most {}",
                context.tokens.len() + tokens.len(),
                limit - 1
            ));
        }
        context.tokens.extend_from_slice(tokens);
        Ok(())
    }

    /// A one-token greedy step over the context that reports the `top` most
    /// likely next tokens, if asked; its sample is not kept (`prefill`,
    /// `forward`).
    pub(super) fn probe(&self, ctx: u32, top: Option<usize>) -> Result<Generate, String> {
        let context = self.contexts.idle(ctx)?;
        Ok(Generate {
            tokens: context.tokens.clone(),
            counted: context.counted,
            max_tokens: 1,
            sampling: SamplingParams::default(),
            text: TextRules::default(),
            ignore_eos: true,
            logprobs: top,
            retain_as: context.retain_as.clone(),
            resume_from: context.resume_from.clone(),
            cache_salt: self.cache_salt.clone(),
            stream: false,
            grammar: None,
            score: None,
            hold_ms: self.max_idle.as_millis() as u64,
        })
    }

    pub(super) fn generation(
        &self,
        ctx: u32,
        options: &GenerateOptions,
    ) -> Result<Generate, String> {
        let context = self.contexts.idle(ctx)?;
        if context.tokens.is_empty() {
            return Err("the context is empty: append tokens or text first".into());
        }
        if options.max_tokens == 0 {
            return Err("max-tokens must be at least 1".into());
        }
        if options.stop.len() > MAX_STOP_STRINGS {
            return Err(format!(
                "at most {MAX_STOP_STRINGS} stop strings, got {}",
                options.stop.len()
            ));
        }
        for s in &options.stop {
            bounded("a stop string", s)?;
        }
        Ok(Generate {
            tokens: context.tokens.clone(),
            counted: context.counted,
            max_tokens: options.max_tokens as usize,
            sampling: sampling(
                &options.sampling,
                &context.shaping,
                self.rt.model.config.vocab,
            )?,
            text: TextRules {
                stop: options.stop.clone(),
                ..TextRules::default()
            },
            ignore_eos: options.ignore_eos,
            logprobs: context.logprobs.then_some(0),
            retain_as: context.retain_as.clone(),
            resume_from: context.resume_from.clone(),
            cache_salt: self.cache_salt.clone(),
            stream: options.stream,
            grammar: None,
            score: None,
            hold_ms: self.max_idle.as_millis() as u64,
        })
    }

    /// A generation's tokens join its context (if the guest has not
    /// dropped it meanwhile), and come back as the WIT's record.
    pub(super) fn finish_generation(
        &mut self,
        ctx: u32,
        done: Generated,
    ) -> Result<Generation, String> {
        if let Ok(context) = self.contexts.get_mut(ctx) {
            context.tokens.extend_from_slice(&done.tokens);
        }
        self.contexts.generated(ctx);
        Ok(Generation {
            tokens: done.tokens,
            text: done.text,
            logprobs: done.logprobs,
            finish_reason: if done.stopped {
                FinishReason::Stop
            } else {
                FinishReason::Length
            },
        })
    }

    /// Set (or, with null, remove) one of the process's own props: checked
    /// as a client's, bounded by the launching key's limits; the change
    /// reaches its sequences from the next step and its watchers as an event.
    fn patch_props(&mut self, name: String, value: Value) -> Result<(), String> {
        bounded("the prop's name", &name)?;
        let mut patch = serde_json::Map::new();
        patch.insert(name, value);
        let (key, process) = (self.key.clone(), self.process.clone());
        let (spent, max) = (&mut self.output_bytes, self.max_output_bytes);
        let props = process.update_props_announced(|props| {
            let mut next = props.clone();
            next.patch_json(&patch).map_err(|e| e.to_string())?;
            if let Some((who, limits)) = &key {
                limits.apply(who, &mut next).map_err(|e| e.to_string())?;
            }
            // The props event keeps the whole snapshot.
            let kept = serde_json::to_string(&next).map_or(0, |j| j.len());
            charge(spent, max, kept + EVENT_OVERHEAD_BYTES)?;
            *props = next;
            Ok::<(), String>(())
        })?;
        self.rt.props_changed(&process, &props);
        Ok(())
    }

    /// Whether a log line of `bytes` may be written: within this process's
    /// and all processes' log rates, and charged to its output budget.
    /// Dropped lines are counted; the first a process drops is noted.
    fn may_log(&mut self, bytes: usize) -> bool {
        let now = std::time::Instant::now();
        let within_rates = self.logs.take(now)
            && (self.all_logs.lock())
                .unwrap_or_else(|e| e.into_inner())
                .take(now);
        if within_rates && self.spend_output(bytes + EVENT_OVERHEAD_BYTES).is_ok() {
            return true;
        }
        self.rt.metrics.inferlet_log_lines_dropped.inc();
        if !self.logs_dropped {
            self.logs_dropped = true;
            tracing::warn!(
                process = %self.process.id,
                "inferlet: log lines dropped past the log rate or max_output_bytes; further drops are only counted (pie_inferlet_log_lines_dropped_total)"
            );
        }
        false
    }

    /// Count `bytes` of output against `max_output_bytes`.
    fn spend_output(&mut self, bytes: usize) -> Result<(), String> {
        charge(&mut self.output_bytes, self.max_output_bytes, bytes)
    }
}

/// Add `bytes` to `spent` unless that passes `max` (`max_output_bytes`:
/// events, props events and log lines, each with its overhead).
fn charge(spent: &mut usize, max: usize, bytes: usize) -> Result<(), String> {
    if spent.saturating_add(bytes) > max {
        return Err(format!(
            "the process's output would pass [runtime.inferlets] max_output_bytes = {max} \
             (events, props changes and log lines, {EVENT_OVERHEAD_BYTES} bytes each beside their text)"
        ));
    }
    *spent += bytes;
    Ok(())
}

/// The WIT's sampling record with a context's shaping, checked as a
/// client's (its fields' names as the WIT spells them).
fn sampling(
    s: &Sampling,
    shaping: &SamplingRequest,
    vocab: usize,
) -> Result<SamplingParams, String> {
    SamplingRequest {
        temperature: Some(s.temperature),
        top_p: Some(s.top_p),
        top_k: Some(s.top_k as usize),
        min_p: Some(s.min_p),
        seed: s.seed,
        ..shaping.clone()
    }
    .check(vocab)
    .map_err(|e| e.message.replace('_', "-"))
}
