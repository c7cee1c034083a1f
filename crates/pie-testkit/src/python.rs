//! Python packages the tests drive (the OpenAI SDK, SGLang's router):
//! whether one is installed, and a script's JSON report on a server.

/// Whether python3 has the `openai` package. `.ci/run` installs it and sets
/// `PIE_REQUIRE_OPENAI=1`, so there a missing SDK fails instead of skipping.
pub fn openai_sdk_available() -> bool {
    python_module_available("openai", "PIE_REQUIRE_OPENAI", "openai")
}

/// Whether python3 can import `module`; where the environment variable
/// `require` is set, a missing one fails (naming the `pip` package to
/// install) instead of skipping.
pub fn python_module_available(module: &str, require: &str, package: &str) -> bool {
    let ok = std::process::Command::new("python3")
        .args(["-c", &format!("import {module}")])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok || std::env::var_os(require).is_none(),
        "python3 -m pip install {package} ({require} is set)"
    );
    if !ok {
        eprintln!("skipping: the Python module {module} is not installed");
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
