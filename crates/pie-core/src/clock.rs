//! Wall-clock time as the binaries read it. Policies never read a clock: they
//! take the time as a parameter, and the binaries pass this one.

use std::time::{SystemTime, UNIX_EPOCH};

/// Unix milliseconds (0 for a clock set before 1970).
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
