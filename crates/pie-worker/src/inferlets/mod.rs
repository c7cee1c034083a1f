//! User inferlets: WebAssembly components (`pie:inferlet@0.2.0`, which keeps 0.1.0) run as
//! processes, beside the built-in ones, on the same runtime and scheduler.
//!
//! Layers, bottom to top: `limits` (CPU meter, memory cap, argument bounds)
//! and `world` (the WIT bindings, the allowed imports) are leaves;
//! `registry` (installed components on disk, compiled once) and `contexts`
//! (a process's token sequences) sit on them; `host` implements the world's
//! imports for one process; this file is the [`Inferlets`] handle: the
//! wasmtime engine and its epoch clock, the guests' own threads, the cap on
//! live instances, and the task that runs one process to its end.
//!
//! Invariant: a process of an inferlet ends in a final state whatever its
//! guest does (returns, errs, traps, spins past `max_cpu_ms`, grows past
//! its memory cap, or is killed), and its end releases every context's pages
//! and its instance slot.

pub mod contexts;
pub mod end;
pub mod host;
pub mod host_passes;
pub mod host_work;
pub mod limits;
pub mod ops;
pub mod registry;
pub mod slots;
pub mod world;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pie_core::auth::KeyLimits;
use pie_core::worker_config::InferletsConfig;
use pie_core::Props;
use wasmtime::component::{Component, Linker, ResourceTable};
use wasmtime::{Engine, Store, UpdateDeadline};
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::WasiCtxBuilder;

use crate::process::Process;
use crate::runtime::{LaunchError, Runtime};
use contexts::Contexts;
use end::{complete, fail};
use host::{GuestState, ProcessHost};
use host_work::HostWork;
use limits::{MemoryCap, Metered, TokenBucket, EPOCH_TICK};
pub use registry::RegistryError;
use registry::{Installed, Registry};
use slots::InstanceSlots;
use world::Inferlet;

/// How a guest stopped past `max_cpu_ms` fails.
const CPU_LIMIT: &str = "the inferlet computed for more than [runtime.inferlets] max_cpu_ms";

/// The end of a guest's stderr kept for its failure message (a panic's).
const STDERR_TAIL: usize = 4096;

