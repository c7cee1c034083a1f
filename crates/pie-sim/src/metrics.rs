//! Metrics of one simulated run: what each request experienced (TTFT,
//! inter-token latency, end-to-end latency, prefix hits, deadline), per-client service for fairness, per-class
//! latencies, throughput, disaggregated prefills' transfers, migrations, and the
//! simulator's own speed (events per second). The whole [`RunMetrics`]
//! serialises to JSON; [`markdown_table`], [`transfer_table`],
//! [`migration_table`], [`copy_table`] and [`pool_table`] compare runs.

use std::collections::{BTreeMap, HashMap};

use pie_policy::cluster::ActionRecord;
use serde::Serialize;

use crate::autoscale::FleetStats;
use crate::copies::CopyCounters;
use crate::disaggregate::{Disaggregation, TransferCounters};
use crate::disk::DiskCounters;
use crate::histogram::LogHistogram;
use crate::migrate::{MigrationCounters, Migrations};
use crate::pool::PoolCounters;
use crate::sim::SimConfig;
use crate::workload::Request;

/// What happened to one request (times in microseconds since the start).
#[derive(Clone, Debug, Default)]
pub struct Record {
    pub arrival_us: u64,
    pub first_token_us: Option<u64>,
    pub finish_us: Option<u64>,
    pub worker: u32,
    /// The prefill-stage worker that prefilled it (`disaggregate`).
    pub prefill_worker: Option<u32>,
    pub prompt_tokens: u32,
    pub generated_tokens: u32,
    /// Prompt tokens served from the prefix cache at first scheduling.
    pub cached_tokens: Option<u32>,
    /// Stopped by the policy (`deadline-abort`).
    pub expired: bool,
    /// Could not fit the page pool.
    pub rejected: bool,
}

