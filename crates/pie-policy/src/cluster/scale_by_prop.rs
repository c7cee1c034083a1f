//! `scale-by-prop`: advises how many workers each group should have, from the
//! demand of the processes whose prop names that group. It only advises: the
//! hints are published (gauges, `GET /v1/cluster/scale`) for an autoscaler.
//!
//! Rule, per group on every tick: demand = queued + running processes whose
//! `prop` has that value (processes without it fall in `default_group`); current
//! = serving workers whose `group` label equals it (unlabelled workers are in
//! `default_group`); wanted = ceil(demand / `target_load_per_worker`) clamped to
//! [`min_workers`, `max_workers`]. The published recommendation starts at current
//! (clamped) and moves ONE step a tick toward wanted: up whenever wanted is
//! higher, down only when demand < (recommended - 1) * target * (1 - hysteresis),
//! so a load that hovers at a boundary does not flap. After a step, no further
//! step while current differs from the recommendation (the previous step is
//! pending), until `pending_timeout_ms` has passed since it. Like Dynamo's
//! planner, one step at a time, as KEDA/HPA would then act on it. Keep
//! `pending_timeout_ms` above the time a new worker takes to start: a step
//! that times out while its worker boots is followed by another (the
//! simulator's autoscaler showed the fleet flapping so).
//!
//! Reason codes: `load-above-target` (a step up, or a new group's first
//! recommendation above its workers), `below-min-workers` (that, but only
//! `min_workers` wants it), `load-below-target`, `load-within-hysteresis`,
//! `previous-step-pending`, `at-target`.
//! A hint is emitted when a group's (current, recommended, reason code) changes,
//! so the action log holds changes, not a line per tick. At most `max_groups`
//! groups are tracked: a prop value is client input, and every group is a
//! Prometheus label; further values count toward `default_group`.
//!
//! Props read: the configured `prop` (any type; its value as text names the
//! group). Config keys (`[cluster.scale-by-prop]`): `prop` (default "tier"),
//! `default_group` ("default"), `target_load_per_worker` (8), `min_workers`
//! (1), `max_workers` (16), `hysteresis` (0.2), `pending_timeout_ms` (60000),
//! `max_groups` (32), `dry_run` (false; honoured by the runner).
//!
//! Invariant (tested, with a property test): each tick the recommendation moves
//! by at most one and stays in [min, max]; a step down happens only below the
//! hysteresis threshold; no step while the previous one is pending and not timed
//! out; one group per distinct prop value.

use std::collections::{BTreeMap, BTreeSet};

use pie_core::PropValue;
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::actions::{Action, ClusterActor, ClusterSnapshot, Decision, ScaleHint};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ScaleByPropConfig {
    /// Record decisions without publishing them (applied by `ActorRunner`).
    pub dry_run: bool,
    pub prop: String,
    pub default_group: String,
    pub target_load_per_worker: f64,
    pub min_workers: usize,
    pub max_workers: usize,
    pub hysteresis: f64,
    pub pending_timeout_ms: u64,
    pub max_groups: usize,
}

impl Default for ScaleByPropConfig {
    fn default() -> Self {
        Self {
            dry_run: false,
            prop: "tier".into(),
            default_group: "default".into(),
            target_load_per_worker: 8.0,
            min_workers: 1,
            max_workers: 16,
            hysteresis: 0.2,
            pending_timeout_ms: 60_000,
            max_groups: 32,
        }
    }
}

impl ScaleByPropConfig {
    /// An error names the offending key.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.target_load_per_worker.is_finite() && self.target_load_per_worker > 0.0) {
            return Err("target_load_per_worker: must be a number > 0".into());
        }
        if self.min_workers > self.max_workers {
            return Err(format!(
                "min_workers: {} is above max_workers {}",
                self.min_workers, self.max_workers
            ));
        }
        if !(0.0..1.0).contains(&self.hysteresis) {
            return Err("hysteresis: must be in [0, 1)".into());
        }
        if self.max_groups == 0 {
            return Err("max_groups: must be positive".into());
        }
        Ok(())
    }
}

