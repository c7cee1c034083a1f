//! Installed inferlets: uploaded components, kept content-addressed under
//! `[runtime.inferlets] dir`, with their compiled code beside them.
//!
//! Layout: `components/SHA256.wasm` (as uploaded), `components/SHA256.cwasm`
//! (compiled by this wasmtime; rebuilt if another cannot read it), and
//! `names/NAME@VERSION` (JSON: the hash, size, upload time). Every file is
//! written to a temporary name and renamed, so a crash leaves none half
//! written.
//!
//! Invariant: a component is validated and compiled before its name is
//! written; a launch after a restart loads the compiled code and compiles
//! nothing (`compiles` and `cache_loads` count which happened). A client
//! key ([`Uploader`] with a quota) replaces and deletes only its own
//! versions, holds at most its quota of them, and compiles one upload at a
//! time, so no tenant fills the disk, takes another's name or holds the
//! compiler.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use pie_core::inferlet_ref;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use wasmtime::component::Component;
use wasmtime::Engine;

use super::world::check_component;
use pie_core::clock::now_ms;

/// The built-in inferlets' names, which no upload may take.
pub use pie_core::inferlet_ref::BUILT_IN;

/// One installed version of an inferlet.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Installed {
    pub name: String,
    pub version: String,
    pub sha256: String,
    pub bytes: usize,
    pub uploaded_ms: u64,
    /// The key that uploaded it (none without keys).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
}

/// Who installs or deletes: a key, held to its own versions and its quota
/// where it has one (a client key's; an admin's or a controller's has none).
pub struct Uploader {
    pub key: String,
    pub quota: Option<Quota>,
}