/// Simulator-wide counters.
#[derive(Clone, Debug, Default)]
pub struct Counters {
    pub events: u64,
    pub end_us: u64,
    pub steps: u64,
    pub batch_tokens: u64,
    pub prefill_tokens: u64,
    /// Tokens computed after the prompt (recomputes after preemption included).
    pub decode_tokens: u64,
    pub prefix_hit_tokens: u64,
    pub preemptions: u64,
    pub rejected: u64,
    /// Tokens served (prompt computed + generated) per client id until the last
    /// open-loop arrival.
    pub window_service: Vec<u64>,
    /// Gaps between consecutive output tokens of a request.
    pub itl: LogHistogram,
    pub transfers: TransferCounters,
    pub migrations: MigrationCounters,
    pub copies: CopyCounters,
    pub pool: PoolCounters,
    pub disk: DiskCounters,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Percentiles {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub mean: f64,
}

impl Percentiles {
    /// Nearest-rank percentiles of `values` (zeros when empty).
    pub fn of(mut values: Vec<f64>) -> Self {
        if values.is_empty() {
            return Self::default();
        }
        values.sort_by(f64::total_cmp);
        let at = |p: f64| {
            let rank = ((p / 100.0) * values.len() as f64).ceil() as usize;
            values[rank.clamp(1, values.len()) - 1]
        };
        Self {
            p50: at(50.0),
            p90: at(90.0),
            p99: at(99.0),
            mean: values.iter().sum::<f64>() / values.len() as f64,
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ClientService {
    pub requests: usize,
    /// Prompt plus generated tokens of its requests.
    pub tokens: u64,
    /// Tokens served (computed prompt + generated) until the last open-loop
    /// arrival, while load was still offered: the fairness figure.
    pub window_tokens: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ClassStats {
    pub requests: usize,
    pub ttft_ms: Percentiles,
    pub e2e_ms: Percentiles,
    pub deadline_misses: usize,
}

/// Tokens served per second over the run, per client (the most served ones).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ServiceOverTime {
    pub bucket_s: f64,
    /// Client -> tokens/s in each bucket: prompt tokens when its first token
    /// came, generated ones spread from then to its end.
    pub clients: BTreeMap<String, Vec<f64>>,
}

/// Buckets of [`ServiceOverTime`], and how many clients it keeps.
const SERVICE_BUCKETS: usize = 60;
const SERVICE_CLIENTS: usize = 8;

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RunMetrics {
    pub workload: String,
    /// The cluster actors' actions, in order (`--router ...,scale-by-prop`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub actions: Vec<ActionRecord>,
    pub policy: String,
    pub router: String,
    pub keep_session: bool,
    pub workers: usize,
    /// Workers sharing one machine of the profile.
    pub workers_per_machine: usize,
    pub profile: String,
    pub profile_calibrated: bool,
    pub requests: usize,
    pub completed: usize,
    pub rejected: usize,
    pub aborted: usize,
    pub ttft_ms: Percentiles,
    /// The TTFT objective (`--slo-ttft-ms`), and the fraction of requests
    /// whose first token came within it (a rejected request misses it).
    pub slo_ttft_ms: f64,
    pub slo_attainment: f64,
    /// Started workers (booting, serving or draining) integrated over the
    /// run: a fixed fleet's size times the run's length.
    pub worker_hours: f64,
    /// The autoscaled fleet (`--autoscale`): its changes and bounds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fleet: Option<FleetStats>,
    /// TTFT of the requests that continue a conversation (later turns).
    pub later_turns_ttft_ms: Percentiles,
    /// TTFT at each whole percentile 0..=100 (for CDF plots).
    pub ttft_cdf_ms: Vec<f64>,
    /// Inter-token latency: time between consecutive output tokens of a
    /// request, over every such pair (to within 1%, see `histogram.rs`).
    pub itl_ms: Percentiles,
    pub e2e_ms: Percentiles,
    pub sim_time_s: f64,
    /// Generated tokens per simulated second.
    pub output_tokens_per_s: f64,
    /// Prompt plus generated tokens per simulated second.
    pub total_tokens_per_s: f64,
    pub prompt_tokens: u64,
    pub generated_tokens: u64,
    pub requested_output_tokens: u64,
    /// Completed requests whose generated tokens differ from the output length
    /// they asked for (capped to what the pool leaves after the prompt): 0
    /// unless tokens were lost or produced twice (e.g. by a migration).
    pub wrong_output_lengths: usize,
    pub prefix_hit_tokens: u64,
    /// Prompt tokens served from the prefix cache / prompt tokens.
    pub prefix_hit_rate: f64,
    pub prefill_tokens_computed: u64,
    pub steps: u64,
    pub mean_batch_tokens: f64,
    pub preemptions: u64,
    pub deadline_requests: usize,
    pub deadline_misses: usize,
    pub clients: BTreeMap<String, ClientService>,
    pub service_over_time: ServiceOverTime,
    /// Jain's index of the clients' `window_tokens` (1: equal service).
    pub jain_window: f64,
    pub classes: BTreeMap<String, ClassStats>,
    /// Prefill-stage workers and KV transfers (`--prefill-workers`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disaggregation: Option<Disaggregation>,
    /// Processes moved between workers (`MigrateProcess` actions, e.g.
    /// `rebalance`); present when the router runs actors.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub migrations: Option<Migrations>,
    /// Prefixes copied between workers (`CopyPrefix` actions, `replicate`);
    /// present when the router runs actors.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub copies: Option<CopyCounters>,
    /// The shared page pool (`--pool-pages`): spills, pushes, pulls, eviction.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pool: Option<PoolCounters>,
    /// The workers' disk tier (`--disk-pages`): persists, spills, loads.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disk: Option<DiskCounters>,
    pub events: u64,
    pub wall_s: f64,
    pub events_per_s: f64,
}

fn ms(us: u64) -> f64 {
    us as f64 / 1000.0
}

/// Whether a finished request missed its `deadline-ms`, if it had one.
/// `pie-sim run --records FILE`: one JSON line per request, in workload order,
/// with the fields `pie bench --out` gives each request (times in ms), so a
/// simulated run can be set beside a real one request by request.
pub fn write_records(path: &std::path::Path, records: &[Record]) -> anyhow::Result<()> {
    use std::io::Write;
    let file = std::fs::File::create(path)
        .map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))?;
    let mut out = std::io::BufWriter::new(file);
    for (index, r) in records.iter().enumerate() {
        let since = |t: Option<u64>| t.map(|t| ms(t - r.arrival_us));
        let line = serde_json::json!({
            "index": index,
            "arrival_ms": ms(r.arrival_us),
            "ttft_ms": since(r.first_token_us),
            "e2e_ms": since(r.finish_us),
            "worker": r.worker,
            "prompt_tokens": r.prompt_tokens,
            "output_tokens": r.generated_tokens,
            "cached_tokens": r.cached_tokens,
        });
        writeln!(out, "{line}")?;
    }
    out.flush()?;
    Ok(())
}

fn missed(req: &Request, rec: &Record) -> Option<bool> {
    let d = req.props.int("deadline-ms")?;
    let deadline_us = rec.arrival_us.saturating_add(d.max(0) as u64 * 1000);
    Some(rec.expired || rec.finish_us.is_none_or(|f| f > deadline_us))
}

/// TTFT (ms) at percentiles 0, 1, ..., 100 (empty when nothing was served).
fn ttft_cdf(served: &[(&Request, &Record)]) -> Vec<f64> {
    let mut v: Vec<f64> = served
        .iter()
        .filter_map(|(_, r)| r.first_token_us.map(|f| ms(f - r.arrival_us)))
        .collect();
    if v.is_empty() {
        return v;
    }
    v.sort_by(f64::total_cmp);
    (0..=100)
        .map(|p| v[(p * (v.len() - 1)).div_ceil(100)])
        .collect()
}

fn service_over_time(
    served: &[(&Request, &Record)],
    clients: &BTreeMap<String, ClientService>,
    sim_time_s: f64,
) -> ServiceOverTime {
    let mut top: Vec<(&String, u64)> = clients.iter().map(|(k, c)| (k, c.tokens)).collect();
    top.sort_by_key(|&(k, t)| (std::cmp::Reverse(t), k));
    top.truncate(SERVICE_CLIENTS);
    let bucket_us = (sim_time_s * 1e6 / SERVICE_BUCKETS as f64).max(1.0);
    let mut series: BTreeMap<String, Vec<f64>> = top
        .iter()
        .map(|(k, _)| ((*k).clone(), vec![0.0; SERVICE_BUCKETS]))
        .collect();
    for (q, r) in served {
        let (Some(first), Some(end), Some(s)) =
            (r.first_token_us, r.finish_us, series.get_mut(&q.client))
        else {
            continue;
        };
        let at = |us: u64| ((us as f64 / bucket_us) as usize).min(SERVICE_BUCKETS - 1);
        s[at(first)] += f64::from(r.prompt_tokens);
        let (b0, b1) = (at(first), at(end));
        let share = f64::from(r.generated_tokens) / (b1 - b0 + 1) as f64;
        s[b0..=b1].iter_mut().for_each(|x| *x += share);
    }
    let bucket_s = bucket_us / 1e6;
    for s in series.values_mut() {
        s.iter_mut().for_each(|x| *x /= bucket_s);
    }
    ServiceOverTime {
        bucket_s,
        clients: series,
    }
}

impl RunMetrics {
    pub fn compute(
        cfg: &SimConfig,
        workload: &str,
        reqs: &[Request],
        records: &[Record],
        client_names: &[String],
        counters: Counters,
        wall_s: f64,
    ) -> Self {
        let served: Vec<(&Request, &Record)> = reqs
            .iter()
            .zip(records)
            .filter(|(_, r)| !r.rejected)
            .collect();
        let ttft = |v: &[(&Request, &Record)]| {
            Percentiles::of(
                v.iter()
                    .filter_map(|(_, r)| r.first_token_us.map(|f| ms(f - r.arrival_us)))
                    .collect(),
            )
        };
        let e2e = |v: &[(&Request, &Record)]| {
            Percentiles::of(
                v.iter()
                    .filter_map(|(_, r)| r.finish_us.map(|f| ms(f - r.arrival_us)))
                    .collect(),
            )
        };
        // Borrowed keys while counting: a multi-turn run has a client per
        // conversation, and owned keys cost an allocation per request.
        let mut by_client: HashMap<&str, ClientService> = HashMap::new();
        for (q, r) in &served {
            let c = by_client.entry(&q.client).or_default();
            c.requests += 1;
            c.tokens += u64::from(r.prompt_tokens + r.generated_tokens);
        }
        let mut clients: BTreeMap<String, ClientService> = by_client
            .into_iter()
            .map(|(k, c)| (k.to_string(), c))
            .collect();
        for (id, name) in client_names.iter().enumerate() {
            if let Some(c) = clients.get_mut(name) {
                c.window_tokens = counters.window_service.get(id).copied().unwrap_or(0);
            }
        }
        let window: Vec<f64> = clients.values().map(|c| c.window_tokens as f64).collect();
        let sum: f64 = window.iter().sum();
        let sq: f64 = window.iter().map(|x| x * x).sum();
        let jain_window = if sq > 0.0 {
            sum * sum / (window.len() as f64 * sq)
        } else {
            1.0
        };
        let mut by_class: BTreeMap<&str, Vec<(&Request, &Record)>> = BTreeMap::new();
        for &(q, r) in &served {
            by_class.entry(&q.class).or_default().push((q, r));
        }
        let classes = by_class
            .into_iter()
            .map(|(k, v)| {
                let misses = v.iter().filter(|(q, r)| missed(q, r) == Some(true)).count();
                (
                    k.to_string(),
                    ClassStats {
                        requests: v.len(),
                        ttft_ms: ttft(&v),
                        e2e_ms: e2e(&v),
                        deadline_misses: misses,
                    },
                )
            })
            .collect();
        let prompt_tokens: u64 = served.iter().map(|(_, r)| u64::from(r.prompt_tokens)).sum();
        let generated_tokens: u64 = served
            .iter()
            .map(|(_, r)| u64::from(r.generated_tokens))
            .sum();
        let sim_time_s = counters.end_us as f64 / 1e6;
        let per_s = |x: u64| {
            if sim_time_s > 0.0 {
                x as f64 / sim_time_s
            } else {
                0.0
            }
        };
        let deadlines: Vec<bool> = served.iter().filter_map(|(q, r)| missed(q, r)).collect();
        let disaggregation = (cfg.prefill_workers > 0).then(|| {
            let remote: Vec<(&Request, &Record)> = served
                .iter()
                .filter(|(_, r)| r.prefill_worker.is_some())
                .copied()
                .collect();
            Disaggregation::new(
                cfg.prefill_workers,
                cfg.kv_bytes_per_token,
                &counters.transfers,
                ttft(&remote),
            )
        });
        Self {
            workload: workload.to_string(),
            actions: Vec::new(),
            policy: cfg.policy.label().to_string(),
            router: cfg.router.label(),
            keep_session: cfg.keep_session,
            workers: cfg.workers,
            workers_per_machine: cfg.workers_per_machine,
            profile: cfg.profile.name.clone(),
            profile_calibrated: cfg.profile.calibrated,
            requests: reqs.len(),
            completed: served
                .iter()
                .filter(|(_, r)| r.finish_us.is_some() && !r.expired)
                .count(),
            rejected: records.iter().filter(|r| r.rejected).count(),
            aborted: records.iter().filter(|r| r.expired).count(),
            ttft_ms: ttft(&served),
            slo_ttft_ms: cfg.slo_ttft_ms,
            slo_attainment: {
                let slo_us = (cfg.slo_ttft_ms * 1000.0) as u64;
                let met = (served.iter())
                    .filter(|(_, r)| r.first_token_us.is_some_and(|f| f - r.arrival_us <= slo_us))
                    .count();
                met as f64 / reqs.len().max(1) as f64
            },
            worker_hours: 0.0,
            fleet: None,
            later_turns_ttft_ms: ttft(
                &served
                    .iter()
                    .filter(|(q, _)| q.follows.is_some())
                    .copied()
                    .collect::<Vec<_>>(),
            ),
            ttft_cdf_ms: ttft_cdf(&served),
            itl_ms: counters.itl.percentiles_ms(),
            e2e_ms: e2e(&served),
            sim_time_s,
            output_tokens_per_s: per_s(generated_tokens),
            total_tokens_per_s: per_s(generated_tokens + prompt_tokens),
            prompt_tokens,
            generated_tokens,
            requested_output_tokens: served.iter().map(|(q, _)| q.output_len() as u64).sum(),
            wrong_output_lengths: {
                let limit = cfg.profile.kv_pages * cfg.profile.page_size;
                served
                    .iter()
                    .filter(|(_, r)| r.finish_us.is_some() && !r.expired)
                    .filter(|(q, r)| {
                        let room = limit.saturating_sub(q.prompt_len());
                        let asked = q.output_len().min(room).max(1);
                        r.generated_tokens as usize != asked
                    })
                    .count()
            },
            prefix_hit_tokens: counters.prefix_hit_tokens,
            prefix_hit_rate: if prompt_tokens > 0 {
                counters.prefix_hit_tokens as f64 / prompt_tokens as f64
            } else {
                0.0
            },
            prefill_tokens_computed: counters.prefill_tokens,
            steps: counters.steps,
            mean_batch_tokens: if counters.steps > 0 {
                counters.batch_tokens as f64 / counters.steps as f64
            } else {
                0.0
            },
            preemptions: counters.preemptions,
            deadline_requests: deadlines.len(),
            deadline_misses: deadlines.iter().filter(|m| **m).count(),
            service_over_time: service_over_time(&served, &clients, sim_time_s),
            clients,
            jain_window,
            classes,
            disaggregation,
            migrations: (!cfg.router.actors().is_empty())
                .then(|| Migrations::new(&counters.migrations)),
            copies: (!cfg.router.actors().is_empty()).then(|| counters.copies.clone()),
            pool: (cfg.pool_pages > 0).then(|| counters.pool.clone()),
            disk: (cfg.disk_pages > 0).then(|| counters.disk.clone()),
            events: counters.events,
            wall_s,
            events_per_s: if wall_s > 0.0 {
                counters.events as f64 / wall_s
            } else {
                0.0
            },
        }
    }
}

/// One row per run, for `pie-sim compare`.
pub fn markdown_table(runs: &[RunMetrics]) -> String {
    let mut s = String::from(
        "| policy | router | TTFT p50 / p90 / p99 ms | ITL p50 / p99 ms | e2e p50 / p99 ms | output tok/s | prefix hit | Jain (window) | deadline misses | preemptions | events/s |\n\
         |---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in runs {
        s.push_str(&format!(
            "| {} | {}{} | {:.0} / {:.0} / {:.0} | {:.1} / {:.1} | {:.0} / {:.0} | {:.0} | {:.1}% | {:.3} | {} / {} | {} | {:.2e} |\n",
            r.policy,
            r.router,
            if r.keep_session { " +keep-session" } else { "" },
            r.ttft_ms.p50,
            r.ttft_ms.p90,
            r.ttft_ms.p99,
            r.itl_ms.p50,
            r.itl_ms.p99,
            r.e2e_ms.p50,
            r.e2e_ms.p99,
            r.output_tokens_per_s,
            100.0 * r.prefix_hit_rate,
            r.jain_window,
            r.deadline_misses,
            r.deadline_requests,
            r.preemptions,
            r.events_per_s,
        ));
    }
    s
}

/// One row per run with prefill-stage workers (empty when none has them).
pub fn transfer_table(runs: &[RunMetrics]) -> String {
    let staged: Vec<(&RunMetrics, &Disaggregation)> = runs
        .iter()
        .filter_map(|r| r.disaggregation.as_ref().map(|d| (r, d)))
        .collect();
    if staged.is_empty() {
        return String::new();
    }
    let mut s = String::from(
        "| router | workers (prefill + decode) | remote prefills | remote TTFT p50 / p99 ms | transferred pages | transferred GB | transfer s (summed) | link wait s (summed) |\n\
         |---|---|---|---|---|---|---|---|\n",
    );
    for (r, d) in staged {
        s.push_str(&format!(
            "| {} | {} + {} | {} | {:.0} / {:.0} | {} | {:.1} | {:.1} | {:.1} |\n",
            r.router,
            d.prefill_workers,
            r.workers - d.prefill_workers,
            d.remote_prefills,
            d.remote_ttft_ms.p50,
            d.remote_ttft_ms.p99,
            d.transferred_pages,
            d.transferred_bytes as f64 / 1e9,
            d.transfer_s,
            d.transfer_wait_s,
        ));
    }
    s
}

/// One row per run whose router runs actors, when any of them migrated a
/// process (empty otherwise): the runs with and without migrations side by side.
pub fn migration_table(runs: &[RunMetrics]) -> String {
    if !runs
        .iter()
        .any(|r| r.migrations.as_ref().is_some_and(|m| m.started > 0))
    {
        return String::new();
    }
    let mut s = String::from(
        "| router | TTFT p50 / p99 ms | e2e p50 / p99 ms | migrations (done / abandoned) | copy stages | moved pages | moved GB | pause mean / max ms |\n\
         |---|---|---|---|---|---|---|---|\n",
    );
    for r in runs {
        let m = r.migrations.clone().unwrap_or_default();
        s.push_str(&format!(
            "| {} | {:.0} / {:.0} | {:.0} / {:.0} | {} ({} / {}) | {} | {} | {:.2} | {:.1} / {:.1} |\n",
            r.router,
            r.ttft_ms.p50,
            r.ttft_ms.p99,
            r.e2e_ms.p50,
            r.e2e_ms.p99,
            m.started,
            m.completed,
            m.abandoned,
            m.stages,
            m.pages,
            m.bytes as f64 / 1e9,
            m.mean_pause_ms,
            m.max_pause_ms,
        ));
    }
    s
}

/// One row per run whose router runs actors, when any of them copied a
/// prefix (empty otherwise).
pub fn copy_table(runs: &[RunMetrics]) -> String {
    if !runs
        .iter()
        .any(|r| r.copies.as_ref().is_some_and(|c| c.copies > 0))
    {
        return String::new();
    }
    let mut s = String::from(
        "| router | TTFT p50 / p90 / p99 ms | e2e p50 / p99 ms | prefix copies | pages sent | GB sent |\n\
         |---|---|---|---|---|---|\n",
    );
    for r in runs {
        let c = r.copies.clone().unwrap_or_default();
        s.push_str(&format!(
            "| {} | {:.0} / {:.0} / {:.0} | {:.0} / {:.0} | {} | {} | {:.2} |\n",
            r.router,
            r.ttft_ms.p50,
            r.ttft_ms.p90,
            r.ttft_ms.p99,
            r.e2e_ms.p50,
            r.e2e_ms.p99,
            c.copies,
            c.pages,
            c.bytes as f64 / 1e9,
        ));
    }
    s
}

/// One row per run, when any run has a disk tier (empty otherwise): later
/// turns' TTFT, prefix hits, and what went to and came from the disks.
pub fn disk_table(runs: &[RunMetrics]) -> String {
    if !runs.iter().any(|r| r.disk.is_some()) {
        return String::new();
    }
    let mut s = String::from(
        "| router | disk pages | later turns TTFT p50 / p90 / p99 ms | prefix hit | persists (pages) | spills (pages) / dropped | loads (pages) | loaded GB | unfit pages | evicted | max held |\n\
         |---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in runs {
        let t = &r.later_turns_ttft_ms;
        let d = r.disk.clone().unwrap_or_default();
        s.push_str(&format!(
            "| {}{} | {} | {:.0} / {:.0} / {:.0} | {:.1}% | {} ({}) | {} ({}) / {} | {} ({}) | {:.1} | {} | {} | {} |\n",
            r.router,
            if r.keep_session { " +keep-session" } else { "" },
            d.capacity_pages,
            t.p50,
            t.p90,
            t.p99,
            100.0 * r.prefix_hit_rate,
            d.persists,
            d.persisted_pages,
            d.spills,
            d.spilled_pages,
            d.dropped_spills,
            d.loads,
            d.loaded_pages,
            d.loaded_bytes as f64 / 1e9,
            d.unfit_pages,
            d.evicted_pages,
            d.max_held_pages,
        ));
    }
    s
}

/// A run's fleet in a table: `autoscaled (start 2, 1..16, boot 60 s)` or
/// `fixed 8`.
pub fn fleet_label(r: &RunMetrics) -> String {
    match &r.fleet {
        Some(f) => format!(
            "autoscaled (start {}, {}..{}, boot {} s)",
            f.initial_workers,
            f.min_workers,
            f.max_workers,
            f.start_ms as f64 / 1000.0
        ),
        None => format!("fixed {}", r.workers),
    }
}

/// One row per run: its fleet, worker-hours and SLO attainment (for
/// `--autoscale` against fixed fleets).
pub fn fleet_table(runs: &[RunMetrics]) -> String {
    let mut s = String::from(
        "| router | fleet | workers min / max | worker-hours | SLO attainment (TTFT <= ms) | TTFT p50 / p90 / p99 ms | starts / drains | sim time s |\n\
         |---|---|---|---|---|---|---|---|\n",
    );
    for r in runs {
        let (min, max, starts, drains) = match &r.fleet {
            Some(f) => (f.min_started, f.max_started, f.starts, f.drains),
            None => (r.workers, r.workers, 0, 0),
        };
        s.push_str(&format!(
            "| {} | {} | {min} / {max} | {:.2} | {:.2}% ({:.0}) | {:.0} / {:.0} / {:.0} | {starts} / {drains} | {:.0} |\n",
            r.router,
            fleet_label(r),
            r.worker_hours,
            100.0 * r.slo_attainment,
            r.slo_ttft_ms,
            r.ttft_ms.p50,
            r.ttft_ms.p90,
            r.ttft_ms.p99,
            r.sim_time_s,
        ));
    }
    s
}

/// Classes beyond which [`class_table`] is left out (e.g. one per prefix group).
pub const MAX_TABLE_CLASSES: usize = 12;

/// One row per run and request class (client, deadline class, priority, turn),
/// when the runs have 2 to [`MAX_TABLE_CLASSES`] classes; empty otherwise.
pub fn class_table(runs: &[RunMetrics]) -> String {
    let classes = runs.first().map_or(0, |r| r.classes.len());
    if !(2..=MAX_TABLE_CLASSES).contains(&classes) {
        return String::new();
    }
    let mut s = String::from(
        "| policy | router | class | requests | TTFT p50 / p90 ms | e2e p50 / p99 ms | deadline misses |\n\
         |---|---|---|---|---|---|---|\n",
    );
    for r in runs {
        let keep = if r.keep_session { " +keep-session" } else { "" };
        for (class, c) in &r.classes {
            s.push_str(&format!(
                "| {} | {}{keep} | {class} | {} | {:.0} / {:.0} | {:.0} / {:.0} | {} |\n",
                r.policy,
                r.router,
                c.requests,
                c.ttft_ms.p50,
                c.ttft_ms.p90,
                c.e2e_ms.p50,
                c.e2e_ms.p99,
                c.deadline_misses,
            ));
        }
    }
    s
}

/// One row per run, when any run has a pool (empty otherwise): later turns'
/// TTFT, prefix hits, and what went to and came from the pool.
pub fn pool_table(runs: &[RunMetrics]) -> String {
    if !runs.iter().any(|r| r.pool.is_some()) {
        return String::new();
    }
    let mut s = String::from(
        "| router | pool pages | later turns TTFT p50 / p90 / p99 ms | prefix hit | spills (pages) / dropped | replicated (pages) | pulls (pages) | pulled GB | short pulls (unfit pages) | evicted (pinned) | max held |\n\
         |---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in runs {
        let t = &r.later_turns_ttft_ms;
        let p = r.pool.clone().unwrap_or_default();
        s.push_str(&format!(
            "| {}{} | {} | {:.0} / {:.0} / {:.0} | {:.1}% | {} ({}) / {} | {} ({}) | {} ({}) | {:.1} | {} ({}) | {} ({}) | {} |\n",
            r.router,
            if r.keep_session { " +keep-session" } else { "" },
            p.capacity_pages,
            t.p50,
            t.p90,
            t.p99,
            100.0 * r.prefix_hit_rate,
            p.spills,
            p.spilled_pages,
            p.dropped_spills,
            p.replicated,
            p.replicated_pages,
            p.pulls,
            p.pulled_pages,
            p.pulled_bytes as f64 / 1e9,
            p.short_pulls,
            p.unfit_pages,
            p.evicted_pages,
            p.evicted_pinned_pages,
            p.max_held_pages,
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let p = Percentiles::of((1..=100).map(f64::from).collect());
        assert_eq!((p.p50, p.p90, p.p99), (50.0, 90.0, 99.0));
        assert_eq!(p.mean, 50.5);
        assert_eq!(Percentiles::of(vec![]).p99, 0.0);
    }

    #[test]
    fn ttft_cdf_and_service_over_time() {
        let req = Request {
            arrival_us: 0,
            follows: None,
            client: "a".into(),
            class: "a".into(),
            prompt: vec![],
            output: crate::workload::Segment { key: 0, len: 0 },
            props: Default::default(),
        };
        let rec = |arrival_us, first, end| Record {
            arrival_us,
            first_token_us: Some(first),
            finish_us: Some(end),
            prompt_tokens: 60,
            generated_tokens: 6,
            ..Record::default()
        };
        let recs: Vec<Record> = (0..10)
            .map(|i| rec(0, (i + 1) * 1000, 60_000_000))
            .collect();
        let served: Vec<(&Request, &Record)> = recs.iter().map(|r| (&req, r)).collect();
        let cdf = ttft_cdf(&served);
        assert_eq!(
            (cdf.len(), cdf[0], cdf[50], cdf[100]),
            (101, 1.0, 6.0, 10.0)
        );
        let clients = BTreeMap::from([(
            "a".to_string(),
            ClientService {
                requests: 10,
                tokens: 660,
                window_tokens: 0,
            },
        )]);
        let s = service_over_time(&served, &clients, 60.0);
        assert_eq!(s.bucket_s, 1.0);
        // 600 prompt tokens in the first second, 60 generated over 60 s.
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        assert!(close(s.clients["a"][0], 601.0), "{:?}", s.clients["a"]);
        assert!(close(s.clients["a"][59], 1.0), "{:?}", s.clients["a"]);
    }
}
