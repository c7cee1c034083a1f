//! One routing decision on the controller's hot path, with 64 workers and
//! 1,000,000 indexed blocks in the cluster prefix index: hash the prompt's
//! pages, find every worker's cached prefix, and run the default pipeline
//! (pin, session-affinity, cache-aware). Target: under 20 us (issue 5).

use criterion::{criterion_group, criterion_main, Criterion};
use pie_core::{block_hashes, ModelFingerprint, PropValue, Props};
use pie_policy::cluster::{
    route, CacheAware, ClusterIndex, ClusterPolicy, Pin, RouteRequest, SessionAffinity, WorkerView,
};

const WORKERS: usize = 64;
const INDEXED_BLOCKS: usize = 1_000_000;
const PAGE: usize = 16;
const PROMPT_TOKENS: usize = 2048;

fn prompt(seed: u32) -> Vec<u32> {
    (0..PROMPT_TOKENS as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) ^ seed) % 49_152)
        .collect()
}

/// Every worker holds its share of random blocks; worker 7 also holds the
/// first half of the benchmarked prompt, so the walk goes 64 blocks deep.
fn index(hot: &[u64]) -> ClusterIndex {
    let mut idx = ClusterIndex::new();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for i in 0..INDEXED_BLOCKS {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        idx.store(i % WORKERS, x);
    }
    for h in &hot[..hot.len() / 2] {
        idx.store(7, *h);
    }
    idx
}

fn bench(c: &mut Criterion) {
    let fp = ModelFingerprint(42);
    let tokens = prompt(1);
    let hot: Vec<u64> = block_hashes(fp, &tokens, PAGE)
        .iter()
        .map(|h| h.0)
        .collect();
    let idx = index(&hot);
    let names: Vec<String> = (0..WORKERS).map(|i| format!("w{i}")).collect();
    let mut pipeline: Vec<Box<dyn ClusterPolicy>> = vec![
        Box::new(Pin::new(Default::default())),
        Box::new(SessionAffinity::new(Default::default())),
        Box::new(CacheAware::new(Default::default())),
    ];
    let mut props = Props::new();
    props
        .set("session", PropValue::Str("bench".into()))
        .expect("valid prop");
    c.bench_function("route_64_workers_1m_blocks", |b| {
        b.iter(|| {
            let hashes: Vec<u64> = block_hashes(fp, &tokens[..tokens.len() - 1], PAGE)
                .iter()
                .map(|h| h.0)
                .collect();
            let depth = idx.prefix_blocks(&hashes, WORKERS);
            let views: Vec<WorkerView> = names
                .iter()
                .zip(&depth)
                .enumerate()
                .map(|(i, (name, d))| WorkerView {
                    name: name.clone(),
                    load: i % 5,
                    cached_prefix_tokens: d * PAGE,
                    ..WorkerView::default()
                })
                .collect();
            let req = RouteRequest {
                props: &props,
                prompt_tokens: tokens.len(),
            };
            route(&mut pipeline, 0, &req, &views).expect("a worker")
        })
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