/// Why a group's recommendation is what it is.
const UP: &str = "load-above-target";
const DOWN: &str = "load-below-target";
const HOLD: &str = "at-target";
const BAND: &str = "load-within-hysteresis";
/// A group's first recommendation is above its workers only for `min_workers`.
const MIN: &str = "below-min-workers";
const PENDING: &str = "previous-step-pending";

#[derive(Clone, Debug, PartialEq, Serialize)]
struct Group {
    recommended: usize,
    current: usize,
    demand: usize,
    /// When the last step was taken (the pending guard's clock).
    stepped_at_ms: Option<u64>,
    code: &'static str,
}

#[derive(Debug)]
pub struct ScaleByProp {
    config: ScaleByPropConfig,
    groups: BTreeMap<String, Group>,
}

impl ScaleByProp {
    pub fn new(config: ScaleByPropConfig) -> Self {
        Self {
            config,
            groups: BTreeMap::new(),
        }
    }

    /// The group a label or prop value falls in: itself if tracked or if there
    /// is room for one more group, else the default group.
    fn group_of(&self, value: Option<String>, new: &mut BTreeSet<String>) -> String {
        let Some(v) = value else {
            return self.config.default_group.clone();
        };
        if self.groups.contains_key(&v) || new.contains(&v) {
            return v;
        }
        // The default group always has a place of its own.
        let tracked = self.groups.len()
            + new.len()
            + usize::from(
                !self.groups.contains_key(&self.config.default_group)
                    && !new.contains(&self.config.default_group),
            );
        if tracked < self.config.max_groups {
            new.insert(v.clone());
            v
        } else {
            self.config.default_group.clone()
        }
    }

    /// The next recommendation for one group, and its reason code, when
    /// its load wants `by_load` workers (`wanted` once clamped).
    fn step(&self, now_ms: u64, g: &Group, by_load: usize, wanted: usize) -> (usize, &'static str) {
        let c = &self.config;
        let pending = g.stepped_at_ms.is_some_and(|at| {
            g.current != g.recommended && now_ms.saturating_sub(at) < c.pending_timeout_ms
        });
        if wanted == g.recommended {
            // A new group starts at its workers clamped to the bounds: above
            // them, its first hint scales up.
            let first_up = g.stepped_at_ms.is_none() && g.current < g.recommended;
            let code = match () {
                _ if !first_up => HOLD,
                _ if by_load < wanted => MIN,
                _ => UP,
            };
            return (g.recommended, code);
        }
        if pending {
            return (g.recommended, PENDING);
        }
        if wanted > g.recommended {
            return (g.recommended + 1, UP);
        }
        let threshold = g.recommended.saturating_sub(1) as f64
            * c.target_load_per_worker
            * (1.0 - c.hysteresis);
        if (g.demand as f64) < threshold {
            (g.recommended - 1, DOWN)
        } else {
            (g.recommended, BAND)
        }
    }
}

fn prop_text(v: &PropValue) -> String {
    match v {
        PropValue::Str(s) => s.clone(),
        PropValue::Int(i) => i.to_string(),
        PropValue::Float(f) => f.to_string(),
        PropValue::Bool(b) => b.to_string(),
    }
}

