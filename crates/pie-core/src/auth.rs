//! Named API keys with roles and per-key policy limits, shared by `pie serve`
//! and `pie-controller`: the inline `[server] api_keys` entries, the
//! `api_keys_file` format, the bearer check (constant time), and the limits a
//! client key's request props must stay within.
//!
//! Roles: a `client` runs and sees its own processes; a `worker` key is what
//! Pie's own binaries present to each other (internal routes, registration,
//! acting for the client a controller forwards); an `admin` may do everything,
//! including `/v1/admin/*`, and sees every client's processes.

use serde::{Deserialize, Serialize};

use crate::props::{PropError, PropValue, Props};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    #[default]
    Client,
    Worker,
    Admin,
}

impl Role {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "client" => Some(Role::Client),
            "worker" => Some(Role::Worker),
            "admin" => Some(Role::Admin),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Client => "client",
            Role::Worker => "worker",
            Role::Admin => "admin",
        }
    }

    /// Internal routes (page transfer, prefill, state, KV events): Pie's own
    /// binaries and operators.
    pub fn is_internal(self) -> bool {
        matches!(self, Role::Worker | Role::Admin)
    }

    /// May a key of this role call a route that needs `need`; Err is the 403
    /// message naming the key and the role it lacks.
    pub fn may_call(self, need: Role, key_name: &str, path: &str) -> Result<(), String> {
        let allowed = match need {
            Role::Client => true,
            Role::Worker => self.is_internal(),
            Role::Admin => self == Role::Admin,
        };
        if allowed {
            return Ok(());
        }
        Err(format!(
            "key `{key_name}` may not call {path}: it needs a key with role `{}`",
            need.as_str()
        ))
    }
}

/// What an operator allows a client key's requests to ask for. A request prop
/// beyond a limit is refused (400 naming the prop and the limit), never
/// clamped silently.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KeyLimits {
    /// The key's fair-share weight: requests without a `weight` prop get it,
    /// and a larger one is refused.
    pub weight: f64,
    /// Highest `priority` prop the key may send (unset: any).
    pub max_priority: Option<i64>,
    /// Longest `keep-ms` the key may ask for (unset: any).
    pub max_keep_ms: Option<i64>,
    /// Shortest `deadline-ms` the key may ask for: under EDF a shorter deadline
    /// buys service (unset: any).
    pub min_deadline_ms: Option<i64>,
    /// May the key send a `pin` prop.
    pub pin: bool,
    /// May the key ask for its prefixes to be persisted (`persist` prop).
    pub persist: bool,
    /// May the key upload and delete inferlets (`admin` keys always may).
    pub upload_inferlets: bool,
    /// Prefix-cache isolation: prompts of keys with the same salt share cached
    /// KV; with different salts (or none) they never do, so `cached_tokens`
    /// and timing cannot tell one tenant what another sent.
    pub cache_salt: Option<String>,
    /// The key's inferlets' `max_wall_ms`, in place of the worker's.
    pub max_wall_ms: Option<u64>,
    /// The key's inferlets' `max_idle_ms`, in place of the worker's.
    pub max_idle_ms: Option<u64>,
    /// The most inferlet versions a client key may have installed (its own
    /// uploads; admin keys have no such limit).
    pub max_inferlets: usize,
    /// The most bytes of components a client key may have installed.
    pub max_inferlet_bytes: u64,
}

/// [`KeyLimits::max_inferlets`]' default.
pub const DEFAULT_MAX_INFERLETS: usize = 16;
/// [`KeyLimits::max_inferlet_bytes`]' default: 256 MiB.
pub const DEFAULT_MAX_INFERLET_BYTES: u64 = 256 << 20;

impl Default for KeyLimits {
    fn default() -> Self {
        Self {
            weight: 1.0,
            max_priority: None,
            max_keep_ms: None,
            min_deadline_ms: None,
            pin: true,
            persist: false,
            upload_inferlets: false,
            cache_salt: None,
            max_wall_ms: None,
            max_idle_ms: None,
            max_inferlets: DEFAULT_MAX_INFERLETS,
            max_inferlet_bytes: DEFAULT_MAX_INFERLET_BYTES,
        }
    }
}

