//! The OpenAI Python SDK's scripts: whether the SDK is installed, and a
//! script's JSON report on a server.

/// Whether python3 has the `openai` package. `.ci/run` installs it and sets
/// `PIE_REQUIRE_OPENAI=1`, so there a missing SDK fails instead of skipping.
pub fn openai_sdk_available() -> bool {
    let ok = std::process::Command::new("python3")
        .args(["-c", "import openai"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok || std::env::var_os("PIE_REQUIRE_OPENAI").is_none(),
        "python3 -m pip install openai"
    );
    if !ok {
        eprintln!("skipping: the openai Python package is not installed");
    }
    ok
}

/// Run the Python `script` with the server's `url`; what it printed, as JSON.
pub async fn python_report(script: &str, url: &str) -> serde_json::Value {
    let (script, url) = (script.to_string(), url.to_string());
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("python3")
            .arg(script)
            .arg(url)
            .output()
            .expect("python3 runs")
    })
    .await
    .expect("the script's task");
    assert!(
        out.status.success(),
        "the script failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("the script prints JSON")
}
