//! The environment chat templates render in, made to behave as Hugging
//! Face's (Python Jinja2 plus `transformers`' additions), since templates
//! are written and trained against that: Python's `str` methods, `tojson`
//! as `json.dumps(..., ensure_ascii=False)` writes it (", " and ": ", no
//! HTML escapes), `none is iterable` false, `raise_exception`,
//! `strftime_now`, and the `{% generation %}` marks (which only tag the
//! assistant's text for training) dropped.

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind};
use serde_json::Value as Json;

/// `template` compiled into its own environment, or its syntax error.
pub(super) fn chat_environment(template: String) -> Result<Environment<'static>, String> {
    let mut env = Environment::new();
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |msg: String| -> Result<String, Error> {
        Err(Error::new(ErrorKind::InvalidOperation, msg))
    });
    env.add_function("strftime_now", |format: String| {
        strftime(&format, now_utc())
    });
    env.add_filter("tojson", tojson);
    env.add_test("iterable", |v: &Value| {
        !v.is_none() && !v.is_undefined() && v.try_iter().is_ok()
    });
    env.add_template_owned("chat", without_generation_marks(&template))
        .map_err(|e| e.to_string())?;
    Ok(env)
}

/// The template without its `{% generation %}` and `{% endgeneration %}`
/// tags (whitespace control marks included).
fn without_generation_marks(template: &str) -> String {
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(open) = rest.find("{%") {
        let Some(len) = rest[open..].find("%}").map(|close| close + 2) else {
            break;
        };
        let inner =
            rest[open + 2..open + len - 2].trim_matches(|c: char| c == '-' || c.is_whitespace());
        out.push_str(&rest[..open]);
        if !matches!(inner, "generation" | "endgeneration") {
            out.push_str(&rest[open..open + len]);
        }
        rest = &rest[open + len..];
    }
    out.push_str(rest);
    out
}

/// `json.dumps(value, ensure_ascii=False, indent=indent,
/// separators=separators, sort_keys=sort_keys)`, as `transformers` defines
/// `tojson`.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let _ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let (item, key) = match separators.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators is (item, key)",
            ))
        }
        // Python's defaults: no space before a newline.
        None if indent.is_some() => (",".into(), ": ".into()),
        None => (", ".into(), ": ".into()),
    };
    let json = serde_json::to_value(value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let style = Style {
        indent,
        item,
        key,
        sort_keys: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    style.write(&json, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

struct Style {
    indent: Option<usize>,
    item: String,
    key: String,
    sort_keys: bool,
}

impl Style {
    fn write(&self, v: &Json, depth: usize, out: &mut String) {
        match v {
            Json::Array(items) if !items.is_empty() => {
                self.write_seq('[', ']', items.iter().map(|i| (None, i)), depth, out)
            }
            Json::Object(map) if !map.is_empty() => {
                let mut entries: Vec<(&String, &Json)> = map.iter().collect();
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                let entries = entries.into_iter().map(|(k, v)| (Some(k), v));
                self.write_seq('{', '}', entries, depth, out)
            }
            Json::String(s) => write_string(s, out),
            other => out.push_str(&other.to_string()),
        }
    }

    fn write_seq<'a>(
        &self,
        open: char,
        close: char,
        entries: impl Iterator<Item = (Option<&'a String>, &'a Json)>,
        depth: usize,
        out: &mut String,
    ) {
        out.push(open);
        for (i, (key, value)) in entries.enumerate() {
            if i > 0 {
                out.push_str(&self.item);
            }
            self.newline(depth + 1, out);
            if let Some(key) = key {
                write_string(key, out);
                out.push_str(&self.key);
            }
            self.write(value, depth + 1, out);
        }
        self.newline(depth, out);
        out.push(close);
    }

    fn newline(&self, depth: usize, out: &mut String) {
        if let Some(width) = self.indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', width * depth));
        }
    }
}

/// A JSON string as Python writes it with `ensure_ascii=False`.
fn write_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Seconds since the Unix epoch.
fn now_utc() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const DAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// Python's `strftime` for the date and time specifiers templates use
/// (`%Y %y %m %d %B %b %A %a %H %M %S %%`), in UTC; any other is an error.
fn strftime(format: &str, epoch_secs: i64) -> Result<String, Error> {
    let days = epoch_secs.div_euclid(86_400);
    let secs = epoch_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    // 1970-01-01 was a Thursday (index 3 from Monday).
    let weekday = (days + 3).rem_euclid(7) as usize;
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('B') => out.push_str(MONTHS[month as usize - 1]),
            Some('b') => out.push_str(&MONTHS[month as usize - 1][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('H') => out.push_str(&format!("{:02}", secs / 3600)),
            Some('M') => out.push_str(&format!("{:02}", secs / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", secs % 60)),
            Some('%') => out.push('%'),
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("strftime_now: %{} is not supported", other.unwrap_or(' ')),
                ))
            }
        }
    }
    Ok(out)
}

/// (year, month 1-12, day 1-31) of a day count since 1970-01-01 (Howard
/// Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(template: &str, ctx: Value) -> String {
        let env = chat_environment(template.into()).unwrap();
        env.get_template("chat").unwrap().render(ctx).unwrap()
    }

    /// `tojson` writes what Python's `json.dumps(ensure_ascii=False)` does.
    #[test]
    fn tojson_writes_as_python_does() {
        let ctx = minijinja::context! {
            x => serde_json::json!({"b": [1, 2.5, "é<\"\n"], "a": {}, "c": null, "d": true})
        };
        assert_eq!(
            render("{{ x | tojson }}", ctx.clone()),
            r#"{"b": [1, 2.5, "é<\"\n"], "a": {}, "c": null, "d": true}"#
        );
        assert_eq!(
            render("{{ x | tojson(indent=2, sort_keys=true) }}", ctx.clone()),
            "{\n  \"a\": {},\n  \"b\": [\n    1,\n    2.5,\n    \"é<\\\"\\n\"\n  ],\n  \"c\": null,\n  \"d\": true\n}"
        );
        assert_eq!(
            render(
                "{{ x.b | tojson(ensure_ascii=False, separators=(',', ':')) }}",
                ctx
            ),
            r#"[1,2.5,"é<\"\n"]"#
        );
    }

    #[test]
    fn none_is_not_iterable_and_generation_marks_are_dropped() {
        let t = "{% if tools is iterable %}tools{% else %}none{% endif %}|{% generation %}a{%- endgeneration -%}";
        assert_eq!(render(t, minijinja::context! { tools => () }), "none|a");
        assert_eq!(
            render(t, minijinja::context! { tools => vec![1] }),
            "tools|a"
        );
    }

    #[test]
    fn strftime_formats_the_date() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        let t = 1_709_211_909;
        assert_eq!(
            strftime("%Y-%m-%d %H:%M:%S %a %A %b %B %y %%", t).unwrap(),
            "2024-02-29 13:05:09 Thu Thursday Feb February 24 %"
        );
        assert_eq!(strftime("%d %B %Y", 0).unwrap(), "01 January 1970");
        assert!(strftime("%Q", 0).is_err());
        let today = render("{{ strftime_now('%Y') }}", minijinja::context! {});
        assert!(today.parse::<i64>().unwrap() >= 2026);
    }
}
