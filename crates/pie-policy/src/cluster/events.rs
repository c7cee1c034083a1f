//! The fleet's events (`WorkerJoined`, `WorkerLeft`, `WorkerDraining`) from
//! two views of the workers, one rule for every executor: the controller
//! between two polls of its registry, the simulator whenever its fleet
//! changes. Pure: the views in, the events out.

use super::actions::{ClusterEvent, WorkerState};

/// A worker as the fleet's events see it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WorkerHealth {
    pub name: String,
    /// Answers its health check (a booting worker does not).
    pub healthy: bool,
    pub draining: bool,
}

impl From<&WorkerState> for WorkerHealth {
    fn from(w: &WorkerState) -> Self {
        Self {
            name: w.name.clone(),
            healthy: w.healthy,
            draining: w.draining,
        }
    }
}

/// Workers that became healthy (joined) or stopped being so (left), or
/// started draining, between `before` and `after`, in `after`'s order; then
/// the healthy workers of `before` gone from `after` (expired, deregistered
/// or stopped), which have left too.
pub fn health_events(before: &[WorkerHealth], after: &[WorkerHealth]) -> Vec<ClusterEvent> {
    let changed = after.iter().filter_map(|w| {
        let was = before.iter().find(|b| b.name == w.name);
        let (was_healthy, was_draining) = was.map_or((false, false), |b| (b.healthy, b.draining));
        match (was_healthy, w.healthy) {
            (false, true) => Some(ClusterEvent::WorkerJoined {
                worker: w.name.clone(),
            }),
            (true, false) => Some(ClusterEvent::WorkerLeft {
                worker: w.name.clone(),
            }),
            _ if w.draining && !was_draining => Some(ClusterEvent::WorkerDraining {
                worker: w.name.clone(),
            }),
            _ => None,
        }
    });
    let gone = before
        .iter()
        .filter(|b| b.healthy && !after.iter().any(|w| w.name == b.name))
        .map(|b| ClusterEvent::WorkerLeft {
            worker: b.name.clone(),
        });
    changed.chain(gone).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(name: &str, healthy: bool, draining: bool) -> WorkerHealth {
        WorkerHealth {
            name: name.into(),
            healthy,
            draining,
        }
    }

    fn left(w: &str) -> ClusterEvent {
        ClusterEvent::WorkerLeft { worker: w.into() }
    }

    #[test]
    fn a_healthy_worker_gone_from_the_list_has_left() {
        let before = [
            worker("w0", true, false),
            worker("w1", true, false),
            worker("w2", false, false),
        ];
        let after = [worker("w0", false, false), worker("w3", true, false)];
        assert_eq!(
            health_events(&before, &after),
            vec![
                left("w0"),
                ClusterEvent::WorkerJoined {
                    worker: "w3".into()
                },
                left("w1"),
            ],
            "w1 expired while healthy; w2 was not healthy: no event"
        );
    }

    #[test]
    fn draining_is_told_once_and_a_drained_worker_leaves() {
        let serving = [worker("w0", true, false), worker("w1", true, false)];
        let draining = [worker("w0", true, false), worker("w1", true, true)];
        let drained = [worker("w0", true, false)];
        let draining_w1 = ClusterEvent::WorkerDraining {
            worker: "w1".into(),
        };
        assert_eq!(health_events(&serving, &draining), vec![draining_w1]);
        assert!(health_events(&draining, &draining).is_empty());
        assert_eq!(health_events(&draining, &drained), vec![left("w1")]);
        // A worker that joins draining has joined (no draining event).
        assert_eq!(
            health_events(&[], &[worker("w2", true, true)]),
            vec![ClusterEvent::WorkerJoined {
                worker: "w2".into()
            }]
        );
        // Booting (listed, not healthy): nothing until it serves.
        assert!(health_events(&[], &[worker("w3", false, false)]).is_empty());
        let state = WorkerState {
            name: "w4".into(),
            healthy: true,
            draining: true,
            ..WorkerState::default()
        };
        assert_eq!(WorkerHealth::from(&state), worker("w4", true, true));
    }
}
