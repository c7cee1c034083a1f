//! Workload generators: seeded, reproducible request lists for the simulator.
//!
//! Owns the request shape (a prompt made of token segments, the output it will
//! generate, props, arrival) and the built-in workloads: `shared-prefix`,
//! `multi-turn`, `multi-tenant`, `deadline-mix`, `priority-mix`,
//! `prefill-decode-mix`, `skewed-sessions`, `diurnal` and `agent` (in
//! `agent.rs`). Arrivals are
//! open-loop Poisson at the workload's rate (`diurnal`: a rate that follows a
//! day cycle), except later turns of a conversation,
//! which arrive a think time after the previous turn finished (closed loop). The
//! same spec, request count and seed give the same list.
//!
//! Tokens are not stored: a [`Segment`] names a deterministic token run by a key,
//! so a million requests with long shared prompts stay small; the simulator
//! expands them to compute block hashes when a request arrives.

use crate::agent::agent;
pub use crate::agent::Agent;
use crate::request::prop;
pub use crate::request::{Follow, Request, Segment, VOCAB};
use pie_core::{PropValue, Props};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// `shared-prefix`: groups of prompts sharing a system prompt.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SharedPrefix {
    pub groups: usize,
    pub system_len: u32,
    pub question_len: u32,
    pub output_len: u32,
    /// Zipf exponent of group popularity; `None`: groups take turns evenly.
    pub zipf: Option<f64>,
    pub rate_per_s: f64,
}

/// `multi-turn`: conversations of several turns, each turn's prompt is the whole
/// conversation so far plus new tokens.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MultiTurn {
    pub turns: usize,
    pub system_len: u32,
    pub new_tokens: u32,
    pub output_len: u32,
    /// Mean think time between a turn's end and the next turn (exponential).
    pub think_ms: f64,
    /// The `keep-ms` prop of every turn (0: none).
    pub keep_ms: i64,
    /// Conversation starts per second.
    pub rate_per_s: f64,
}

/// `multi-tenant`: one flooding client and several light ones.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MultiTenant {
    pub flood_rate_per_s: f64,
    pub light_clients: usize,
    pub light_rate_per_s: f64,
    /// The `weight` prop of the light clients (the flood has 1).
    pub light_weight: f64,
    pub input_len: u32,
    pub output_len: u32,
}

/// `deadline-mix`: a tight and a loose `deadline-ms` class.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeadlineMix {
    pub tight_fraction: f64,
    pub tight_ms: i64,
    pub loose_ms: i64,
    pub input_len: u32,
    pub output_len: u32,
    pub rate_per_s: f64,
}

/// `priority-mix`: a fraction of `priority` 1 requests among priority 0.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PriorityMix {
    pub high_fraction: f64,
    pub input_len: u32,
    pub output_len: u32,
    pub rate_per_s: f64,
}

/// `prefill-decode-mix`: decode streams (short prompts, long outputs) with
/// long prompts of short outputs arriving among them: what makes a colocated
/// worker's decode steps wait on prefills (`disaggregate`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PrefillDecodeMix {
    /// The fraction of requests that are long prompts.
    pub long_fraction: f64,
    pub long_prompt_len: u32,
    pub long_output_len: u32,
    pub stream_prompt_len: u32,
    pub stream_output_len: u32,
    pub rate_per_s: f64,
}

