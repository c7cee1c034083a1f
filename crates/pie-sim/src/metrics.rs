//! Metrics of one simulated run, the top of the crate: from a finished
//! simulation's records and counters (`sim::Outcome`), what each request
//! experienced (TTFT, inter-token latency, end-to-end latency, prefix hits,
//! deadline), per-client service for fairness, per-class latencies,
//! throughput, each feature's figures (transfers, migrations, copies, pool,
//! disk, fleet), and the simulator's own speed (events per second). The
//! whole [`RunMetrics`] serialises to JSON; `tables.rs` compares runs.

use std::collections::{BTreeMap, HashMap};

use pie_policy::cluster::ActionRecord;
use serde::Serialize;

use pie_workload::{nearest_rank, Percentiles};

use crate::actors::FailedAction;
use crate::autoscale::FleetStats;
use crate::config::SimConfig;
use crate::copies::CopyCounters;
use crate::disaggregate::Disaggregation;
use crate::disk::DiskCounters;
use crate::migrate::Migrations;
use crate::pool::PoolCounters;
use crate::records::{ms, Record};
use crate::sim::Outcome;
use crate::workload::Request;

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
    /// The actions that failed (a copy whose target stopped first), in order.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub failed_actions: Vec<FailedAction>,
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

fn missed(req: &Request, rec: &Record) -> Option<bool> {
    let d = req.props.int("deadline-ms")?;
    let deadline_us = rec.arrival_us.saturating_add(d.max(0) as u64 * 1000);
    Some(rec.expired || rec.finish_us.is_none_or(|f| f > deadline_us))
}

/// TTFT (ms) at percentiles 0, 1, ..., 100 by the workspace's one rule,
/// nearest rank (empty when nothing was served).
fn ttft_cdf(served: &[(&Request, &Record)]) -> Vec<f64> {
    let mut v: Vec<f64> = served
        .iter()
        .filter_map(|(_, r)| r.first_token_us.map(|f| ms(f - r.arrival_us)))
        .collect();
    if v.is_empty() {
        return v;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    (0..=100)
        .map(|p| v[(nearest_rank(f64::from(p), n as u64) as usize).min(n) - 1])
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

/// A request and what happened to it.
type Served<'a> = (&'a Request, &'a Record);

/// TTFT (ms) percentiles of `v`'s requests that got a first token.
fn ttft(v: &[Served]) -> Percentiles {
    Percentiles::of(
        v.iter()
            .filter_map(|(_, r)| r.first_token_us.map(|f| ms(f - r.arrival_us)))
            .collect(),
    )
}

/// End-to-end latency (ms) percentiles of `v`'s finished requests.
fn e2e(v: &[Served]) -> Percentiles {
    Percentiles::of(
        v.iter()
            .filter_map(|(_, r)| r.finish_us.map(|f| ms(f - r.arrival_us)))
            .collect(),
    )
}

/// Each client's service (with its `window_service` by the ids of
/// `client_names`), and Jain's index of their window tokens.
fn client_service(
    served: &[Served],
    client_names: &[String],
    window_service: &[u64],
) -> (BTreeMap<String, ClientService>, f64) {
    // Borrowed keys while counting: a multi-turn run has a client per
    // conversation, and owned keys cost an allocation per request.
    let mut by_client: HashMap<&str, ClientService> = HashMap::new();
    for (q, r) in served {
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
            c.window_tokens = window_service.get(id).copied().unwrap_or(0);
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
    (clients, jain_window)
}

/// Latencies and deadline misses per request class.
fn class_stats(served: &[Served]) -> BTreeMap<String, ClassStats> {
    let mut by_class: BTreeMap<&str, Vec<Served>> = BTreeMap::new();
    for &(q, r) in served {
        by_class.entry(&q.class).or_default().push((q, r));
    }
    by_class
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
        .collect()
}

/// Completed requests whose generated tokens differ from the output length
/// they asked for, capped to what the pool leaves after the prompt.
fn wrong_output_lengths(cfg: &SimConfig, served: &[Served]) -> usize {
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
}

/// The fraction of `reqs` whose first token came within `slo_ttft_ms`.
fn slo_attainment(slo_ttft_ms: f64, served: &[Served], reqs: usize) -> f64 {
    let slo_us = (slo_ttft_ms * 1000.0) as u64;
    let met = (served.iter())
        .filter(|(_, r)| r.first_token_us.is_some_and(|f| f - r.arrival_us <= slo_us))
        .count();
    met as f64 / reqs.max(1) as f64
}

/// `x` over `y`, 0 when `y` is not positive.
fn ratio(x: f64, y: f64) -> f64 {
    if y > 0.0 {
        x / y
    } else {
        0.0
    }
}

impl RunMetrics {
    /// The figures of `outcome`, a simulation of `reqs` (named `workload`)
    /// configured by `cfg`, which took `wall_s` seconds.
    pub fn compute(
        cfg: &SimConfig,
        workload: &str,
        reqs: &[Request],
        outcome: &Outcome,
        wall_s: f64,
    ) -> Self {
        let (records, counters) = (&outcome.records, &outcome.counters);
        let served: Vec<Served> = reqs
            .iter()
            .zip(records)
            .filter(|(_, r)| !r.rejected)
            .collect();
        let (clients, jain_window) =
            client_service(&served, &outcome.clients, &counters.window_service);
        let prompt_tokens: u64 = served.iter().map(|(_, r)| u64::from(r.prompt_tokens)).sum();
        let generated_tokens: u64 = served
            .iter()
            .map(|(_, r)| u64::from(r.generated_tokens))
            .sum();
        let sim_time_s = counters.end_us as f64 / 1e6;
        let per_s = |x: u64| ratio(x as f64, sim_time_s);
        let deadlines: Vec<bool> = served.iter().filter_map(|(q, r)| missed(q, r)).collect();
        let disaggregation = (cfg.prefill_workers > 0).then(|| {
            let remote: Vec<Served> = served
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
        let actors = !cfg.router.actors().is_empty();
        Self {
            workload: workload.to_string(),
            actions: outcome.actions.clone(),
            failed_actions: outcome.failed_actions.clone(),
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
            slo_attainment: slo_attainment(cfg.slo_ttft_ms, &served, reqs.len()),
            worker_hours: outcome.worker_hours,
            fleet: outcome.fleet.clone(),
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
            wrong_output_lengths: wrong_output_lengths(cfg, &served),
            prefix_hit_tokens: counters.prefix_hit_tokens,
            prefix_hit_rate: ratio(counters.prefix_hit_tokens as f64, prompt_tokens as f64),
            prefill_tokens_computed: counters.prefill_tokens,
            steps: counters.steps,
            mean_batch_tokens: ratio(counters.batch_tokens as f64, counters.steps as f64),
            preemptions: counters.preemptions,
            deadline_requests: deadlines.len(),
            deadline_misses: deadlines.iter().filter(|m| **m).count(),
            service_over_time: service_over_time(&served, &clients, sim_time_s),
            clients,
            jain_window,
            classes: class_stats(&served),
            disaggregation,
            migrations: actors.then(|| Migrations::new(&counters.migrations)),
            copies: actors.then(|| counters.copies.clone()),
            pool: (cfg.pool_pages > 0).then(|| counters.pool.clone()),
            disk: (cfg.disk_pages > 0).then(|| counters.disk.clone()),
            events: counters.events,
            wall_s,
            events_per_s: ratio(counters.events as f64, wall_s),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            (101, 1.0, 5.0, 10.0)
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
