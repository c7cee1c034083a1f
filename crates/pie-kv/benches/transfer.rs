//! The page codec's throughput on SmolLM2-135M's page shape (30 layers, 16
//! tokens, KV width 192: 737 KB per page in f32): exporting a page, checking
//! it as a receiver does (checksum and chain), importing it. Together they
//! bound what one core moves per second (docs/benchmarks/kv-transfer.md compares it with
//! recomputing the prefix).

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use pie_core::{BlockHash, ModelFingerprint};
use pie_kv::stream::{frame, StreamCheck, StreamHeader};
use pie_kv::transfer::{export_page, import_page, page_bytes_len, PageFormat};
use pie_kv::{KvLayout, KvPool};

const LAYOUT: KvLayout = KvLayout {
    layers: 30,
    page_size: 16,
    kv_dim: 192,
};

fn source() -> (KvPool, Vec<u8>) {
    let mut pool = KvPool::new(LAYOUT, 2, ModelFingerprint(7));
    let page = pool.allocate().expect("room");
    for layer in 0..LAYOUT.layers {
        for slot in 0..LAYOUT.page_size {
            let row: Vec<f32> = (0..LAYOUT.kv_dim)
                .map(|i| (layer * 31 + slot * 7 + i) as f32 * 0.001)
                .collect();
            pool.write(layer, page, slot, &row, &row);
        }
    }
    pool.publish(page, BlockHash(1));
    let bytes = export_page(&pool, page).expect("exports");
    (pool, bytes)
}

fn codec(c: &mut Criterion) {
    let (pool, bytes) = source();
    let page = pool.lookup(BlockHash(1)).expect("published");
    let format = PageFormat::of(&pool);
    let mut group = c.benchmark_group("page");
    group.throughput(Throughput::Bytes(page_bytes_len(&format) as u64));
    group.bench_function("export", |b| b.iter(|| export_page(&pool, page)));
    let header = StreamHeader::new(format).frame();
    group.bench_function("check", |b| {
        b.iter(|| {
            let mut check = StreamCheck::new(format, vec![BlockHash(1)], 0);
            check.frame(header[4..].to_vec()).expect("header");
            check.frame(bytes.clone()).expect("page")
        })
    });
    group.bench_function("frame", |b| b.iter(|| frame(&bytes)));
    group.bench_function("import", |b| {
        let mut into = KvPool::new(LAYOUT, 1, ModelFingerprint(7));
        b.iter(|| {
            let imported = import_page(&mut into, &bytes).expect("imports");
            // Evicted and freed again so every iteration copies the page in.
            if let Ok(evicted) = into.allocate() {
                into.release(evicted);
            }
            imported
        })
    });
    group.finish();
}

criterion_group!(benches, codec);
criterion_main!(benches);
