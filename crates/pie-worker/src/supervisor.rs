//! Engine supervision: whether the engine thread is alive and making progress.
//!
//! The engine thread reports progress at every loop iteration and says when it
//! goes idle (blocked waiting for a command). It is unhealthy when it panicked
//! (for good: a panic leaves the KV pool in an unknown state, so the worker
//! process must be restarted) or when it has made no progress for `stall_ms`
//! while work was pending (until it makes progress again). `/health`,
//! `/v1/internal/state` and `/metrics` report it, and launches are refused, so
//! a controller stops routing to a worker that would only fail or hang.
//!
//! A leaf: it knows the engine thread only through [`Supervision`] and the
//! runtime only through the closure its watchdog runs.

use std::any::Any;
use std::cell::RefCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Once, OnceLock};
use std::time::{Duration, Instant};

/// The engine thread's liveness, written by the engine and read by everyone.
pub struct Supervision {
    stall_ms: u64,
    epoch: Instant,
    /// Milliseconds after `epoch` of the engine's last progress.
    progress_ms: AtomicU64,
    /// Whether the engine has work pending (it is not waiting for a command).
    busy: AtomicBool,
    panic: OnceLock<String>,
    /// `fault-injection`: the engine stops making progress while work is pending.
    #[cfg(feature = "fault-injection")]
    stall_fault: AtomicBool,
    /// `fault-injection`: a pause before each step (slow steps).
    #[cfg(feature = "fault-injection")]
    step_delay_ms: AtomicU64,
}

/// Faults the `fault-injection` feature can inject into the engine thread.
#[cfg(feature = "fault-injection")]
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Fault {
    /// Panic at the engine's next loop iteration.
    Panic,
    /// Sleep instead of stepping while work is pending.
    Stall,
    /// Pause `delay_ms` before each KV page this worker sends to a peer.
    SlowTransfer,
    /// Pause `delay_ms` before each engine step (a slow engine: a test can
    /// act while a process is mid-way).
    SlowSteps,
}

impl Supervision {
    pub fn new(stall_ms: u64) -> Self {
        Self {
            stall_ms,
            epoch: Instant::now(),
            progress_ms: AtomicU64::new(0),
            busy: AtomicBool::new(false),
            panic: OnceLock::new(),
            #[cfg(feature = "fault-injection")]
            stall_fault: AtomicBool::new(false),
            #[cfg(feature = "fault-injection")]
            step_delay_ms: AtomicU64::new(0),
        }
    }

    fn elapsed_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// The engine is working (called at every iteration with work pending).
    pub fn progress(&self) {
        self.progress_ms.store(self.elapsed_ms(), Ordering::Relaxed);
        self.busy.store(true, Ordering::Relaxed);
    }

    /// The engine has nothing to do and waits for a command: not a stall.
    pub fn idle(&self) {
        self.busy.store(false, Ordering::Relaxed);
    }

    /// Record the engine thread's panic; returns the reason reported for it.
    pub fn panicked(&self, message: &str) -> String {
        let _ = self
            .panic
            .set(format!("the engine thread panicked: {message}"));
        self.panic.get().cloned().unwrap_or_default()
    }

    pub fn has_panicked(&self) -> bool {
        self.panic.get().is_some()
    }

    /// `Err(reason)` when the engine panicked or stalls.
    pub fn health(&self) -> Result<(), String> {
        self.health_at(self.elapsed_ms())
    }

    fn health_at(&self, now_ms: u64) -> Result<(), String> {
        if let Some(reason) = self.panic.get() {
            return Err(reason.clone());
        }
        let idle_for = now_ms.saturating_sub(self.progress_ms.load(Ordering::Relaxed));
        if self.busy.load(Ordering::Relaxed) && idle_for >= self.stall_ms {
            return Err(format!(
                "the engine stalled: no progress for {idle_for} ms with work pending (server.stall_ms = {})",
                self.stall_ms
            ));
        }
        Ok(())
    }

