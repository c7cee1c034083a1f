//! How a process of an inferlet ends: finished (its guest returned `Ok`)
//! or failed with a reason, counted once whoever ends it first. A leaf.

use crate::process::{ProcState, Process};
use crate::runtime::Runtime;

/// The process ends finished (its guest returned Ok).
pub fn complete(rt: &Runtime, process: &Process) {
    if process.finish(ProcState::Finished, Some("stop"), None) {
        rt.metrics.count_request("finished");
    }
}

/// The process ends failed, saying `why`.
pub fn fail(rt: &Runtime, process: &Process, why: String) {
    if process.finish(ProcState::Failed, None, Some(why)) {
        rt.metrics.count_request("failed");
    }
}