/// `skewed-sessions`: long-lived conversations (several turns of long
/// outputs) most of which land on a few workers. Why it is skewed: a fraction
/// `hot_fraction` of the sessions open with a `pin` prop naming one of the
/// workers `w0..w{hot_workers}` (as an upstream gateway's sticky hashing over
/// a short, stale replica list would send them), and only their opening turn
/// carries it; later turns carry only `session`, so `session-affinity` keeps
/// them where the session opened. The other sessions open unpinned and go
/// where the rest of the pipeline sends them. With `session-affinity` first
/// and a load-aware policy after `pin`, the hot workers queue while the rest
/// have room: what `rebalance` is for (it may move the later turns, never a
/// turn pinned to its worker). `hot_workers` must not exceed the workers
/// simulated (a pin to a worker that does not exist is refused).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SkewedSessions {
    pub turns: usize,
    pub system_len: u32,
    pub new_tokens: u32,
    pub output_len: u32,
    /// Mean think time between a turn's end and the next turn (exponential).
    pub think_ms: f64,
    pub hot_workers: usize,
    pub hot_fraction: f64,
    /// Session starts per second.
    pub rate_per_s: f64,
}

/// `diurnal`: independent requests whose arrival rate follows a day: at
/// time `t` it is `low + (peak - low) * (1 - cos(2 pi t / day)) / 2` per
/// second, the trough at the start of each day and the peak half a day in,
/// a day lasting `day_ms` (compressed, so that a run covers one or two days
/// in reasonable simulated time). Drawn as a Poisson process by thinning:
/// candidates at the peak rate, each kept with probability rate / peak.
/// What an autoscaler follows (`pie-sim --autoscale`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Diurnal {
    pub day_ms: f64,
    pub low_rate_per_s: f64,
    pub peak_rate_per_s: f64,
    pub input_len: u32,
    pub output_len: u32,
}

impl Diurnal {
    /// The arrival rate (per second) at `t_us` from the start.
    pub fn rate_at(&self, t_us: u64) -> f64 {
        let phase = t_us as f64 / (self.day_ms.max(1e-3) * 1000.0);
        let swing = (1.0 - (std::f64::consts::TAU * phase).cos()) / 2.0;
        self.low_rate_per_s + (self.peak_rate_per_s - self.low_rate_per_s) * swing
    }
}

/// A workload and its parameters. Default rates are for one worker of the
/// default (GPU) profile, where a 256 + 128 token request costs about 45 ms of
/// step time (about 22 requests/s): `multi-tenant`'s flood alone overloads it,
/// `deadline-mix` and `priority-mix` run near capacity so that queues form.
/// [`WorkloadSpec::scale_rate`] scales them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum WorkloadSpec {
    SharedPrefix(SharedPrefix),
    MultiTurn(MultiTurn),
    MultiTenant(MultiTenant),
    DeadlineMix(DeadlineMix),
    PriorityMix(PriorityMix),
    PrefillDecodeMix(PrefillDecodeMix),
    SkewedSessions(SkewedSessions),
    Diurnal(Diurnal),
    Agent(Agent),
}

pub const WORKLOADS: &[&str] = &[
    "shared-prefix",
    "multi-turn",
    "multi-tenant",
    "deadline-mix",
    "priority-mix",
    "prefill-decode-mix",
    "skewed-sessions",
    "diurnal",
    "agent",
];

