//! The `pie-sim` CLI: `run` one configuration, or `compare` policies (worker
//! plane) and routers (cluster plane) on the same seeded workload, printing a
//! markdown table and optionally writing every run's metrics as JSON.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use pie_sim::autoscale::AutoscaleConfig;
use pie_sim::requests::{self, Input};
use pie_sim::tables::{
    class_table, copy_table, disk_table, fleet_table, markdown_table, migration_table, pool_table,
    transfer_table,
};
use pie_sim::worker_config::WorkerConfig;
use pie_sim::{run, run_records, PolicyName, RouterSpec, RunMetrics, SimConfig};

#[derive(Parser)]
#[command(
    name = "pie-sim",
    about = "Simulate Pie workers running the real policies"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run one policy and router; print the metrics JSON.
    Run {
        #[command(flatten)]
        common: Common,
        /// The ordering policy (default: the --worker-config's, else fcfs).
        #[arg(long)]
        policy: Option<String>,
        /// The cluster policies' pipeline, comma-separated as in the controller's
        /// `cluster_policies`: pin, session-affinity, cache-aware, least-loaded,
        /// round-robin, disaggregate (with --prefill-workers).
        #[arg(long, default_value = "round-robin")]
        router: String,
        /// Write what happened to each request here, one JSON line per request
        /// in workload order (arrival, TTFT, end-to-end, worker, cached
        /// tokens): to set beside `pie bench --out`'s records request by request.
        #[arg(long, value_name = "FILE")]
        records: Option<PathBuf>,
    },
    /// Run each policy x router on the same workload; print a markdown table.
    Compare {
        #[command(flatten)]
        common: Common,
        /// Comma-separated: fcfs, fair, priority, deadline, deadline-abort
        /// (default: the --worker-config's, else fcfs).
        #[arg(long)]
        policies: Option<String>,
        /// A cluster pipeline (comma-separated policies, as for `run`); repeat
        /// `--router` to compare several.
        #[arg(long, default_value = "round-robin")]
        router: Vec<String>,
        /// Write SVG charts (TTFT CDF, throughput, prefix hits, deadline misses,
        /// per-client service over time) into this directory.
        #[arg(long)]
        plots: Option<PathBuf>,
        /// Run every configuration without and with keep-session.
        #[arg(long, conflicts_with = "keep_session")]
        both_keep_session: bool,
        /// Also run every configuration on fixed fleets of these sizes
        /// (comma-separated; no autoscaling), on the same workload, and print
        /// the fleet table (worker-hours, SLO attainment).
        #[arg(long, value_delimiter = ',')]
        fixed_fleets: Vec<usize>,
    },
}

