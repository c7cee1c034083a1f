//! `pie cluster up`: N workers and a controller on loopback, as child processes.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use anyhow::{bail, Context, Result};

/// Children killed when dropped, so an error or Ctrl-C leaves nothing running.
struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Start `program args`, wait for its `prefix URL` line; returns the URL.
fn start(children: &mut Children, program: &Path, args: &[String], prefix: &str) -> Result<String> {
    let mut child = Command::new(program)
        .args(args)
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {}", program.display()))?;
    let mut lines = BufReader::new(child.stdout.take().context("no stdout")?).lines();
    children.0.push(child);
    let first = lines
        .next()
        .context("the child exited before printing its address")??;
    let url = first
        .strip_prefix(prefix)
        .with_context(|| format!("unexpected first line `{first}`"))?
        .to_string();
    std::thread::spawn(move || {
        for line in lines.map_while(Result::ok) {
            println!("{line}");
        }
    });
    Ok(url)
}

fn sibling(name: &str) -> Result<PathBuf> {
    let path = std::env::current_exe()?.with_file_name(name);
    if !path.exists() {
        bail!(
            "{} not found next to pie (build it: cargo build --release --bin {name})",
            path.display()
        );
    }
    Ok(path)
}

pub fn up(
    workers: usize,
    config: Option<&Path>,
    model: &Path,
    port: u16,
    policies: Option<&str>,
    step_log_dir: Option<&Path>,
) -> Result<()> {
    let mut children = Children(Vec::new());
    let pie = std::env::current_exe()?;
    let mut controller_args: Vec<String> = vec![
        "--port".into(),
        port.to_string(),
        "--model".into(),
        model.display().to_string(),
    ];
    for i in 0..workers {
        let mut args: Vec<String> = vec![
            "serve".into(),
            "--port".into(),
            "0".into(),
            "--model".into(),
            model.display().to_string(),
        ];
        if let Some(c) = config {
            args.extend(["--config".into(), c.display().to_string()]);
        }
        if let Some(dir) = step_log_dir {
            let log = dir.join(format!("w{i}.steps.jsonl"));
            args.extend(["--step-log".into(), log.display().to_string()]);
        }
        let url = start(&mut children, &pie, &args, "pie: listening on ")?;
        println!("worker w{i}: {url}");
        controller_args.extend(["--worker".into(), format!("w{i}={url}")]);
    }
    if let Some(p) = policies {
        controller_args.extend(["--policies".into(), p.to_string()]);
    }
    let url = start(
        &mut children,
        &sibling("pie-controller")?,
        &controller_args,
        "pie-controller: listening on ",
    )?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    // Listening before the line that says the cluster is up: a SIGTERM sent
    // right after it must stop the children, not kill this process alone.
    let stop = {
        let _runtime = rt.enter();
        stop_requested()?
    };
    println!("controller: {url}  (Ctrl-C stops the cluster)");
    rt.block_on(stop)
}

/// Ctrl-C, or SIGTERM (what `kill`, `docker stop` and systemd send): either one
/// must end the returned future, so the children are stopped rather than
/// orphaned. The SIGTERM handler is installed when this is called.
fn stop_requested() -> Result<impl std::future::Future<Output = Result<()>>> {
    #[cfg(unix)]
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    Ok(async move {
        #[cfg(unix)]
        tokio::select! {
            interrupted = tokio::signal::ctrl_c() => interrupted?,
            _ = term.recv() => {}
        }
        #[cfg(not(unix))]
        tokio::signal::ctrl_c().await?;
        Ok(())
    })
}