impl WorkloadSpec {
    /// The named workload with its default parameters.
    pub fn named(name: &str) -> Result<Self, String> {
        Ok(match name {
            "shared-prefix" => Self::SharedPrefix(SharedPrefix {
                groups: 32,
                system_len: 1024,
                question_len: 64,
                output_len: 128,
                zipf: Some(1.1),
                rate_per_s: 20.0,
            }),
            "multi-turn" => Self::MultiTurn(MultiTurn {
                turns: 5,
                system_len: 256,
                new_tokens: 64,
                output_len: 128,
                think_ms: 3000.0,
                keep_ms: 10_000,
                rate_per_s: 4.0,
            }),
            "multi-tenant" => Self::MultiTenant(MultiTenant {
                flood_rate_per_s: 30.0,
                light_clients: 3,
                light_rate_per_s: 1.0,
                light_weight: 1.0,
                input_len: 256,
                output_len: 128,
            }),
            "deadline-mix" => Self::DeadlineMix(DeadlineMix {
                tight_fraction: 0.3,
                tight_ms: 6000,
                loose_ms: 60_000,
                input_len: 256,
                output_len: 128,
                rate_per_s: 20.0,
            }),
            "priority-mix" => Self::PriorityMix(PriorityMix {
                high_fraction: 0.2,
                input_len: 256,
                output_len: 128,
                rate_per_s: 20.0,
            }),
            "prefill-decode-mix" => Self::PrefillDecodeMix(PrefillDecodeMix {
                long_fraction: 0.1,
                long_prompt_len: 2000,
                long_output_len: 16,
                stream_prompt_len: 128,
                stream_output_len: 512,
                rate_per_s: RATE_PREFILL_DECODE_MIX,
            }),
            "skewed-sessions" => Self::SkewedSessions(SkewedSessions {
                turns: 4,
                system_len: 256,
                new_tokens: 64,
                output_len: 1024,
                think_ms: 2000.0,
                hot_workers: 1,
                hot_fraction: 0.5,
                rate_per_s: RATE_SKEWED_SESSIONS,
            }),
            "diurnal" => Self::Diurnal(Diurnal {
                day_ms: 3_600_000.0,
                low_rate_per_s: 1.0,
                peak_rate_per_s: RATE_DIURNAL_PEAK,
                input_len: 256,
                output_len: 128,
            }),
            "agent" => Self::Agent(Agent::default_shape()),
            other => {
                return Err(format!(
                    "unknown workload `{other}` (available: {})",
                    WORKLOADS.join(", ")
                ))
            }
        })
    }

    /// This workload with parameters replaced by `key=value` overrides (values
    /// in JSON: `system_len=256`, `zipf=null`). An unknown key, or a value of
    /// the wrong type, is an error naming the key (and the workload's
    /// parameters, or what the value should be).
    pub fn with_overrides(self, overrides: &[String]) -> Result<Self, String> {
        let name = self.name();
        let mut spec = self;
        for item in overrides {
            let (key, raw) = item
                .split_once('=')
                .ok_or_else(|| format!("override `{item}` is not key=value"))?;
            let mut value = serde_json::to_value(&spec).map_err(|e| e.to_string())?;
            let params = value
                .as_object_mut()
                .ok_or_else(|| format!("workload `{name}` has no parameters"))?;
            if key == "kind" || !params.contains_key(key) {
                let known: Vec<&str> = params
                    .keys()
                    .map(String::as_str)
                    .filter(|k| *k != "kind")
                    .collect();
                return Err(format!(
                    "workload `{name}` has no parameter `{key}` (parameters: {})",
                    known.join(", ")
                ));
            }
            let parsed = serde_json::from_str(raw)
                .unwrap_or_else(|_| serde_json::Value::String(raw.to_string()));
            params.insert(key.to_string(), parsed);
            spec = serde_json::from_value(value)
                .map_err(|e| format!("workload `{name}`: bad value for `{key}`: {e}"))?;
        }
        Ok(spec)
    }