/// What a launch of an installed inferlet needs besides its name.
pub struct InferletLaunch {
    /// `NAME` or `NAME@VERSION`.
    pub reference: String,
    /// The launch's `args`, handed to the guest as JSON.
    pub args: serde_json::Value,
    pub props: Props,
    pub client: String,
    /// The launching key's name and limits (a client key's).
    pub key: Option<(String, KeyLimits)>,
    pub cache_salt: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum InferletError {
    #[error(transparent)]
    Registry(#[from] RegistryError),
    #[error(transparent)]
    Launch(#[from] LaunchError),
}

pub struct Inferlets {
    engine: Engine,
    linker: Linker<GuestState>,
    pub registry: Registry,
    config: InferletsConfig,
    /// Slots for live instances, shared per key; launches beyond wait
    /// (queued).
    instances: Arc<InstanceSlots>,
    live: Arc<AtomicUsize>,
    /// Where guest code runs: its own threads, so a guest between two epoch
    /// ticks never holds up the API or the engine.
    guests: tokio::runtime::Handle,
    /// All processes' log rate.
    all_logs: Arc<std::sync::Mutex<TokenBucket>>,
    /// Where heavy host calls run.
    work: Arc<HostWork>,
}

impl Inferlets {
    pub fn new(config: &InferletsConfig) -> anyhow::Result<Arc<Self>> {
        let mut wasm = wasmtime::Config::new();
        wasm.epoch_interruption(true);
        let engine = Engine::new(&wasm).map_err(|e| anyhow::anyhow!("{e}"))?;
        let linker = host::linker(&engine).map_err(|e| anyhow::anyhow!("{e}"))?;
        let dir = config
            .dir
            .clone()
            .unwrap_or_else(|| pie_core::config_file::pie_home().join("inferlets"));
        let registry = Registry::open(engine.clone(), dir.clone())
            .map_err(|e| anyhow::anyhow!("[runtime.inferlets] dir {}: {e}", dir.display()))?;
        let guests = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(config.threads)
            .thread_name("pie-inferlet")
            .on_thread_start(yield_to_the_engine)
            .enable_all()
            .build()?;
        let handle = guests.handle().clone();
        // Lives as long as the server; dropping it inside async code would panic.
        std::mem::forget(guests);
        spawn_epoch_clock(&engine)?;
        tracing::info!(
            "inferlets: {} installed in {}",
            registry.list().len(),
            dir.display()
        );
        Ok(Arc::new(Self {
            engine,
            linker,
            registry,
            config: config.clone(),
            instances: InstanceSlots::new(config.max_instances),
            live: Arc::default(),
            guests: handle,
            all_logs: Arc::new(std::sync::Mutex::new(TokenBucket::new(
                config.all_log_lines_per_s as f64,
                config.all_log_lines_burst as f64,
            ))),
            work: Arc::default(),
        }))
    }

    /// Instances running now.
    pub fn live_instances(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }

    /// The largest component an upload may send.
    pub fn max_upload_bytes(&self) -> usize {
        self.config.max_upload.0 as usize
    }

    /// Start a process of an installed inferlet; it waits in the queue for
    /// an instance slot like any queued process.
    pub fn launch(
        self: &Arc<Self>,
        rt: &Arc<Runtime>,
        launch: InferletLaunch,
    ) -> Result<Arc<Process>, InferletError> {
        let installed = self.registry.find(&launch.reference)?;
        rt.admit(&launch.client)?;
        let label = format!("{}@{}", installed.name, installed.version);
        let process = rt.register_process(&label, launch.client.clone(), launch.props.clone(), 0);
        let (inbox_tx, inbox) = crate::inbox::inbox(
            self.config.max_pending_messages,
            self.config.max_pending_bytes.0 as usize,
        );
        process.set_inbox(inbox_tx);
        let key_limits = launch.key.as_ref().map(|(_, limits)| limits);
        let max_idle = key_limits
            .and_then(|l| l.max_idle_ms)
            .unwrap_or(self.config.max_idle_ms);
        let max_wall = key_limits
            .and_then(|l| l.max_wall_ms)
            .unwrap_or(self.config.max_wall_ms);
        let host = ProcessHost {
            rt: rt.clone(),
            process: process.clone(),
            contexts: Contexts::new(&process.id),
            args: launch.args.to_string(),
            key: launch.key,
            cache_salt: launch.cache_salt,
            inbox: Arc::new(tokio::sync::Mutex::new(inbox)),
            ops_held: 0,
            full_bytes_held: 0,
            meter: Arc::default(),
            work: self.work.clone(),
            max_idle: Duration::from_millis(max_idle),
            output_bytes: 0,
            max_output_bytes: self.config.max_output_bytes.0 as usize,
            logs: TokenBucket::new(
                self.config.log_lines_per_s as f64,
                self.config.log_lines_burst as f64,
            ),
            all_logs: self.all_logs.clone(),
            logs_dropped: false,
        };
        let max_wall = Duration::from_millis(max_wall);
        self.guests
            .spawn(self.clone().run(installed, host, max_wall));
        Ok(process)
    }

    /// Run one process to its end (see the module's invariant).
    async fn run(self: Arc<Self>, installed: Installed, host: ProcessHost, max_wall: Duration) {
        let (rt, process) = (host.rt.clone(), host.process.clone());
        // Killed while it waits for a slot: it never takes one.
        let _slot = tokio::select! {
            slot = self.instances.acquire(&process.client, |n| rt.shares_of(n)) => slot,
            _ = process.ended() => return,
        };
        if process.state().is_final() {
            return;
        }
        let this = self.clone();
        let loaded = tokio::task::spawn_blocking(move || this.registry.load(&installed)).await;
        let component = match loaded {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => return fail(&rt, &process, format!("cannot load the inferlet: {e}")),
            Err(e) => return fail(&rt, &process, format!("cannot load the inferlet: {e}")),
        };
        self.live.fetch_add(1, Ordering::Relaxed);
        let stderr = MemoryOutputPipe::new(STDERR_TAIL);
        let mut store = self.store(host, stderr.clone());
        let meter = store.data().host.meter.clone();
        let max_cpu = Duration::from_millis(self.config.max_cpu_ms);
        let m = meter.clone();
        store.epoch_deadline_callback(move |_| {
            if m.used() > max_cpu {
                return Err(wasmtime::format_err!(
                    "{CPU_LIMIT} = {} ms",
                    max_cpu.as_millis()
                ));
            }
            Ok(UpdateDeadline::Yield(1))
        });
        store.set_epoch_deadline(1);
        process.mark_running();
        let outcome = {
            let run = run_guest(&mut store, &component, &self.linker);
            tokio::select! {
                outcome = Metered::new(run, meter) => Some(outcome),
                _ = process.ended() => None,
                _ = tokio::time::sleep(max_wall) => Some(Ok(Err(format!(
                    "the inferlet ran for {} ms, past max_wall_ms",
                    max_wall.as_millis()
                )))),
            }
        };
        match outcome {
            None => {}
            Some(Ok(Ok(()))) => complete(&rt, &process),
            Some(Ok(Err(message))) => fail(&rt, &process, message),
            Some(Err(trap)) => {
                let why = describe_trap(&trap, store.data().memory.refused.as_deref(), &stderr);
                fail(&rt, &process, why)
            }
        }
        let contexts = store.data_mut().host.contexts.drain();
        // The instance's memory goes before it stops counting as live.
        drop(store);
        // Its operations' tasks end on their own threads: their sequences
        // are aborted before the contexts are released, so none is retained
        // after.
        wait_for_sequences(&process).await;
        for key in contexts {
            rt.release_retained(&process.client, &key);
        }
        self.live.fetch_sub(1, Ordering::Relaxed);
    }

    fn store(&self, host: ProcessHost, stderr: MemoryOutputPipe) -> Store<GuestState> {
        let mut table = ResourceTable::new();
        table.set_max_capacity(limits::MAX_HOST_RESOURCES);
        let state = GuestState {
            wasi: WasiCtxBuilder::new().stderr(stderr).build(),
            table,
            memory: MemoryCap {
                max_bytes: self.config.max_memory.0 as usize,
                refused: None,
            },
            host,
        };
        let mut store = Store::new(&self.engine, state);
        store.limiter(|s| &mut s.memory);
        store
    }
}

/// The longest a process's end waits for its operations' sequences.
const SEQUENCES_GONE: Duration = Duration::from_secs(1);

/// Until no sequence of `process` runs (bounded by [`SEQUENCES_GONE`]).
async fn wait_for_sequences(process: &Process) {
    let gone = async {
        while !process.seqs().is_empty() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    };
    let _ = tokio::time::timeout(SEQUENCES_GONE, gone).await;
}

/// Instantiate the component and call its `run`.
async fn run_guest(
    store: &mut Store<GuestState>,
    component: &Component,
    linker: &Linker<GuestState>,
) -> wasmtime::Result<Result<(), String>> {
    let instance = Inferlet::instantiate_async(&mut *store, component, linker).await?;
    instance.call_run(&mut *store).await
}

/// Why a guest trapped: the cap it hit, or the trap with what it printed
/// to stderr last (a Rust panic's message).
fn describe_trap(
    trap: &wasmtime::Error,
    refused: Option<&str>,
    stderr: &MemoryOutputPipe,
) -> String {
    if let Some(why) = refused {
        return why.to_string();
    }
    let printed = String::from_utf8_lossy(&stderr.contents())
        .trim()
        .to_string();
    // The root is the trap itself (or the CPU limit's error); the chain
    // above it is a wasm backtrace, of no use without the guest's symbols.
    let root = trap.root_cause().to_string();
    if root.starts_with(CPU_LIMIT) {
        return root;
    }
    if trap.downcast_ref::<wasmtime::Trap>() == Some(&wasmtime::Trap::StackOverflow) {
        return format!("the inferlet overflowed its stack (stack overflow: {root})");
    }
    if printed.is_empty() {
        format!("the inferlet trapped: {root}")
    } else {
        format!("the inferlet trapped: {root}: {printed}")
    }
}

/// Guest threads run at a lower scheduling priority (nice +10) than the
/// engine and the API, so a guest computing between two epoch ticks takes
/// only CPU time they leave.
fn yield_to_the_engine() {
    #[cfg(target_os = "linux")]
    // SAFETY: plain system calls on the calling thread; a refusal leaves its
    // priority as it was.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        if libc::setpriority(libc::PRIO_PROCESS, tid, 10) != 0 {
            tracing::warn!("cannot lower an inferlet thread's priority");
        }
    }
}

/// Advance the engine's epoch every [`EPOCH_TICK`] while it exists
/// (without it no guest could be interrupted: an error, not a fallback).
fn spawn_epoch_clock(engine: &Engine) -> std::io::Result<()> {
    let weak = engine.weak();
    std::thread::Builder::new()
        .name("pie-epoch".into())
        .spawn(move || {
            while let Some(engine) = weak.upgrade() {
                engine.increment_epoch();
                drop(engine);
                std::thread::sleep(EPOCH_TICK);
            }
        })?;
    Ok(())
}
