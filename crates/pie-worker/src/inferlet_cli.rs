//! `pie inferlet new | build | upload` and `pie run` of a WebAssembly
//! inferlet: a new crate anywhere (the guest SDK and the WIT travel inside
//! this binary and are written beside it, so it builds outside this
//! repository), its build for `wasm32-wasip2`, its upload to a worker, and
//! a run in this process on a runtime of its own.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use futures_util::StreamExt;

use crate::config::Config;
use crate::inferlets::{InferletLaunch, Inferlets};
use crate::process::{ProcEvent, ProcState};

/// The guest SDK's source and the world it binds (0.3.0, over 0.2.0's and
/// 0.1.0's interfaces and WASI's `io`), as this binary was built, by path
/// in the new crate.
const SDK_FILES: &[(&str, &str)] = &[
    (
        "pie-inferlet/src/lib.rs",
        include_str!("../../../inferlets/sdk/src/lib.rs"),
    ),
    (
        "pie-inferlet/src/context.rs",
        include_str!("../../../inferlets/sdk/src/context.rs"),
    ),
    (
        "pie-inferlet/src/host.rs",
        include_str!("../../../inferlets/sdk/src/host.rs"),
    ),
    (
        "pie-inferlet/src/model.rs",
        include_str!("../../../inferlets/sdk/src/model.rs"),
    ),
    (
        "pie-inferlet/src/options.rs",
        include_str!("../../../inferlets/sdk/src/options.rs"),
    ),
    (
        "pie-inferlet/src/pending.rs",
        include_str!("../../../inferlets/sdk/src/pending.rs"),
    ),
    (
        "pie-inferlet/src/stream.rs",
        include_str!("../../../inferlets/sdk/src/stream.rs"),
    ),
    (
        "pie-inferlet/wit/inferlet.wit",
        include_str!("../../../wit/0.3.0/inferlet.wit"),
    ),
    (
        "pie-inferlet/wit/deps/inferlet-0.2.0/inferlet.wit",
        include_str!("../../../wit/0.2.0/inferlet.wit"),
    ),
    (
        "pie-inferlet/wit/deps/inferlet-0.1.0/inferlet.wit",
        include_str!("../../../wit/0.1.0/inferlet.wit"),
    ),
    (
        "pie-inferlet/wit/deps/io/io.wit",
        include_str!("../../../wit/0.3.0/deps/io/io.wit"),
    ),
];

const SDK_MANIFEST: &str = r#"[package]
name = "pie-inferlet"
description = "Guest SDK for Pie inferlets (written by `pie inferlet new`)."
version = "0.1.0"
edition = "2024"
publish = false

[dependencies]
serde = { version = "1", features = ["derive"] }
serde_json = "1"
wit-bindgen = { version = "0.63", default-features = false, features = ["macros", "realloc", "std"] }
"#;

const CRATE_MANIFEST: &str = r#"[package]
name = "NAME"
version = "0.1.0"
edition = "2024"
publish = false

[lib]
crate-type = ["cdylib"]

[dependencies]
pie-inferlet = { path = "pie-inferlet" }
serde = { version = "1", features = ["derive"] }

# Its own workspace, wherever it is put.
[workspace]

[profile.release]
opt-level = "s"
lto = true
codegen-units = 1
strip = true
panic = "abort"
"#;

const CRATE_LIB: &str = r#"//! NAME: a Pie inferlet. Args: `{"prompt": string, "max_tokens"?: int}`.

use pie_inferlet::{Context, GenerateOptions};
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Args {
    prompt: String,
    max_tokens: Option<u32>,
}

fn run() -> Result<(), String> {
    let args: Args = pie_inferlet::args()?;
    let ctx = Context::new()?;
    ctx.append_text(&args.prompt)?;
    let options = GenerateOptions::new()
        .max_tokens(args.max_tokens.unwrap_or(64))
        .stream(true);
    ctx.generate(&options)?;
    Ok(())
}

pie_inferlet::main!(run);
"#;

const TOOLCHAIN: &str = "[toolchain]\nchannel = \"stable\"\ntargets = [\"wasm32-wasip2\"]\n";
const CARGO_CONFIG: &str = "[build]\ntarget = \"wasm32-wasip2\"\n";

