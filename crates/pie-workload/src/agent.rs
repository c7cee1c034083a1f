//! `agent`: the ReAct agent loop of `scripts/agent-bench.py` as a workload,
//! so that `pie bench` and `pie-sim` run it too. `agents` agents start
//! together (a closed population: when one ends, the next starts in its
//! place, until the requests asked for are drawn); agent `a` runs
//! `steps[a % steps.len()]` steps of `output_len[a % output_len.len()]`
//! tokens each (the step counts and output lengths `scripts/agent-bench.py`
//! measured for its first agents, taken in turn: agents whose answers are
//! short and long keep contexts of different sizes, which a mean length
//! does not, and a small pool keeps more of the short ones). A step's
//! prompt is the agent's whole history: a system prompt every agent
//! shares, its question, then per earlier step the model's output and the
//! tool's observation. The next step
//! arrives a tool latency (uniform in `latency_min_ms..=latency_max_ms`)
//! after the previous one finished. With `keep_ms` above 0 every step
//! carries a `session` and `keep-ms` (the client loop with `keep-session`);
//! with `release_at_end` too, the last step's `keep-ms` is 0, which ends
//! the session's retention when it finishes (the `agent` inferlet: its
//! context held across its tool calls, and freed when its process ends);
//! with 0, the plain loop.

use pie_core::PropValue;
use rand::rngs::StdRng;
use rand::Rng;
use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize};

use crate::request::{prop, Follow, Request, Segment};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Agent {
    pub agents: usize,
    /// Each agent's number of steps, in turn (at least one each).
    #[serde(deserialize_with = "one_or_many")]
    pub steps: Vec<usize>,
    pub system_len: u32,
    pub question_len: u32,
    /// Each agent's output per step (a thought and an action), in turn: one
    /// length (`output_len=23`) or a list (`output_len=[22,27]`).
    #[serde(deserialize_with = "one_or_many")]
    pub output_len: Vec<u32>,
    /// Each tool result, sent back as the next step's new tokens.
    pub observation_len: u32,
    pub latency_min_ms: f64,
    pub latency_max_ms: f64,
    /// The `keep-ms` prop of every step, with a `session` (0: neither).
    pub keep_ms: i64,
    /// The last step keeps nothing (`keep-ms` 0), freeing the session's
    /// pages as it ends, as an inferlet's process does.
    #[serde(default)]
    pub release_at_end: bool,
}

impl Agent {
    /// The shape `scripts/agent-bench.py` measures on the default model: a
    /// first prompt of 100 tokens (an 84-token protocol and a 16-token
    /// question), steps of 23 tokens answered by 23-token observations (the
    /// template's tokens included) after 100-2000 ms, six steps each.
    pub fn default_shape() -> Self {
        Self {
            agents: 32,
            steps: vec![6],
            system_len: 84,
            question_len: 16,
            output_len: vec![23],
            observation_len: 23,
            latency_min_ms: 100.0,
            latency_max_ms: 2000.0,
            keep_ms: 0,
            release_at_end: false,
        }
    }
}

/// Agent `a`'s entry of a per-agent list (0 for an empty one).
fn in_turn<T: Copy + Default>(list: &[T], a: u64) -> T {
    let at = a as usize % list.len().max(1);
    list.get(at).copied().unwrap_or_default()
}

/// A list parameter given as one value (`output_len=23`) or several.
fn one_or_many<'de, D, T>(d: D) -> Result<Vec<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany<T> {
        One(T),
        Many(Vec<T>),
    }
    match OneOrMany::deserialize(d) {
        Ok(OneOrMany::One(v)) => Ok(vec![v]),
        Ok(OneOrMany::Many(vs)) => Ok(vs),
        Err(_) => Err(D::Error::custom("expected one value or a list of values")),
    }
}

/// Every agent's client: one, as `scripts/agent-bench.py`'s agents are
/// (`fair` then serves the steps first come first served, not the agents
/// in turn, which would keep every agent's context in play at once).
const CLIENT: &str = "agents";

/// Segment kinds of this workload (apart from the other workloads').
const AGENT_SYSTEM: u64 = 101;
const AGENT_QUESTION: u64 = 102;
const AGENT_STEP: u64 = 103;
const AGENT_OBSERVATION: u64 = 104;

