//! What `Runtime` holds for `retain-all`'s spills (`spill.rs` does the
//! spilling): the tier asked for, the engine's spills, the bound on those in
//! flight.

use std::sync::{Arc, Mutex};

use pie_policy::cluster::SPILLS_IN_FLIGHT;
use tokio::sync::{mpsc, Semaphore};

use super::disk_tier::PersistTo;
use crate::engine::Spill;

pub(super) struct SpillState {
    /// The tier asked for; None: spilling is off.
    pub(super) to: Mutex<Option<PersistTo>>,
    /// The engine's spills, until `start_spills` takes them.
    pub(super) spilled: Mutex<Option<mpsc::UnboundedReceiver<Spill>>>,
    pub(super) in_flight: Arc<Semaphore>,
}

impl SpillState {
    pub fn new(spilled: mpsc::UnboundedReceiver<Spill>) -> Self {
        Self {
            to: Mutex::new(None),
            spilled: Mutex::new(Some(spilled)),
            in_flight: Arc::new(Semaphore::new(SPILLS_IN_FLIGHT)),
        }
    }
}
