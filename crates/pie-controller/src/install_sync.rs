//! Handing installed inferlets to the workers: after each poll of a healthy
//! worker, whatever it lacks of the controller's set (`installs`) is
//! uploaded to it under the worker key (it checks and compiles, as for any
//! upload); a worker that already lists the same name, version and sha256
//! is recorded as holding it without a second upload. A worker that is
//! down is forgotten, so it is asked again when it comes back; a refusal is
//! tried again after `installs::RETRY_AFTER`.

use std::collections::HashSet;

use axum::http::Method;
use serde_json::Value;

use crate::controller::Controller;
use crate::installs::Entry;
use crate::worker_client::describe;

/// After a poll of `worker`: hand it what it lacks, or forget it if down.
pub async fn after_poll(ctl: &Controller, worker: &str, url: &str) {
    if !ctl.registry.healthy(worker) {
        ctl.installs.forget(worker);
        return;
    }
    let missing = ctl.installs.missing(worker);
    if missing.is_empty() {
        return;
    }
    let held = listed(ctl, url).await.unwrap_or_default();
    for entry in missing {
        let result = match held.contains(&(entry.reference(), entry.sha256.clone())) {
            true => Ok(()),
            false => install(ctl, url, &entry).await.map_err(|f| f.why),
        };
        if let Err(why) = &result {
            tracing::warn!(
                worker,
                inferlet = entry.reference(),
                why,
                "install failed; retried later"
            );
        }
        ctl.installs.record(worker, &entry, result);
    }
}

/// Why an install did not happen.
pub struct Failed {
    /// The worker refused the component itself (a 4xx): not a component,
    /// a refused import, too large.
    pub refused: bool,
    pub why: String,
}

impl Failed {
    fn unreached(why: String) -> Self {
        Self {
            refused: false,
            why,
        }
    }
}

/// Upload `entry` to the worker at `url`.
pub async fn install(ctl: &Controller, url: &str, entry: &Entry) -> Result<(), Failed> {
    let bytes = ctl.installs.bytes(entry).map_err(Failed::unreached)?;
    let target = format!(
        "{url}/v1/inferlets?name={}&version={}",
        entry.name, entry.version
    );
    let sent = (ctl.worker_client)
        .request(Method::POST, &target)
        .body(bytes)
        .send()
        .await
        .map_err(|e| Failed::unreached(describe(&e)))?;
    let status = sent.status();
    if status.is_success() {
        return Ok(());
    }
    let body: Value = sent.json().await.unwrap_or(Value::Null);
    let message = body["error"]["message"].as_str().unwrap_or("no message");
    Err(Failed {
        refused: status.is_client_error(),
        why: format!("{status}: {message}"),
    })
}

/// The worker's installed (reference, sha256) pairs.
async fn listed(ctl: &Controller, url: &str) -> Option<HashSet<(String, String)>> {
    let answer = (ctl.worker_client)
        .request(Method::GET, &format!("{url}/v1/inferlets"))
        .send()
        .await
        .ok()?;
    let list: Value = answer.json().await.ok()?;
    let pairs = (list["inferlets"].as_array()?.iter())
        .filter_map(|i| {
            let reference = format!("{}@{}", i["name"].as_str()?, i["version"].as_str()?);
            Some((reference, i["sha256"].as_str()?.to_string()))
        })
        .collect();
    Some(pairs)
}