#[derive(Args)]
struct Common {
    /// shared-prefix, multi-turn, multi-tenant, deadline-mix, priority-mix,
    /// prefill-decode-mix, skewed-sessions, diurnal, agent, or trace (with --trace).
    #[arg(long)]
    workload: String,
    /// A JSONL trace (Mooncake format plus `props`) for --workload trace.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Override a generator's parameter (`--set system_len=256`); repeatable.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    overrides: Vec<String>,
    /// Workers (with --autoscale: the initial fleet).
    #[arg(long, default_value_t = 1)]
    workers: usize,
    /// The workers a generator's per-worker rates are multiplied by (with
    /// --load); default --workers. Fixed fleets of different sizes (and an
    /// autoscaled one) see the same workload when they give the same figure.
    #[arg(long)]
    rate_workers: Option<usize>,
    /// Follow scale-by-prop's hints (it must be in --router): start workers
    /// (serving after --scale-start-ms) and drain them, between --scale-min
    /// and --scale-max; --workers is the initial fleet.
    #[arg(long)]
    autoscale: bool,
    /// A started worker's delay before it serves (loading its model), ms.
    #[arg(long, default_value_t = 60_000)]
    scale_start_ms: u64,
    /// The fewest workers the autoscaler keeps started.
    #[arg(long, default_value_t = 1)]
    scale_min: usize,
    /// The most workers the autoscaler starts.
    #[arg(long, default_value_t = 64)]
    scale_max: usize,
    /// A step down follows the highest recommendation of this window, as the
    /// Kubernetes HPA's scale-down stabilisation (default 300 s; 0: every
    /// hint as it comes).
    #[arg(long, default_value_t = 300_000)]
    scale_down_window_ms: u64,
    /// The TTFT objective (ms) of the metrics' SLO attainment.
    #[arg(long, default_value_t = pie_sim::config::DEFAULT_SLO_TTFT_MS)]
    slo_ttft_ms: f64,
    /// Workers that share one machine of the profile: their steps in flight at
    /// the same time split its speed (several `pie serve` processes on one host).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    workers_per_machine: u64,
    /// Requests to generate (default 2000); for a trace, replay the first N.
    #[arg(long)]
    requests: Option<usize>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Offered load relative to the workload's default per-worker rate (which is
    /// multiplied by --workers); for a trace, the replay speed.
    #[arg(long, default_value_t = 1.0)]
    load: f64,
    /// gpu (roofline estimate), cpu (uncalibrated placeholder), or the path of a
    /// JSON profile file (as `pie bench --calibrate` writes it).
    #[arg(long, default_value = "gpu")]
    profile: String,
    /// Override the profile's KV pages per worker.
    #[arg(long)]
    kv_pages: Option<usize>,
    /// Override the profile's `max_running` (sequences a worker runs at once).
    #[arg(long)]
    max_running: Option<usize>,
    /// Make workers w0..wN-1 prefill-stage and the rest decode-stage (0: all
    /// `both`); `--router disaggregate,...` then prefills long prompts on them
    /// and moves the KV pages to the decode worker.
    #[arg(long, default_value_t = 0)]
    prefill_workers: usize,
    /// KV bytes per token, which prices page transfers between workers
    /// (default: the profile's model; see `pie_sim::disaggregate`).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    kv_bytes_per_token: Option<u64>,
    /// A shared page pool (`pie-pool`) of this many pages that every worker
    /// pulls a prompt's pooled prefix from before its prefill (0: none);
    /// `pool-replicate` and `retain-all` push to it. Transfers cost the
    /// profile's transfer time.
    #[arg(long, default_value_t = 0)]
    pool_pages: usize,
    /// A disk tier of this many pages on every worker (0: none), LRU: an
    /// arrival first loads its prompt's leading pages its worker's disk holds;
    /// `persist-prefix` and `retain-all` (to disk, or any without a pool)
    /// write to it. Reads and writes cost an NVMe SSD's (`pie_sim::disk`).
    #[arg(long, default_value_t = 0)]
    disk_pages: usize,
    /// Set an actor's key, as `[cluster.ACTOR] KEY = VALUE` in the
    /// controller's config (`--actor-set rebalance.signal=kv`); repeatable.
    #[arg(long = "actor-set", value_name = "ACTOR.KEY=VALUE")]
    actor_overrides: Vec<String>,
    /// How often the actors look at the cluster (simulated ms).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..))]
    actor_tick_ms: u64,
    /// Run keep-session (retention by the `session` and `keep-ms` props).
    #[arg(long)]
    keep_session: bool,
    /// A worker's config.toml: its `[runtime]` table (policies, their settings,
    /// limits) applies to every simulated worker of every run; the flags above
    /// override it.
    #[arg(long, value_name = "FILE")]
    worker_config: Option<PathBuf>,
    /// Write the metrics of every run as a JSON array here.
    #[arg(long)]
    json: Option<PathBuf>,
}

fn split<T: std::str::FromStr<Err = String>>(list: &str) -> Result<Vec<T>> {
    list.split(',')
        .map(|s| s.trim().parse::<T>().map_err(anyhow::Error::msg))
        .collect()
}

/// A run's fleet: `Some(n)`, a fixed one of `n` workers instead of
/// `--workers` (and no autoscaling); None: as the flags say.
type FleetChoice = Option<usize>;

