//! Registration with a controller (`pie serve --controller`): a heartbeat
//! that registers again every 2 s (a restarted controller learns about this
//! worker again), and a best-effort deregistration after a drain.

use serde_json::json;

/// `pie serve --controller URL --name NAME [--group GROUP]`.
pub struct Registration {
    pub controller: String,
    pub name: String,
    /// The worker's `group` label (`scale-by-prop` counts workers per group).
    pub group: Option<String>,
}

/// Register with a controller and keep registering (a heartbeat), so a restarted
/// controller learns about this worker again. A controller with API keys needs
/// this worker's key (`[server] worker_key`) to have role `worker` there.
pub async fn heartbeat(registration: Registration, url: String, key: Option<String>) {
    let Registration {
        controller,
        name,
        group,
    } = registration;
    let http = reqwest::Client::new();
    let endpoint = format!("{}/v1/cluster/register", controller.trim_end_matches('/'));
    let mut body = json!({"name": name, "url": url});
    if let Some(group) = group {
        body["group"] = json!(group);
    }
    loop {
        let mut req = http
            .post(&endpoint)
            .json(&body)
            .timeout(std::time::Duration::from_secs(2));
        if let Some(k) = &key {
            req = req.bearer_auth(k);
        }
        match req.send().await {
            Ok(r) if r.status().is_success() => {}
            Ok(r) => {
                tracing::warn!(controller, status = %r.status(), "the controller refused registration")
            }
            Err(e) => tracing::warn!(controller, error = %e, "cannot register with the controller"),
        }
        tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    }
}

/// Tell the controller this worker leaves (after a drain); best effort: a
/// controller that does not hear it expires the worker after its
/// `registration_ttl_ms`.
pub async fn deregister(controller: &str, name: &str, key: Option<&str>) {
    let endpoint = format!("{}/v1/cluster/deregister", controller.trim_end_matches('/'));
    let mut req = reqwest::Client::new()
        .post(&endpoint)
        .json(&json!({"name": name}))
        .timeout(std::time::Duration::from_secs(2));
    if let Some(k) = key {
        req = req.bearer_auth(k);
    }
    match req.send().await {
        Ok(r) if r.status().is_success() => tracing::info!(controller, "deregistered"),
        Ok(r) => {
            tracing::warn!(controller, status = %r.status(), "the controller refused deregistration")
        }
        Err(e) => tracing::warn!(controller, error = %e, "cannot deregister from the controller"),
    }
}
