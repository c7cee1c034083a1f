//! The `pie` command line.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Result;
use clap::{Parser, Subcommand};
use pie_model::synth::{write_test_model, SynthSpec};
use pie_model::{Model, SamplingParams, SamplingRequest};
use pie_policy::cluster::Stage;
use pie_worker::config::{Config, PolicyList, DEFAULT_CONFIG};
use pie_worker::{fetch, inferlet_cli};

mod engine_bench;

#[derive(Parser)]
#[command(
    name = "pie",
    version,
    about = "Pie: LLM serving with programmable scheduling policies"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serve the HTTP API (OpenAI-compatible and native) on one worker.
    Serve(ServeArgs),
    /// Config files: write the commented default, or check one.
    Config {
        #[command(subcommand)]
        command: ConfigCmd,
    },
    /// Run one inferlet to completion and print its output: a built-in
    /// (`text-completion`, `chat`, with `--prompt`), an installed one by name
    /// or a component file (`.wasm`), with `--args`.
    Run {
        inferlet: String,
        /// The built-ins' prompt.
        #[arg(long)]
        prompt: Option<String>,
        #[arg(long, default_value_t = 64)]
        max_tokens: usize,
        /// A WebAssembly inferlet's args (JSON).
        #[arg(long, default_value = "{}")]
        args: String,
        /// Its config file (`[runtime]`, `[runtime.inferlets] dir`).
        #[arg(long)]
        config: Option<PathBuf>,
        #[command(flatten)]
        model: ModelArgs,
        #[command(flatten)]
        sampling: SamplingArgs,
    },
    /// WebAssembly inferlets: start a crate, build it, upload it.
    Inferlet {
        #[command(subcommand)]
        command: InferletCmd,
    },
    /// A local cluster on loopback.
    Cluster {
        #[command(subcommand)]
        command: ClusterCmd,
    },
    /// Model files: synthesize the test model, or fetch the default one.
    Model {
        #[command(subcommand)]
        command: ModelCmd,
    },
    /// Measure the engine: prefill, single-stream and batched decode throughput.
    EngineBench {
        #[command(flatten)]
        model: ModelArgs,
        #[arg(long, default_value_t = 512)]
        prompt_tokens: usize,
        #[arg(long, default_value_t = 64)]
        decode_tokens: usize,
        /// Decode figures for each of these numbers of sequences (0: none).
        #[arg(long, value_delimiter = ',', default_value = "1,8,32,64")]
        concurrency: Vec<usize>,
        /// Tokens of context before the measured work: the prefill runs after a
        /// cached prefix of this many tokens, each decoding sequence after a
        /// prompt of this many (32 when 0). `--prompt-tokens 0` skips the prefill.
        #[arg(long, default_value_t = 0)]
        depth: usize,
        /// KV page values: f16 or f32 (`[runtime] kv_dtype`).
        #[arg(long, default_value_t = pie_core::KvDtype::default())]
        kv_dtype: pie_core::KvDtype,
    },
    /// Load-test a worker or controller with a workload; or, with --calibrate,
    /// time the engine here and write a step-time profile for pie-sim.
    Bench(BenchArgs),
}

#[derive(clap::Args)]
struct BenchArgs {
    /// A worker (`pie serve`) or a `pie-controller`.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    url: String,
    /// shared-prefix, multi-turn, multi-tenant, deadline-mix, priority-mix,
    /// prefill-decode-mix, skewed-sessions, diurnal, agent.
    #[arg(long, default_value = "shared-prefix")]
    workload: String,
    /// Override a workload parameter (repeatable), e.g. `--set system_len=256`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// Replay a JSONL trace (Mooncake format) instead of --workload.
    #[arg(long, conflicts_with = "workload")]
    trace: Option<PathBuf>,
    /// Requests to send (for a trace: its first N records).
    #[arg(long, default_value_t = 100)]
    requests: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Closed loop with N requests in flight (default: open loop at the arrival times).
    #[arg(long)]
    concurrency: Option<usize>,
    /// Map prompt token ids into this vocabulary (default: the server's `vocab_size`).
    #[arg(long)]
    vocab: Option<u32>,
    /// JSON: the summary and every request (with --calibrate: the profile; default profile.json).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Time engine steps in-process and fit the cost profile pie-sim reads.
    #[arg(long)]
    calibrate: bool,
    /// With --calibrate: fit these step logs (`pie serve --step-log`) instead
    /// of timing steps here (repeatable; the model gives the engine limits).
    #[arg(long, requires = "calibrate", num_args = 1..)]
    from_steps: Vec<PathBuf>,
    #[command(flatten)]
    model: ModelArgs,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
}