fn refused(key: &str, reason: String) -> PropError {
    PropError {
        key: key.to_string(),
        reason,
    }
}

impl KeyLimits {
    /// Check a client's props against the limits and fill in the key's weight.
    /// `who` names the key in errors.
    pub fn apply(&self, who: &str, props: &mut Props) -> Result<(), PropError> {
        match props.float("weight") {
            Some(w) if w > self.weight => {
                return Err(refused(
                    "weight",
                    format!("{w} is above key `{who}`'s limit of {}", self.weight),
                ))
            }
            Some(_) => {}
            None => props.set("weight", PropValue::Float(self.weight))?,
        }
        let int_limits = [
            ("priority", self.max_priority, false),
            ("keep-ms", self.max_keep_ms, false),
            ("deadline-ms", self.min_deadline_ms, true),
        ];
        for (prop, limit, is_minimum) in int_limits {
            let (Some(value), Some(limit)) = (props.int(prop), limit) else {
                continue;
            };
            if (is_minimum && value < limit) || (!is_minimum && value > limit) {
                let side = if is_minimum { "below" } else { "above" };
                return Err(refused(
                    prop,
                    format!("{value} is {side} key `{who}`'s limit of {limit}"),
                ));
            }
        }
        for (prop, allowed) in [("pin", self.pin), ("persist", self.persist)] {
            if !allowed && props.get(prop).is_some() {
                return Err(refused(prop, format!("key `{who}` may not set `{prop}`")));
            }
        }
        Ok(())
    }

    /// A config error in the limits themselves, as (field, message).
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        if !(self.weight.is_finite() && self.weight > 0.0) {
            return Err((
                "weight",
                format!("must be a positive number, got {}", self.weight),
            ));
        }
        for (field, ms) in [
            ("max_wall_ms", self.max_wall_ms),
            ("max_idle_ms", self.max_idle_ms),
        ] {
            if ms == Some(0) {
                return Err((field, "must be at least 1".into()));
            }
        }
        Ok(())
    }
}

/// May `keys` bring a worker two or more tenants: two client or admin keys
/// (whose requests run as their own client), or a worker key (a controller
/// acting for its clients)? Then a worker shares its queue and inferlet
/// instances per client.
pub fn several_tenants(keys: &[ApiKey]) -> bool {
    let tenants = keys.iter().filter(|k| k.role != Role::Worker).count();
    tenants >= 2 || keys.iter().any(|k| k.role == Role::Worker)
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiKey {
    pub name: String,
    pub key: String,
    #[serde(default)]
    pub role: Role,
    #[serde(default)]
    pub limits: KeyLimits,
}

impl ApiKey {
    pub fn new(name: &str, key: &str, role: Role) -> Self {
        Self {
            name: name.to_string(),
            key: key.to_string(),
            role,
            limits: KeyLimits::default(),
        }
    }
}

/// Keys from a file of `name key [role] [limit=value ...]` lines (blank lines
/// and `#` comments ignored), e.g. `bob sk-b client weight=2 max_priority=5`;
/// the limits are [`KeyLimits`]' fields with TOML values. An error names the
/// 1-based line.
pub fn parse_key_file(text: &str) -> Result<Vec<ApiKey>, (usize, String)> {
    let mut keys = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        keys.push(parse_key_line(line).map_err(|e| (i + 1, e))?);
    }
    Ok(keys)
}

fn parse_key_line(line: &str) -> Result<ApiKey, String> {
    let mut words = line.split_whitespace();
    let (Some(name), Some(key)) = (words.next(), words.next()) else {
        return Err("expected `name key [role] [limit=value ...]`".into());
    };
    let mut api_key = ApiKey::new(name, key, Role::Client);
    let mut limits = String::new();
    for word in words {
        match word.split_once('=') {
            Some((field, value)) => limits.push_str(&format!("{field} = {value}\n")),
            None => {
                api_key.role = Role::parse(word)
                    .ok_or_else(|| format!("unknown role `{word}` (client, worker or admin)"))?;
            }
        }
    }
    api_key.limits = toml::from_str(&limits).map_err(|e| format!("limits: {}", e.message()))?;
    api_key
        .limits
        .validate()
        .map_err(|(field, m)| format!("limits: {field}: {m}"))?;
    Ok(api_key)
}

