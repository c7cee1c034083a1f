//! Props: small typed key-value attributes on a process, read by policies.
//!
//! Limits: at most [`MAX_PROPS`] props, keys of at most [`MAX_KEY_BYTES`] bytes of
//! `[a-z0-9-]`, string values of at most [`MAX_STRING_BYTES`] bytes. The props the
//! built-in policies read ([`KNOWN_PROPS`]) must have their documented type.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

pub const MAX_PROPS: usize = 64;
pub const MAX_KEY_BYTES: usize = 64;
pub const MAX_STRING_BYTES: usize = 1024;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum PropValue {
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PropType {
    Int,
    Float,
    Bool,
    Str,
}

impl fmt::Display for PropType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PropType::Int => "an integer",
            PropType::Float => "a number",
            PropType::Bool => "a boolean",
            PropType::Str => "a string",
        })
    }
}

/// The props that built-in policies read, with their types (DESIGN.md).
pub const KNOWN_PROPS: &[(&str, PropType)] = &[
    ("priority", PropType::Int),
    ("keep-ms", PropType::Int),
    ("deadline-ms", PropType::Int),
    ("client", PropType::Str),
    ("weight", PropType::Float),
    ("session", PropType::Str),
    ("pin", PropType::Str),
    ("persist", PropType::Bool),
];

/// The props that say who a process is: set at launch from its key, never
/// changed by a patch (a client's or its own guest's), so no process can
/// charge its service to another client or read as another tenant.
pub const IDENTITY_PROPS: &[&str] = &["client"];

/// A prop that breaks the rules, with the key that does.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("prop `{key}`: {reason}")]
pub struct PropError {
    pub key: String,
    pub reason: String,
}

fn prop_error(key: &str, reason: impl Into<String>) -> PropError {
    PropError {
        key: key.to_string(),
        reason: reason.into(),
    }
}

/// A process's props, ordered by key.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Props(BTreeMap<String, PropValue>);

impl Props {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn get(&self, key: &str) -> Option<&PropValue> {
        self.0.get(key)
    }

    pub fn int(&self, key: &str) -> Option<i64> {
        match self.0.get(key) {
            Some(PropValue::Int(v)) => Some(*v),
            _ => None,
        }
    }

    pub fn float(&self, key: &str) -> Option<f64> {
        match self.0.get(key) {
            Some(PropValue::Float(v)) => Some(*v),
            Some(PropValue::Int(v)) => Some(*v as f64),
            _ => None,
        }
    }

    pub fn bool(&self, key: &str) -> Option<bool> {
        match self.0.get(key) {
            Some(PropValue::Bool(v)) => Some(*v),
            _ => None,
        }
    }

    pub fn str(&self, key: &str) -> Option<&str> {
        match self.0.get(key) {
            Some(PropValue::Str(v)) => Some(v),
            _ => None,
        }
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&String, &PropValue)> {
        self.0.iter()
    }

    /// Set one prop after checking it; the props are unchanged on error.
    pub fn set(&mut self, key: &str, value: PropValue) -> Result<(), PropError> {
        check_key(key)?;
        let value = check_value(key, value)?;
        if !self.0.contains_key(key) && self.0.len() >= MAX_PROPS {
            return Err(prop_error(
                key,
                format!("a process may have at most {MAX_PROPS} props"),
            ));
        }
        self.0.insert(key.to_string(), value);
        Ok(())
    }

