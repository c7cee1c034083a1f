//! Every Pie scheduling policy, pure: no I/O, no async, no wall clock (time is a
//! parameter). The worker, the controller and the simulator run these same objects.

pub mod fcfs;
pub mod worker;

pub use fcfs::Fcfs;
pub use worker::{Candidate, WorkerPolicy};
