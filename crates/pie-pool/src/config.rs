//! `pie-pool`'s `config.toml`. Unknown keys and bad values are errors that
//! name the file, the line and the key.

use std::path::{Path, PathBuf};

use pie_core::auth::ApiKey;
use pie_core::config_file::ConfigError;
use pie_core::pool::{HIGH_WATERMARK, LOW_WATERMARK};
use pie_core::ByteSize;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub server: ServerConfig,
    pub pool: PoolConfig,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    pub host: String,
    pub port: u16,
    /// Keys with role `worker` (pulls, pushes) or `admin` (also deletes);
    /// none: every route is open (one trusted host).
    pub api_keys: Vec<ApiKey>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 8090,
            api_keys: Vec::new(),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PoolConfig {
    /// Bytes of pages kept in memory.
    pub capacity: ByteSize,
    /// Eviction starts above this share of `capacity` ...
    pub high_watermark: f64,
    /// ... and stops at this one.
    pub low_watermark: f64,
    /// The disk tier: pages written through here and read back after a
    /// restart. Unset: memory only.
    pub dir: Option<PathBuf>,
    pub disk_budget: ByteSize,
    /// Pages unused this long are deleted (memory and disk); 0: never.
    pub ttl_ms: u64,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            capacity: ByteSize(4 << 30),
            high_watermark: HIGH_WATERMARK,
            low_watermark: LOW_WATERMARK,
            dir: None,
            disk_budget: ByteSize(64 << 30),
            ttl_ms: 0,
        }
    }
}

impl Config {
    pub fn parse(text: &str, file: &Path) -> Result<Self, ConfigError> {
        let config: Config = pie_core::config_file::parse_toml(text, file)?;
        config
            .validate()
            .map_err(|(key, message)| ConfigError::key(file, key, message))?;
        Ok(config)
    }

    pub fn load(file: &Path) -> Result<Self, ConfigError> {
        Self::parse(&pie_core::config_file::read(file)?, file)
    }

    fn validate(&self) -> Result<(), (&'static str, String)> {
        let p = &self.pool;
        if p.capacity.0 == 0 {
            return Err(("pool.capacity", "must be at least 1 byte".into()));
        }
        if !(p.low_watermark > 0.0 && p.low_watermark < p.high_watermark && p.high_watermark <= 1.0)
        {
            return Err((
                "pool.low_watermark",
                format!(
                    "need 0 < low_watermark < high_watermark <= 1, got {} and {}",
                    p.low_watermark, p.high_watermark
                ),
            ));
        }
        pie_core::auth::check_keys(&self.server.api_keys).map_err(|e| ("server.api_keys", e))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_the_key() {
        let parse = |t: &str| Config::parse(t, Path::new("pool.toml"));
        assert_eq!(parse("").unwrap(), Config::default());
        let err = parse("[pool]\nlow_watermark = 0.95\n").unwrap_err();
        assert!(err.to_string().contains("pool.low_watermark"), "{err}");
        let err = parse("[pool]\ncapasity = 1\n").unwrap_err();
        assert!(err.to_string().contains("capasity"), "{err}");
        assert!(err.location.starts_with("pool.toml:2"), "{err:?}");
    }
}
