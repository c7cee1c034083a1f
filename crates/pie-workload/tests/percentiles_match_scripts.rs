//! The scripts' percentiles (`scripts/pielib.py`) are this crate's: the same
//! samples fed to both give the same p50, p90, p99 and mean. Needs `python3`
//! (`.ci/run` has it).

use std::path::Path;
use std::process::Command;

use pie_workload::percentiles::Percentiles;
use proptest::prelude::*;

/// Equal but for the last bit: serde_json's fast float parsing may round a
/// printed number one unit off, and the mean's sum may differ in its last bit.
fn same(a: f64, b: f64) -> bool {
    (a - b).abs() <= 2.0 * f64::EPSILON * a.abs().max(b.abs())
}

fn assert_same(python: Percentiles, rust: Percentiles, samples: &[f64]) {
    let pairs = [
        (python.p50, rust.p50),
        (python.p90, rust.p90),
        (python.p99, rust.p99),
        (python.mean, rust.mean),
    ];
    assert!(
        pairs.iter().all(|&(a, b)| same(a, b)),
        "pielib {python:?} vs Percentiles::of {rust:?} for {samples:?}"
    );
}

fn pielib_percentiles(samples: &[f64]) -> Percentiles {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/pielib.py");
    let out = Command::new("python3")
        .arg(&script)
        .arg("percentiles")
        .args(samples.iter().map(|s| format!("{s:?}")))
        .output()
        .expect("python3 runs scripts/pielib.py");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("pielib prints the four figures as JSON")
}

#[test]
fn fixed_samples_give_the_same_figures() {
    let cases: [&[f64]; 5] = [
        &[],
        &[7.0],
        &[20.0, 10.0],
        &[3.0, 1.0, 2.0, 2.0, 9.5, 0.25, 4.0, 4.0, 8.0, 6.5],
        &[1e-5, 1e5, 42.0],
    ];
    for samples in cases {
        assert_same(
            pielib_percentiles(samples),
            Percentiles::of(samples.to_vec()),
            samples,
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    #[test]
    fn random_samples_give_the_same_figures(
        samples in prop::collection::vec(0.0f64..10_000.0, 1..300)
    ) {
        assert_same(pielib_percentiles(&samples), Percentiles::of(samples.clone()), &samples);
    }
}
