//! Reading samples out of Prometheus text exposition (`GET /metrics`).

/// Every sample of the text: its series (the name, with its labels as
/// written) and value; comments and lines that are no sample are skipped.
pub fn samples(text: &str) -> impl Iterator<Item = (&str, f64)> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|line| {
            let (series, rest) = match line.find('{') {
                Some(_) => {
                    let close = line.rfind('}')?;
                    (&line[..=close], &line[close + 1..])
                }
                None => line.split_once(' ')?,
            };
            let value = rest.split_whitespace().next()?.parse().ok()?;
            Some((series, value))
        })
}

/// The sum of every sample of metric `name` (all label sets; a name with
/// labels picks that series), or `None` when the text has no such metric
/// (e.g. a controller's `/metrics`).
pub fn sum(text: &str, name: &str) -> Option<f64> {
    let of_name = |series: &str| {
        series == name
            || series
                .strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{'))
    };
    samples(text)
        .filter(|(series, _)| of_name(series))
        .map(|(_, value)| value)
        .reduce(|a, b| a + b)
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

    #[test]
    fn every_sample_is_read_with_its_series() {
        let read: Vec<(&str, f64)> = samples(TEXT).collect();
        assert_eq!(read.len(), 4);
        assert_eq!(read[3], ("pie_requests_total{status=\"killed\"}", 2.0));
        assert_eq!(
            sum(TEXT, "pie_requests_total{status=\"killed\"}"),
            Some(2.0)
        );
        let odd = "x{le=\"+Inf\"} +Inf\nnot a sample\n";
        assert_eq!(
            samples(odd).collect::<Vec<_>>(),
            [("x{le=\"+Inf\"}", f64::INFINITY)]
        );
    }
}
