//! `replicate` in the simulator: on `shared-prefix` with one system prompt
//! taking about half the traffic and a small `max_running` (so the hot
//! worker's own limit binds), the hot prefix is copied to other workers, the
//! sent bytes are the pages' KV, every request still produces its output, and
//! the intended effect: TTFT p99 drops against cache-aware alone.

mod common;

use common::{hot_system_prompt, HOT_REQUESTS as REQUESTS};
use pie_policy::cluster::Action;
use pie_sim::disaggregate::kv_bytes_per_token;
use pie_sim::{CostProfile, RunMetrics};

fn sim(router: &str) -> RunMetrics {
    hot_system_prompt(router, |_| {})
}

#[test]
fn replicate_copies_the_hot_prefix_without_recompute_and_cuts_ttft_p99() {
    let plain = sim("cache-aware");
    let copied = sim("cache-aware,replicate");
    for m in [&plain, &copied] {
        assert_eq!(m.completed, REQUESTS, "{}", m.router);
        assert_eq!(m.wrong_output_lengths, 0, "{}", m.router);
    }
    assert!(plain.copies.is_none(), "no actor, no copy figures");
    let c = copied.copies.as_ref().expect("an actor ran");
    let copies: Vec<(&str, &str)> = copied
        .actions
        .iter()
        .map(|a| match &a.action {
            Action::CopyPrefix { from, to, .. } => (from.as_str(), to.as_str()),
            other => panic!("{other:?}"),
        })
        .collect();
    assert!(
        !copies.is_empty() && c.copies == copies.len() as u64,
        "{c:?}"
    );
    assert!(copies.iter().all(|(from, to)| from != to));
    let profile = CostProfile::gpu_a100_llama3_8b();
    assert!(c.pages > 0, "{c:?}");
    assert_eq!(
        c.bytes,
        c.pages * 16 * kv_bytes_per_token(&profile, pie_core::KvDtype::F32)
    );
    assert!(c.received >= c.pages, "every sent page taken: {c:?}");
    assert!(
        copied.ttft_ms.p99 < 0.8 * plain.ttft_ms.p99,
        "TTFT p99 with replicate {} vs {}",
        copied.ttft_ms.p99,
        plain.ttft_ms.p99
    );
}
