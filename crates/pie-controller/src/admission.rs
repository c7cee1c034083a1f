//! Admission when the cluster is saturated (`cluster-priority`): requests wait
//! in `cluster-priority`'s queue for a free running slot, in the queue's order
//! (priority, then `queue_order`), at most `max_wait_ms` (then 503 with
//! `Retry-After`); at most `max_queued` wait (then 429). A woken request holds
//! a [`SlotTicket`] until it takes its slot, so one free slot is never
//! promised twice. Under `queue_order = "fair"` the queue orders clients by
//! their weighted service ([`ServiceCounters`], `[cluster.fair]`), which
//! every relayed answer charges as it streams.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::StatusCode;
use axum::response::Response;
use pie_core::Props;
use pie_policy::cluster::{PriorityQueue, QueueOrder};
use pie_policy::ServiceCounters;
use tokio::sync::oneshot;

use crate::clients::ClientsInFlight;
use crate::config::ClusterConfig;
use crate::metrics::ControllerMetrics;
use crate::registry::Registry;
use crate::respond::retry_later;

pub struct Admission {
    /// `cluster-priority` is in the pipeline: requests wait here when every
    /// worker is at `max_running`.
    pub queueing: AtomicBool,
    pub queue: Mutex<PriorityQueue<oneshot::Sender<SlotTicket>>>,
    /// `[cluster] max_wait_ms`: the longest wait for a slot before 503.
    pub max_wait_ms: AtomicU64,
    /// Requests in flight per client (`queue_order = "fair"` reads them).
    pub clients_in_flight: ClientsInFlight,
    /// Weighted service per client, charged while `queue_order = "fair"`.
    service: Mutex<ServiceCounters>,
    charging: AtomicBool,
    /// Requests woken from the queue that have not yet claimed their slot.
    pub woken: Arc<AtomicUsize>,
}

impl Admission {
    pub fn new(cluster: &ClusterConfig) -> Self {
        let mut queue = PriorityQueue::new(cluster.max_queued);
        queue.set_order(cluster.queue_order);
        Self {
            queueing: AtomicBool::new(cluster.queueing()),
            queue: Mutex::new(queue),
            max_wait_ms: cluster.max_wait_ms.get().into(),
            clients_in_flight: ClientsInFlight::default(),
            service: Mutex::new(ServiceCounters::new(cluster.fair.clone())),
            charging: AtomicBool::new(cluster.queue_order == QueueOrder::Fair),
            woken: Arc::default(),
        }
    }

    fn lock_service(&self) -> std::sync::MutexGuard<'_, ServiceCounters> {
        self.service.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `client` received service (see [`ServiceCounters::charge`]); counted
    /// only while the queue orders by it.
    pub fn charge(&self, client: &str, weight: f64, input_tokens: usize, output_tokens: usize) {
        if self.charging.load(Ordering::Relaxed) {
            (self.lock_service()).charge(client, weight, input_tokens, output_tokens);
        }
    }

    /// A request about to be sent, whose prompt the controller counted
    /// `prompt_tokens` (0 without a tokenizer): charged once, before its
    /// answer (a non-streamed one arrives whole at the end), so a long prompt
    /// counts at once; the answer's `usage` corrects it upward.
    pub fn charge_prompt(&self, props: &Props, prompt_tokens: usize) -> usize {
        let (client, weight) = client_and_weight(props);
        self.charge(client, weight, prompt_tokens, 0);
        prompt_tokens
    }

    /// The clients' weighted service, for `GET /v1/cluster`.
    pub fn service_summary(&self) -> serde_json::Value {
        self.lock_service().summary()
    }

    /// A reloaded `[cluster]`: queueing, `max_queued`, `queue_order` and
    /// `max_wait_ms` apply at once (call `release_waiters` after).
    pub fn apply(&self, cluster: &ClusterConfig) {
        self.queueing.store(cluster.queueing(), Ordering::Relaxed);
        {
            let mut queue = self.lock_queue();
            queue.set_max_queued(cluster.max_queued);
            queue.set_order(cluster.queue_order);
        }
        self.lock_service().set_config(cluster.fair.clone());
        (self.charging).store(cluster.queue_order == QueueOrder::Fair, Ordering::Relaxed);
        self.max_wait_ms
            .store(cluster.max_wait_ms.get(), Ordering::Relaxed);
    }