    pub fn name(&self) -> &'static str {
        match self {
            Self::SharedPrefix(_) => "shared-prefix",
            Self::MultiTurn(_) => "multi-turn",
            Self::MultiTenant(_) => "multi-tenant",
            Self::DeadlineMix(_) => "deadline-mix",
            Self::PriorityMix(_) => "priority-mix",
            Self::PrefillDecodeMix(_) => "prefill-decode-mix",
            Self::SkewedSessions(_) => "skewed-sessions",
            Self::Diurnal(_) => "diurnal",
            Self::Agent(_) => "agent",
        }
    }

    /// Multiply every arrival rate by `factor` (e.g. the number of workers).
    pub fn scale_rate(&mut self, factor: f64) {
        match self {
            Self::SharedPrefix(w) => w.rate_per_s *= factor,
            Self::MultiTurn(w) => w.rate_per_s *= factor,
            Self::MultiTenant(w) => {
                w.flood_rate_per_s *= factor;
                w.light_rate_per_s *= factor;
            }
            Self::DeadlineMix(w) => w.rate_per_s *= factor,
            Self::PriorityMix(w) => w.rate_per_s *= factor,
            Self::PrefillDecodeMix(w) => w.rate_per_s *= factor,
            Self::SkewedSessions(w) => w.rate_per_s *= factor,
            Self::Diurnal(w) => {
                w.low_rate_per_s *= factor;
                w.peak_rate_per_s *= factor;
            }
            // A closed population: more workers, more agents.
            Self::Agent(w) => w.agents = (w.agents as f64 * factor).round().max(1.0) as usize,
        }
    }

    /// `requests` requests from `seed`.
    pub fn generate(&self, requests: usize, seed: u64) -> Vec<Request> {
        let mut rng = StdRng::seed_from_u64(seed);
        match self {
            Self::SharedPrefix(w) => shared_prefix(w, requests, &mut rng),
            Self::MultiTurn(w) => multi_turn(w, requests, &mut rng),
            Self::MultiTenant(w) => multi_tenant(w, requests, &mut rng),
            Self::DeadlineMix(w) => deadline_mix(w, requests, &mut rng),
            Self::PriorityMix(w) => priority_mix(w, requests, &mut rng),
            Self::PrefillDecodeMix(w) => prefill_decode_mix(w, requests, &mut rng),
            Self::SkewedSessions(w) => skewed_sessions(w, requests, &mut rng),
            Self::Diurnal(w) => diurnal(w, requests, &mut rng),
            Self::Agent(w) => agent(w, requests, &mut rng),
        }
    }
}

/// Exponential inter-arrival gap in microseconds at `rate_per_s`.
fn gap_us(rng: &mut StdRng, rate_per_s: f64) -> u64 {
    let u: f64 = rng.gen_range(f64::MIN_POSITIVE..1.0);
    (-u.ln() / rate_per_s.max(1e-9) * 1e6) as u64
}

/// A later turn: it follows request `previous` after an exponential think
/// time of mean `think_ms`.
fn next_turn(rng: &mut StdRng, previous: usize, think_ms: f64) -> Follow {
    Follow {
        request: previous,
        think_us: gap_us(rng, 1000.0 / think_ms.max(1e-3)),
    }
}

fn plain(
    arrival_us: u64,
    client: &str,
    class: &str,
    prompt: Vec<Segment>,
    output: Segment,
) -> Request {
    Request {
        arrival_us,
        follows: None,
        client: client.to_string(),
        class: class.to_string(),
        prompt,
        output,
        props: Props::new(),
    }
}

/// `prefill-decode-mix`'s default rate per worker of the GPU profile: about
/// 70% busy colocated, where a stream costs about 60 ms of batched decode and a
/// long prompt about 220 ms of prefill.
const RATE_PREFILL_DECODE_MIX: f64 = 8.0;

/// `skewed-sessions`' default rate of session starts per worker of the GPU
/// profile.
const RATE_SKEWED_SESSIONS: f64 = 0.5;

/// `diurnal`'s default peak rate per worker of the GPU profile: about half
/// a worker's capacity for 256 + 128 token requests, so that a fleet sized
/// for the peak has headroom (its trough is a tenth of it).
const RATE_DIURNAL_PEAK: f64 = 10.0;

const SYSTEM: u64 = 1;
const QUESTION: u64 = 2;
const OUTPUT: u64 = 3;
const USER: u64 = 4;

