//! `disaggregate` in the simulator: prefill-stage workers only prefill, remote
//! prefills follow the policy's threshold, transfers cost time, work is
//! conserved, and the intended effect: long prefills stop stalling the decode
//! streams (inter-token latency p99).

use pie_sim::workload::PrefillDecodeMix;
use pie_sim::{run, CostProfile, PolicyName, RunMetrics, SimConfig, WorkloadSpec};

const WORKERS: usize = 8;
const PREFILL_WORKERS: usize = 2;
const REQUESTS: usize = 2000;

fn mix(long_prompt_len: u32) -> WorkloadSpec {
    let WorkloadSpec::PrefillDecodeMix(w) = WorkloadSpec::named("prefill-decode-mix").unwrap()
    else {
        panic!("prefill-decode-mix is its own kind");
    };
    let mut spec = WorkloadSpec::PrefillDecodeMix(PrefillDecodeMix {
        long_prompt_len,
        ..w
    });
    spec.scale_rate(WORKERS as f64);
    spec
}

fn sim(spec: &WorkloadSpec, prefill_workers: usize, profile: CostProfile) -> RunMetrics {
    let router = match prefill_workers {
        0 => "cache-aware",
        _ => "disaggregate,cache-aware",
    };
    let mut cfg = SimConfig::new(
        WORKERS,
        PolicyName::Fcfs,
        router.parse().expect("valid router"),
        profile,
    );
    cfg.prefill_workers = prefill_workers;
    let reqs = spec.generate(REQUESTS, 11);
    run(&cfg, spec.name(), &reqs).expect("simulation runs")
}

fn gpu() -> CostProfile {
    CostProfile::gpu_a100_llama3_8b()
}

#[test]
fn prefill_workers_never_decode_and_work_is_conserved() {
    let spec = mix(2000);
    let colocated = sim(&spec, 0, gpu());
    let split = sim(&spec, PREFILL_WORKERS, gpu());
    assert!(colocated.disaggregation.is_none());
    let d = split.disaggregation.as_ref().expect("prefill workers");
    assert_eq!(
        d.prefill_worker_output_tokens, 0,
        "a prefill worker decoded"
    );
    for m in [&colocated, &split] {
        assert_eq!(m.completed, REQUESTS, "{}", m.router);
        assert_eq!((m.rejected, m.aborted, m.preemptions), (0, 0, 0));
        assert_eq!(m.generated_tokens, m.requested_output_tokens);
    }
    assert_eq!(split.generated_tokens, colocated.generated_tokens);
    // Every long prompt (2,000 uncached tokens) went remote; no stream did.
    let long = split.classes["long-prompt"].requests as u64;
    assert_eq!(d.remote_prefills, long);
    // Each prompt token is computed once, except the last partial page of a
    // remote prefill (2,000 = 124 full pages + 16): only full pages travel,
    // so the decode worker recomputes those 16 tokens.
    assert_eq!(colocated.prefill_tokens_computed, colocated.prompt_tokens);
    assert_eq!(
        split.prefill_tokens_computed,
        split.prompt_tokens + 16 * long
    );
    assert_eq!(d.transferred_pages, 124 * long);
    assert_eq!(d.transferred_bytes, 124 * 16 * 131_072 * long);
}

#[test]
fn only_prompts_above_the_threshold_prefill_remotely() {
    // `min_remote_prefill_tokens` is 512 by default.
    let short = sim(&mix(500), PREFILL_WORKERS, gpu());
    let d = short.disaggregation.expect("prefill workers");
    assert_eq!((d.remote_prefills, d.transferred_bytes), (0, 0));
    let long = sim(&mix(520), PREFILL_WORKERS, gpu());
    let d = long.disaggregation.expect("prefill workers");
    assert_eq!(
        d.remote_prefills,
        long.classes["long-prompt"].requests as u64
    );
    assert_eq!(d.min_remote_uncached_tokens, 520);
}

