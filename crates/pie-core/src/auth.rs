//! Named API keys, shared by `pie serve` and `pie-controller`: the inline
//! `[server] api_keys` entries, the `api_keys_file` format (`name key` lines),
//! and the bearer-token check. A key's name is its holder's client identity.

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiKey {
    pub name: String,
    pub key: String,
    /// The holder acts for other clients (a controller in front of workers):
    /// its requests' `client` prop is the client, not the key's name.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub forwards_client: bool,
}

/// Keys from a file of `name key` lines (blank lines and `#` comments
/// ignored); an error names the 1-based line.
pub fn parse_key_file(text: &str) -> Result<Vec<ApiKey>, (usize, String)> {
    let mut keys = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (name, key) = line
            .split_once(char::is_whitespace)
            .ok_or_else(|| (i + 1, "expected `name key`".to_string()))?;
        keys.push(ApiKey {
            name: name.to_string(),
            key: key.trim().to_string(),
            forwards_client: false,
        });
    }
    Ok(keys)
}

/// Why a request is refused (HTTP 401).
#[derive(Debug, PartialEq, Eq)]
pub enum AuthError {
    Missing,
    Invalid,
}

impl std::fmt::Display for AuthError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            AuthError::Missing => "missing API key: send `Authorization: Bearer KEY`",
            AuthError::Invalid => "invalid API key",
        })
    }
}

/// The key presented in an `Authorization` header value, among `keys`.
pub fn authenticate<'a>(
    keys: &'a [ApiKey],
    authorization: Option<&str>,
) -> Result<&'a ApiKey, AuthError> {
    let presented = authorization
        .and_then(|v| v.strip_prefix("Bearer "))
        .ok_or(AuthError::Missing)?;
    keys.iter()
        .find(|k| k.key == presented.trim())
        .ok_or(AuthError::Invalid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_files_and_bearer_tokens() {
        let keys = parse_key_file("# team\nalice sk-a\n\nbob  sk-b \n").expect("valid");
        assert_eq!(keys.len(), 2);
        assert_eq!(
            (keys[1].name.as_str(), keys[1].key.as_str()),
            ("bob", "sk-b")
        );
        assert_eq!(parse_key_file("alice\n").unwrap_err().0, 1);
        assert_eq!(
            authenticate(&keys, Some("Bearer sk-b")).map(|k| &k.name),
            Ok(&"bob".to_string())
        );
        assert_eq!(
            authenticate(&keys, Some("Bearer nope")),
            Err(AuthError::Invalid)
        );
        assert_eq!(authenticate(&keys, None), Err(AuthError::Missing));
        assert_eq!(
            authenticate(&keys, Some("Basic x")),
            Err(AuthError::Missing)
        );
    }
}
