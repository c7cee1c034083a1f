//! Building the worker policies from `[runtime]`: at most one ordering policy
//! (`fcfs`, `fair`, `priority`, `deadline`) plus `keep-session` and/or `offload`.

use pie_policy::{Deadline, Fair, Fcfs, KeepSession, Offload, Priority, WorkerPolicy};

use crate::config::RuntimeConfig;

/// Every worker policy name this build knows.
pub const AVAILABLE: &[&str] = &[
    "fcfs",
    "fair",
    "priority",
    "deadline",
    "keep-session",
    "offload",
];

/// The active worker policies.
pub struct WorkerPolicies {
    pub names: Vec<String>,
    pub ordering: Box<dyn WorkerPolicy>,
    pub keep_session: Option<KeepSession>,
    pub offload: Option<Offload>,
}

impl WorkerPolicies {
    /// Build from config, or an error naming the bad entry.
    pub fn build(rt: &RuntimeConfig) -> Result<Self, String> {
        let names = rt.worker_policy.names();
        let mut ordering: Option<Box<dyn WorkerPolicy>> = None;
        let mut keep_session = None;
        let mut offload = None;
        for name in &names {
            let order: Box<dyn WorkerPolicy> = match name.as_str() {
                "fcfs" => Box::new(Fcfs),
                "fair" => Box::new(Fair::new(rt.fair.clone())),
                "priority" => Box::new(Priority::new(rt.priority.clone())),
                "deadline" => Box::new(Deadline::new(rt.deadline.clone())),
                "keep-session" => {
                    keep_session = Some(KeepSession::new(rt.keep_session.clone()));
                    continue;
                }
                "offload" => {
                    if rt.offload.peers.is_empty() {
                        return Err(
                            "`offload` needs at least one peer in [runtime.offload] peers".into(),
                        );
                    }
                    offload = Some(Offload::new(rt.offload.clone()));
                    continue;
                }
                other => {
                    return Err(format!(
                        "unknown worker policy `{other}` (available: {})",
                        AVAILABLE.join(", ")
                    ))
                }
            };
            if let Some(first) = &ordering {
                return Err(format!(
                    "`{name}`: only one ordering policy may be listed (already `{}`)",
                    first.name()
                ));
            }
            ordering = Some(order);
        }
        Ok(Self {
            names,
            ordering: ordering.unwrap_or_else(|| Box::new(Fcfs)),
            keep_session,
            offload,
        })
    }
}