#[derive(clap::Args, Clone)]
struct ServeArgs {
    /// config.toml; flags below override it.
    #[arg(long)]
    config: Option<PathBuf>,
    #[arg(long)]
    host: Option<String>,
    /// 0 picks a free port (printed on start).
    #[arg(long)]
    port: Option<u16>,
    #[arg(long)]
    model: Option<PathBuf>,
    /// `[model] chat_template`: a Jinja chat template file used in place of the model's.
    #[arg(long)]
    chat_template: Option<PathBuf>,
    /// Comma-separated, e.g. `fcfs`.
    #[arg(long, value_delimiter = ',')]
    worker_policy: Option<Vec<String>>,
    #[arg(long)]
    kv_pages: Option<usize>,
    #[arg(long)]
    page_size: Option<usize>,
    #[arg(long)]
    max_batch_tokens: Option<usize>,
    #[arg(long)]
    max_running: Option<usize>,
    #[arg(long)]
    max_queued: Option<usize>,
    /// `[runtime] stage`: both, prefill or decode (the controller's `disaggregate`).
    #[arg(long)]
    stage: Option<Stage>,
    /// A pie-controller to register with (and heartbeat to) once ready.
    #[arg(long, requires = "name")]
    controller: Option<String>,
    /// This worker's name in the cluster.
    #[arg(long)]
    name: Option<String>,
    /// This worker's group label at the controller (`scale-by-prop` counts
    /// workers per group).
    #[arg(long, requires = "controller")]
    group: Option<String>,
    /// `[server] step_log`: log every engine step here (JSON lines).
    #[arg(long)]
    step_log: Option<PathBuf>,
}

impl ServeArgs {
    fn config(&self) -> Result<Config> {
        let me = self.clone();
        let mut c = match &me.config {
            Some(path) => Config::load(path)?,
            None => Config::default(),
        };
        let (s, rt) = (&mut c.server, &mut c.runtime);
        s.host = me.host.unwrap_or(s.host.clone());
        s.port = me.port.unwrap_or(s.port);
        s.max_queued = me.max_queued.unwrap_or(s.max_queued);
        c.model.path = me.model.or(c.model.path.take());
        c.model.chat_template = me.chat_template.or(c.model.chat_template.take());
        s.step_log = me.step_log.or(s.step_log.take());
        if let Some(names) = me.worker_policy {
            rt.worker_policy = PolicyList::Many(names);
        }
        if let Some(pages) = me.kv_pages {
            rt.kv_pages = Some(pages);
            rt.kv_memory = None;
        }
        rt.page_size = me.page_size.unwrap_or(rt.page_size);
        rt.max_batch_tokens = me.max_batch_tokens.unwrap_or(rt.max_batch_tokens);
        rt.max_running = me.max_running.unwrap_or(rt.max_running);
        rt.stage = me.stage.unwrap_or(rt.stage);
        // Flags go through the same checks as the file.
        let text = toml::to_string(&c)?;
        Ok(Config::parse(
            &text,
            std::path::Path::new("<command line>"),
        )?)
    }
}

