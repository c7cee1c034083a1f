//! A request's hold on a running slot of the worker it runs on: counted in
//! the registry's load and per client while the response streams, moved with
//! the stream, released (waking a queued request) and traced when the body is
//! dropped, finished or abandoned.

use std::sync::Arc;

use axum::body::Body;
use axum::response::Response;
use futures_util::StreamExt;

use crate::actors::DemandGuard;
use crate::controller::Controller;
use crate::trace::TracedRequest;

/// A request occupying a running slot on `worker` until its response body is
/// dropped (fully streamed or abandoned by the client); then it is traced.
pub struct InFlight {
    ctl: Arc<Controller>,
    worker: String,
    /// Whose request it is (counted in `Admission::clients_in_flight`).
    client: String,
    pub traced: Option<TracedRequest>,
    /// The request as the actors' demand, until it finishes.
    pub demand: Option<DemandGuard>,
}

impl InFlight {
    pub fn begin(ctl: &Arc<Controller>, worker: &str, client: &str) -> Self {
        ctl.registry.count_started(worker);
        ctl.admission.clients_in_flight.started(client);
        Self {
            ctl: ctl.clone(),
            worker: worker.to_string(),
            client: client.to_string(),
            traced: None,
            demand: None,
        }
    }

    /// The request's stream went on on `worker`.
    pub fn moved_to(&mut self, worker: &str) {
        self.ctl.registry.count_finished(&self.worker);
        self.ctl.registry.count_started(worker);
        self.worker = worker.to_string();
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.ctl.registry.count_finished(&self.worker);
        self.ctl.admission.clients_in_flight.finished(&self.client);
        self.ctl.release_waiters();
        if let (Some(recorder), Some(t)) = (&self.ctl.trace, self.traced.take()) {
            let output = t.output_length();
            if let Err(e) = recorder.record(t.input, output, &t.props) {
                tracing::warn!("server.trace_file: cannot write: {e}");
            }
        }
    }
}

/// `resp` with its body holding `slot` until the body is dropped.
pub fn hold_until_streamed(resp: Response, mut slot: InFlight) -> Response {
    resp.map(|body| {
        Body::from_stream(body.into_data_stream().map(move |chunk| {
            if let (Some(t), Ok(bytes)) = (&mut slot.traced, &chunk) {
                t.observe(bytes);
            }
            chunk
        }))
    })
}
