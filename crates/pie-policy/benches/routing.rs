//! One routing decision on the controller's hot path, with 64 workers and
//! 1,000,000 indexed blocks in the cluster prefix index: hash the prompt's
//! pages, find every worker's cached prefix, and run the default pipeline
//! (pin, session-affinity, cache-aware). Target: under 20 us (issue 5).
//!
//! And one cache-aware decision at 1,000 workers as the simulator's router
//! makes it (issue 12): every worker's prefix from the index and the pipeline
//! over all of them, against the holders' prefixes from `prefix_holders` and
//! the pipeline over a shortlist (`LoadOrder`), which decides the same.

use criterion::{criterion_group, criterion_main, Criterion};
use pie_core::{block_hashes, ModelFingerprint, PropValue, Props};
use pie_policy::cluster::{
    route, route_among, CacheAware, ClusterIndex, ClusterPolicy, LoadOrder, Pin, RouteRequest,
    SessionAffinity, WorkerView,
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

const MANY_WORKERS: usize = 1000;

/// 1,000 workers with 200 blocks each; every tenth holds the first half of
/// the prompt, none anticipates anything.
fn many_workers(hot: &[u64]) -> (ClusterIndex, ClusterIndex, Vec<WorkerView>) {
    let mut idx = ClusterIndex::new();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for i in 0..MANY_WORKERS * 200 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        idx.store(i % MANY_WORKERS, x);
    }
    for w in (0..MANY_WORKERS).step_by(10) {
        for h in &hot[..hot.len() / 2] {
            idx.store(w, *h);
        }
    }
    let views = (0..MANY_WORKERS)
        .map(|i| WorkerView {
            name: format!("w{i}"),
            load: 2 + i * 7 % 5,
            ..WorkerView::default()
        })
        .collect();
    (idx, ClusterIndex::new(), views)
}

fn bench_many(c: &mut Criterion) {
    let fp = ModelFingerprint(42);
    let tokens = prompt(1);
    let hashes: Vec<u64> = block_hashes(fp, &tokens[..tokens.len() - 1], PAGE)
        .iter()
        .map(|h| h.0)
        .collect();
    let (idx, pending, mut views) = many_workers(&hashes);
    let props = Props::new();
    let req = RouteRequest {
        props: &props,
        prompt_tokens: tokens.len(),
    };
    let mut group = c.benchmark_group("cache_aware_1000_workers");
    let mut pipeline: Vec<Box<dyn ClusterPolicy>> =
        vec![Box::new(CacheAware::new(Default::default()))];
    group.bench_function("all_workers", |b| {
        b.iter(|| {
            let held = idx.prefix_blocks(&hashes, MANY_WORKERS);
            let ahead = idx.prefix_blocks_with(&pending, &hashes, MANY_WORKERS);
            for ((v, held), ahead) in views.iter_mut().zip(held).zip(ahead) {
                v.cached_prefix_tokens = held * PAGE;
                v.anticipated_prefix_tokens = ahead * PAGE;
            }
            route(&mut pipeline, 0, &req, &views).expect("a worker")
        })
    });
    let mut order = LoadOrder::new();
    for (i, v) in views.iter().enumerate() {
        order.set(i, v.load);
    }
    let mut pipeline: Vec<Box<dyn ClusterPolicy>> =
        vec![Box::new(CacheAware::new(Default::default()))];
    let mut holders: Vec<usize> = Vec::new();
    group.bench_function("shortlist", |b| {
        b.iter(|| {
            for &w in &holders {
                views[w].cached_prefix_tokens = 0;
                views[w].anticipated_prefix_tokens = 0;
            }
            holders.clear();
            for h in idx.prefix_holders(&pending, &hashes, MANY_WORKERS) {
                views[h.slot].cached_prefix_tokens = h.held * PAGE;
                views[h.slot].anticipated_prefix_tokens = h.ahead * PAGE;
                holders.push(h.slot);
            }
            let shortlist = order.shortlist(&holders, &[]);
            route_among(&mut pipeline, 0, &req, &views, shortlist).expect("a worker")
        })
    });
    group.finish();
}

criterion_group!(benches, bench, bench_many);
criterion_main!(benches);
