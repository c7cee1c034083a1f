//! Heavy host work off the guests' threads. Tokenizing, decoding, chat
//! templates and grammar compiles of inputs past [`INLINE_BYTES`] run on a
//! bounded pool, at most half the cores (at least one thread), at the
//! guests' lower priority; the CPU time they take is charged to the calling
//! process's `max_cpu_ms` as if its guest had computed it. Smaller inputs
//! run in place, inside the guest's metered poll (a few milliseconds at
//! most). A leaf of `inferlets` beside `limits`.
//!
//! Invariant: a guest's host call never holds a guest thread for more than
//! the in-place work of [`INLINE_BYTES`], and every CPU nanosecond spent
//! for it, in place or on the pool, counts toward its `max_cpu_ms`.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;

use super::limits::{thread_cpu_ns, CpuMeter};

/// Inputs up to this size are worked on in place.
pub const INLINE_BYTES: usize = 4096;

/// The pool for host work of every process of a worker.
pub struct HostWork {
    permits: Arc<Semaphore>,
    threads: usize,
}

impl Default for HostWork {
    fn default() -> Self {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self::with_threads((cores / 2).max(1))
    }
}

impl HostWork {
    pub fn with_threads(threads: usize) -> Self {
        Self {
            permits: Arc::new(Semaphore::new(threads)),
            threads,
        }
    }

    /// Threads the pool may use at once.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Do `work` on an input of `size` bytes for the process metered by
    /// `meter`: in place when small, else on the pool (waiting for a turn,
    /// first come first served), charging its CPU time to `meter`.
    pub async fn run<T: Send + 'static>(
        &self,
        size: usize,
        meter: &CpuMeter,
        work: impl FnOnce() -> Result<T, String> + Send + 'static,
    ) -> Result<T, String> {
        if size <= INLINE_BYTES {
            return work();
        }
        let _turn = self
            .permits
            .acquire()
            .await
            .map_err(|_| "the host's work pool is closed".to_string())?;
        let (out, cpu_ns) = tokio::task::spawn_blocking(move || {
            let start = thread_cpu_ns();
            let out = work();
            (out, thread_cpu_ns().saturating_sub(start))
        })
        .await
        .map_err(|e| format!("the host's work failed: {e}"))?;
        meter.charge(Duration::from_nanos(cpu_ns));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spin(ms: u64) -> Result<u64, String> {
        let start = thread_cpu_ns();
        while thread_cpu_ns() - start < ms * 1_000_000 {
            std::hint::spin_loop();
        }
        Ok(ms)
    }

    /// Work on the pool is charged to the caller's meter, and runs on
    /// another thread than the caller's.
    #[tokio::test]
    async fn pooled_work_is_charged_and_runs_elsewhere() {
        let work = HostWork::with_threads(1);
        let meter = CpuMeter::default();
        let caller = std::thread::current().id();
        let (ms, elsewhere) = work
            .run(INLINE_BYTES + 1, &meter, move || {
                Ok((spin(30)?, std::thread::current().id() != caller))
            })
            .await
            .unwrap();
        assert_eq!(ms, 30);
        assert!(elsewhere);
        assert!(
            meter.used() >= Duration::from_millis(30),
            "{:?}",
            meter.used()
        );
    }

    /// The pool takes one piece of work per thread at once: a second waits.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_pool_is_bounded() {
        let work = Arc::new(HostWork::with_threads(1));
        let (started_tx, started_rx) = std::sync::mpsc::channel();
        let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
        let first = tokio::spawn({
            let work = work.clone();
            async move {
                let meter = CpuMeter::default();
                work.run(INLINE_BYTES + 1, &meter, move || {
                    started_tx.send(()).map_err(|e| e.to_string())?;
                    release_rx.recv().map_err(|e| e.to_string())
                })
                .await
            }
        });
        started_rx.recv().unwrap();
        let meter = CpuMeter::default();
        let second = work.run(INLINE_BYTES + 1, &meter, || Ok(()));
        let waited = tokio::time::timeout(Duration::from_millis(100), second).await;
        assert!(waited.is_err(), "the second waits for the first's turn");
        release_tx.send(()).unwrap();
        first.await.unwrap().unwrap();
        work.run(INLINE_BYTES + 1, &meter, || Ok(())).await.unwrap();
    }
}