    /// How often the watchdog checks: a fraction of `stall_ms`, so a stall is
    /// reported soon after it passes the limit.
    fn tick(&self) -> Duration {
        Duration::from_millis((self.stall_ms / 4).clamp(10, 1000))
    }

    #[cfg(feature = "fault-injection")]
    pub fn set_stall_fault(&self) {
        self.stall_fault.store(true, Ordering::Relaxed);
    }

    #[cfg(feature = "fault-injection")]
    pub fn stall_fault(&self) -> bool {
        self.stall_fault.load(Ordering::Relaxed)
    }

    #[cfg(feature = "fault-injection")]
    pub fn set_step_delay(&self, delay_ms: u64) {
        self.step_delay_ms.store(delay_ms, Ordering::Relaxed);
    }

    #[cfg(feature = "fault-injection")]
    pub fn step_delay(&self) -> Duration {
        Duration::from_millis(self.step_delay_ms.load(Ordering::Relaxed))
    }
}

thread_local! {
    /// The supervision of the loop this thread runs, for the panic hook.
    static SUPERVISED: RefCell<Option<Arc<Supervision>>> = const { RefCell::new(None) };
}

fn panic_message(payload: &(dyn Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}

/// Records a supervised thread's panic before the default hook prints it:
/// printing a backtrace can take long enough to be reported as a stall first.
fn install_panic_hook() {
    static INSTALLED: Once = Once::new();
    INSTALLED.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let _ = SUPERVISED.try_with(|s| {
                if let Some(s) = s.borrow().as_ref() {
                    s.panicked(&panic_message(info.payload()));
                }
            });
            previous(info);
        }));
    });
}

/// Run `engine_loop` on this thread; if it panics, record why and return the
/// reason (the caller fails the sequences the loop was serving with it).
pub fn run_supervised(
    supervision: &Arc<Supervision>,
    engine_loop: impl FnOnce(),
) -> Result<(), String> {
    install_panic_hook();
    SUPERVISED.with(|s| *s.borrow_mut() = Some(supervision.clone()));
    let looped = catch_unwind(AssertUnwindSafe(engine_loop));
    SUPERVISED.with(|s| *s.borrow_mut() = None);
    looped.map_err(|payload| {
        let reason = supervision.panicked(&panic_message(&*payload));
        tracing::error!("{reason}; the worker reports itself unhealthy until restarted");
        reason
    })
}

/// The watchdog thread: every tick, runs `watch` (the runtime acts on the
/// engine's health and bounds its records); ends when `watch` returns false
/// (the runtime was dropped).
pub fn spawn_watchdog(supervision: &Supervision, mut watch: impl FnMut() -> bool + Send + 'static) {
    let tick = supervision.tick();
    let spawned = std::thread::Builder::new()
        .name("pie-watchdog".into())
        .spawn(move || {
            while watch() {
                std::thread::sleep(tick);
            }
        });
    if let Err(e) = spawned {
        tracing::error!("cannot start the engine watchdog: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_is_healthy_however_long_and_busy_is_a_stall_past_the_limit() {
        let s = Supervision::new(100);
        assert_eq!(s.health_at(1_000_000), Ok(()), "idle: no stall");
        s.progress();
        let at = s.progress_ms.load(Ordering::Relaxed);
        assert_eq!(s.health_at(at + 99), Ok(()));
        let err = s.health_at(at + 150).unwrap_err();
        assert!(err.contains("no progress for 150 ms"), "{err}");
        s.progress();
        assert_eq!(
            s.health_at(s.progress_ms.load(Ordering::Relaxed)),
            Ok(()),
            "progress again: healthy again"
        );
        s.idle();
        assert_eq!(s.health_at(at + 1_000_000), Ok(()));
    }

    #[test]
    fn a_panic_is_reported_for_good_with_its_message() {
        let s = Arc::new(Supervision::new(100));
        let failed = run_supervised(&s, || panic!("index out of bounds")).unwrap_err();
        assert_eq!(
            failed,
            "the engine thread panicked: index out of bounds".to_string()
        );
        s.progress();
        assert_eq!(s.health(), Err(failed));
    }
}