fn simulate(
    common: &Common,
    worker: Option<&WorkerConfig>,
    policies: &[PolicyName],
    routers: &[RouterSpec],
    keep_session: &[bool],
    fleets: &[FleetChoice],
    records: Option<&Path>,
) -> Result<Vec<RunMetrics>> {
    let (workload, reqs) = requests::load(&Input {
        workload: &common.workload,
        trace: common.trace.as_deref(),
        overrides: &common.overrides,
        requests: common.requests,
        seed: common.seed,
        workers: common.rate_workers.unwrap_or(common.workers),
        load: common.load,
    })?;
    let mut profile = pie_sim::profile::load(&common.profile)?;
    let runtime = worker.map(|w| w.runtime.clone()).unwrap_or_default();
    if let Some(w) = worker {
        w.apply_limits(&mut profile);
    }
    profile.kv_pages = common.kv_pages.unwrap_or(profile.kv_pages);
    profile.max_running = common.max_running.unwrap_or(profile.max_running);
    let mut actor_configs = pie_policy::cluster::ActorConfigs::default();
    pie_sim::actors::apply_overrides(&mut actor_configs, &common.actor_overrides)?;
    let autoscale = common.autoscale.then_some(AutoscaleConfig {
        start_ms: common.scale_start_ms,
        min_workers: common.scale_min,
        max_workers: common.scale_max,
        down_window_ms: common.scale_down_window_ms,
    });
    let mut runs = Vec::new();
    for &fleet in fleets {
        for router in routers {
            for &policy in policies {
                for &keep in keep_session {
                    let workers = fleet.unwrap_or(common.workers);
                    let mut cfg = SimConfig::new(workers, policy, router.clone(), profile.clone());
                    cfg.autoscale = match fleet {
                        Some(_) => None,
                        None => autoscale.clone(),
                    };
                    cfg.slo_ttft_ms = common.slo_ttft_ms;
                    cfg.keep_session = keep;
                    cfg.actor_configs = actor_configs.clone();
                    cfg.actor_tick_ms = common.actor_tick_ms;
                    cfg.runtime = runtime.clone();
                    cfg.workers_per_machine = common.workers_per_machine as usize;
                    cfg.prefill_workers = common.prefill_workers;
                    cfg.pool_pages = common.pool_pages;
                    cfg.disk_pages = common.disk_pages;
                    cfg.seed = common.seed;
                    cfg.kv_bytes_per_token = common.kv_bytes_per_token.unwrap_or_else(|| {
                        pie_sim::disaggregate::kv_bytes_per_token(&cfg.profile, runtime.kv_dtype)
                    });
                    let m = match records {
                        None => run(&cfg, &workload, &reqs)?,
                        Some(path) => {
                            let (m, recs) = run_records(&cfg, &workload, &reqs)?;
                            pie_sim::records::write_records(path, &recs)?;
                            m
                        }
                    };
                    eprintln!(
                        "{}: {} events in {:.2} s ({:.2e} events/s)",
                        pie_sim::plots::run_label(&m),
                        m.events,
                        m.wall_s,
                        m.events_per_s
                    );
                    runs.push(m);
                }
            }
        }
    }
    if let Some(path) = &common.json {
        std::fs::write(path, serde_json::to_string_pretty(&runs)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(runs)
}

/// `--worker-config`, read once per command.
fn worker_config(common: &Common) -> Result<Option<WorkerConfig>> {
    Ok(match &common.worker_config {
        Some(path) => Some(WorkerConfig::load(path)?),
        None => None,
    })
}

/// The ordering policies to run: those named, else the worker config's, else fcfs.
fn ordering_policies(
    named: Option<&str>,
    worker: Option<&WorkerConfig>,
) -> Result<Vec<PolicyName>> {
    match (named, worker) {
        (Some(list), _) => split(list),
        (None, Some(w)) => Ok(vec![
            PolicyName::of_runtime(&w.runtime).map_err(anyhow::Error::msg)?
        ]),
        (None, None) => Ok(vec![PolicyName::Fcfs]),
    }
}

/// Keep-session: the flag, or the worker config lists it.
fn keeps_sessions(common: &Common, worker: Option<&WorkerConfig>) -> bool {
    common.keep_session || worker.is_some_and(WorkerConfig::keeps_sessions)
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Run {
            common,
            policy,
            router,
            records,
        } => {
            let worker = worker_config(&common)?;
            let runs = simulate(
                &common,
                worker.as_ref(),
                &ordering_policies(policy.as_deref(), worker.as_ref())?,
                &[router.parse().map_err(anyhow::Error::msg)?],
                &[keeps_sessions(&common, worker.as_ref())],
                &[None],
                records.as_deref(),
            )?;
            println!("{}", serde_json::to_string_pretty(&runs)?);
        }
        Command::Compare {
            common,
            policies,
            router,
            plots,
            both_keep_session,
            fixed_fleets,
        } => {
            let routers = router
                .iter()
                .map(|r| r.parse().map_err(anyhow::Error::msg))
                .collect::<Result<Vec<RouterSpec>>>()?;
            let worker = worker_config(&common)?;
            let keep = match both_keep_session {
                true => vec![false, true],
                false => vec![keeps_sessions(&common, worker.as_ref())],
            };
            let runs = simulate(
                &common,
                worker.as_ref(),
                &ordering_policies(policies.as_deref(), worker.as_ref())?,
                &routers,
                &keep,
                &std::iter::once(None)
                    .chain(fixed_fleets.iter().map(|&n| Some(n)))
                    .collect::<Vec<_>>(),
                None,
            )?;
            let first = &runs[0];
            println!(
                "{} on {} worker(s), {} requests, profile {}{}\n",
                first.workload,
                first.workers,
                first.requests,
                first.profile,
                if first.profile_calibrated {
                    ""
                } else {
                    " (uncalibrated)"
                }
            );
            print!("{}", markdown_table(&runs));
            let transfers = transfer_table(&runs);
            if !transfers.is_empty() {
                print!("\nDisaggregated prefills:\n\n{transfers}");
            }
            let migrations = migration_table(&runs);
            if !migrations.is_empty() {
                print!("\nMigrations:\n\n{migrations}");
            }
            let copies = copy_table(&runs);
            if !copies.is_empty() {
                print!("\nPrefix copies:\n\n{copies}");
            }
            let pool = pool_table(&runs);
            if !pool.is_empty() {
                print!("\nPool:\n\n{pool}");
            }
            let disk = disk_table(&runs);
            if !disk.is_empty() {
                print!("\nDisk:\n\n{disk}");
            }
            if common.autoscale || !fixed_fleets.is_empty() {
                print!("\nFleet:\n\n{}", fleet_table(&runs));
            }
            let classes = class_table(&runs);
            if !classes.is_empty() {
                print!("\nPer class:\n\n{classes}");
            }
            if let Some(dir) = plots {
                for path in pie_sim::plots::write(&dir, &runs)? {
                    eprintln!("wrote {}", path.display());
                }
            }
        }
    }
    Ok(())
}