impl ClusterActor for ScaleByProp {
    fn name(&self) -> &'static str {
        "scale-by-prop"
    }

    fn on_tick(&mut self, now_ms: u64, snapshot: &ClusterSnapshot) -> Vec<Decision> {
        let mut new = BTreeSet::new();
        let mut demand: BTreeMap<String, usize> = BTreeMap::new();
        let mut current: BTreeMap<String, usize> = BTreeMap::new();
        for w in &snapshot.workers {
            let g = self.group_of(w.group.clone(), &mut new);
            let n = current.entry(g.clone()).or_insert(0);
            if w.serving() {
                *n += 1;
            }
            demand.entry(g).or_insert(0);
        }
        for p in &snapshot.processes {
            let value = p.props.get(&self.config.prop).map(prop_text);
            *demand.entry(self.group_of(value, &mut new)).or_insert(0) += 1;
        }
        for g in self.groups.keys() {
            demand.entry(g.clone()).or_insert(0);
        }
        let (min, max) = (self.config.min_workers, self.config.max_workers);
        let mut out = Vec::new();
        for (name, d) in demand {
            let now_current = current.get(&name).copied().unwrap_or(0);
            let by_load = (d as f64 / self.config.target_load_per_worker).ceil() as usize;
            let wanted = by_load.clamp(min, max);
            let prev = self.groups.get(&name).cloned().unwrap_or(Group {
                recommended: now_current.clamp(min, max),
                current: now_current,
                demand: d,
                stepped_at_ms: None,
                code: "",
            });
            let seen = Group {
                current: now_current,
                demand: d,
                ..prev.clone()
            };
            let (recommended, code) = self.step(now_ms, &seen, by_load, wanted);
            let next = Group {
                recommended,
                code,
                stepped_at_ms: if recommended != seen.recommended {
                    Some(now_ms)
                } else {
                    seen.stepped_at_ms
                },
                ..seen
            };
            let changed = (prev.current, prev.recommended, prev.code)
                != (next.current, next.recommended, next.code);
            if changed {
                out.push(Decision {
                    action: Action::ScaleHint(ScaleHint {
                        group: name.clone(),
                        current: next.current,
                        recommended: next.recommended,
                        signal: "load".into(),
                        value: d as f64,
                    }),
                    reason: format!(
                        "{code}: {d} processes for {now_current} workers at {} per worker \
                         wants {wanted} (clamped to {min}..={max}); recommending {recommended}",
                        self.config.target_load_per_worker
                    ),
                });
            }
            self.groups.insert(name, next);
        }
        out
    }

    fn summary(&self) -> serde_json::Value {
        json!({
            "prop": self.config.prop,
            "groups": self.groups,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::actions::{ProcessState, WorkerState};
    use pie_core::Props;
    use proptest::prelude::*;

    fn config() -> ScaleByPropConfig {
        ScaleByPropConfig {
            target_load_per_worker: 2.0,
            min_workers: 1,
            max_workers: 10,
            hysteresis: 0.25,
            pending_timeout_ms: 1000,
            ..ScaleByPropConfig::default()
        }
    }

    /// `workers` per group label and `demand` processes per tier value.
    fn snap(workers: &[(&str, usize)], demand: &[(Option<&str>, usize)]) -> ClusterSnapshot {
        let mut s = ClusterSnapshot::default();
        for &(g, n) in workers {
            for i in 0..n {
                s.workers.push(WorkerState {
                    name: format!("{g}-{i}"),
                    group: (g != "default").then(|| g.to_string()),
                    healthy: true,
                    ..WorkerState::default()
                });
            }
        }
        for &(tier, n) in demand {
            for i in 0..n {
                let mut props = Props::new();
                if let Some(t) = tier {
                    props.set("tier", PropValue::Str(t.into())).expect("valid");
                }
                s.processes.push(ProcessState {
                    id: format!("{tier:?}-{i}"),
                    worker: None,
                    props,
                });
            }
        }
        s
    }

    fn hint(d: &[Decision], group: &str) -> Option<ScaleHint> {
        d.iter().find_map(|d| match &d.action {
            Action::ScaleHint(h) if h.group == group => Some(h.clone()),
            _ => None,
        })
    }

    fn rec(a: &ScaleByProp, group: &str) -> usize {
        a.groups[group].recommended
    }

    #[test]
    fn steps_one_at_a_time_and_waits_for_the_pending_step() {
        let mut a = ScaleByProp::new(config());
        // 9 gold processes at 2 per worker want 5 workers; gold has 1.
        let d = a.on_tick(0, &snap(&[("gold", 1)], &[(Some("gold"), 9)]));
        let h = hint(&d, "gold").expect("a hint");
        assert_eq!((h.current, h.recommended, h.value), (1, 2, 9.0));
        assert!(d[0].reason.starts_with(UP) || d[1].reason.starts_with(UP));
        // Current has not followed: the step is pending.
        a.on_tick(100, &snap(&[("gold", 1)], &[(Some("gold"), 9)]));
        assert_eq!(rec(&a, "gold"), 2);
        assert_eq!(a.groups["gold"].code, PENDING);
        // The autoscaler added a worker: the next step.
        a.on_tick(200, &snap(&[("gold", 2)], &[(Some("gold"), 9)]));
        assert_eq!(rec(&a, "gold"), 3);
        // Nobody follows: after the timeout the steps go on.
        a.on_tick(900, &snap(&[("gold", 2)], &[(Some("gold"), 9)]));
        assert_eq!(rec(&a, "gold"), 3);
        a.on_tick(1200, &snap(&[("gold", 2)], &[(Some("gold"), 9)]));
        assert_eq!(rec(&a, "gold"), 4);
    }

    /// A group without workers that wants one says it scales up (it once
    /// said `at-target`, as its first recommendation starts at `min_workers`).
    #[test]
    fn a_group_going_from_no_worker_to_one_says_it_scales_up() {
        let mut a = ScaleByProp::new(config());
        let d = a.on_tick(0, &snap(&[], &[(Some("gold"), 2)]));
        let h = hint(&d, "gold").expect("a hint");
        assert_eq!((h.current, h.recommended), (0, 1));
        assert!(d[0].reason.starts_with(UP), "{}", d[0].reason);
        let mut a = ScaleByProp::new(ScaleByPropConfig {
            min_workers: 2,
            ..config()
        });
        let d = a.on_tick(0, &snap(&[], &[(Some("gold"), 2)]));
        assert_eq!(hint(&d, "gold").map(|h| h.recommended), Some(2));
        assert!(d[0].reason.starts_with(MIN), "{}", d[0].reason);
        // Once the workers came, the group is at its target.
        let d = a.on_tick(10, &snap(&[("gold", 2)], &[(Some("gold"), 2)]));
        assert!(d[0].reason.starts_with(HOLD), "{}", d[0].reason);
    }

    #[test]
    fn scales_down_only_below_the_hysteresis_band() {
        let mut a = ScaleByProp::new(config());
        // Start at 4 workers, 4 wanted (8 processes).
        a.on_tick(0, &snap(&[("gold", 4)], &[(Some("gold"), 8)]));
        assert_eq!(rec(&a, "gold"), 4);
        // 5 processes want 3, but 5 >= (4 - 1) * 2 * 0.75 = 4.5: hold.
        let d = a.on_tick(10, &snap(&[("gold", 4)], &[(Some("gold"), 5)]));
        assert_eq!(rec(&a, "gold"), 4);
        let held = hint(&d, "gold").expect("the reason code changed");
        assert_eq!(held.recommended, 4);
        assert!(d[0].reason.starts_with(BAND), "{}", d[0].reason);
        // 4 < 4.5: one step down.
        a.on_tick(20, &snap(&[("gold", 4)], &[(Some("gold"), 4)]));
        assert_eq!(rec(&a, "gold"), 3);
    }

    #[test]
    fn one_group_per_prop_value_and_the_default_group() {
        let mut a = ScaleByProp::new(config());
        let d = a.on_tick(
            0,
            &snap(
                &[("gold", 1), ("default", 2)],
                &[(Some("gold"), 1), (Some("silver"), 3), (None, 1)],
            ),
        );
        let groups: Vec<&str> = a.groups.keys().map(String::as_str).collect();
        assert_eq!(groups, ["default", "gold", "silver"]);
        assert_eq!(a.groups["default"].current, 2);
        assert_eq!(a.groups["silver"].current, 0);
        assert_eq!(a.groups["silver"].demand, 3);
        assert_eq!(d.len(), 3, "a first hint for every group");
        // Nothing changed: nothing emitted.
        let again = a.on_tick(
            1,
            &snap(
                &[("gold", 1), ("default", 2)],
                &[(Some("gold"), 1), (Some("silver"), 3), (None, 1)],
            ),
        );
        assert_eq!(hint(&again, "gold"), None);
    }

    #[test]
    fn prop_values_beyond_max_groups_count_toward_the_default_group() {
        let mut a = ScaleByProp::new(ScaleByPropConfig {
            max_groups: 2,
            ..config()
        });
        a.on_tick(0, &snap(&[], &[(Some("a"), 1), (Some("b"), 2)]));
        assert_eq!(a.groups.len(), 2);
        assert_eq!(a.groups["a"].demand, 1);
        assert_eq!(a.groups["default"].demand, 2);
    }

    #[test]
    fn bad_configs_name_the_key() {
        let bad = |c: ScaleByPropConfig, key: &str| {
            let e = c.validate().unwrap_err();
            assert!(e.starts_with(key), "{e}");
        };
        bad(
            ScaleByPropConfig {
                target_load_per_worker: 0.0,
                ..config()
            },
            "target_load_per_worker",
        );
        bad(
            ScaleByPropConfig {
                min_workers: 11,
                ..config()
            },
            "min_workers",
        );
        bad(
            ScaleByPropConfig {
                hysteresis: 1.0,
                ..config()
            },
            "hysteresis",
        );
        assert_eq!(config().validate(), Ok(()));
    }

    proptest! {
        #[test]
        fn invariant_holds_for_any_demand_and_fleet(
            ticks in prop::collection::vec(
                (0u64..400, 0usize..40, 0usize..40, 0usize..12, 0usize..12), 1..60),
        ) {
            let c = config();
            let mut a = ScaleByProp::new(c.clone());
            let mut now = 0;
            for (dt, gold, silver, gold_workers, silver_workers) in ticks {
                now += dt;
                let before: BTreeMap<String, Group> = a.groups.clone();
                let s = snap(
                    &[("gold", gold_workers), ("silver", silver_workers)],
                    &[(Some("gold"), gold), (Some("silver"), silver)],
                );
                let decisions = a.on_tick(now, &s);
                let mut hinted: Vec<&str> = decisions
                    .iter()
                    .filter_map(|d| match &d.action {
                        Action::ScaleHint(h) => Some(h.group.as_str()),
                        _ => None,
                    })
                    .collect();
                let n = hinted.len();
                hinted.sort_unstable();
                hinted.dedup();
                prop_assert_eq!(hinted.len(), n, "one hint per group");
                prop_assert!(a.groups.len() <= 3, "gold, silver, default");
                for (name, g) in &a.groups {
                    prop_assert!((c.min_workers..=c.max_workers).contains(&g.recommended));
                    let Some(b) = before.get(name) else { continue };
                    prop_assert!(g.recommended.abs_diff(b.recommended) <= 1, "one step");
                    if g.recommended != b.recommended {
                        let pending = b.stepped_at_ms.is_some_and(|at| {
                            g.current != b.recommended && now - at < c.pending_timeout_ms
                        });
                        prop_assert!(!pending, "stepped while pending");
                    }
                    if g.recommended < b.recommended {
                        let threshold = (b.recommended - 1) as f64
                            * c.target_load_per_worker * (1.0 - c.hysteresis);
                        prop_assert!((g.demand as f64) < threshold, "down inside the band");
                    }
                }
            }
        }
    }
}
