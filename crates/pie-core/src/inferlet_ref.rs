//! How installed inferlets are named, as a worker and a controller take
//! them: `NAME` (its latest upload) or `NAME@VERSION`, each part 1-64 of
//! `a-z A-Z 0-9 . _ -`, starting with a letter or digit.

/// The built-in inferlets' names (reserved: no upload takes them).
pub const BUILT_IN: &[&str] = &["text-completion", "chat"];

/// `reference` as its name and version (None: the latest).
pub fn split(reference: &str) -> (&str, Option<&str>) {
    match reference.split_once('@') {
        Some((name, version)) => (name, Some(version)),
        None => (reference, None),
    }
}

/// Whether `value` may name an inferlet or a version (`what` says which, for
/// the error).
pub fn check_part(what: &str, value: &str) -> Result<(), String> {
    let ok = (1..=64).contains(&value.len())
        && value
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphanumeric())
        && (value.chars()).all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    match ok {
        true => Ok(()),
        false => Err(format!(
            "{what} `{value}`: 1 to 64 of a-z, A-Z, 0-9, '.', '_', '-', starting with a letter or digit"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_split_and_bad_parts_are_named() {
        assert_eq!(split("agent@1.2"), ("agent", Some("1.2")));
        assert_eq!(split("agent"), ("agent", None));
        assert!(check_part("name", "my-agent_2.0").is_ok());
        for bad in ["", "-x", "a b", "a@b", &"x".repeat(65)] {
            let e = check_part("name", bad).unwrap_err();
            assert!(e.starts_with("name `"), "{e}");
        }
    }
}
