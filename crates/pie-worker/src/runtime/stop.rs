//! Stop strings in streamed text: a leaf helper of the built-in inferlets'
//! driver.
//!
//! Invariant: no part of a stop string is ever emitted (a possible stop
//! string's beginning is held back until it is known not to be one).

/// Finds stop strings in streamed text, holding back a possible stop string's
/// beginning so that no part of a stop string is ever emitted.
pub(super) struct StopScanner<'a> {
    stops: &'a [String],
    pending: String,
    hold: usize,
}

impl<'a> StopScanner<'a> {
    pub(super) fn new(stops: &'a [String]) -> Self {
        let hold = stops
            .iter()
            .map(String::len)
            .max()
            .unwrap_or(0)
            .saturating_sub(1);
        Self {
            stops,
            pending: String::new(),
            hold,
        }
    }

    /// Text safe to emit now, and whether a stop string was found.
    pub(super) fn push(&mut self, delta: &str) -> (String, bool) {
        self.pending.push_str(delta);
        if let Some(at) = self
            .stops
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| self.pending.find(s.as_str()))
            .min()
        {
            let emit = self.pending[..at].to_string();
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