#[derive(Subcommand)]
enum InferletCmd {
    /// A new inferlet crate in ./NAME, with the guest SDK written beside it.
    New { name: String },
    /// Build a crate for wasm32-wasip2; prints the component's path.
    Build {
        #[arg(default_value = ".")]
        dir: PathBuf,
    },
    /// Upload a component to a worker (key: PIE_API_KEY).
    Upload {
        file: PathBuf,
        #[arg(long)]
        url: String,
        /// Default: the file's stem.
        #[arg(long)]
        name: Option<String>,
        #[arg(long)]
        version: Option<String>,
    },
}

#[derive(Subcommand)]
enum ClusterCmd {
    /// Start N workers and a pie-controller in front of them; Ctrl-C stops all.
    Up {
        #[arg(long, default_value_t = 2)]
        workers: usize,
        /// Worker config.toml (each worker gets a free port).
        #[arg(long)]
        config: Option<PathBuf>,
        #[command(flatten)]
        model: ModelArgs,
        /// The controller's port.
        #[arg(long, default_value_t = 9090)]
        port: u16,
        /// Cluster policies, comma-separated (default: the controller's).
        #[arg(long)]
        policies: Option<String>,
        /// Each worker logs its engine steps to DIR/wN.steps.jsonl (`pie serve --step-log`).
        #[arg(long)]
        step_log_dir: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
enum ConfigCmd {
    /// Write the commented default config.
    Init {
        #[arg(default_value = "config.toml")]
        out: PathBuf,
        #[arg(long)]
        force: bool,
    },
    /// Validate a config file.
    Check { file: PathBuf },
}

#[derive(Subcommand)]
enum ModelCmd {
    /// Write a tiny random-weights GGUF (for tests).
    Synth {
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// `llama`, `qwen2`, `qwen3`, `phi3`, `gemma2` or `gemma3`.
        #[arg(long, default_value = "llama")]
        arch: String,
    },
    /// Download the default model into the cache (if needed) and print its path.
    Fetch,
}

#[derive(clap::Args)]
struct ModelArgs {
    /// A Llama, Qwen, Phi-3 or Gemma GGUF file; default: SmolLM2-135M-Instruct, fetched on first use.
    #[arg(long)]
    model: Option<PathBuf>,
}

impl ModelArgs {
    fn load(&self) -> Result<Arc<Model>> {
        let path = match &self.model {
            Some(p) => p.clone(),
            None => fetch::default_model()?,
        };
        Ok(Arc::new(Model::load(&path)?))
    }
}

#[derive(clap::Args)]
struct SamplingArgs {
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long)]
    seed: Option<u64>,
}

impl SamplingArgs {
    /// Checked as a client's (the flags' names are the API's fields').
    fn params(&self) -> Result<SamplingParams> {
        let checked = SamplingRequest {
            temperature: Some(self.temperature),
            top_k: Some(self.top_k),
            top_p: Some(self.top_p),
            seed: self.seed,
            ..SamplingRequest::default()
        }
        .check(usize::MAX);
        checked.map_err(|e| anyhow::anyhow!("--{}", e.message.replace('_', "-")))
    }
}

