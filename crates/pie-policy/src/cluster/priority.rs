//! `cluster-priority`: a controller-side wait queue for a saturated cluster.
//!
//! Rule: when every candidate worker is at its `max_running` (the controller's
//! registry decides that from the workers' reports), or requests are
//! already waiting, a new request waits in the controller; when a slot frees, the
//! waiting request with the highest `priority` goes first, FCFS within a level;
//! with `[cluster] queue_order = "fair"`, within a level the request of the
//! client with the least weighted service across the whole cluster goes first
//! (then FCFS): the virtual token counters of `crate::service`, charged by
//! the controller from the `usage` of every answer it relays (`[cluster.fair]`
//! `input_weight`, `output_weight`; the `weight` prop divides), so a client
//! cannot multiply its share by spreading requests over workers, sending long
//! prompts or asking for long answers.
//! At most `[cluster] max_queued` requests wait; one more is refused with 429.
//! Props read: `priority` (int, default 0), `client` (set by the controller
//! from the client's key). Config keys: `[cluster] max_queued` (default 1024),
//! `queue_order` ("priority" or "fair"). Invariant (tested): pops come out by
//! priority, then arrival (then, under "fair", least service before
//! arrival), and the queue never holds more than `max_queued`.
//!
//! The queue is generic over what waits (the controller stores a wake-up handle),
//! so it is pure and the simulator can reuse it.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use pie_core::Props;
use serde::{Deserialize, Serialize};

use super::Reject;

/// How waiting requests of one priority level are ordered.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum QueueOrder {
    /// First come, first served.
    #[default]
    Priority,
    /// The client with the least weighted service cluster-wide first.
    Fair,
}

pub const DEFAULT_MAX_QUEUED: usize = 1024;

struct Waiting<T> {
    priority: i64,
    arrival: u64,
    client: String,
    item: T,
}

impl<T> PartialEq for Waiting<T> {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl<T> Eq for Waiting<T> {}
impl<T> PartialOrd for Waiting<T> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl<T> Ord for Waiting<T> {
    /// Max-heap: higher priority first, then earlier arrival.
    fn cmp(&self, other: &Self) -> Ordering {
        self.priority
            .cmp(&other.priority)
            .then_with(|| other.arrival.cmp(&self.arrival))
    }
}

pub struct PriorityQueue<T> {
    heap: BinaryHeap<Waiting<T>>,
    arrivals: u64,
    max_queued: usize,
    order: QueueOrder,
}

impl<T> PriorityQueue<T> {
    pub fn new(max_queued: usize) -> Self {
        Self {
            heap: BinaryHeap::new(),
            arrivals: 0,
            max_queued,
            order: QueueOrder::Priority,
        }
    }

    pub fn set_order(&mut self, order: QueueOrder) {
        self.order = order;
    }

    pub fn set_max_queued(&mut self, max_queued: usize) {
        self.max_queued = max_queued;
    }

    pub fn len(&self) -> usize {
        self.heap.len()
    }

    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }

    /// Queue `item` by the `priority` prop of `props`, or refuse it (429) when
    /// `max_queued` are already waiting.
    pub fn push(&mut self, props: &Props, item: T) -> Result<(), Reject> {
        if self.heap.len() >= self.max_queued {
            return Err(Reject {
                status: 429,
                message: format!(
                    "every worker is at max_running and {} requests are already waiting (max_queued); retry later",
                    self.heap.len()
                ),
            });
        }
        self.arrivals += 1;
        self.heap.push(Waiting {
            priority: props.int("priority").unwrap_or(0),
            arrival: self.arrivals,
            client: props.str("client").unwrap_or("anonymous").to_string(),
            item,
        });
        Ok(())
    }

    pub fn order(&self) -> QueueOrder {
        self.order
    }

    /// The clients with requests waiting.
    pub fn waiting_clients(&self) -> impl Iterator<Item = &str> {
        self.heap.iter().map(|w| w.client.as_str())
    }

    /// The next request to admit; `service` says how much weighted service
    /// a client received across the cluster (read only under "fair").
    pub fn pop(&mut self, service: impl Fn(&str) -> f64) -> Option<T> {
        if self.order == QueueOrder::Priority {
            return self.heap.pop().map(|w| w.item);
        }
        let mut waiting = std::mem::take(&mut self.heap).into_vec();
        let next = (0..waiting.len()).min_by(|&a, &b| {
            let (a, b) = (&waiting[a], &waiting[b]);
            b.priority
                .cmp(&a.priority)
                .then(service(&a.client).total_cmp(&service(&b.client)))
                .then(a.arrival.cmp(&b.arrival))
        })?;
        let chosen = waiting.swap_remove(next);
        self.heap = waiting.into();
        Some(chosen.item)
    }

    /// Drop waiting items that no longer want a slot (e.g. the client left).
    pub fn retain(&mut self, mut keep: impl FnMut(&T) -> bool) {
        self.heap.retain(|w| keep(&w.item));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pie_core::PropValue;
    use proptest::prelude::*;

    fn with_priority(p: i64) -> Props {
        let mut props = Props::new();
        props
            .set("priority", PropValue::Int(p))
            .expect("priority is a known int prop");
        props
    }

    #[test]
    fn bounded_with_429() {
        let mut q = PriorityQueue::new(2);
        q.push(&Props::new(), 1).expect("room");
        q.push(&Props::new(), 2).expect("room");
        let refused = q.push(&Props::new(), 3).unwrap_err();
        assert_eq!(refused.status, 429);
        assert!(
            refused.message.contains("max_queued"),
            "{}",
            refused.message
        );
        q.retain(|&i| i != 1);
        assert_eq!(q.len(), 1);
        q.push(&Props::new(), 3).expect("room after the leaver");
    }

    #[test]
    fn fair_order_serves_the_client_with_least_service_first() {
        let mut q = PriorityQueue::new(usize::MAX);
        q.set_order(QueueOrder::Fair);
        let as_client = |client: &str, priority: i64| {
            let mut props = with_priority(priority);
            props.set("client", PropValue::Str(client.into())).unwrap();
            props
        };
        for (i, client) in ["flood", "flood", "flood", "light"].iter().enumerate() {
            q.push(&as_client(client, 0), i).unwrap();
        }
        q.push(&as_client("flood", 1), 9).unwrap();
        let service = |client: &str| if client == "flood" { 500.0 } else { 10.0 };
        assert_eq!(q.pop(service), Some(9), "priority still comes first");
        assert_eq!(
            q.pop(service),
            Some(3),
            "then the light client, despite arriving last"
        );
        assert_eq!(q.pop(service), Some(0), "then FCFS");
        assert_eq!(q.waiting_clients().collect::<Vec<_>>(), ["flood", "flood"]);
        assert_eq!(q.len(), 2);
    }

    proptest! {
        #[test]
        fn pops_by_priority_then_arrival(prios in prop::collection::vec(-3i64..4, 0..60)) {
            let mut q = PriorityQueue::new(usize::MAX);
            for (i, p) in prios.iter().enumerate() {
                q.push(&with_priority(*p), i).expect("unbounded");
            }
            let order: Vec<usize> = std::iter::from_fn(|| q.pop(|_| 0.0)).collect();
            let mut want: Vec<usize> = (0..prios.len()).collect();
            want.sort_by_key(|&i| (std::cmp::Reverse(prios[i]), i));
            prop_assert_eq!(order, want);
        }
    }
}