    /// Apply every entry of `other` (a JSON object); all or nothing. A JSON null
    /// removes the key.
    pub fn merge_json(
        &mut self,
        other: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<(), PropError> {
        let mut next = self.clone();
        for (key, value) in other {
            if value.is_null() {
                next.0.remove(key);
            } else {
                next.set(key, from_json(key, value)?)?;
            }
        }
        *self = next;
        Ok(())
    }

    /// A running process's patch: [`Props::merge_json`], refusing any
    /// [`IDENTITY_PROPS`] key (set or removed).
    pub fn patch_json(
        &mut self,
        patch: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<(), PropError> {
        if let Some(key) = patch.keys().find(|k| IDENTITY_PROPS.contains(&k.as_str())) {
            return Err(prop_error(
                key,
                "is the process's identity, set at launch from its key; it cannot change",
            ));
        }
        self.merge_json(patch)
    }

    /// Props from a JSON object.
    pub fn from_json(value: &serde_json::Value) -> Result<Self, PropError> {
        let obj = value
            .as_object()
            .ok_or_else(|| prop_error("props", "must be a JSON object"))?;
        let mut props = Props::new();
        props.merge_json(obj)?;
        Ok(props)
    }
}

fn check_key(key: &str) -> Result<(), PropError> {
    if key.is_empty() || key.len() > MAX_KEY_BYTES {
        return Err(prop_error(
            key,
            format!("keys are 1 to {MAX_KEY_BYTES} bytes"),
        ));
    }
    if !key
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    {
        return Err(prop_error(key, "keys use only a-z, 0-9 and -"));
    }
    Ok(())
}

fn check_value(key: &str, value: PropValue) -> Result<PropValue, PropError> {
    if let PropValue::Str(s) = &value {
        if s.len() > MAX_STRING_BYTES {
            return Err(prop_error(
                key,
                format!(
                    "string values are at most {MAX_STRING_BYTES} bytes, got {}",
                    s.len()
                ),
            ));
        }
    }
    let Some((_, want)) = KNOWN_PROPS.iter().find(|(k, _)| *k == key) else {
        return Ok(value);
    };
    let value = match (want, value) {
        (PropType::Float, PropValue::Int(v)) => PropValue::Float(v as f64),
        (_, v) => v,
    };
    let ok = matches!(
        (want, &value),
        (PropType::Int, PropValue::Int(_))
            | (PropType::Float, PropValue::Float(_))
            | (PropType::Bool, PropValue::Bool(_))
            | (PropType::Str, PropValue::Str(_))
    );
    if !ok {
        return Err(prop_error(key, format!("must be {want}")));
    }
    if key == "weight" && !matches!(value, PropValue::Float(w) if w > 0.0 && w.is_finite()) {
        return Err(prop_error(key, "must be a number > 0"));
    }
    // A deadline at or before arrival would jump an EDF queue for nothing.
    if key == "deadline-ms" && !matches!(value, PropValue::Int(d) if d > 0) {
        return Err(prop_error(
            key,
            "must be a whole number of ms > 0 (after arrival)",
        ));
    }
    if key == "keep-ms" && !matches!(value, PropValue::Int(k) if k >= 0) {
        return Err(prop_error(key, "must be a whole number of ms >= 0"));
    }
    Ok(value)
}

fn from_json(key: &str, value: &serde_json::Value) -> Result<PropValue, PropError> {
    use serde_json::Value as J;
    Ok(match value {
        J::Bool(b) => PropValue::Bool(*b),
        J::Number(n) => match n.as_i64() {
            Some(i) => PropValue::Int(i),
            None => PropValue::Float(
                n.as_f64()
                    .ok_or_else(|| prop_error(key, "number out of range"))?,
            ),
        },
        J::String(s) => PropValue::Str(s.clone()),
        _ => {
            return Err(prop_error(
                key,
                "values are integers, numbers, booleans or strings",
            ))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn typed_known_props_and_free_ones() {
        let p = Props::from_json(
            &json!({"priority": 3, "weight": 2, "session": "s1", "my-flag": true, "x": 1.5}),
        )
        .unwrap();
        assert_eq!(p.int("priority"), Some(3));
        assert_eq!(p.get("weight"), Some(&PropValue::Float(2.0)));
        assert_eq!(p.str("session"), Some("s1"));
        assert_eq!(p.get("my-flag"), Some(&PropValue::Bool(true)));
        assert_eq!(serde_json::to_value(&p).unwrap()["x"], json!(1.5));
    }

    #[test]
    fn bad_props_name_the_key() {
        let err = |v| Props::from_json(&v).unwrap_err().key;
        assert_eq!(err(json!({"priority": "high"})), "priority");
        assert_eq!(err(json!({"weight": 0})), "weight");
        assert_eq!(err(json!({"deadline-ms": 0})), "deadline-ms");
        assert_eq!(err(json!({"deadline-ms": -5})), "deadline-ms");
        assert_eq!(err(json!({"keep-ms": -1})), "keep-ms");
        assert_eq!(err(json!({"Bad_Key": 1})), "Bad_Key");
        assert_eq!(err(json!({"nested": {"a": 1}})), "nested");
        assert_eq!(err(json!({"s": "x".repeat(1025)})), "s");
        let many: serde_json::Map<_, _> = (0..65).map(|i| (format!("k{i}"), json!(i))).collect();
        assert!(Props::from_json(&serde_json::Value::Object(many))
            .unwrap_err()
            .reason
            .contains("at most 64"));
        assert_eq!(err(json!([1])), "props");
    }

    #[test]
    fn merge_is_all_or_nothing_and_null_removes() {
        let mut p = Props::from_json(&json!({"priority": 1, "tag": "a"})).unwrap();
        assert!(p
            .merge_json(json!({"priority": 5, "weight": -1}).as_object().unwrap())
            .is_err());
        assert_eq!(p.int("priority"), Some(1));
        let patch = |v: serde_json::Value| v.as_object().unwrap().clone();
        let mut who = Props::from_json(&json!({"client": "alice"})).unwrap();
        let err = who
            .patch_json(&patch(json!({"priority": 1, "client": "bob"})))
            .unwrap_err();
        assert_eq!(err.key, "client");
        assert!(who.patch_json(&patch(json!({"client": null}))).is_err());
        assert_eq!(
            (who.str("client"), who.int("priority")),
            (Some("alice"), None)
        );
        who.patch_json(&patch(json!({"priority": 1}))).unwrap();
        assert_eq!(who.int("priority"), Some(1));
        p.merge_json(json!({"priority": 5, "tag": null}).as_object().unwrap())
            .unwrap();
        assert_eq!(p.int("priority"), Some(5));
        assert_eq!(p.get("tag"), None);
    }
}
