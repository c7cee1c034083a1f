//! `pie bench` end to end: the binary against a tiny-model `pie serve`, its JSON
//! checked (every request completed, exact output lengths, prefix-cache hits on
//! shared prefixes and across the turns of a conversation), and
//! `pie bench --calibrate` on the tiny model writing a usable cost profile.

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::{test_model, Server};
use pie_workload::CostProfile;
use serde_json::Value;

fn out_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}-{}.json", std::process::id()))
}

/// Run `pie bench` against `url` with `args`; returns its JSON report.
fn bench(url: &str, name: &str, args: &[&str]) -> Value {
    let out = out_path(name);
    let result = Command::new(env!("CARGO_BIN_EXE_pie"))
        .args(["bench", "--quiet", "--url", url, "--out"])
        .arg(&out)
        .args(args)
        .output()
        .expect("run pie bench");
    let stdout = String::from_utf8_lossy(&result.stdout);
    assert!(
        result.status.success(),
        "pie bench failed: {stdout}\n{}",
        String::from_utf8_lossy(&result.stderr)
    );
    assert!(stdout.contains("ttft"), "the table is printed: {stdout}");
    let report = serde_json::from_slice(&std::fs::read(&out).expect("--out written"));
    let _ = std::fs::remove_file(&out);
    report.expect("JSON report")
}

