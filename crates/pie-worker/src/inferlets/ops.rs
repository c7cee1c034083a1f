//! Operations a guest keeps in flight (`pie:inferlet/passes`): each runs as
//! its own task on the guests' runtime, and its resource holds the task's
//! result until the guest takes it. A resource is a `wasi:io/poll`
//! pollable: ready once its task ended. A leaf (the host applies a taken
//! result to the process's contexts).
//!
//! Invariant: an operation lives no longer than its resource: dropping the
//! resource (or the process's store) aborts the task, and with it the
//! engine sequence it drives.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{oneshot, Mutex};
use wasmtime_wasi_io::poll::Pollable;

use crate::inbox::InboxReceiver;
use crate::process::Process;
use crate::runtime::{Generated, Runtime};

/// Where an operation's result is: with its task, ready, or given out.
pub enum Outcome<T> {
    Running {
        result: oneshot::Receiver<Result<T, String>>,
        task: AbortOnDrop,
    },
    Done(Result<T, String>),
    Taken,
}

impl<T: Send + 'static> Outcome<T> {
    /// `work` started as a task of the current runtime.
    pub fn spawn(work: impl Future<Output = Result<T, String>> + Send + 'static) -> Self {
        let (tx, result) = oneshot::channel();
        let task = tokio::spawn(async move {
            let _ = tx.send(work.await);
        })
        .abort_handle();
        Self::Running {
            result,
            task: AbortOnDrop(task),
        }
    }

    /// Wait until the task ended.
    pub async fn ready(&mut self) {
        if let Self::Running { result, .. } = self {
            let done = result.await.unwrap_or_else(|_| Err(stopped()));
            *self = Self::Done(done);
        }
    }

    /// The result if the task ended (once; later takes are `Taken`'s err).
    pub fn take(&mut self) -> Option<Result<T, String>> {
        if let Self::Running { result, .. } = self {
            match result.try_recv() {
                Ok(done) => *self = Self::Done(done),
                Err(oneshot::error::TryRecvError::Empty) => return None,
                Err(oneshot::error::TryRecvError::Closed) => *self = Self::Done(Err(stopped())),
            }
        }
        match std::mem::replace(self, Self::Taken) {
            Self::Done(done) => Some(done),
            _ => Some(Err("the operation's result was taken already".into())),
        }
    }

    /// Whether its result is still to be given out.
    pub fn pending(&self) -> bool {
        !matches!(self, Self::Taken)
    }
}

/// A task that stops when its operation goes.
pub struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

fn stopped() -> String {
    "the operation stopped before it finished".into()
}

/// A generation in flight over context `ctx`.
pub struct GenerationOp {
    pub ctx: u32,
    pub outcome: Outcome<Generated>,
}

/// A verification pass in flight over context `ctx`.
pub struct PassOp {
    pub ctx: u32,
    /// The tokens the context gains when the result is taken.
    pub appended: Vec<u32>,
    /// The positions asked for, as the guest listed them, and the context's
    /// length before the pass (position p follows token `base + p - 1`).
    pub positions: Vec<u32>,
    pub base: usize,
    /// Bytes of full distributions it holds against the process's bound.
    pub full_bytes: usize,
    pub outcome: Outcome<Generated>,
}

/// A wait for the process's next message.
pub struct MessageOp {
    pub outcome: Outcome<String>,
    /// A poll that waits on it alone this long fails the process.
    pub max_idle: Duration,
    pub rt: Arc<Runtime>,
    pub process: Arc<Process>,
}

impl MessageOp {
    /// The next message of `inbox` (shared with `receive`: each message goes
    /// to one waiter, in order).
    pub fn start(
        inbox: Arc<Mutex<InboxReceiver>>,
        max_idle: Duration,
        rt: Arc<Runtime>,
        process: Arc<Process>,
    ) -> Self {
        let outcome = Outcome::spawn(async move {
            // The inbox lives as long as the process: a closed one never answers.
            match inbox.lock().await.recv().await {
                Some(message) => Ok(message),
                None => std::future::pending().await,
            }
        });
        Self {
            outcome,
            max_idle,
            rt,
            process,
        }
    }
}

#[wasmtime_wasi_io::async_trait]
impl Pollable for GenerationOp {
    async fn ready(&mut self) {
        self.outcome.ready().await
    }
}

#[wasmtime_wasi_io::async_trait]
impl Pollable for PassOp {
    async fn ready(&mut self) {
        self.outcome.ready().await
    }
}

#[wasmtime_wasi_io::async_trait]
impl Pollable for MessageOp {
    async fn ready(&mut self) {
        if tokio::time::timeout(self.max_idle, self.outcome.ready())
            .await
            .is_err()
        {
            let why = format!(
                "the inferlet waited on a message-op for {} ms with nothing arriving, \
                 past max_idle_ms",
                self.max_idle.as_millis()
            );
            super::end::fail(&self.rt, &self.process, why);
            std::future::pending::<()>().await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_result_is_given_out_once_and_a_dropped_op_stops_its_task() {
        let mut op = Outcome::spawn(async { Ok::<_, String>(7) });
        op.ready().await;
        assert_eq!(op.take(), Some(Ok(7)));
        assert!(op.take().unwrap().unwrap_err().contains("taken already"));
        assert!(!op.pending());

        let (tx, rx) = oneshot::channel::<()>();
        let op = Outcome::spawn(async move {
            let _keep = tx;
            std::future::pending::<Result<(), String>>().await
        });
        drop(op);
        assert!(rx.await.is_err(), "the task ended when its op was dropped");

        let mut running = Outcome::spawn(std::future::pending::<Result<(), String>>());
        assert_eq!(running.take(), None);
        assert!(running.pending());
    }
}
