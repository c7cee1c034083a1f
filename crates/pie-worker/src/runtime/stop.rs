//! Stop strings in streamed text: a leaf helper of the built-in inferlets'
//! driver.
//!
//! Invariant: no part of a stop string is emitted unless the rules keep it
//! (a possible stop string's beginning is held back until it is known not
//! to be one), and none is looked for in the first `min_tokens` tokens'
//! text (emitted as it comes).

use super::request::TextRules;

/// Finds stop strings in streamed text, holding back a possible stop string's
/// beginning so that no part of a stop string is ever emitted.
pub(super) struct StopScanner<'a> {
    rules: &'a TextRules,
    pending: String,
    hold: usize,
    /// Deltas pushed so far (one a token).
    pushed: usize,
}

impl<'a> StopScanner<'a> {
    pub(super) fn new(rules: &'a TextRules) -> Self {
        let hold = (rules.stop.iter())
            .map(String::len)
            .max()
            .unwrap_or(0)
            .saturating_sub(1);
        Self {
            rules,
            pending: String::new(),
            hold,
            pushed: 0,
        }
    }

    /// Text safe to emit now, and whether a stop string was found.
    pub(super) fn push(&mut self, delta: &str) -> (String, bool) {
        self.pending.push_str(delta);
        self.pushed += 1;
        if self.pushed < self.rules.min_tokens {
            return (std::mem::take(&mut self.pending), false);
        }
        if let Some((at, len)) = (self.rules.stop.iter())
            .filter(|s| !s.is_empty())
            .filter_map(|s| self.pending.find(s.as_str()).map(|at| (at, s.len())))
            .min()
        {
            let end = if self.rules.keep_stop { at + len } else { at };
            let emit = self.pending[..end].to_string();
            self.pending.clear();
            return (emit, true);
        }
        let mut cut = self.pending.len().saturating_sub(self.hold);
        while !self.pending.is_char_boundary(cut) {
            cut -= 1;
        }
        let rest = self.pending.split_off(cut);
        (std::mem::replace(&mut self.pending, rest), false)
    }

    pub(super) fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn emitted(rules: &TextRules, deltas: &[&str]) -> (String, bool) {
        let mut scanner = StopScanner::new(rules);
        let mut out = String::new();
        for delta in deltas {
            let (emit, stopped) = scanner.push(delta);
            out.push_str(&emit);
            if stopped {
                return (out, true);
            }
        }
        out.push_str(&scanner.flush());
        (out, false)
    }

    fn stop_at(s: &str) -> TextRules {
        TextRules {
            stop: vec![s.into()],
            ..TextRules::default()
        }
    }

    #[test]
    fn a_stop_string_across_deltas_is_cut_and_not_emitted() {
        let rules = stop_at("END");
        assert_eq!(
            emitted(&rules, &["ab", "cE", "ND", "x"]),
            ("abc".into(), true)
        );
        assert_eq!(emitted(&rules, &["ab", "cE", "N"]), ("abcEN".into(), false));
    }

    #[test]
    fn kept_stop_strings_are_emitted_whole() {
        let rules = TextRules {
            keep_stop: true,
            ..stop_at("END")
        };
        assert_eq!(
            emitted(&rules, &["ab", "cE", "NDx"]),
            ("abcEND".into(), true)
        );
    }

    #[test]
    fn no_stop_string_is_looked_for_before_min_tokens() {
        let rules = TextRules {
            min_tokens: 3,
            ..stop_at(".")
        };
        assert_eq!(
            emitted(&rules, &["a.", "b.", "c.", "d"]),
            ("a.b.c".into(), true)
        );
        let rules = TextRules {
            min_tokens: 5,
            ..stop_at(".")
        };
        assert_eq!(emitted(&rules, &["a.", "b."]), ("a.b.".into(), false));
    }
}