    fn lock_queue(&self) -> std::sync::MutexGuard<'_, PriorityQueue<oneshot::Sender<SlotTicket>>> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Requests waiting for a slot.
    pub fn queued(&self) -> usize {
        self.lock_queue().len()
    }

    /// Wake as many waiting requests as there are free running slots not yet
    /// promised to a woken request (all of them when queueing is off).
    pub fn release_waiters(&self, registry: &Registry, metrics: &ControllerMetrics) {
        let mut queue = self.lock_queue();
        queue.retain(|tx| !tx.is_closed());
        let mut free = if self.queueing.load(Ordering::Relaxed) {
            registry
                .free_slots()
                .saturating_sub(self.woken.load(Ordering::SeqCst))
        } else {
            usize::MAX
        };
        let mut service = self.lock_service();
        if queue.order() == QueueOrder::Fair && !queue.is_empty() {
            let in_flight = self.clients_in_flight.names();
            let present = in_flight
                .iter()
                .map(String::as_str)
                .chain(queue.waiting_clients())
                .collect();
            service.track(&present);
        }
        while free > 0 {
            let Some(tx) = queue.pop(|client| service.counter(client)) else {
                break;
            };
            // A ticket refused by a waiter that left is dropped, and un-counts itself.
            if tx.send(SlotTicket::new(&self.woken)).is_ok() {
                free -= 1;
            }
        }
        metrics.queued.set(queue.len() as i64);
    }

    /// Wait for a running slot when the cluster is saturated (or others wait);
    /// Err is the refusal when `max_queued` are already waiting.
    pub async fn wait_for_slot(
        &self,
        registry: &Registry,
        metrics: &ControllerMetrics,
        props: &Props,
    ) -> Result<Option<SlotTicket>, Response> {
        if !self.queueing.load(Ordering::Relaxed) {
            return Ok(None);
        }
        let rx = {
            let mut queue = self.lock_queue();
            if queue.is_empty() && !registry.saturated() {
                return Ok(None);
            }
            let (tx, rx) = oneshot::channel();
            if let Err(r) = queue.push(props, tx) {
                metrics.queue_full.inc();
                return Err(retry_later(StatusCode::TOO_MANY_REQUESTS, r.message));
            }
            metrics.queued.set(queue.len() as i64);
            rx
        };
        // A slot may have freed between the check and the push.
        self.release_waiters(registry, metrics);
        let max_wait_ms = self.max_wait_ms.load(Ordering::Relaxed);
        match tokio::time::timeout(Duration::from_millis(max_wait_ms), rx).await {
            Ok(Ok(ticket)) => Ok(Some(ticket)),
            Ok(Err(_)) => Err(retry_later(
                StatusCode::SERVICE_UNAVAILABLE,
                "the controller is shutting down",
            )),
            Err(_) => {
                metrics.wait_timeouts.inc();
                // Our sender is closed now: take it out of the queue's count.
                self.release_waiters(registry, metrics);
                Err(retry_later(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("no worker had a free slot within max_wait_ms = {max_wait_ms}"),
                ))
            }
        }
    }
}

/// Whose request it is (the `client` prop, set from its key) and its
/// `weight` (default 1).
pub fn client_and_weight(props: &Props) -> (&str, f64) {
    let client = props.str("client").unwrap_or("anonymous");
    (client, props.float("weight").unwrap_or(1.0))
}

/// A woken request's claim on a free slot, counted in `Controller::woken`
/// until it is dropped (once the request holds its slot, or if it never
/// arrives), so concurrent wake-ups cannot promise one slot twice.
pub struct SlotTicket(Arc<AtomicUsize>);

impl SlotTicket {
    fn new(woken: &Arc<AtomicUsize>) -> Self {
        woken.fetch_add(1, Ordering::SeqCst);
        Self(woken.clone())
    }
}

impl Drop for SlotTicket {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}
