//! What one inferlet instance may use, enforced: its own execution time
//! (the CPU time of every poll of the guest, checked at each epoch tick),
//! its linear memory (a limiter that names the cap), and the size of what a
//! host call accepts. A leaf: no other module of `inferlets` below it.
//!
//! Invariant: a guest that computes without calling the host gives its
//! thread back at every epoch tick ([`EPOCH_TICK`]), and fails once its
//! metered time passes `max_cpu_ms`; time it spends awaiting the host (a
//! generation, a message, a sleep) is not metered.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

/// How often the epoch advances: a spinning guest yields this often.
pub const EPOCH_TICK: Duration = Duration::from_millis(5);

/// The most bytes one string argument of a host call may have.
pub const MAX_ARG_BYTES: usize = 1 << 20;

/// Bytes of text a host call may tokenize or template, per token of the
/// model's context window (a token of real text is rarely over 16 bytes).
pub const TEXT_BYTES_PER_TOKEN: usize = 16;

/// The most bytes of a grammar, a regex or a JSON schema.
pub const MAX_GRAMMAR_BYTES: usize = 64 << 10;

/// The most bytes of text a host call may tokenize or template for a model
/// of `context_length` tokens (never more than [`MAX_ARG_BYTES`]).
pub fn max_text_bytes(context_length: usize) -> usize {
    (context_length * TEXT_BYTES_PER_TOKEN).min(MAX_ARG_BYTES)
}

/// The most operations (`passes`) a process holds at once.
pub const MAX_OPS: usize = 64;

/// The most tokens one pass appends (and so at most one more position).
pub const MAX_PASS_TOKENS: usize = 128;

/// The most bytes of full distributions one pass returns (about 1 MiB a
/// position at a 262,144-token vocabulary) ...
pub const MAX_FULL_BYTES: usize = 4 << 20;

/// ... and all the operations a process holds.
pub const MAX_FULL_BYTES_HELD: usize = 16 << 20;

/// The most bytes of token sets (`steering`) a process's contexts keep.
pub const MAX_TOKEN_SET_BYTES: usize = 4 << 20;

/// The most host resources (operations, pollables, WASI streams) an
/// instance holds at once.
pub const MAX_HOST_RESOURCES: usize = 4096;

/// The most contexts one process may hold at once.
pub const MAX_CONTEXTS: usize = 1024;

/// The most contexts one `generate-all` may take.
pub const MAX_PARALLEL: usize = 64;

/// What the host keeps for one event or log line beyond its bytes (its
/// entry in the record's index, its enum), charged against
/// `max_output_bytes` with the bytes, so an empty event is not free.
pub const EVENT_OVERHEAD_BYTES: usize = 64;

/// A token bucket: `rate` tokens a second up to `capacity`, full at first.
#[derive(Debug)]
pub struct TokenBucket {
    rate: f64,
    capacity: f64,
    tokens: f64,
    last: std::time::Instant,
}

impl TokenBucket {
    pub fn new(rate: f64, capacity: f64) -> Self {
        Self {
            rate,
            capacity,
            tokens: capacity,
            last: std::time::Instant::now(),
        }
    }

    /// Take one token at `now` if there is one.
    pub fn take(&mut self, now: std::time::Instant) -> bool {
        let refill = now.saturating_duration_since(self.last).as_secs_f64() * self.rate;
        self.tokens = (self.tokens + refill).min(self.capacity);
        self.last = now;
        if self.tokens < 1.0 {
            return false;
        }
        self.tokens -= 1.0;
        true
    }
}

/// A guest's execution time: the CPU time of the thread that polls it,
/// summed over its polls, plus the poll in progress (read from inside it:
/// the epoch callback runs on that thread).
#[derive(Default)]
pub struct CpuMeter {
    used_ns: AtomicU64,
    poll_started_ns: Mutex<Option<u64>>,
}

impl CpuMeter {
    /// Execution time so far, the poll in progress included (call from
    /// the polling thread).
    pub fn used(&self) -> Duration {
        let running = self
            .poll_started_ns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .map_or(0, |start| thread_cpu_ns().saturating_sub(start));
        Duration::from_nanos(self.used_ns.load(Ordering::Relaxed) + running)
    }

    /// Add CPU time spent for the guest elsewhere (host work on the pool).
    pub fn charge(&self, time: Duration) {
        self.used_ns
            .fetch_add(time.as_nanos() as u64, Ordering::Relaxed);
    }