/// What a client key may have installed.
#[derive(Clone, Copy)]
pub struct Quota {
    pub max_inferlets: usize,
    pub max_bytes: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// The request is wrong: a bad name, not a component, a refused import.
    #[error("{0}")]
    Invalid(String),
    #[error("no inferlet `{0}` is installed")]
    NotFound(String),
    /// A key past its quota, or touching another key's versions.
    #[error("{0}")]
    Forbidden(String),
    /// The key has an upload compiling already.
    #[error("{0}")]
    Busy(String),
    #[error("cannot store the inferlet: {0}")]
    Io(#[from] std::io::Error),
}

pub struct Registry {
    engine: Engine,
    dir: PathBuf,
    loaded: Mutex<HashMap<String, Component>>,
    /// Keys with an upload compiling.
    compiling: Mutex<HashSet<String>>,
    /// Components compiled (at upload, or when no compiled code could be read).
    pub compiles: AtomicU64,
    /// Components loaded from their compiled code on disk.
    pub cache_loads: AtomicU64,
}

impl Registry {
    pub fn open(engine: Engine, dir: PathBuf) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir.join("components"))?;
        std::fs::create_dir_all(dir.join("names"))?;
        Ok(Self {
            engine,
            dir,
            loaded: Mutex::new(HashMap::new()),
            compiling: Mutex::new(HashSet::new()),
            compiles: AtomicU64::new(0),
            cache_loads: AtomicU64::new(0),
        })
    }

    /// Validate, compile and store `wasm` as `name@version` (version: the
    /// hash's first 12 hex digits when not given), for `uploader`. Replaces
    /// an earlier upload of the same name and version.
    pub fn install(
        &self,
        name: &str,
        version: Option<&str>,
        wasm: &[u8],
        uploader: Option<&Uploader>,
    ) -> Result<Installed, RegistryError> {
        check_name("name", name)?;
        if BUILT_IN.contains(&name) {
            return Err(RegistryError::Invalid(format!(
                "`{name}` is a built-in inferlet's name; choose another"
            )));
        }
        let sha256 = hex(&Sha256::digest(wasm));
        let version = version.map_or_else(|| sha256[..12].to_string(), str::to_string);
        check_name("version", &version)?;
        // The slot first: a key's check and write are not interleaved with
        // another upload of its own.
        let _compiling = match uploader.filter(|u| u.quota.is_some()) {
            Some(u) => Some(self.begin_compile(&u.key)?),
            None => None,
        };
        if let Some(u) = uploader {
            self.check_quota(u, name, &version, wasm.len())?;
        }
        let component = self.compile(wasm)?;
        check_component(&self.engine, &component).map_err(RegistryError::Invalid)?;
        let base = self.dir.join("components").join(&sha256);
        write_atomically(&base.with_extension("wasm"), wasm)?;
        self.store_compiled(&base, &component)?;
        let installed = Installed {
            name: name.to_string(),
            version,
            sha256: sha256.clone(),
            bytes: wasm.len(),
            uploaded_ms: now_ms(),
            owner: uploader.map(|u| u.key.clone()),
        };
        let record = serde_json::to_vec(&installed).map_err(std::io::Error::other)?;
        write_atomically(&self.name_file(name, &installed.version), &record)?;
        self.lock_loaded().insert(sha256, component);
        Ok(installed)
    }

    /// `uploader` may install `name@version` of `bytes`: a client key only
    /// over its own version, within its quota (the version it replaces not
    /// counted).
    fn check_quota(
        &self,
        uploader: &Uploader,
        name: &str,
        version: &str,
        bytes: usize,
    ) -> Result<(), RegistryError> {
        let Some(quota) = uploader.quota else {
            return Ok(());
        };
        let key = uploader.key.as_str();
        let all = self.list();
        let same = |i: &Installed| i.name == name && i.version == version;
        if all
            .iter()
            .any(|i| same(i) && i.owner.as_deref() != Some(key))
        {
            return Err(RegistryError::Forbidden(format!(
                "`{name}@{version}` was installed by another key; key `{key}` may replace only \
                 its own versions (choose another name or version)"
            )));
        }
        let own: Vec<&Installed> = (all.iter())
            .filter(|i| i.owner.as_deref() == Some(key) && !same(i))
            .collect();
        if own.len() >= quota.max_inferlets {
            return Err(RegistryError::Forbidden(format!(
                "key `{key}` has {} inferlet versions installed, its limit max_inferlets; \
                 delete some first",
                own.len()
            )));
        }
        let held: u64 = own.iter().map(|i| i.bytes as u64).sum();
        if held + bytes as u64 > quota.max_bytes {
            return Err(RegistryError::Forbidden(format!(
                "key `{key}` holds {held} bytes of inferlets and this one has {bytes}: past its \
                 limit max_inferlet_bytes ({}); delete some first",
                quota.max_bytes
            )));
        }
        Ok(())
    }

    /// `key`'s one compile: a second upload while it runs is refused.
    fn begin_compile(&self, key: &str) -> Result<CompileSlot<'_>, RegistryError> {
        let mut compiling = self.compiling.lock().unwrap_or_else(|e| e.into_inner());
        if !compiling.insert(key.to_string()) {
            return Err(RegistryError::Busy(format!(
                "key `{key}` has an upload compiling already; one at a time, retry when it ends"
            )));
        }
        Ok(CompileSlot {
            registry: self,
            key: key.to_string(),
        })
    }

    /// Every installed version, by name, then oldest first.
    pub fn list(&self) -> Vec<Installed> {
        let Ok(entries) = std::fs::read_dir(self.dir.join("names")) else {
            return Vec::new();
        };
        let mut all: Vec<Installed> = entries
            .filter_map(|e| std::fs::read(e.ok()?.path()).ok())
            .filter_map(|bytes| serde_json::from_slice(&bytes).ok())
            .collect();
        all.sort_by(|a, b| (&a.name, a.uploaded_ms).cmp(&(&b.name, b.uploaded_ms)));
        all
    }

    /// `NAME` (its latest upload) or `NAME@VERSION`.
    pub fn find(&self, reference: &str) -> Result<Installed, RegistryError> {
        let (name, version) = inferlet_ref::split(reference);
        self.list()
            .into_iter()
            .rfind(|i| i.name == name && version.is_none_or(|v| i.version == v))
            .ok_or_else(|| RegistryError::NotFound(reference.to_string()))
    }

    /// The compiled component of an installed inferlet: in memory, else from
    /// its compiled code on disk, else compiled again (and stored).
    pub fn load(&self, installed: &Installed) -> Result<Component, RegistryError> {
        if let Some(c) = self.lock_loaded().get(&installed.sha256) {
            return Ok(c.clone());
        }
        let base = self.dir.join("components").join(&installed.sha256);
        // SAFETY: the file is compiled code this registry wrote itself (from
        // a component it validated), in a directory only the operator's
        // worker writes; wasmtime checks that its engine and version match.
        let from_disk =
            unsafe { Component::deserialize_file(&self.engine, base.with_extension("cwasm")) };
        let component = match from_disk {
            Ok(c) => {
                self.cache_loads.fetch_add(1, Ordering::Relaxed);
                c
            }
            Err(e) => {
                tracing::info!(
                    "inferlet {}@{}: compiling again ({e})",
                    installed.name,
                    installed.version
                );
                let c = self.compile(&std::fs::read(base.with_extension("wasm"))?)?;
                self.store_compiled(&base, &c)?;
                c
            }
        };
        self.lock_loaded()
            .insert(installed.sha256.clone(), component.clone());
        Ok(component)
    }

    /// Forget `NAME` (every version) or `NAME@VERSION`; a component no name
    /// uses any more is deleted. Returns what was removed.
    pub fn remove(
        &self,
        reference: &str,
        uploader: Option<&Uploader>,
    ) -> Result<Vec<Installed>, RegistryError> {
        let (name, version) = match reference.split_once('@') {
            Some((n, v)) => (n, Some(v)),
            None => (reference, None),
        };
        let all = self.list();
        let (gone, kept): (Vec<Installed>, Vec<Installed>) = all
            .into_iter()
            .partition(|i| i.name == name && version.is_none_or(|v| i.version == v));
        if gone.is_empty() {
            return Err(RegistryError::NotFound(reference.to_string()));
        }
        if let Some(key) = uploader.filter(|u| u.quota.is_some()).map(|u| &u.key) {
            if let Some(other) = gone.iter().find(|i| i.owner.as_deref() != Some(key)) {
                return Err(RegistryError::Forbidden(format!(
                    "`{}@{}` was installed by another key; key `{key}` may delete only its own \
                     versions",
                    other.name, other.version
                )));
            }
        }
        for i in &gone {
            std::fs::remove_file(self.name_file(&i.name, &i.version))?;
            if !kept.iter().any(|k| k.sha256 == i.sha256) {
                let base = self.dir.join("components").join(&i.sha256);
                let _ = std::fs::remove_file(base.with_extension("wasm"));
                let _ = std::fs::remove_file(base.with_extension("cwasm"));
                self.lock_loaded().remove(&i.sha256);
            }
        }
        Ok(gone)
    }

    fn compile(&self, wasm: &[u8]) -> Result<Component, RegistryError> {
        self.compiles.fetch_add(1, Ordering::Relaxed);
        Component::new(&self.engine, wasm).map_err(|e| {
            RegistryError::Invalid(format!("not a valid WebAssembly component: {e:#}"))
        })
    }

    fn store_compiled(&self, base: &Path, component: &Component) -> Result<(), RegistryError> {
        let code = component
            .serialize()
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        Ok(write_atomically(&base.with_extension("cwasm"), &code)?)
    }

    fn name_file(&self, name: &str, version: &str) -> PathBuf {
        self.dir.join("names").join(format!("{name}@{version}"))
    }

    fn lock_loaded(&self) -> std::sync::MutexGuard<'_, HashMap<String, Component>> {
        self.loaded.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Names and versions: 1-64 of `a-z A-Z 0-9 . _ -`, starting with a letter