fn shared_prefix(w: &SharedPrefix, n: usize, rng: &mut StdRng) -> Vec<Request> {
    let groups = w.groups.max(1);
    let cdf: Option<Vec<f64>> = w.zipf.map(|s| {
        let mut acc = 0.0;
        let mut cdf: Vec<f64> = (1..=groups)
            .map(|k| {
                acc += 1.0 / (k as f64).powf(s);
                acc
            })
            .collect();
        cdf.iter_mut().for_each(|c| *c /= acc);
        cdf
    });
    let mut t = 0;
    (0..n)
        .map(|i| {
            t += gap_us(rng, w.rate_per_s);
            let g = match &cdf {
                Some(cdf) => {
                    let u: f64 = rng.gen();
                    cdf.partition_point(|c| *c < u).min(groups - 1)
                }
                None => i % groups,
            };
            let prompt = vec![
                Segment::named(&[SYSTEM, g as u64], w.system_len),
                Segment::named(&[QUESTION, i as u64], w.question_len),
            ];
            let output = Segment::named(&[OUTPUT, i as u64], w.output_len);
            plain(t, "default", &format!("group-{g}"), prompt, output)
        })
        .collect()
}

fn multi_turn(w: &MultiTurn, n: usize, rng: &mut StdRng) -> Vec<Request> {
    let turns = w.turns.max(1);
    let mut out = Vec::with_capacity(n);
    let mut t = 0;
    let mut conv = 0u64;
    while out.len() < n {
        t += gap_us(rng, w.rate_per_s);
        let session = format!("conv-{conv}");
        let mut prompt = vec![Segment::named(&[SYSTEM], w.system_len)];
        for turn in 0..turns.min(n - out.len()) {
            prompt.push(Segment::named(&[USER, conv, turn as u64], w.new_tokens));
            let output = Segment::named(&[OUTPUT, conv, turn as u64], w.output_len);
            let mut r = plain(t, &session, &format!("turn-{turn}"), prompt.clone(), output);
            prop(&mut r.props, "session", PropValue::Str(session.clone()));
            if w.keep_ms > 0 {
                prop(&mut r.props, "keep-ms", PropValue::Int(w.keep_ms));
            }
            if turn > 0 {
                r.follows = Some(next_turn(rng, out.len() - 1, w.think_ms));
            }
            prompt.push(output);
            out.push(r);
        }
        conv += 1;
    }
    out
}

fn multi_tenant(w: &MultiTenant, n: usize, rng: &mut StdRng) -> Vec<Request> {
    // Client 0 floods; clients 1.. are light. Merge their Poisson streams.
    let rates: Vec<f64> = std::iter::once(w.flood_rate_per_s)
        .chain(std::iter::repeat_n(w.light_rate_per_s, w.light_clients))
        .collect();
    let names: Vec<String> = std::iter::once("flood".to_string())
        .chain((0..w.light_clients).map(|i| format!("light-{i}")))
        .collect();
    let mut next: Vec<u64> = rates.iter().map(|&r| gap_us(rng, r)).collect();
    (0..n)
        .map(|i| {
            let (c, &t) = next
                .iter()
                .enumerate()
                .min_by_key(|(c, t)| (**t, *c))
                .expect("at least the flooding client");
            next[c] = t + gap_us(rng, rates[c]);
            let prompt = vec![Segment::named(&[QUESTION, i as u64], w.input_len)];
            let output = Segment::named(&[OUTPUT, i as u64], w.output_len);
            let mut r = plain(t, &names[c], &names[c], prompt, output);
            prop(&mut r.props, "client", PropValue::Str(names[c].clone()));
            let weight = if c == 0 { 1.0 } else { w.light_weight };
            prop(&mut r.props, "weight", PropValue::Float(weight));
            r
        })
        .collect()
}

fn deadline_mix(w: &DeadlineMix, n: usize, rng: &mut StdRng) -> Vec<Request> {
    let mut t = 0;
    (0..n)
        .map(|i| {
            t += gap_us(rng, w.rate_per_s);
            let tight = rng.gen_bool(w.tight_fraction.clamp(0.0, 1.0));
            let (class, ms) = if tight {
                ("tight", w.tight_ms)
            } else {
                ("loose", w.loose_ms)
            };
            let prompt = vec![Segment::named(&[QUESTION, i as u64], w.input_len)];
            let output = Segment::named(&[OUTPUT, i as u64], w.output_len);
            let mut r = plain(t, "default", class, prompt, output);
            prop(&mut r.props, "deadline-ms", PropValue::Int(ms));
            r
        })
        .collect()
}