    fn enter(&self) {
        *self
            .poll_started_ns
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(thread_cpu_ns());
    }

    fn leave(&self) {
        let start = self
            .poll_started_ns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(start) = start {
            self.used_ns
                .fetch_add(thread_cpu_ns().saturating_sub(start), Ordering::Relaxed);
        }
    }
}

/// The calling thread's CPU time (ns): time it ran, not time it waited for
/// a core (guest threads run below the engine's priority).
pub fn thread_cpu_ns() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid timespec for the call to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// A future whose polls are metered: the guest runs only inside them.
pub struct Metered<F> {
    inner: Pin<Box<F>>,
    meter: Arc<CpuMeter>,
}

impl<F> Metered<F> {
    pub fn new(inner: F, meter: Arc<CpuMeter>) -> Self {
        Self {
            inner: Box::pin(inner),
            meter,
        }
    }
}

impl<F: Future> Future for Metered<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        self.meter.enter();
        let out = self.inner.as_mut().poll(cx);
        self.meter.leave();
        out
    }
}

/// Caps an instance's linear memories and tables; a refused growth traps
/// with the cap named (the guest would otherwise abort with a bare trap).
pub struct MemoryCap {
    pub max_bytes: usize,
    /// Why the last growth was refused, for the process's failure.
    pub refused: Option<String>,
}

/// The most table elements an instance may have.
const MAX_TABLE_ELEMENTS: usize = 100_000;

impl wasmtime::ResourceLimiter for MemoryCap {
    fn memory_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired <= self.max_bytes {
            return Ok(true);
        }
        let why = format!(
            "the inferlet asked for {} MiB of memory, past [runtime.inferlets] max_memory = {} MiB",
            desired.div_ceil(1 << 20),
            self.max_bytes >> 20
        );
        self.refused = Some(why.clone());
        Err(wasmtime::format_err!("{why}"))
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(desired <= MAX_TABLE_ELEMENTS)
    }
}

/// A string argument within [`MAX_ARG_BYTES`], or the error naming it.
pub fn bounded<'a>(what: &str, text: &'a str) -> Result<&'a str, String> {
    bounded_to(what, text, MAX_ARG_BYTES)
}

/// A string argument within `max` bytes, or the error naming it.
pub fn bounded_to<'a>(what: &str, text: &'a str, max: usize) -> Result<&'a str, String> {
    if text.len() > max {
        return Err(format!(
            "{what} has {} bytes; this host call takes at most {max}",
            text.len()
        ));
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bucket gives its capacity at once, then its rate.
    #[test]
    fn a_token_bucket_gives_its_burst_then_its_rate() {
        let start = std::time::Instant::now();
        let mut bucket = TokenBucket::new(10.0, 3.0);
        let taken = (0..5).filter(|_| bucket.take(start)).count();
        assert_eq!(taken, 3);
        let later = start + std::time::Duration::from_millis(250);
        let taken = (0..5).filter(|_| bucket.take(later)).count();
        assert_eq!(taken, 2, "a quarter second at 10/s refills 2.5");
        let much_later = later + std::time::Duration::from_secs(60);
        let taken = (0..10).filter(|_| bucket.take(much_later)).count();
        assert_eq!(taken, 3, "never past the capacity");
    }

    /// Time between polls (awaiting) is not metered; CPU time inside is
    /// (the busy part spins for 30 ms of its own CPU time, however loaded
    /// the machine).
    #[tokio::test]
    async fn only_time_inside_polls_is_metered() {
        let meter = Arc::new(CpuMeter::default());
        let busy_then_wait = async {
            let start = thread_cpu_ns();
            while thread_cpu_ns() - start < 30_000_000 {
                std::hint::spin_loop();
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        Metered::new(busy_then_wait, meter.clone()).await;
        let used = meter.used();
        assert!(used >= Duration::from_millis(30), "{used:?}");
        assert!(used < Duration::from_millis(150), "{used:?}");
    }

    #[test]
    fn growth_past_the_cap_is_refused_with_the_cap_named() {
        use wasmtime::ResourceLimiter;
        let mut cap = MemoryCap {
            max_bytes: 64 << 20,
            refused: None,
        };
        assert!(cap.memory_growing(0, 32 << 20, None).unwrap());
        let err = cap.memory_growing(32 << 20, 128 << 20, None).unwrap_err();
        assert!(err.to_string().contains("max_memory = 64 MiB"), "{err}");
        assert!(cap.refused.is_some());
    }
}
