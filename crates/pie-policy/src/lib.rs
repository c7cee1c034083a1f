//! Every Pie scheduling policy, pure: no I/O, no async, no wall clock (time is a
//! parameter). The worker, the controller and the simulator run these same objects.

pub mod cluster;
pub mod deadline;
pub mod fair;
pub mod fcfs;
pub mod keep_session;
pub mod offload;
pub mod priority;
pub mod runtime;
pub mod scheduler;
pub mod service;
pub mod shares;
pub mod worker;

pub use deadline::{Deadline, DeadlineConfig, OnMiss};
pub use fair::{Fair, FairConfig};
pub use fcfs::Fcfs;
pub use keep_session::{KeepSession, KeepSessionConfig, Retention};
pub use offload::{Offload, OffloadConfig};
pub use priority::{Priority, PriorityConfig};
pub use scheduler::{KvAccounting, Planned, Scheduler, StepLimits};
pub use service::ServiceCounters;
pub use shares::Shares;
pub use worker::{Candidate, WorkerPolicy};
