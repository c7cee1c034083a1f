//! The OpenAI surface through the controller: every field of the installed
//! SDK's request types is served or refused by name, as a worker does (the
//! same rule, `pie_core::openai_fields`, checked before any worker is asked).

use crate::harness::{Cluster, Spec};
use serde_json::{json, Value};

/// Needs python3 with the `openai` package (`.ci/run` installs it and sets
/// PIE_REQUIRE_OPENAI=1 so a missing SDK fails instead of skipping).
fn sdk_available() -> bool {
    let ok = std::process::Command::new("python3")
        .args(["-c", "import openai"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok || std::env::var_os("PIE_REQUIRE_OPENAI").is_none(),
        "python3 -m pip install openai"
    );
    ok
}

#[tokio::test]
async fn every_sdk_field_is_served_or_refused_by_name_through_the_controller() {
    if !sdk_available() {
        return;
    }
    let c = Cluster::start_with(Spec {
        workers: 1,
        ..Spec::new("least-loaded")
    })
    .await;
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../pie-worker/tests/openai_fields.py"
    );
    let url = c.controller.url.clone();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("python3")
            .arg(script)
            .arg(url)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "fields script failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    for route in ["completions", "chat"] {
        let r = &report[route];
        assert_eq!(r["undecided"], json!([]), "{route}: {r}");
        assert_eq!(r["wrong"], json!([]), "{route}: {r}");
        assert_eq!(
            r["typo"],
            json!({"status": 400, "param": "temprature"}),
            "{route}: {r}"
        );
        let refused = r["refused"].as_array().unwrap();
        assert!(refused.contains(&"n".into()), "{route}: {r}");
    }
}
