//! Per-step ordering cost of each ordering policy at 10, 1,000 and 10,000
//! runnable processes. Compare with the engine's step time on the default model
//! (`pie engine-bench`; docs/benchmarks/controller.md gives the ratio).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use pie_core::{PropValue, Props, SeqId};
use pie_policy::{Candidate, Deadline, Fair, Fcfs, Priority, WorkerPolicy};

fn candidates(n: usize) -> Vec<Candidate> {
    (0..n)
        .map(|i| {
            let mut props = Props::new();
            props
                .set("priority", PropValue::Int((i % 5) as i64))
                .expect("valid prop");
            props
                .set("deadline-ms", PropValue::Int((i * 37 % 1000) as i64))
                .expect("valid prop");
            Candidate {
                seq: SeqId(i as u64),
                arrival_ms: (i * 7919 % 10_000) as u64,
                running: i % 3 == 0,
                prefill_tokens: i % 100,
                client: format!("client-{}", i % 16),
                props,
            }
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("order");
    for n in [10usize, 1_000, 10_000] {
        let base = candidates(n);
        let policies: Vec<Box<dyn WorkerPolicy>> = vec![
            Box::new(Fcfs),
            Box::new(Fair::default()),
            Box::new(Priority::default()),
            Box::new(Deadline::default()),
        ];
        for mut policy in policies {
            group.bench_with_input(BenchmarkId::new(policy.name(), n), &base, |b, base| {
                b.iter_batched_ref(
                    || base.clone(),
                    |cands| policy.order(1_000, cands),
                    criterion::BatchSize::LargeInput,
                )
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
