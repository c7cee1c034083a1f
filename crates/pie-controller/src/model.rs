//! The model the controller routes with: its tokenizer (prompts to tokens,
//! chat templates) and fingerprint (block hashes, forwarded token ids). From
//! `--model`, or else read once from the first worker that answers
//! (`GET /v1/internal/tokenizer`), so the controller never routes blind: a
//! worker is admitted only once the model is known and only with its
//! fingerprint (`Registry::poll` refuses another, naming both).

use axum::http::Method;
use pie_model::{Tokenizer, TokenizerSpec};
use serde::Deserialize;

use crate::worker_client::WorkerClient;

pub struct RoutingModel {
    pub tokenizer: Tokenizer,
    pub fingerprint: u64,
}

#[derive(Deserialize)]
struct WorkerTokenizer {
    fingerprint: u64,
    tokenizer: TokenizerSpec,
}

/// The tokenizer and fingerprint of the worker at `url` (its
/// `GET /v1/internal/tokenizer`, under the worker key).
pub async fn read_routing_model(client: &WorkerClient, url: &str) -> Result<RoutingModel, String> {
    let resp = client
        .request(Method::GET, &format!("{url}/v1/internal/tokenizer"))
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
    let tokenizer = tokio::task::spawn_blocking(move || Tokenizer::from_spec(sent.tokenizer))
        .await
        .map_err(|e| format!("building its tokenizer: {e}"))?
        .map_err(|e| format!("building its tokenizer: {e}"))?;
    Ok(RoutingModel {
        tokenizer,
        fingerprint: sent.fingerprint,
    })
}
