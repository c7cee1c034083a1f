//! The OpenAI surface through the controller: every field of the installed
//! SDK's request types is served or refused by name, as a worker does (the
//! same rule, `pie_core::openai_fields`, checked before any worker is asked).

use crate::harness::{Cluster, Spec};
use serde_json::json;

#[tokio::test]
async fn every_sdk_field_is_served_or_refused_by_name_through_the_controller() {
    if !pie_testkit::openai_sdk_available() {
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
    let report = pie_testkit::python_report(script, &c.controller.url).await;
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
        let refused_here = if route == "chat" { "tools" } else { "suffix" };
        assert!(refused.contains(&refused_here.into()), "{route}: {r}");
        for served in ["n", "logprobs"] {
            let served_here = r["served"].as_array().unwrap();
            assert!(served_here.contains(&served.into()), "{route}: {r}");
        }
    }
}
