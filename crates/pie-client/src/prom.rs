//! Reading samples out of Prometheus text exposition (`GET /metrics`).

/// The sum of every sample of metric `name` (all label sets), or `None` when
/// the text has no such metric (e.g. a controller's `/metrics`).
pub fn sum(text: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let value = match rest.chars().next() {
            Some('{') => rest.rsplit_once('}').map(|(_, v)| v),
            Some(' ') => Some(rest),
            _ => None, // a longer name sharing this prefix
        };
        if let Some(v) = value.and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok()) {
            *found.get_or_insert(0.0) += v;
        }
    }
    found
}

/// Counter deltas between two scrapes; `None` when either lacks the metric.
pub fn delta(before: &str, after: &str, name: &str) -> Option<f64> {
    Some(sum(after, name)? - sum(before, name)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "# HELP pie_prompt_tokens Prompt tokens computed (prefill).\n\
# TYPE pie_prompt_tokens counter\n\
pie_prompt_tokens_total 1200\n\
pie_prompt_tokens_total_extra 5\n\
pie_requests_total{status=\"finished\"} 7\n\
pie_requests_total{status=\"killed\"} 2 1700000000\n";

    #[test]
    fn samples_sum_over_labels_and_skip_longer_names() {
        assert_eq!(sum(TEXT, "pie_prompt_tokens_total"), Some(1200.0));
        assert_eq!(sum(TEXT, "pie_requests_total"), Some(9.0));
        assert_eq!(sum(TEXT, "pie_prefix_cache_hit_tokens_total"), None);
    }

    #[test]
    fn delta_needs_both_scrapes() {
        let after = TEXT.replace("1200", "1500");
        assert_eq!(delta(TEXT, &after, "pie_prompt_tokens_total"), Some(300.0));
        assert_eq!(delta("", &after, "pie_prompt_tokens_total"), None);
    }
}
