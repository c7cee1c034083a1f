//! Reading a TOML config file into a schema, with errors that name the file,
//! the line and the key (`config.toml:5: key `runtime.page_sise`: unknown
//! field ...`): one reader for the worker, the controller and the simulator.

use std::path::Path;

use serde::de::DeserializeOwned;

/// A config problem: where it is and what is wrong.
#[derive(Debug, thiserror::Error)]
#[error("{location}: {message}")]
pub struct ConfigError {
    /// `file` or `file:line`.
    pub location: String,
    pub message: String,
}

impl ConfigError {
    /// A problem with `key` found after parsing (no line is known).
    pub fn key(file: &Path, key: &str, message: impl std::fmt::Display) -> Self {
        Self {
            location: file.display().to_string(),
            message: format!("key `{key}`: {message}"),
        }
    }
}

/// Parse `text`, read from `file` (named in errors), as `T`.
pub fn parse_toml<T: DeserializeOwned>(text: &str, file: &Path) -> Result<T, ConfigError> {
    let de = toml::Deserializer::new(text);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let key = e.path().to_string();
        let inner = e.into_inner();
        let line = inner
            .span()
            .map(|s| text[..s.start.min(text.len())].matches('\n').count() + 1);
        let location = match line {
            Some(l) => format!("{}:{l}", file.display()),
            None => file.display().to_string(),
        };
        let message = if key.is_empty() || key == "." {
            inner.message().to_string()
        } else {
            format!("key `{key}`: {}", inner.message())
        };
        ConfigError { location, message }
    })
}

/// A config file's text; an error names it.
pub fn read(file: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(file).map_err(|e| ConfigError {
        location: file.display().to_string(),
        message: format!("cannot read: {e}"),
    })
}

/// Read `file` and parse it as `T`.
pub fn load_toml<T: DeserializeOwned>(file: &Path) -> Result<T, ConfigError> {
    parse_toml(&read(file)?, file)
}

/// Where Pie keeps what it fetches and installs: `$PIE_HOME`, else
/// `~/.cache/pie`.
pub fn pie_home() -> std::path::PathBuf {
    if let Some(home) = std::env::var_os("PIE_HOME") {
        return home.into();
    }
    let home = std::env::var_os("HOME").map_or_else(|| ".".into(), std::path::PathBuf::from);
    home.join(".cache").join("pie")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Schema {
        table: Table,
    }

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Table {
        count: u32,
    }

    #[test]
    fn errors_name_file_line_and_key() {
        let file = Path::new("c.toml");
        let err = parse_toml::<Schema>("[table]\ncount = \"x\"\n", file).unwrap_err();
        assert_eq!(err.location, "c.toml:2");
        assert!(err.message.starts_with("key `table.count`"), "{err}");
        let err = parse_toml::<Schema>("[table]\ncount = 1\nextra = 2\n", file).unwrap_err();
        assert!(err.message.contains("extra"), "{err}");
        let err = load_toml::<Schema>(Path::new("/nonexistent/c.toml")).unwrap_err();
        assert!(err.message.contains("cannot read"), "{err}");
    }
}