/// `pie inferlet new NAME`: a crate in `./NAME` with the SDK vendored.
pub fn new_crate(name: &str) -> Result<()> {
    let valid = !name.is_empty()
        && name.chars().next().is_some_and(|c| c.is_ascii_lowercase())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_');
    if !valid {
        bail!("`{name}`: a crate name of a-z, 0-9, '-', '_', starting with a letter");
    }
    let dir = PathBuf::from(name);
    if dir.exists() {
        bail!("{} exists", dir.display());
    }
    let files = [
        ("Cargo.toml", CRATE_MANIFEST.replace("NAME", name)),
        ("src/lib.rs", CRATE_LIB.replace("NAME", name)),
        ("rust-toolchain.toml", TOOLCHAIN.to_string()),
        (".cargo/config.toml", CARGO_CONFIG.to_string()),
        ("pie-inferlet/Cargo.toml", SDK_MANIFEST.to_string()),
    ];
    let sdk = SDK_FILES
        .iter()
        .map(|(path, text)| (*path, text.to_string()));
    for (path, text) in files.into_iter().chain(sdk) {
        let path = dir.join(path);
        std::fs::create_dir_all(path.parent().unwrap_or(&dir))?;
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    println!(
        "created {name}/ (the SDK is in {name}/pie-inferlet); build it with `pie inferlet build {name}`"
    );
    Ok(())
}

/// The target inferlets are built for.
const WASM_TARGET: &str = "wasm32-wasip2";

/// Makes sure the toolchain that builds in `dir` has [`WASM_TARGET`]:
/// rustup adds it where it is missing (a toolchain installed before
/// without it does not get it on its own), saying so; without rustup, an
/// error says what to install.
fn ensure_wasm_target(dir: &Path) -> Result<()> {
    let sysroot = Command::new("rustc")
        .args(["--print", "sysroot"])
        .current_dir(dir)
        .output()
        .context("running rustc (is a Rust toolchain installed?)")?;
    let sysroot = String::from_utf8_lossy(&sysroot.stdout).trim().to_string();
    if Path::new(&sysroot)
        .join("lib/rustlib")
        .join(WASM_TARGET)
        .is_dir()
    {
        return Ok(());
    }
    let has_rustup = Command::new("rustup").arg("--version").output().is_ok();
    if !has_rustup {
        bail!(
            "the Rust toolchain at {sysroot} has no {WASM_TARGET} target, and rustup is not \
             installed to add it: install rustup and run `rustup target add {WASM_TARGET}`, \
             or install your distribution's {WASM_TARGET} standard library"
        );
    }
    eprintln!("pie: installing the {WASM_TARGET} target (rustup target add {WASM_TARGET})");
    let added = Command::new("rustup")
        .args(["target", "add", WASM_TARGET])
        .current_dir(dir)
        .status()
        .context("running rustup")?;
    if !added.success() {
        bail!(
            "`rustup target add {WASM_TARGET}` failed in {}",
            dir.display()
        );
    }
    Ok(())
}

/// `pie inferlet build [DIR]`: `cargo build --release` for `wasm32-wasip2`
/// (the target added first where it is missing); prints each component's
/// path.
pub fn build(dir: &Path) -> Result<()> {
    ensure_wasm_target(dir)?;
    let output = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
        .args([
            "build",
            "--release",
            "--target",
            WASM_TARGET,
            "--message-format",
            "json-render-diagnostics",
        ])
        .current_dir(dir)
        .stderr(std::process::Stdio::inherit())
        .output()
        .with_context(|| format!("running cargo in {}", dir.display()))?;
    if !output.status.success() {
        bail!("cargo build failed in {}", dir.display());
    }
    let mut built = 0;
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let Ok(message) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let files = message["filenames"].as_array().into_iter().flatten();
        for file in files
            .filter_map(|f| f.as_str())
            .filter(|f| f.ends_with(".wasm"))
        {
            println!("{file}");
            built += 1;
        }
    }
    if built == 0 {
        bail!(
            "no component was built in {} (crate-type = [\"cdylib\"]?)",
            dir.display()
        );
    }
    Ok(())
}