pub(crate) fn agent(w: &Agent, n: usize, rng: &mut StdRng) -> Vec<Request> {
    let mut out: Vec<Request> = Vec::with_capacity(n);
    let (low, high) = (
        w.latency_min_ms.min(w.latency_max_ms),
        w.latency_max_ms.max(w.latency_min_ms),
    );
    let slots = w.agents.max(1);
    // Each slot's last request so far: its next agent starts when it ends.
    let mut last: Vec<Option<usize>> = vec![None; slots];
    for a in 0u64.. {
        let name = format!("agent-{a}");
        let slot = a as usize % slots;
        let steps = in_turn(&w.steps, a).max(1);
        let output_len = in_turn(&w.output_len, a);
        let mut prompt = vec![
            Segment::named(&[AGENT_SYSTEM], w.system_len),
            Segment::named(&[AGENT_QUESTION, a], w.question_len),
        ];
        for step in 0..steps as u64 {
            if out.len() == n {
                return out;
            }
            let output = Segment::named(&[AGENT_STEP, a, step], output_len);
            let mut r = Request {
                arrival_us: 0,
                follows: None,
                client: CLIENT.to_string(),
                class: format!("step-{step}"),
                prompt: prompt.clone(),
                output,
                props: Default::default(),
            };
            if w.keep_ms > 0 {
                let final_step = step + 1 == steps as u64;
                let keep_ms = if final_step && w.release_at_end {
                    0
                } else {
                    w.keep_ms
                };
                prop(&mut r.props, "session", PropValue::Str(name.clone()));
                prop(&mut r.props, "keep-ms", PropValue::Int(keep_ms));
            }
            r.follows = match (step, last[slot]) {
                (0, None) => None,
                (0, Some(request)) => Some(Follow {
                    request,
                    think_us: 0,
                }),
                _ => Some(Follow {
                    request: out.len() - 1,
                    think_us: (rng.gen_range(low..=high) * 1000.0) as u64,
                }),
            };
            last[slot] = Some(out.len());
            prompt.push(output);
            prompt.push(Segment::named(
                &[AGENT_OBSERVATION, a, step],
                w.observation_len,
            ));
            out.push(r);
        }
    }
    out
}

#[cfg(test)]
mod tests {

    use crate::request::Follow;
    use crate::WorkloadSpec;

    fn agent(overrides: &[&str]) -> (WorkloadSpec, super::Agent) {
        let overrides: Vec<String> = overrides.iter().map(|o| o.to_string()).collect();
        let spec = (WorkloadSpec::named("agent").unwrap())
            .with_overrides(&overrides)
            .unwrap();
        match &spec {
            WorkloadSpec::Agent(w) => (spec.clone(), w.clone()),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn each_step_continues_its_agent_after_a_tool_latency() {
        let (spec, w) = agent(&["steps=[6]"]);
        let steps = w.steps[0];
        let n = (w.agents + 1) * steps;
        let requests = spec.generate(n, 7);
        assert_eq!(requests.len(), n);
        assert_eq!(requests, spec.generate(n, 7), "seeded");
        for (i, r) in requests.iter().enumerate() {
            assert!(r.props.str("session").is_none(), "plain by default");
            let f = r.follows;
            match (i % steps, i / steps) {
                (0, agent) if agent < w.agents => assert_eq!(f, None),
                // The next agent takes the first one's place when it ends.
                (0, _) => assert_eq!(
                    f,
                    Some(Follow {
                        request: steps - 1,
                        think_us: 0
                    })
                ),
                _ => {
                    let f = f.expect("a later step follows");
                    assert_eq!(f.request, i - 1);
                    assert!(r.continues(&requests[i - 1]), "step {i} holds the history");
                    let ms = f.think_us as f64 / 1000.0;
                    assert!((w.latency_min_ms..=w.latency_max_ms).contains(&ms), "{ms}");
                }
            }
        }
        // Agents share the system prompt, not their questions.
        let (a, b) = (&requests[0], &requests[steps]);
        assert_eq!(a.prompt[0], b.prompt[0]);
        assert_ne!(a.prompt[1], b.prompt[1]);
        let (session, _) = agent(&["steps=[6]", "keep_ms=5000", "agents=2"]);
        let requests = session.generate(2 * steps, 7);
        assert_eq!(requests[steps].props.str("session"), Some("agent-1"));
        assert_eq!(requests[0].props.int("keep-ms"), Some(5000));
        assert_eq!(requests[steps - 1].props.int("keep-ms"), Some(5000));
        let (inferlet, _) = agent(&["steps=[6]", "keep_ms=5000", "release_at_end=true"]);
        let keeps: Vec<_> = (inferlet.generate(steps + 1, 7).iter())
            .map(|r| (r.props.str("session").is_some(), r.props.int("keep-ms")))
            .collect();
        let (held, last) = ((true, Some(5000)), (true, Some(0)));
        assert_eq!(keeps, [held, held, held, held, held, last, held]);
    }

    /// Agent `a` runs `steps[a % len]` steps: its requests are that many
    /// classes `step-0..`, and the next agent's first step starts anew.
    #[test]
    fn agents_take_their_step_counts_in_turn() {
        let (spec, _) = agent(&["steps=[3,1]", "agents=1"]);
        let steps: Vec<String> = (spec.generate(9, 3).into_iter())
            .map(|r| r.class.replace("step-", ""))
            .collect();
        assert_eq!(steps.concat(), "012001200");
    }

    /// Agent `a`'s steps generate `output_len[a % len]` tokens each; one
    /// length is every agent's.
    #[test]
    fn agents_take_their_output_lengths_in_turn() {
        let (spec, w) = agent(&["steps=2", "agents=3", "output_len=[5,9]"]);
        assert_eq!(w.steps, [2]);
        let lengths: Vec<u32> = (spec.generate(8, 3).iter()).map(|r| r.output.len).collect();
        assert_eq!(lengths, [5, 5, 9, 9, 5, 5, 9, 9]);
        let (_, w) = agent(&["output_len=25"]);
        assert_eq!(w.output_len, [25]);
        let err = WorkloadSpec::named("agent")
            .unwrap()
            .with_overrides(&["output_len=\"long\"".to_string()])
            .unwrap_err();
        assert!(
            err.contains("`output_len`") && err.contains("one value or a list"),
            "{err}"
        );
    }
}
