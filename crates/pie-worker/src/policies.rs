//! Building the worker policy from `[runtime] worker_policy` names.

use pie_policy::{Fcfs, WorkerPolicy};

/// The worker policies this build offers.
pub const AVAILABLE: &[&str] = &["fcfs"];

/// The policy object for a list of names, or an error naming the bad entry.
pub fn build(names: &[String]) -> Result<Box<dyn WorkerPolicy>, String> {
    let mut ordering: Option<Box<dyn WorkerPolicy>> = None;
    for name in names {
        let policy: Box<dyn WorkerPolicy> = match name.as_str() {
            "fcfs" => Box::new(Fcfs),
            other => {
                return Err(format!(
                    "unknown worker policy `{other}` (available: {})",
                    AVAILABLE.join(", ")
                ))
            }
        };
        if ordering.is_some() {
            return Err(format!(
                "`{name}`: at most one ordering policy may be listed"
            ));
        }
        ordering = Some(policy);
    }
    Ok(ordering.unwrap_or_else(|| Box::new(Fcfs)))
}
