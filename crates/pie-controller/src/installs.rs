//! Inferlets installed through the controller (`POST /v1/inferlets`): the
//! set it keeps on its own disk (`[cluster] inferlets_dir`: a manifest and
//! each component by its sha256, so a restart keeps the set), and which
//! workers hold each one. The workers compile and check a component; the
//! controller only stores and hands it on (`install_sync`), so it needs no
//! WebAssembly runtime.
//!
//! Invariant: a launch by the name of an inferlet installed here goes only
//! to a worker that answered its install (`lacking`); a worker that went
//! down is asked again when it comes back (installs are content-addressed,
//! so asking twice is harmless).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use pie_core::inferlet_ref;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// A failed install is tried again after this long.
pub const RETRY_AFTER: Duration = Duration::from_secs(2);

/// One installed version.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub name: String,
    pub version: String,
    pub sha256: String,
    pub bytes: usize,
}

impl Entry {
    pub fn reference(&self) -> String {
        format!("{}@{}", self.name, self.version)
    }
}

/// What became of one entry on one worker.
#[derive(Clone, Debug)]
enum Outcome {
    Installed,
    Failed { why: String, at: Instant },
}

#[derive(Default)]
struct State {
    /// In upload order; a later upload of the same name and version replaces.
    entries: Vec<Entry>,
    /// Worker name -> entry reference -> outcome.
    workers: HashMap<String, HashMap<String, Outcome>>,
}

pub struct Installs {
    dir: PathBuf,
    state: Mutex<State>,
}

