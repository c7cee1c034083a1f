//! A simulation's configuration: the worker-plane ordering policy
//! ([`PolicyName`]), and [`SimConfig`], what a run simulates (fleet,
//! router and actors, profile, tiers, autoscaling), with its validation.

use std::str::FromStr;

use pie_core::KvDtype;
use pie_policy::cluster::ActorConfigs;
use pie_policy::runtime::{PolicyList, RuntimeConfig, WorkerPolicies};
use pie_policy::{OnMiss, WorkerPolicy};

use crate::autoscale::AutoscaleConfig;
use crate::cost::CostProfile;
use crate::disaggregate::kv_bytes_per_token;
use crate::router::RouterSpec;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PolicyName {
    Fcfs,
    Fair,
    Priority,
    Deadline,
    /// `deadline` with `on_miss = "abort"`.
    DeadlineAbort,
}

impl PolicyName {
    pub const ALL: &'static [&'static str] =
        &["fcfs", "fair", "priority", "deadline", "deadline-abort"];

    /// A fresh policy object, with the defaults `pie serve` uses.
    pub fn build(self) -> Box<dyn WorkerPolicy> {
        self.build_with(&RuntimeConfig::default())
    }

    /// A fresh policy object with a worker's `[runtime]` settings, by the
    /// worker's own factory (`pie_policy::runtime::WorkerPolicies`).
    pub fn build_with(self, runtime: &RuntimeConfig) -> Box<dyn WorkerPolicy> {
        WorkerPolicies::build(&self.runtime(runtime))
            .expect("an ordering policy name the factory knows")
            .ordering
    }

    /// `runtime` with this as its only worker policy (`deadline-abort`:
    /// `deadline` with `on_miss = "abort"`).
    fn runtime(self, runtime: &RuntimeConfig) -> RuntimeConfig {
        let mut rt = runtime.clone();
        let name = match self {
            Self::DeadlineAbort => {
                rt.deadline.on_miss = OnMiss::Abort;
                "deadline"
            }
            other => other.label(),
        };
        rt.worker_policy = PolicyList::One(name.into());
        rt
    }

    /// The ordering policy a worker's `[runtime]` runs (fcfs when it lists
    /// none); an error for what the simulator does not model (`offload`).
    pub fn of_runtime(runtime: &RuntimeConfig) -> Result<Self, String> {
        let policies = WorkerPolicies::build(runtime)?;
        if policies.offload.is_some() {
            return Err("`offload` is not simulated: remove it from worker_policy".into());
        }
        Ok(match policies.ordering.name() {
            "deadline" if runtime.deadline.on_miss == OnMiss::Abort => Self::DeadlineAbort,
            name => name.parse()?,
        })
    }

    pub fn label(self) -> &'static str {
        Self::ALL[self as usize]
    }
}

impl FromStr for PolicyName {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "fcfs" => Self::Fcfs,
            "fair" => Self::Fair,
            "priority" => Self::Priority,
            "deadline" => Self::Deadline,
            "deadline-abort" => Self::DeadlineAbort,
            other => {
                return Err(format!(
                    "unknown policy `{other}` (available: {})",
                    Self::ALL.join(", ")
                ))
            }
        })
    }
}

#[derive(Clone, Debug)]
pub struct SimConfig {
    pub workers: usize,
    pub policy: PolicyName,
    /// The cluster policies' pipeline (`pie_policy::cluster`).
    pub router: RouterSpec,
    /// Run `KeepSession` (retention from the `session` and `keep-ms` props).
    pub keep_session: bool,
    /// The worker's `[runtime]` policy settings (`[runtime.fair]`,
    /// `[runtime.keep-session]`, ...); its limits are the profile's.
    pub runtime: RuntimeConfig,
    /// The `[cluster.<actor>]` settings of the router's actors.
    pub actor_configs: ActorConfigs,
    /// How often the actors look at the cluster (simulated ms).
    pub actor_tick_ms: u64,
    pub profile: CostProfile,
    /// Workers sharing one machine of the profile (`machine.rs`); 1: each worker
    /// has a machine to itself.
    pub workers_per_machine: usize,
    /// Workers `w0..` of this many are prefill-stage (the rest decode-stage);
    /// 0: every worker does both.
    pub prefill_workers: usize,
    /// KV bytes per token, which prices a transfer of pages between workers
    /// (default: the model the profile models, `disaggregate::kv_bytes_per_token`).
    pub kv_bytes_per_token: u64,
    /// The shared pool's capacity in pages (`pool.rs`); 0: no pool. Every
    /// worker pulls from it.
    pub pool_pages: usize,
    /// Follow `scale-by-prop`'s hints (`autoscale.rs`), `workers` being the
    /// initial fleet; None: a fixed fleet of `workers`.
    pub autoscale: Option<AutoscaleConfig>,
    /// The TTFT objective (ms) of `slo_attainment` in the metrics.
    pub slo_ttft_ms: f64,
    /// Each worker's disk tier in pages (`disk.rs`); 0: none.
    pub disk_pages: usize,
    /// Seeds the run's own randomness (the profile's step-time variance,
    /// `jitter.rs`); the workload's seed, so a run is reproducible from it.
    pub seed: u64,
}

impl SimConfig {
    pub fn new(
        workers: usize,
        policy: PolicyName,
        router: RouterSpec,
        profile: CostProfile,
    ) -> Self {
        Self {
            workers,
            policy,
            router,
            keep_session: false,
            runtime: RuntimeConfig::default(),
            actor_configs: ActorConfigs::default(),
            actor_tick_ms: 1000,
            kv_bytes_per_token: kv_bytes_per_token(&profile, KvDtype::default()),
            profile,
            workers_per_machine: 1,
            prefill_workers: 0,
            pool_pages: 0,
            autoscale: None,
            slo_ttft_ms: DEFAULT_SLO_TTFT_MS,
            disk_pages: 0,
            seed: 0,
        }
    }
}

/// `--slo-ttft-ms`'s default: a chat service's first token within half a
/// second; at the GPU profile's speed a worker that keeps up answers in tens
/// of ms, so a miss means a queue.
pub const DEFAULT_SLO_TTFT_MS: f64 = 500.0;

impl SimConfig {
    /// What a simulation of this configuration needs: workers, pages and
    /// limits, a decode stage, and for `--autoscale`, scale-by-prop's hints.
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(self.workers > 0, "at least one worker");
        anyhow::ensure!(
            self.profile.page_size > 0 && self.profile.kv_pages > 0,
            "page size and pages must be positive"
        );
        anyhow::ensure!(
            self.profile.max_batch_tokens > 0 && self.profile.max_running > 0,
            "max_batch_tokens and max_running must be positive"
        );
        anyhow::ensure!(
            self.workers_per_machine > 0,
            "workers per machine must be positive"
        );
        anyhow::ensure!(
            self.prefill_workers < self.workers,
            "--prefill-workers ({}) must leave at least one of the {} workers to decode",
            self.prefill_workers,
            self.workers
        );
        if let Some(a) = &self.autoscale {
            anyhow::ensure!(
                self.router.actors().contains(&"scale-by-prop"),
                "--autoscale follows scale-by-prop's hints: add scale-by-prop to --router"
            );
            anyhow::ensure!(
                self.prefill_workers == 0,
                "--autoscale: prefill-stage workers (--prefill-workers) are not autoscaled"
            );
            anyhow::ensure!(
                a.min_workers >= 1 && a.min_workers <= a.max_workers,
                "--scale-min ({}) must be at least 1 and at most --scale-max ({})",
                a.min_workers,
                a.max_workers
            );
        }
        Ok(())
    }
}
