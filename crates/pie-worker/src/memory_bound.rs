//! The worker's resident-memory bound, a formula of its config
//! (`docs/tenancy-and-limits.md`): what the model, the KV pool, the inferlet
//! instances, the records and the runtime may hold at most. Said at
//! start-up, with a warning when it passes the machine's memory. A leaf.

use std::fmt;

use crate::config::Config;

/// What the runtime holds besides the parts below: its threads, the
/// tokenizer, the engine's scratch buffers (about 600 MiB resident was
/// measured at start with the default model and a 1 GiB pool).
pub const RUNTIME_BYTES: u64 = 512 << 20;

/// The upper bound, by part.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryBound {
    pub model: u64,
    pub kv_pool: u64,
    pub instances: u64,
    /// One instance: its linear memory, its live output and events, its
    /// waiting messages and its compiled code (at most the upload's size).
    pub per_instance: u64,
    pub finished_records: u64,
    pub runtime: u64,
}

impl MemoryBound {
    /// The bound for `config`, a model file of `model_bytes` and a KV pool
    /// of `kv_bytes`.
    pub fn of(config: &Config, model_bytes: u64, kv_bytes: u64) -> Self {
        let inferlets = &config.runtime.inferlets;
        Self {
            model: model_bytes,
            kv_pool: kv_bytes,
            instances: inferlets.max_instances as u64,
            per_instance: inferlets.max_memory.0
                + inferlets.max_output_bytes.0
                + inferlets.max_pending_bytes.0
                + inferlets.max_upload.0,
            finished_records: config.server.max_finished_bytes.0,
            runtime: RUNTIME_BYTES,
        }
    }

    pub fn total(&self) -> u64 {
        self.model
            + self.kv_pool
            + self.instances * self.per_instance
            + self.finished_records
            + self.runtime
    }
}

fn mib(bytes: u64) -> u64 {
    bytes.div_ceil(1 << 20)
}

impl fmt::Display for MemoryBound {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "model {} MiB + KV pool {} MiB + {} inferlet instances x {} MiB + \
             finished records {} MiB + runtime {} MiB = {} MiB",
            mib(self.model),
            mib(self.kv_pool),
            self.instances,
            mib(self.per_instance),
            mib(self.finished_records),
            mib(self.runtime),
            mib(self.total())
        )
    }
}

/// This machine's memory (`MemTotal`), where it can be read.
pub fn machine_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib = info
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse::<u64>()
        .ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The defaults, with the default model (about 100 MiB) and its 1 GiB
    /// pool, fit a 24 GiB machine with room to spare.
    #[test]
    fn the_default_bound_fits_a_24_gib_machine() {
        let bound = MemoryBound::of(&Config::default(), 100 << 20, 1 << 30);
        assert_eq!(bound.instances, 32);
        assert_eq!(mib(bound.per_instance), 256 + 16 + 1 + 32);
        assert!(bound.total() < 16 << 30, "{bound}");
        let said = bound.to_string();
        assert!(
            said.ends_with(&format!("= {} MiB", mib(bound.total()))),
            "{said}"
        );
    }

    #[test]
    fn each_limit_moves_the_bound() {
        let mut config = Config::default();
        let before = MemoryBound::of(&config, 0, 0).total();
        config.runtime.inferlets.max_instances += 1;
        let after = MemoryBound::of(&config, 0, 0);
        assert_eq!(after.total() - before, after.per_instance);
        config.server.max_finished_bytes.0 += 1 << 20;
        assert_eq!(
            MemoryBound::of(&config, 0, 0).total() - after.total(),
            1 << 20
        );
    }
}
