//! The model the controller routes with: its tokenizer (prompts to tokens,
//! chat templates) and fingerprint (block hashes, forwarded token ids). From
//! `--model`, or else read once from the first worker that answers
//! (`GET /v1/internal/tokenizer`), so the controller never routes blind: a
//! worker is admitted only once the model is known and only with its
//! fingerprint (`Registry::poll` refuses another, naming both).

use pie_model::{Tokenizer, TokenizerSpec};
use serde::Deserialize;

use crate::proxy::Controller;
use crate::registry::with_worker_key;

pub struct RoutingModel {
    pub tokenizer: Tokenizer,
    pub fingerprint: u64,
}

#[derive(Deserialize)]
struct WorkerTokenizer {
    fingerprint: u64,
    tokenizer: TokenizerSpec,
}

impl Controller {
    pub fn routing_model(&self) -> Option<&RoutingModel> {
        self.model.get()
    }

    /// The fingerprint every worker must have: the known model's, or that of
    /// the tokenizer read now from the worker at `url`; Err says why that
    /// worker cannot be admitted.
    pub async fn learn_model(&self, url: &str) -> Result<u64, String> {
        if let Some(model) = self.model.get() {
            return Ok(model.fingerprint);
        }
        let req = self.http.get(format!("{url}/v1/internal/tokenizer"));
        let resp = with_worker_key(req, self.worker_key.as_deref())
            .send()
            .await
            .map_err(|e| format!("cannot read its tokenizer: {e}"))?;
        if !resp.status().is_success() {
            return Err(format!(
                "cannot read its tokenizer: GET /v1/internal/tokenizer answered {}",
                resp.status()
            ));
        }
        let sent: WorkerTokenizer = resp
            .json()
            .await
            .map_err(|e| format!("cannot read its tokenizer: {e}"))?;
        // Building the BPE tables takes a while: off the async threads.
        let tokenizer = tokio::task::spawn_blocking(move || Tokenizer::from_spec(sent.tokenizer))
            .await
            .map_err(|e| format!("building its tokenizer: {e}"))?
            .map_err(|e| format!("building its tokenizer: {e}"))?;
        let learned = RoutingModel {
            tokenizer,
            fingerprint: sent.fingerprint,
        };
        if self.model.set(learned).is_ok() {
            tracing::info!(
                url,
                fingerprint = format!("{:#018x}", sent.fingerprint),
                "routing with the tokenizer read from this worker"
            );
        }
        Ok(self.model.get().map_or(sent.fingerprint, |m| m.fingerprint))
    }
}
