//! `pie-pool`'s Prometheus metrics (`GET /metrics`), read from the store's
//! counters when scraped.

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

use crate::store::PageStore;

/// The metrics text of `store` now.
pub fn encode_store(store: &PageStore) -> String {
    let mut registry = Registry::with_prefix("pie_pool");
    let (pages, bytes, disk_pages) = store.sizes();
    let gauges = [
        ("pages", "Pages in memory", pages as i64),
        ("bytes", "Bytes of pages in memory", bytes as i64),
        ("disk_pages", "Pages on the disk tier", disk_pages as i64),
    ];
    for (name, help, value) in gauges {
        registry.register(name, help, ConstGauge::new(value));
    }
    let c = store.counts;
    let counters = [
        ("stored_pages", "Pages taken in (pushes)", c.stored),
        ("memory_hits", "Pages served from memory", c.hits_memory),
        ("disk_hits", "Pages served from the disk tier", c.hits_disk),
        (
            "misses",
            "Pulls that ended at a page the pool lacks",
            c.misses,
        ),
        (
            "evicted_pages",
            "Pages evicted from memory past the high watermark",
            c.evicted,
        ),
        (
            "refused_pages",
            "Pages refused on the way in or read back damaged",
            c.refused,
        ),
        (
            "deleted_pages",
            "Pages deleted (by prefix, by age, TTL)",
            c.deleted,
        ),
    ];
    for (name, help, value) in counters {
        registry.register(name, help, ConstCounter::new(value));
    }
    let mut out = String::new();
    encode(&mut out, &registry).expect("writing to a String");
    out
}