/// Every key of a server (inline and from its file), checked together: names
/// and secrets must each be unique: a key's name is its holder's identity.
pub fn check_keys(keys: &[ApiKey]) -> Result<(), String> {
    for (i, k) in keys.iter().enumerate() {
        if k.key.is_empty() {
            return Err(format!("key `{}` is empty", k.name));
        }
        if let Err((field, m)) = k.limits.validate() {
            return Err(format!("key `{}`: limits.{field}: {m}", k.name));
        }
        for other in &keys[..i] {
            if other.name == k.name {
                return Err(format!("two keys are named `{}`", k.name));
            }
            if other.key == k.key {
                return Err(format!(
                    "keys `{}` and `{}` are the same secret",
                    other.name, k.name
                ));
            }
        }
    }
    Ok(())
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

/// The key presented in an `Authorization` header value, among `keys`. Every
/// key is compared, each in constant time, so timing tells nothing of how
/// close a guess was or which key it resembled.
pub fn authenticate<'a>(
    keys: &'a [ApiKey],
    authorization: Option<&str>,
) -> Result<&'a ApiKey, AuthError> {
    let presented = authorization
        .and_then(|v| v.strip_prefix("Bearer "))
        .ok_or(AuthError::Missing)?
        .trim()
        .as_bytes();
    keys.iter()
        .fold(None, |found, k| {
            let same = constant_time_eq::constant_time_eq(k.key.as_bytes(), presented);
            found.or(same.then_some(k))
        })
        .ok_or(AuthError::Invalid)
}

/// Who made a request, after authentication.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Caller {
    /// No keys are configured: a single-tenant server, everyone may do everything.
    Open,
    Key {
        name: String,
        role: Role,
    },
}

impl Caller {
    pub fn role(&self) -> Role {
        match self {
            Caller::Open => Role::Admin,
            Caller::Key { role, .. } => *role,
        }
    }

    /// May this caller see and change processes owned by `client`.
    pub fn may_access(&self, client: &str) -> bool {
        match self {
            Caller::Open => true,
            Caller::Key {
                role: Role::Admin, ..
            } => true,
            Caller::Key { name, .. } => name == client,
        }
    }
}

/// Headers a controller (a `worker`-role key) sends with a request it makes
/// for a client, so the worker can apply that client's ownership. Workers
/// ignore them from any other key.
pub const ACT_AS_CLIENT: &str = "x-pie-client";
pub const ACT_AS_ROLE: &str = "x-pie-client-role";
/// The forwarded client's cache salt (its key's `limits.cache_salt`).
pub const ACT_AS_CACHE_SALT: &str = "x-pie-cache-salt";
/// The forwarded client key's limits as JSON (its cache salt left out: it
/// has its own header), so that its inferlets' props changes and time
/// limits on the worker are what its key allows.
pub const ACT_AS_LIMITS: &str = "x-pie-client-limits";

#[cfg(test)]
mod tests {
    use super::*;

    /// Shares bind with two tenant keys, or a controller's worker key, and
    /// never with one tenant alone.
    #[test]
    fn several_tenants_are_two_tenant_keys_or_a_controller() {
        let keys = |text: &str| parse_key_file(text).unwrap();
        assert!(!several_tenants(&[]));
        assert!(!several_tenants(&keys("alice sk-a\n")));
        assert!(several_tenants(&keys("alice sk-a\nroot sk-r admin\n")));
        assert!(several_tenants(&keys("ctl sk-c worker\n")));
    }