/// or digit (they become file names).
/// A key's compile in progress; dropping it ends it.
struct CompileSlot<'a> {
    registry: &'a Registry,
    key: String,
}

impl Drop for CompileSlot<'_> {
    fn drop(&mut self) {
        let mut compiling = (self.registry.compiling.lock()).unwrap_or_else(|e| e.into_inner());
        compiling.remove(&self.key);
    }
}

fn check_name(what: &str, value: &str) -> Result<(), RegistryError> {
    inferlet_ref::check_part(what, value).map_err(RegistryError::Invalid)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension(format!("tmp{}", rand::random::<u32>()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_file_safe() {
        for bad in ["", "../x", "a/b", "-x", &"x".repeat(65), "a b"] {
            assert!(check_name("name", bad).is_err(), "{bad:?}");
        }
        for good in ["best-of-n", "agent_2", "v1.2.3", "X"] {
            assert!(check_name("name", good).is_ok(), "{good:?}");
        }
    }

    #[test]
    fn not_a_component_and_built_in_names_are_refused() {
        let dir = std::env::temp_dir().join(format!("pie-reg-{}", rand::random::<u64>()));
        let reg = Registry::open(Engine::default(), dir.clone()).unwrap();
        let err = reg.install("x", None, b"not wasm", None).unwrap_err();
        assert!(
            err.to_string()
                .contains("not a valid WebAssembly component"),
            "{err}"
        );
        let err = reg.install("chat", None, b"", None).unwrap_err();
        assert!(err.to_string().contains("built-in"), "{err}");
        assert!(reg.list().is_empty());
        assert!(matches!(reg.find("x"), Err(RegistryError::NotFound(_))));
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A key compiles one upload at a time; its slot frees when it ends,
    /// and another key's compile is not held up by it.
    #[test]
    fn a_key_compiles_one_upload_at_a_time() {
        let dir = std::env::temp_dir().join(format!("pie-reg-{}", rand::random::<u64>()));
        let reg = Registry::open(Engine::default(), dir.clone()).unwrap();
        let slot = reg.begin_compile("alice").unwrap();
        let err = reg
            .begin_compile("alice")
            .err()
            .expect("a second is refused");
        assert!(matches!(err, RegistryError::Busy(_)), "{err}");
        assert!(err.to_string().contains("one at a time"), "{err}");
        assert!(reg.begin_compile("bob").is_ok());
        drop(slot);
        assert!(reg.begin_compile("alice").is_ok());
        let _ = std::fs::remove_dir_all(dir);
    }
}