fn main() -> Result<()> {
    pie_model::allocator::keep_freed_memory();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Cmd::Serve(args) => {
            let config = args.config()?;
            let registration =
                args.controller
                    .clone()
                    .zip(args.name.clone())
                    .map(|(controller, name)| pie_worker::register::Registration {
                        controller,
                        name,
                        group: args.group.clone(),
                    });
            let reloader: pie_worker::reload::Reloader = std::sync::Arc::new(move || args.config());
            tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?
                .block_on(pie_worker::serve::serve(config, reloader, registration))
        }
        Cmd::Cluster {
            command:
                ClusterCmd::Up {
                    workers,
                    config,
                    model,
                    port,
                    policies,
                    step_log_dir,
                },
        } => {
            let model = match model.model {
                Some(p) => p,
                None => fetch::default_model()?,
            };
            pie_worker::cluster::up(
                workers,
                config.as_deref(),
                &model,
                port,
                policies.as_deref(),
                step_log_dir.as_deref(),
            )
        }
        Cmd::Config {
            command: ConfigCmd::Init { out, force },
        } => {
            if out.exists() && !force {
                anyhow::bail!("{} exists; pass --force to overwrite", out.display());
            }
            std::fs::write(&out, DEFAULT_CONFIG)?;
            println!("wrote {}", out.display());
            Ok(())
        }
        Cmd::Config {
            command: ConfigCmd::Check { file },
        } => {
            Config::load(&file)?;
            println!("{}: ok", file.display());
            Ok(())
        }
        Cmd::Run {
            inferlet,
            prompt,
            max_tokens,
            args,
            config,
            model,
            sampling,
        } => run_any(
            &inferlet, prompt, max_tokens, &args, config, model, &sampling,
        ),
        Cmd::Inferlet { command } => inferlet(command),
        Cmd::Model {
            command: ModelCmd::Synth { out, seed, arch },
        } => {
            let arch = pie_model::architecture::architecture(&arch)?.name;
            write_test_model(
                &out,
                &SynthSpec {
                    seed,
                    arch,
                    ..SynthSpec::default()
                },
            )?;
            println!("{}", out.display());
            Ok(())
        }
        Cmd::Model {
            command: ModelCmd::Fetch,
        } => {
            println!("{}", fetch::default_model()?.display());
            Ok(())
        }
        Cmd::EngineBench {
            model,
            prompt_tokens,
            decode_tokens,
            concurrency,
            depth,
            kv_dtype,
        } => engine_bench::run(
            model.load()?,
            kv_dtype,
            prompt_tokens,
            decode_tokens,
            &concurrency,
            depth,
        ),
        Cmd::Bench(args) => bench(args),
    }
}

fn bench(args: BenchArgs) -> Result<()> {
    if args.calibrate {
        let model = match args.model.model {
            Some(p) => p,
            None => fetch::default_model()?,
        };
        let out = args.out.unwrap_or_else(|| PathBuf::from("profile.json"));
        if args.from_steps.is_empty() {
            pie_worker::calibrate::run(&model, &out)?;
        } else {
            pie_worker::calibrate::served::run(&model, &args.from_steps, &out)?;
        }
        return Ok(());
    }
    let command = pie_client::BenchCommand {
        url: args.url,
        workload: args.workload,
        set: args.set,
        trace: args.trace,
        requests: args.requests,
        seed: args.seed,
        concurrency: args.concurrency,
        vocab: args.vocab,
        out: args.out,
        progress: !args.quiet,
    };
    let report = command.run().map_err(anyhow::Error::msg)?;
    if report.summary.completed == 0 && report.summary.requests > 0 {
        anyhow::bail!("no request completed");
    }
    Ok(())
}

fn inferlet(command: InferletCmd) -> Result<()> {
    match command {
        InferletCmd::New { name } => inferlet_cli::new_crate(&name),
        InferletCmd::Build { dir } => inferlet_cli::build(&dir),
        InferletCmd::Upload {
            file,
            url,
            name,
            version,
        } => inferlet_cli::upload(&file, &url, name.as_deref(), version.as_deref()),
    }
}

/// `pie run`: a built-in with its prompt, else a WebAssembly inferlet.
fn run_any(
    inferlet: &str,
    prompt: Option<String>,
    max_tokens: usize,
    args: &str,
    config: Option<PathBuf>,
    model: ModelArgs,
    sampling: &SamplingArgs,
) -> Result<()> {
    let mut config = match config {
        Some(file) => Config::load(&file)?,
        None => Config::default(),
    };
    if model.model.is_some() {
        config.model.path = model.model;
    }
    match (inferlet, prompt) {
        ("text-completion" | "chat", Some(prompt)) => {
            let sampling = sampling.params()?;
            inferlet_cli::run_builtin(inferlet, prompt, max_tokens, sampling, config)
        }
        ("text-completion" | "chat", None) => anyhow::bail!("{inferlet} needs --prompt"),
        _ => inferlet_cli::run(inferlet, args, config),
    }
}