    #[test]
    fn key_files_and_bearer_tokens() {
        let keys =
            parse_key_file("# team\nalice sk-a\n\nbob  sk-b  admin\nw1 sk-w worker\n").unwrap();
        assert_eq!(keys.len(), 3);
        assert_eq!(
            (keys[1].name.as_str(), keys[1].key.as_str(), keys[1].role),
            ("bob", "sk-b", Role::Admin)
        );
        assert_eq!(keys[0].role, Role::Client);
        assert_eq!(keys[2].role, Role::Worker);
        assert_eq!(parse_key_file("alice\n").unwrap_err().0, 1);
        assert_eq!(
            authenticate(&keys, Some("Bearer sk-b")).map(|k| &k.name),
            Ok(&"bob".to_string())
        );
        assert_eq!(
            authenticate(&keys, Some("Bearer sk-")),
            Err(AuthError::Invalid)
        );
        assert_eq!(authenticate(&keys, None), Err(AuthError::Missing));
        assert_eq!(
            authenticate(&keys, Some("Basic x")),
            Err(AuthError::Missing)
        );
    }

    #[test]
    fn key_file_limits_and_errors_name_the_line_and_cause() {
        let keys = parse_key_file("bob sk-b client weight=2 max_priority=5 pin=false\n").unwrap();
        assert_eq!(keys[0].limits.weight, 2.0);
        assert_eq!(keys[0].limits.max_priority, Some(5));
        assert!(!keys[0].limits.pin);
        let (line, m) = parse_key_file("a sk-a\nb sk-b boss\n").unwrap_err();
        assert_eq!(line, 2);
        assert!(m.contains("boss"), "{m}");
        let (line, m) = parse_key_file("a sk-a\n\nb sk-b max_prio=3\n").unwrap_err();
        assert_eq!(line, 3);
        assert!(m.contains("max_prio"), "{m}");
        let (_, m) = parse_key_file("a sk-a weight=-1\n").unwrap_err();
        assert!(m.contains("weight"), "{m}");
        let twins = parse_key_file("a sk-a\nb sk-a\n").unwrap();
        assert!(check_keys(&twins).unwrap_err().contains("same secret"));
        let namesakes = parse_key_file("a sk-a\na sk-b\n").unwrap();
        assert!(check_keys(&namesakes)
            .unwrap_err()
            .contains("two keys are named `a`"));
    }

    fn props(json: serde_json::Value) -> Props {
        Props::from_json(&json).unwrap()
    }

    #[test]
    fn limits_refuse_props_beyond_them_and_name_the_limit() {
        let limits = KeyLimits {
            max_priority: Some(5),
            min_deadline_ms: Some(1000),
            max_keep_ms: Some(60_000),
            pin: false,
            ..KeyLimits::default()
        };
        let mut ok = props(serde_json::json!({"priority": 5, "deadline-ms": 1000}));
        limits.apply("bob", &mut ok).unwrap();
        assert_eq!(
            ok.float("weight"),
            Some(1.0),
            "the key's weight is filled in"
        );
        for (bad, prop, says) in [
            (serde_json::json!({"weight": 1e9}), "weight", "limit of 1"),
            (
                serde_json::json!({"priority": 1000000}),
                "priority",
                "limit of 5",
            ),
            (
                serde_json::json!({"deadline-ms": 10}),
                "deadline-ms",
                "below",
            ),
            (serde_json::json!({"keep-ms": 600000}), "keep-ms", "above"),
            (serde_json::json!({"pin": "w1"}), "pin", "may not"),
            (serde_json::json!({"persist": true}), "persist", "may not"),
        ] {
            let e = limits.apply("bob", &mut props(bad)).unwrap_err();
            assert_eq!(e.key, prop);
            assert!(e.reason.contains(says) && e.reason.contains("bob"), "{e}");
        }
    }

    #[test]
    fn callers_see_only_their_own_unless_admin_or_open() {
        let alice = Caller::Key {
            name: "alice".into(),
            role: Role::Client,
        };
        assert!(alice.may_access("alice"));
        assert!(!alice.may_access("bob"));
        let root = Caller::Key {
            name: "root".into(),
            role: Role::Admin,
        };
        assert!(root.may_access("bob"));
        assert!(Caller::Open.may_access("bob"));
    }
}