fn priority_mix(w: &PriorityMix, n: usize, rng: &mut StdRng) -> Vec<Request> {
    let mut t = 0;
    (0..n)
        .map(|i| {
            t += gap_us(rng, w.rate_per_s);
            let high = rng.gen_bool(w.high_fraction.clamp(0.0, 1.0));
            let prompt = vec![Segment::named(&[QUESTION, i as u64], w.input_len)];
            let output = Segment::named(&[OUTPUT, i as u64], w.output_len);
            let mut r = plain(
                t,
                "default",
                if high { "high" } else { "low" },
                prompt,
                output,
            );
            prop(&mut r.props, "priority", PropValue::Int(i64::from(high)));
            r
        })
        .collect()
}

fn prefill_decode_mix(w: &PrefillDecodeMix, n: usize, rng: &mut StdRng) -> Vec<Request> {
    let mut t = 0;
    (0..n)
        .map(|i| {
            t += gap_us(rng, w.rate_per_s);
            let long = rng.gen_bool(w.long_fraction.clamp(0.0, 1.0));
            let (class, input, output) = if long {
                ("long-prompt", w.long_prompt_len, w.long_output_len)
            } else {
                ("stream", w.stream_prompt_len, w.stream_output_len)
            };
            let prompt = vec![Segment::named(&[QUESTION, i as u64], input)];
            let output = Segment::named(&[OUTPUT, i as u64], output);
            plain(t, "default", class, prompt, output)
        })
        .collect()
}

fn skewed_sessions(w: &SkewedSessions, n: usize, rng: &mut StdRng) -> Vec<Request> {
    let turns = w.turns.max(1);
    let mut out = Vec::with_capacity(n);
    let mut t = 0;
    let mut conv = 0u64;
    while out.len() < n {
        t += gap_us(rng, w.rate_per_s);
        let session = format!("sess-{conv}");
        let home = (w.hot_workers > 0 && rng.gen_bool(w.hot_fraction.clamp(0.0, 1.0)))
            .then(|| rng.gen_range(0..w.hot_workers));
        let class = if home.is_some() { "hot" } else { "spread" };
        let mut prompt = vec![Segment::named(&[SYSTEM], w.system_len)];
        for turn in 0..turns.min(n - out.len()) {
            prompt.push(Segment::named(&[USER, conv, turn as u64], w.new_tokens));
            let output = Segment::named(&[OUTPUT, conv, turn as u64], w.output_len);
            let mut r = plain(t, "default", class, prompt.clone(), output);
            prop(&mut r.props, "session", PropValue::Str(session.clone()));
            match (turn, home) {
                (0, Some(h)) => prop(&mut r.props, "pin", PropValue::Str(format!("w{h}"))),
                (0, None) => {}
                _ => r.follows = Some(next_turn(rng, out.len() - 1, w.think_ms)),
            }
            prompt.push(output);
            out.push(r);
        }
        conv += 1;
    }
    out
}

