//! Admission when the cluster is saturated (`cluster-priority`): requests wait
//! in `cluster-priority`'s queue for a free running slot, in the queue's order
//! (priority, then `queue_order`), at most `max_wait_ms` (then 503 with
//! `Retry-After`); at most `max_queued` wait (then 429). A woken request holds
//! a [`SlotTicket`] until it takes its slot, so one free slot is never
//! promised twice.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::StatusCode;
use axum::response::Response;
use pie_core::Props;
use pie_policy::cluster::PriorityQueue;
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
            woken: Arc::default(),
        }
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
        while free > 0 {
            let Some(tx) = queue.pop(|client| self.clients_in_flight.count(client)) else {
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