/// `pie inferlet upload FILE --url URL`: install it on a worker (key:
/// `PIE_API_KEY`); the name defaults to the file's stem.
pub fn upload(file: &Path, url: &str, name: Option<&str>, version: Option<&str>) -> Result<()> {
    let wasm = std::fs::read(file).with_context(|| format!("reading {}", file.display()))?;
    let name = match name {
        Some(n) => n.to_string(),
        None => default_name(file)?,
    };
    let mut query = vec![("name", name)];
    if let Some(v) = version {
        query.push(("version", v.to_string()));
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let answer = runtime.block_on(async {
        let mut req = reqwest::Client::new()
            .post(format!("{}/v1/inferlets", url.trim_end_matches('/')))
            .query(&query)
            .body(wasm);
        if let Ok(key) = std::env::var("PIE_API_KEY") {
            req = req.bearer_auth(key);
        }
        let r = req.send().await?;
        Ok::<_, reqwest::Error>((r.status(), r.text().await?))
    })?;
    match answer {
        (status, body) if status.is_success() => {
            println!("{body}");
            Ok(())
        }
        (status, body) => bail!("{url} answered {status}: {body}"),
    }
}

fn default_name(file: &Path) -> Result<String> {
    let stem = file.file_stem().and_then(|s| s.to_str());
    stem.map(|s| s.replace('_', "-"))
        .with_context(|| format!("{}: pass --name", file.display()))
}

/// `pie run NAME|FILE.wasm`: run an installed inferlet (in `[runtime.inferlets]
/// dir`) or a component file, in this process, printing its output; JSON
/// events go to stderr.
pub fn run(reference: &str, args: &str, mut config: Config) -> Result<()> {
    let args: serde_json::Value = serde_json::from_str(args).context("--args is not JSON")?;
    let local = Path::new(reference);
    let scratch = std::env::temp_dir().join(format!("pie-run-{}", std::process::id()));
    let reference = if local.extension().is_some_and(|e| e == "wasm") {
        config.runtime.inferlets.dir = Some(scratch.clone());
        "local".to_string()
    } else {
        reference.to_string()
    };
    let tokio = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let result = tokio.block_on(async {
        let inferlets = Inferlets::new(&config.runtime.inferlets)?;
        if reference == "local" {
            let wasm = std::fs::read(local)?;
            inferlets.registry.install("local", None, &wasm, None)?;
        }
        let rt =
            tokio::task::spawn_blocking(move || crate::serve::start_runtime(&config)).await??;
        run_to_end(&inferlets, &rt, reference, args).await
    });
    let _ = std::fs::remove_dir_all(&scratch);
    result
}

async fn run_to_end(
    inferlets: &Arc<Inferlets>,
    rt: &Arc<crate::runtime::Runtime>,
    reference: String,
    args: serde_json::Value,
) -> Result<()> {
    let launch = InferletLaunch {
        reference,
        args,
        props: Default::default(),
        client: "cli".into(),
        key: None,
        cache_salt: None,
    };
    let process = inferlets.launch(rt, launch)?;
    print_events(&process).await
}

/// `pie run text-completion|chat --prompt P`: the built-in, as `pie serve`
/// runs it (the same launch, driver and sequence runner), on a runtime in
/// this process; text-completion's output follows its prompt.
pub fn run_builtin(
    inferlet: &str,
    prompt: String,
    max_tokens: usize,
    sampling: pie_model::SamplingParams,
    config: Config,
) -> Result<()> {
    use crate::runtime::{GenOptions, Inferlet, Prompt};
    let builtin = match inferlet {
        "text-completion" => {
            print!("{prompt}");
            Inferlet::TextCompletion {
                prompt: Prompt::Text(prompt),
            }
        }
        "chat" => Inferlet::Chat {
            messages: vec![pie_model::ChatMessage::text("user", prompt)],
            resume_session: false,
            tools: None,
            ending: pie_model::ChatEnding::GenerationPrompt,
        },
        other => bail!("`{other}` is not a built-in inferlet"),
    };
    let opts = GenOptions {
        max_tokens: Some(max_tokens),
        sampling,
        ..GenOptions::default()
    };
    let tokio = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    tokio.block_on(async {
        let rt =
            tokio::task::spawn_blocking(move || crate::serve::start_runtime(&config)).await??;
        let (process, _) = rt.launch(builtin, opts, Default::default(), "cli".into(), None)?;
        print_events(&process).await
    })
}

/// A process's text to stdout as it comes, its JSON and props events to
/// stderr, until it ends: Ok when it finished.
async fn print_events(process: &Arc<crate::process::Process>) -> Result<()> {
    use std::io::Write;
    let mut events = process.events();
    let mut stdout = std::io::stdout();
    while let Some(event) = events.next().await {
        match event {
            ProcEvent::Text { text, .. } => {
                write!(stdout, "{text}")?;
                stdout.flush()?;
            }
            ProcEvent::Json(json) => eprintln!("event: {json}"),
            ProcEvent::Props(props) => eprintln!("props: {props}"),
            ProcEvent::Done {
                state: ProcState::Finished,
                ..
            } => {
                writeln!(stdout)?;
                return Ok(());
            }
            ProcEvent::Done { state, error, .. } => {
                bail!(
                    "the inferlet {}: {}",
                    state.as_str(),
                    error.unwrap_or_default()
                )
            }
        }
    }
    bail!("the process ended without a final state")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A new crate gets every file of the SDK and of the world it binds.
    #[test]
    fn every_sdk_and_wit_file_travels_with_a_new_crate() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let sources = std::fs::read_dir(root.join("inferlets/sdk/src")).unwrap();
        for entry in sources {
            let name = entry.unwrap().file_name().into_string().unwrap();
            let path = format!("pie-inferlet/src/{name}");
            assert!(
                SDK_FILES.iter().any(|(p, _)| *p == path),
                "{path} is not written by `pie inferlet new`"
            );
        }
        let deps = std::fs::read_dir(root.join("wit/0.3.0/deps"))
            .unwrap()
            .count();
        let wit_files = SDK_FILES
            .iter()
            .filter(|(p, _)| p.ends_with(".wit"))
            .count();
        assert_eq!(wit_files, deps + 1, "the world and each of its deps");
    }
}