impl Installs {
    /// The set kept in `dir` (read if it is there).
    pub fn open(dir: PathBuf) -> Result<Self, String> {
        let manifest = dir.join("manifest.json");
        let entries = match std::fs::read(&manifest) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map_err(|e| format!("{}: {e}", manifest.display()))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(format!("{}: {e}", manifest.display())),
        };
        Ok(Self {
            dir,
            state: Mutex::new(State {
                entries,
                workers: HashMap::new(),
            }),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Store `wasm` as `name@version` (version: the hash's first 12 hex
    /// digits when not given) on disk; the entry. No worker holds it yet.
    pub fn add(&self, name: &str, version: Option<&str>, wasm: &[u8]) -> Result<Entry, String> {
        inferlet_ref::check_part("name", name)?;
        let sha256 = hex(&Sha256::digest(wasm));
        let version = version.map_or_else(|| sha256[..12].to_string(), str::to_string);
        inferlet_ref::check_part("version", &version)?;
        let entry = Entry {
            name: name.to_string(),
            version,
            sha256,
            bytes: wasm.len(),
        };
        write_atomically(&self.component(&entry.sha256), wasm)?;
        let mut state = self.lock();
        state.entries.retain(|e| e.reference() != entry.reference());
        state.entries.push(entry.clone());
        for outcomes in state.workers.values_mut() {
            outcomes.remove(&entry.reference());
        }
        self.save(&state.entries)?;
        Ok(entry)
    }

    /// Take `entry` back out (every worker refused it), its bytes too
    /// unless another entry has the same.
    pub fn remove(&self, entry: &Entry) -> Result<(), String> {
        let mut state = self.lock();
        state.entries.retain(|e| e != entry);
        if !state.entries.iter().any(|e| e.sha256 == entry.sha256) {
            let _ = std::fs::remove_file(self.component(&entry.sha256));
        }
        self.save(&state.entries)
    }

    /// Whether `reference` names an inferlet installed here.
    pub fn knows(&self, reference: &str) -> bool {
        find(&self.lock().entries, reference).is_some()
    }

    /// The component's bytes.
    pub fn bytes(&self, entry: &Entry) -> Result<Vec<u8>, String> {
        let path = self.component(&entry.sha256);
        std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// The entries `worker` does not hold and should be asked for now (not
    /// refused within [`RETRY_AFTER`]).
    pub fn missing(&self, worker: &str) -> Vec<Entry> {
        let state = self.lock();
        let outcomes = state.workers.get(worker);
        (state.entries.iter())
            .filter(|e| match outcomes.and_then(|o| o.get(&e.reference())) {
                Some(Outcome::Installed) => false,
                Some(Outcome::Failed { at, .. }) => at.elapsed() >= RETRY_AFTER,
                None => true,
            })
            .cloned()
            .collect()
    }

    /// What `worker` answered for `entry`.
    pub fn record(&self, worker: &str, entry: &Entry, result: Result<(), String>) {
        let outcome = match result {
            Ok(()) => Outcome::Installed,
            Err(why) => Outcome::Failed {
                why,
                at: Instant::now(),
            },
        };
        let mut state = self.lock();
        let outcomes = state.workers.entry(worker.to_string()).or_default();
        outcomes.insert(entry.reference(), outcome);
    }

    /// `worker` went down: what it held is unknown until it answers again.
    pub fn forget(&self, worker: &str) {
        self.lock().workers.remove(worker);
    }

    /// For a launch of `reference` (`NAME` or `NAME@VERSION`) among
    /// `workers`: the ones that do not hold it. Empty when the controller did
    /// not install it (a built-in, or one installed on workers directly).
    pub fn lacking(&self, reference: &str, workers: &[String]) -> Vec<String> {
        let state = self.lock();
        let Some(entry) = find(&state.entries, reference) else {
            return Vec::new();
        };
        let holds = |w: &String| {
            state
                .workers
                .get(w)
                .and_then(|o| o.get(&entry.reference()))
                .is_some_and(|o| matches!(o, Outcome::Installed))
        };
        workers.iter().filter(|w| !holds(w)).cloned().collect()
    }

    /// Every entry with each known worker's state, for `GET /v1/inferlets`.
    pub fn view(&self) -> serde_json::Value {
        let state = self.lock();
        let entries: Vec<serde_json::Value> = (state.entries.iter())
            .map(|e| {
                let workers: serde_json::Map<String, serde_json::Value> = (state.workers.iter())
                    .filter_map(|(w, o)| Some((w.clone(), describe(o.get(&e.reference())?).into())))
                    .collect();
                serde_json::json!({"name": e.name, "version": e.version, "sha256": e.sha256,
                    "bytes": e.bytes, "workers": workers})
            })
            .collect();
        serde_json::json!({ "inferlets": entries })
    }

    fn component(&self, sha256: &str) -> PathBuf {
        self.dir.join("components").join(format!("{sha256}.wasm"))
    }

    fn save(&self, entries: &[Entry]) -> Result<(), String> {
        let json = serde_json::to_vec_pretty(entries).map_err(|e| e.to_string())?;
        write_atomically(&self.dir.join("manifest.json"), &json)
    }
}

/// `NAME` (its latest upload) or `NAME@VERSION`.
fn find<'a>(entries: &'a [Entry], reference: &str) -> Option<&'a Entry> {
    let (name, version) = inferlet_ref::split(reference);
    (entries.iter()).rfind(|e| e.name == name && version.is_none_or(|v| e.version == v))
}

fn describe(outcome: &Outcome) -> String {
    match outcome {
        Outcome::Installed => "installed".into(),
        Outcome::Failed { why, .. } => format!("failed: {why}"),
    }
}

fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), String> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes)
        .and_then(|()| std::fs::rename(&tmp, path))
        .map_err(|e| format!("{}: {e}", path.display()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir() -> PathBuf {
        std::env::temp_dir().join(format!(
            "pie-installs-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ))
    }

    #[test]
    fn the_set_survives_a_reopen_and_launches_go_only_where_it_is_held() {
        let dir = temp_dir();
        let _ = std::fs::remove_dir_all(&dir);
        let installs = Installs::open(dir.clone()).unwrap();
        let entry = installs.add("agent", Some("1"), b"component").unwrap();
        let workers = ["w0".to_string(), "w1".to_string()];
        assert_eq!(installs.lacking("agent", &workers), workers);
        installs.record("w0", &entry, Ok(()));
        installs.record("w1", &entry, Err("down".into()));
        assert_eq!(installs.lacking("agent@1", &workers), ["w1"]);
        assert!(installs.lacking("chat", &workers).is_empty(), "not ours");
        assert!(installs.missing("w0").is_empty());
        assert!(installs.missing("w1").is_empty(), "refused just now: later");
        installs.forget("w0");
        assert_eq!(installs.missing("w0"), std::slice::from_ref(&entry));
        let reopened = Installs::open(dir.clone()).unwrap();
        assert_eq!(reopened.missing("w2"), std::slice::from_ref(&entry));
        assert_eq!(reopened.bytes(&entry).unwrap(), b"component");
        assert!(installs.add("Bad Name", None, b"x").is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