fn diurnal(w: &Diurnal, n: usize, rng: &mut StdRng) -> Vec<Request> {
    let peak = w.peak_rate_per_s.max(w.low_rate_per_s).max(1e-9);
    let mut t = 0;
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        t += gap_us(rng, peak);
        let keep: f64 = rng.gen();
        if keep * peak >= w.rate_at(t) {
            continue;
        }
        let i = out.len() as u64;
        let prompt = vec![Segment::named(&[QUESTION, i], w.input_len)];
        let output = Segment::named(&[OUTPUT, i], w.output_len);
        out.push(plain(t, "default", "default", prompt, output));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn overrides(items: &[&str]) -> Vec<String> {
        items.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn skewed_sessions_pin_only_opening_turns_to_the_hot_workers() {
        let spec = WorkloadSpec::named("skewed-sessions")
            .and_then(|w| w.with_overrides(&overrides(&["hot_workers=2", "hot_fraction=0.8"])))
            .expect("valid overrides");
        let reqs = spec.generate(400, 3);
        assert_eq!(reqs.len(), 400);
        let (mut opening, mut pinned) = (0, 0);
        for (i, r) in reqs.iter().enumerate() {
            assert!(r.props.str("session").is_some());
            assert_eq!(r.output_len(), 1024);
            match r.follows {
                None => {
                    opening += 1;
                    if let Some(pin) = r.props.str("pin") {
                        pinned += 1;
                        assert!(pin == "w0" || pin == "w1", "{pin}");
                        assert_eq!(r.class, "hot");
                    }
                }
                Some(f) => {
                    assert_eq!(r.props.str("pin"), None, "later turns are not pinned");
                    assert_eq!(f.request, i - 1);
                    assert!(r.continues(&reqs[i - 1]));
                    assert_eq!(r.class, reqs[i - 1].class);
                }
            }
        }
        assert_eq!(opening, 100, "4 turns a session");
        // 80% of 100 sessions open pinned, give or take the draw.
        assert!((65..=92).contains(&pinned), "{pinned}");
    }

    #[test]
    fn diurnal_arrivals_follow_the_day() {
        let spec = WorkloadSpec::named("diurnal")
            .and_then(|w| w.with_overrides(&overrides(&["day_ms=100000"])))
            .expect("valid override");
        let WorkloadSpec::Diurnal(d) = &spec else {
            panic!("{spec:?}");
        };
        assert_eq!(d.rate_at(0), d.low_rate_per_s);
        assert!((d.rate_at(50_000_000) - d.peak_rate_per_s).abs() < 1e-9);
        // Two days at a mean of 5.5 requests/s: about 1,100.
        let reqs = spec.generate(1100, 4);
        let mut per_tenth = [0usize; 10];
        for r in reqs.iter().filter(|r| r.arrival_us < 100_000_000) {
            per_tenth[(r.arrival_us / 10_000_000) as usize] += 1;
        }
        // Expected per tenth of a day: 10 s x the mean rate over it (1.4 at
        // the edges, 9.6 around the peak).
        assert!(per_tenth[0] < 30 && per_tenth[9] < 30, "{per_tenth:?}");
        assert!(per_tenth[4] > 70 && per_tenth[5] > 70, "{per_tenth:?}");
        assert!(reqs.windows(2).all(|p| p[0].arrival_us <= p[1].arrival_us));
    }

    #[test]
    fn overrides_replace_named_parameters() {
        let spec = WorkloadSpec::named("shared-prefix")
            .and_then(|w| w.with_overrides(&overrides(&["system_len=256", "zipf=null"])))
            .expect("valid overrides");
        match spec {
            WorkloadSpec::SharedPrefix(w) => {
                assert_eq!(w.system_len, 256);
                assert_eq!(w.zipf, None);
                assert_eq!(w.groups, 32, "untouched parameters keep their defaults");
            }
            other => panic!("kind changed: {other:?}"),
        }
    }

    #[test]
    fn bad_overrides_name_the_key() {
        let base = || WorkloadSpec::named("multi-turn").expect("built-in");
        let unknown = base()
            .with_overrides(&overrides(&["groups=3"]))
            .unwrap_err();
        assert!(
            unknown.contains("`groups`") && unknown.contains("think_ms"),
            "{unknown}"
        );
        let wrong_type = base()
            .with_overrides(&overrides(&["turns=many"]))
            .unwrap_err();
        assert!(
            wrong_type.contains("multi-turn") && wrong_type.contains("bad value for `turns`"),
            "{wrong_type}"
        );
        assert!(base().with_overrides(&overrides(&["kind=x"])).is_err());
    }
}
