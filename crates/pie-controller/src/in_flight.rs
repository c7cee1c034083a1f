//! A request's hold on a running slot of the worker it runs on: counted in
//! the registry's load and per client while the response streams, moved with
//! the stream, its client charged for the service its response reports
//! (`queue_order = "fair"`), released (waking a queued request) and traced
//! when the body is dropped, finished or abandoned.

use std::sync::Arc;

use axum::body::Body;
use axum::response::Response;
use futures_util::StreamExt;

use pie_core::Props;

use crate::actors::DemandGuard;
use crate::admission::client_and_weight;
use crate::controller::Controller;
use crate::trace::TracedRequest;
use crate::usage::UsageMeter;

/// A request occupying a running slot on `worker` until its response body is
/// dropped (fully streamed or abandoned by the client); then it is traced.
pub struct InFlight {
    ctl: Arc<Controller>,
    worker: String,
    /// Whose request it is (counted in `Admission::clients_in_flight`).
    client: String,
    /// The request's `weight` prop: its service is charged divided by it.
    weight: f64,
    usage: UsageMeter,
    /// Prompt tokens charged at the start (the controller's own count).
    charged_prompt: usize,
    /// Generated tokens already charged as they streamed.
    charged_output: usize,
    pub traced: Option<TracedRequest>,
    /// The request as the actors' demand, until it finishes.
    pub demand: Option<DemandGuard>,
}

impl InFlight {
    /// `charged_prompt`: the prompt tokens already charged for the request
    /// (see [`crate::admission::Admission::charge_prompt`]).
    pub fn begin(
        ctl: &Arc<Controller>,
        worker: &str,
        props: &Props,
        charged_prompt: usize,
    ) -> Self {
        let (client, weight) = client_and_weight(props);
        ctl.registry.count_started(worker);
        ctl.admission.clients_in_flight.started(client);
        Self {
            ctl: ctl.clone(),
            worker: worker.to_string(),
            client: client.to_string(),
            weight,
            usage: UsageMeter::default(),
            charged_prompt,
            charged_output: 0,
            traced: None,
            demand: None,
        }
    }

    /// The next piece of the response (or of a native process's events).
    pub fn observe(&mut self, bytes: &[u8]) {
        let tokens = self.usage.observe(bytes);
        self.generated(tokens);
    }

    /// `tokens` more were generated: charged as they stream, so a long
    /// answer counts before it ends.
    pub fn generated(&mut self, tokens: usize) {
        if tokens > 0 {
            (self.ctl.admission).charge(&self.client, self.weight, 0, tokens);
            self.charged_output += tokens;
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
        let prompt = (self.usage.prompt_length().unwrap_or(0)).saturating_sub(self.charged_prompt);
        let output = self.usage.output_length();
        let uncharged = output.saturating_sub(self.charged_output);
        (self.ctl.admission).charge(&self.client, self.weight, prompt, uncharged);
        self.ctl.registry.count_finished(&self.worker);
        self.ctl.admission.clients_in_flight.finished(&self.client);
        self.ctl.release_waiters();
        if let (Some(recorder), Some(t)) = (&self.ctl.trace, self.traced.take()) {
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
            if let Ok(bytes) = &chunk {
                slot.observe(bytes);
            }
            chunk
        }))
    })
}