#[tokio::test(flavor = "multi_thread")]
async fn shared_prefix_requests_all_complete_with_cache_hits() {
    let server = Server::start("", &[]).await;
    let r = bench(
        &server.url,
        "bench-shared",
        &[
            "--workload",
            "shared-prefix",
            "--requests",
            "24",
            "--seed",
            "3",
            "--set",
            "groups=2",
            "--set",
            "zipf=null",
            "--set",
            "system_len=64",
            "--set",
            "question_len=8",
            "--set",
            "output_len=8",
            "--set",
            "rate_per_s=40",
        ],
    );
    let s = &r["summary"];
    assert_eq!(s["requests"], 24);
    assert_eq!(s["completed"], 24, "{s}");
    assert_eq!(s["errors"], serde_json::json!({}));
    assert_eq!(s["output_tokens"], 24 * 8, "ignore_eos gives exact lengths");
    assert_eq!(s["prompt_tokens"], 24 * 72);
    assert!(
        s["cached_tokens"].as_u64().unwrap() >= 22 * 64,
        "all but the first of each group hit: {s}"
    );
    assert!(
        s["server"]["prefix_hit_tokens"].as_f64().unwrap() > 0.0,
        "{s}"
    );
    let records = r["records"].as_array().unwrap();
    assert_eq!(records.len(), 24);
    for rec in records {
        let (ttft, e2e) = (
            rec["ttft_ms"].as_f64().unwrap(),
            rec["e2e_ms"].as_f64().unwrap(),
        );
        assert!(ttft > 0.0 && ttft <= e2e, "{rec}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn later_turns_reuse_the_generated_tokens() {
    let server = Server::start("", &["--worker-policy", "fcfs,keep-session"]).await;
    let r = bench(
        &server.url,
        "bench-turns",
        &[
            "--workload",
            "multi-turn",
            "--requests",
            "6",
            "--concurrency",
            "2",
            "--set",
            "turns=3",
            "--set",
            "system_len=64",
            "--set",
            "new_tokens=16",
            "--set",
            "output_len=32",
            "--set",
            "think_ms=5",
        ],
    );
    assert_eq!(r["summary"]["completed"], 6, "{}", r["summary"]);
    let records = r["records"].as_array().unwrap();
    for rec in records.iter().filter(|rec| rec["class"] != "turn-0") {
        // Turn k's prompt is turn k-1's prompt, its 32 generated tokens and 16 new
        // ones; the cache covers more than the earlier prompt alone.
        let (prompt, cached) = (
            rec["prompt_tokens"].as_u64().unwrap(),
            rec["cached_tokens"].as_u64().unwrap(),
        );
        assert!(
            cached > prompt - 16 - 32,
            "generated tokens were reused: {rec}"
        );
    }
}

/// `pie bench --calibrate` on the test model with `args`, into a profile
/// named `name`: its stdout and the profile it wrote.
fn calibrate(name: &str, args: &[&std::ffi::OsStr]) -> (String, CostProfile) {
    let out = out_path(name);
    let result = Command::new(env!("CARGO_BIN_EXE_pie"))
        .args(["bench", "--calibrate", "--model"])
        .arg(test_model())
        .args(args)
        .arg("--out")
        .arg(&out)
        .output()
        .expect("run pie bench --calibrate");
    let stdout = String::from_utf8_lossy(&result.stdout).into_owned();
    assert!(
        result.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&result.stderr)
    );
    let profile: CostProfile =
        serde_json::from_slice(&std::fs::read(&out).expect("profile written"))
            .expect("a CostProfile");
    let _ = std::fs::remove_file(&out);
    (stdout, profile)
}

#[test]
fn calibrate_writes_a_profile_for_the_simulator() {
    let (stdout, profile) = calibrate("bench-profile", &[]);
    assert!(
        stdout.contains("R^2"),
        "the fit quality is printed: {stdout}"
    );
    assert!(profile.calibrated);
    // Timings, not a speed target: on a loaded machine the fitted intercept can
    // come out 0 (the fit keeps terms non-negative), but tokens always cost.
    assert!(
        profile.a_ms >= 0.0 && profile.b_ms_per_token > 0.0,
        "{profile:?}"
    );
    assert!(profile.c_ms_per_context_token >= 0.0);
    // Measured, so only positive: each kind's own mean over the fit.
    let prefill_mean = profile.prefill_mean_over_fit.expect("prefill's own mean");
    assert!(
        prefill_mean > 0.0 && profile.step_mean_over_fit > 0.0,
        "{profile:?}"
    );
    assert_eq!(
        (
            profile.page_size,
            profile.max_batch_tokens,
            profile.max_running
        ),
        (16, 512, 64)
    );
    assert!(profile.source.contains("test-model-"), "{}", profile.source);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_served_runs_step_log_counts_every_token_and_fits_a_profile() {
    let log = out_path("bench-steps").with_extension("jsonl");
    let server = Server::start(
        &format!("[server]\nstep_log = {:?}\n", log.display().to_string()),
        &[],
    )
    .await;
    let r = bench(
        &server.url,
        "bench-steps-report",
        &[
            "--workload",
            "shared-prefix",
            "--requests",
            "12",
            "--set",
            "groups=2",
            "--set",
            "system_len=64",
            "--set",
            "question_len=8",
            "--set",
            "output_len=6",
            "--set",
            "rate_per_s=20",
        ],
    );
    let s = &r["summary"];
    assert_eq!(s["completed"], 12, "{s}");
    let steps: Vec<Value> = std::fs::read_to_string(&log)
        .expect("step log written")
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    // Every prompt token not found cached, and every generated token but each
    // request's last (never fed back), is computed in exactly one logged step.
    let computed: u64 = steps
        .iter()
        .map(|l| l["batch_tokens"].as_u64().unwrap())
        .sum();
    let uncached = s["prompt_tokens"].as_u64().unwrap() - s["cached_tokens"].as_u64().unwrap();
    assert_eq!(computed, uncached + 12 * 5, "{s}");
    assert!(steps[1..].iter().all(|l| l["idle_ms"].as_f64().is_some()));
    let (_, profile) = calibrate(
        "bench-served-profile",
        &["--from-steps".as_ref(), log.as_os_str()],
    );
    let _ = std::fs::remove_file(&log);
    // Timings of a tiny model's sub-millisecond steps, not a speed: which
    // terms survive the fit varies (its recovery of known terms is a unit
    // test); a step still costs something, and each kind's mean is measured.
    let prompt = pie_workload::StepShape::of(&[(0, 64)]);
    assert!(
        profile.calibrated && profile.step_ms(&prompt) > 0.0,
        "{profile:?}"
    );
    assert!(
        profile.prefill_mean_over_fit.is_some_and(|m| m > 0.0) && profile.step_mean_over_fit > 0.0,
        "{profile:?}"
    );
    assert!(
        profile
            .source
            .contains(&format!("{} served steps", steps.len())),
        "{}",
        profile.source
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_trace_replays_with_its_lengths_and_shared_blocks() {
    let server = Server::start("", &[]).await;
    let trace = out_path("bench-trace").with_extension("jsonl");
    let lines = [
        r#"{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [7, 8]}"#,
        r#"{"timestamp": 50, "input_length": 530, "output_length": 6, "hash_ids": [7, 9]}"#,
        r#"{"timestamp": 90, "input_length": 20, "output_length": 2, "hash_ids": [1]}"#,
    ];
    std::fs::write(&trace, lines.join("\n")).unwrap();
    let trace_arg = trace.to_string_lossy().into_owned();
    let r = bench(&server.url, "bench-trace-report", &["--trace", &trace_arg]);
    let _ = std::fs::remove_file(&trace);
    let s = &r["summary"];
    assert_eq!(
        (s["requests"].as_u64(), s["completed"].as_u64()),
        (Some(3), Some(3)),
        "{s}"
    );
    assert_eq!(s["output_tokens"], 12);
    assert_eq!(s["prompt_tokens"], 600 + 530 + 20);
    // The second prompt starts with the first one's 512-token block (id 7).
    assert!(
        r["records"][1]["cached_tokens"].as_u64().unwrap() >= 512,
        "{}",
        r["records"][1]
    );
}