#[test]
fn transfers_take_time() {
    let spec = mix(2000);
    let fast = sim(&spec, PREFILL_WORKERS, gpu());
    let mut slow_link = gpu();
    slow_link.transfer_bytes_per_s = 1e9;
    let slow = sim(&spec, PREFILL_WORKERS, slow_link);
    let (f, s) = (
        fast.disaggregation.expect("staged"),
        slow.disaggregation.expect("staged"),
    );
    assert_eq!(f.transferred_bytes, s.transferred_bytes);
    // 124 pages of 2 MiB: 10.4 ms at 25 GB/s, 260 ms at 1 GB/s.
    assert!(
        s.remote_ttft_ms.p50 > f.remote_ttft_ms.p50 + 200.0,
        "remote TTFT p50 {} ms at 1 GB/s vs {} ms at 25 GB/s",
        s.remote_ttft_ms.p50,
        f.remote_ttft_ms.p50
    );
    assert!(s.transfer_s > 20.0 * f.transfer_s);
}

#[test]
fn disaggregation_cuts_the_decode_streams_inter_token_latency_p99() {
    let spec = mix(2000);
    let colocated = sim(&spec, 0, gpu());
    let split = sim(&spec, PREFILL_WORKERS, gpu());
    assert!(
        2.0 * split.itl_ms.p99 < colocated.itl_ms.p99,
        "ITL p99: disaggregated {} ms, colocated {} ms",
        split.itl_ms.p99,
        colocated.itl_ms.p99
    );
    // Deterministic: the same run gives the same figures.
    let again = sim(&spec, PREFILL_WORKERS, gpu());
    assert_eq!(
        (again.itl_ms, again.ttft_ms, again.disaggregation),
        (split.itl_ms, split.ttft_ms, split.disaggregation)
    );
}

#[test]
fn every_worker_prefilling_is_refused() {
    let mut cfg = SimConfig::new(
        2,
        PolicyName::Fcfs,
        "disaggregate".parse().expect("valid router"),
        gpu(),
    );
    cfg.prefill_workers = 2;
    let err = run(&cfg, "x", &mix(2000).generate(10, 1)).unwrap_err();
    assert!(err.to_string().contains("--prefill-workers"), "{err}");
}

/// The workers' `[runtime] kv_dtype` (`--worker-config`) sizes the pages a
/// CPU profile's transfers move: f16 pages are half of f32's.
#[test]
fn a_worker_configs_kv_dtype_sizes_the_pages_moved() {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let kv_bytes = |dtype: &str| {
        let config = dir.join(format!("sim-kv-{dtype}-{}.toml", std::process::id()));
        std::fs::write(&config, format!("[runtime]\nkv_dtype = \"{dtype}\"\n")).unwrap();
        let json = dir.join(format!("sim-kv-{dtype}-{}.json", std::process::id()));
        let status = std::process::Command::new(env!("CARGO_BIN_EXE_pie-sim"))
            .args(["run", "--workload", "prefill-decode-mix", "--workers", "4"])
            .args([
                "--prefill-workers",
                "2",
                "--router",
                "disaggregate,cache-aware",
            ])
            .args(["--requests", "100", "--profile", "cpu"])
            .arg("--worker-config")
            .arg(&config)
            .arg("--json")
            .arg(&json)
            .stderr(std::process::Stdio::null())
            .status()
            .unwrap();
        assert!(status.success());
        let runs: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let d = &runs[0]["disaggregation"];
        let pages = d["transferred_pages"].as_u64().unwrap();
        assert!(pages > 0, "no remote prefill: {d}");
        assert_eq!(
            d["transferred_bytes"].as_u64(),
            Some(pages * 16 * d["kv_bytes_per_token"].as_u64().unwrap())
        );
        d["kv_bytes_per_token"].as_u64().unwrap()
    };
    assert_eq!(kv_bytes("f32"), 46_080);
    assert_eq!(kv_bytes("f16"), 23_040);
}
