//! `--worker-config FILE`: a worker's `config.toml` (only its `[runtime]` table
//! is read; other tables are the worker's business), so a simulated worker runs
//! the same policies with the same settings as `pie serve` with that file.
//! The file's limits (`page_size`, `kv_pages`, `max_batch_tokens`,
//! `max_running`) replace the cost profile's where the file sets them; the
//! command-line flags override both.

use std::path::Path;

use anyhow::Result;
use pie_core::config_file::{parse_toml, ConfigError};
use pie_policy::runtime::{RuntimeConfig, WorkerPolicies};
use serde::Deserialize;

use crate::cost::CostProfile;

/// A worker's `[runtime]` and which of its limits the file sets.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerConfig {
    pub runtime: RuntimeConfig,
    set: Vec<String>,
}

#[derive(Deserialize)]
struct WorkerFile {
    #[serde(default)]
    runtime: RuntimeConfig,
}

#[derive(Deserialize)]
struct Keys {
    #[serde(default)]
    runtime: toml::Table,
}

impl WorkerConfig {
    pub fn load(file: &Path) -> Result<Self, ConfigError> {
        Self::parse(&pie_core::config_file::read(file)?, file)
    }

    pub fn parse(text: &str, file: &Path) -> Result<Self, ConfigError> {
        let runtime = parse_toml::<WorkerFile>(text, file)?.runtime;
        runtime
            .validate()
            .map_err(|(key, message)| ConfigError::key(file, &key, message))?;
        if runtime.kv_memory.is_some() {
            return Err(ConfigError::key(
                file,
                "runtime.kv_memory",
                "the simulator has no model to size pages by: set kv_pages instead",
            ));
        }
        if WorkerPolicies::build(&runtime).is_ok_and(|p| p.offload.is_some()) {
            return Err(ConfigError::key(
                file,
                "runtime.worker_policy",
                "`offload` is not simulated: remove it",
            ));
        }
        let set = parse_toml::<Keys>(text, file)?
            .runtime
            .keys()
            .cloned()
            .collect();
        Ok(Self { runtime, set })
    }

    /// Whether `[runtime]` lists `keep-session`.
    pub fn keeps_sessions(&self) -> bool {
        self.runtime
            .worker_policy
            .names()
            .iter()
            .any(|n| n == "keep-session")
    }

    /// The profile's limits replaced by those the file sets.
    pub fn apply_limits(&self, profile: &mut CostProfile) {
        let rt = &self.runtime;
        let has = |key: &str| self.set.iter().any(|k| k == key);
        if has("page_size") {
            profile.page_size = rt.page_size;
        }
        if let Some(pages) = rt.kv_pages {
            profile.kv_pages = pages;
        }
        if has("max_batch_tokens") {
            profile.max_batch_tokens = rt.max_batch_tokens;
        }
        if has("max_running") {
            profile.max_running = rt.max_running;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::PolicyName;

    fn parse(text: &str) -> Result<WorkerConfig, ConfigError> {
        WorkerConfig::parse(text, Path::new("worker.toml"))
    }

    #[test]
    fn reads_runtime_only_and_applies_the_limits_it_sets() {
        let c = parse(
            "[server]\nport = 9\n[runtime]\nworker_policy = [\"fair\", \"keep-session\"]\nmax_running = 3\nkv_pages = 40\n[runtime.fair]\noutput_weight = 5.0\n",
        )
        .unwrap();
        assert!(c.keeps_sessions());
        assert_eq!(PolicyName::of_runtime(&c.runtime), Ok(PolicyName::Fair));
        assert_eq!(c.runtime.fair.output_weight, 5.0);
        let mut profile = CostProfile::cpu_placeholder();
        let before = profile.clone();
        c.apply_limits(&mut profile);
        assert_eq!((profile.max_running, profile.kv_pages), (3, 40));
        assert_eq!(profile.page_size, before.page_size, "not set in the file");
        assert_eq!(profile.max_batch_tokens, before.max_batch_tokens);
    }

    #[test]
    fn errors_name_the_file_and_key() {
        let err = parse("[runtime]\nworker_policy = \"bogus\"\n").unwrap_err();
        assert_eq!(err.location, "worker.toml");
        assert!(err.message.contains("runtime.worker_policy") && err.message.contains("bogus"));
        let err = parse("[runtime.fair]\ninput_wieght = 1.0\n").unwrap_err();
        assert!(err.message.contains("input_wieght"), "{err}");
        assert_eq!(err.location, "worker.toml:2");
        let err = parse("[runtime]\nkv_memory = \"1GiB\"\n").unwrap_err();
        assert!(err.message.contains("runtime.kv_memory"), "{err}");
        let err = parse("[runtime]\nworker_policy = [\"fcfs\", \"offload\"]\n[runtime.offload]\npeers = [\"http://x\"]\n").unwrap_err();
        assert!(err.message.contains("offload"), "{err}");
    }

    #[test]
    fn deadline_abort_is_deadline_with_on_miss_abort() {
        let c = parse(
            "[runtime]\nworker_policy = \"deadline\"\n[runtime.deadline]\non_miss = \"abort\"\n",
        )
        .unwrap();
        assert_eq!(
            PolicyName::of_runtime(&c.runtime),
            Ok(PolicyName::DeadlineAbort)
        );
        let policy = PolicyName::DeadlineAbort.build_with(&c.runtime);
        assert_eq!(policy.name(), "deadline");
    }
}
