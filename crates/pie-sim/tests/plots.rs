//! `compare --plots`: every chart is well-formed SVG with one series per run.

use pie_sim::{plots, run, CostProfile, PolicyName, RunMetrics, SimConfig, WorkloadSpec};

/// Checks that tags nest and close and attribute values are quoted; returns the
/// number of elements.
fn well_formed(svg: &str) -> Result<usize, String> {
    let mut stack: Vec<&str> = Vec::new();
    let mut elements = 0;
    let mut rest = svg;
    while let Some(start) = rest.find('<') {
        let end = rest[start..].find('>').ok_or("unclosed tag")? + start;
        let tag = &rest[start + 1..end];
        rest = &rest[end + 1..];
        if !tag.matches('"').count().is_multiple_of(2) || tag.contains('<') {
            return Err(format!("bad tag <{tag}>"));
        }
        if let Some(name) = tag.strip_prefix('/') {
            let open = stack.pop().ok_or(format!("stray </{name}>"))?;
            if open != name {
                return Err(format!("<{open}> closed by </{name}>"));
            }
        } else {
            elements += 1;
            let name = tag.split_whitespace().next().ok_or("empty tag")?;
            if !tag.ends_with('/') {
                stack.push(name);
            }
        }
    }
    match stack.is_empty() && !rest.contains('>') {
        true => Ok(elements),
        false => Err(format!("unclosed {stack:?}")),
    }
}

#[test]
fn charts_are_well_formed_with_one_series_per_run() {
    let spec = WorkloadSpec::named("deadline-mix").expect("built-in");
    let reqs = spec.generate(300, 5);
    let runs: Vec<RunMetrics> = [PolicyName::Fcfs, PolicyName::Deadline, PolicyName::Fair]
        .into_iter()
        .map(|p| {
            let cfg = SimConfig::new(
                1,
                p,
                "round-robin".parse().expect("router"),
                CostProfile::gpu_a100_llama3_8b(),
            );
            run(&cfg, spec.name(), &reqs).expect("simulation runs")
        })
        .collect();
    let dir = std::env::temp_dir().join(format!("pie-sim-plots-{}", std::process::id()));
    let files = plots::write(&dir, &runs).expect("plots written");
    assert_eq!(files.len(), 4 + runs.len());
    for path in &files {
        let svg = std::fs::read_to_string(path).expect("written file");
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        assert!(well_formed(&svg).expect(name) > 10, "{name}");
        assert!(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
        let series = svg.matches("<g class=\"series\"").count();
        if name.starts_with("service-") {
            // deadline-mix has one client.
            assert_eq!(series, 1, "{name}");
        } else {
            assert_eq!(series, runs.len(), "{name}");
            for r in &runs {
                let label = format!("data-label=\"{}\"", plots::run_label(r));
                assert!(svg.contains(&label), "{name} lacks {label}");
            }
        }
    }
    assert!(well_formed("<svg><g></svg></g>").is_err());
    let _ = std::fs::remove_dir_all(dir);
}
