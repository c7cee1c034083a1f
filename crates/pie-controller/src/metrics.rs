//! The controller's Prometheus metrics (`GET /metrics`).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// Labels of a routing decision.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabels {
    pub worker: String,
    /// The deciding policy (`x-pie-route` up to its colon).
    pub policy: String,
}

/// Labels of a recorded cluster action.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ActionLabels {
    pub actor: String,
    pub kind: String,
    /// "true" or "false".
    pub dry_run: String,
}

/// A scale hint's worker group.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GroupLabels {
    pub group: String,
}

/// A part of the controller's own time per routed request
/// (`pie_controller_overhead_seconds`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PartLabels {
    /// `tokenize`, `hash`, `route` or `proxy` (see [`ControllerMetrics::overhead`]).
    pub part: &'static str,
}

/// Why a stream went on on another worker.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MoveLabels {
    /// `drain`, `relocate`, `rebalance` (a live hand-off) or `crash` (the
    /// worker's stream broke: resumed from the tokens sent).
    pub reason: &'static str,
}

fn overhead_histogram() -> Histogram {
    // 10 us to about 0.6 s in steps of 1.5x.
    Histogram::new(exponential_buckets(1e-5, 1.5, 28))
}

/// Metrics under `pie_controller_` describe this process; those under
/// `pie_cluster_` describe the cluster it advises (what an autoscaler reads).
pub struct ControllerMetrics {
    registry: Registry,
    pub routed: Family<RouteLabels, Counter>,
    pub retries: Counter,
    pub rejected: Counter,
    pub reload_failures: Counter,
    pub queued: Gauge,
    pub queue_full: Counter,
    pub wait_timeouts: Counter,
    pub kv_snapshots: Counter,
    pub kv_resyncs: Counter,
    pub actions: Family<ActionLabels, Counter>,
    pub scale_recommended: Family<GroupLabels, Gauge>,
    pub scale_current: Family<GroupLabels, Gauge>,
    /// The controller's own time per routed request, by part: `tokenize`
    /// (parsing the body, props, the chat template and tokenizing the prompt),
    /// `hash` (the block-hash chain and the cluster-index lookup of every
    /// worker's cached prefix), `route` (the policy pipeline's decision, its
    /// lock included), `proxy` (the controller's work from the decision to
    /// handing the request to its HTTP client, the forwarded body with
    /// `pie_prompt_tokens` included, plus its work from the worker's first
    /// bytes to handing the response on; the wait for the worker, and for a
    /// slot in the cluster-priority queue, are not the controller's cost and
    /// are left out). Each part is observed once per request that reaches it:
    /// `proxy` once per request relayed.
    pub overhead: Family<PartLabels, Histogram, fn() -> Histogram>,
    /// Streams resumed on another worker, by reason.
    pub moved: Family<MoveLabels, Counter>,
    /// Moves given up (no worker could take the stream, or the migration's
    /// first stage failed: the process went on where it was).
    pub move_failures: Family<MoveLabels, Counter>,
    /// The pause a moved stream's client saw: from the last token of the
    /// old worker to the first of the new one.
    pub move_pause: Family<MoveLabels, Histogram, fn() -> Histogram>,
}

impl Default for ControllerMetrics {
    fn default() -> Self {
        let mut m = Self {
            registry: Registry::default(),
            routed: Family::default(),
            retries: Counter::default(),
            rejected: Counter::default(),
            reload_failures: Counter::default(),
            queued: Gauge::default(),
            queue_full: Counter::default(),
            wait_timeouts: Counter::default(),
            kv_snapshots: Counter::default(),
            kv_resyncs: Counter::default(),
            actions: Family::default(),
            scale_recommended: Family::default(),
            scale_current: Family::default(),
            overhead: Family::new_with_constructor(overhead_histogram),
            moved: Family::default(),
            move_failures: Family::default(),
            move_pause: Family::new_with_constructor(overhead_histogram),
        };
        let cluster = m.registry.sub_registry_with_prefix("pie_cluster");
        cluster.register(
            "actions",
            "Cluster actions decided, by actor, kind and dry run",
            m.actions.clone(),
        );
        cluster.register(
            "scale_recommended",
            "Workers scale-by-prop recommends for the group",
            m.scale_recommended.clone(),
        );
        cluster.register(
            "scale_current",
            "Serving workers labelled with the group when the hint was made",
            m.scale_current.clone(),
        );
        let r = m.registry.sub_registry_with_prefix("pie_controller");
        r.register(
            "routed",
            "Requests routed, by worker and deciding policy",
            m.routed.clone(),
        );
        r.register(
            "retries",
            "Requests moved to another worker after a failed or silent one",
            m.retries.clone(),
        );
        r.register(
            "rejected",
            "Requests the pipeline refused (e.g. unknown pin)",
            m.rejected.clone(),
        );
        r.register(
            "config_reload_failures",
            "Config reloads refused as invalid",
            m.reload_failures.clone(),
        );
        r.register(
            "queued",
            "Requests waiting in the controller (cluster-priority)",
            m.queued.clone(),
        );
        r.register(
            "queue_full",
            "Requests refused with 429 because max_queued were waiting",
            m.queue_full.clone(),
        );
        r.register(
            "wait_timeouts",
            "Requests refused with 503 after waiting max_wait_ms for a slot",
            m.wait_timeouts.clone(),
        );
        r.register(
            "kv_snapshots",
            "KV index snapshots received from workers",
            m.kv_snapshots.clone(),
        );
        r.register(
            "kv_resyncs",
            "KV event subscriptions restarted (gap, lag or lost connection)",
            m.kv_resyncs.clone(),
        );
        r.register(
            "overhead_seconds",
            "The controller's own time per routed request, by part (tokenize, hash, route, proxy)",
            m.overhead.clone(),
        );
        r.register(
            "streams_moved",
            "Streams resumed on another worker, by reason (drain, relocate, rebalance, crash)",
            m.moved.clone(),
        );
        r.register(
            "stream_move_failures",
            "Stream moves given up, by reason",
            m.move_failures.clone(),
        );
        r.register(
            "stream_move_pause_seconds",
            "Last token on the old worker to first token on the new one, by reason",
            m.move_pause.clone(),
        );
        m
    }
}

impl ControllerMetrics {
    /// Record `seconds` of the controller's own time in `part`.
    pub fn observe_part(&self, part: &'static str, seconds: f64) {
        self.overhead
            .get_or_create(&PartLabels { part })
            .observe(seconds);
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }
}
