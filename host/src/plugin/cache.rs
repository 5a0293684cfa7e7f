//! The compiled-plugin cache: native code on disk, so it is treated as such.
//!
//! Loading a compiled artifact runs whatever machine code is in the file
//! (wasmtime's `deserialize` is `unsafe` for that reason). So an artifact is
//! only ever loaded after its MAC checks out: HMAC-SHA256 under a secret
//! key that lives in the cache directory (`.key`, mode 0600, created on
//! first use), over the cache key (component hash + wasmtime version +
//! engine settings) and the artifact bytes. A garbage, bit-flipped or
//! foreign artifact (another plugin's, or another installation's) fails the
//! check, is logged, deleted and recompiled — never run.
//!
//! The directory itself must be private: it is created 0700, and one that
//! is group- or world-writable, or owned by another user, refuses start-up
//! with the reason (`relay.plugin_cache = false` compiles in memory instead).
//! There is no fallback to a shared temporary directory.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

const MAC_LEN: usize = 32;
const KEY_FILE: &str = ".key";

/// A private directory of MAC'd artifacts.
pub struct ArtifactCache {
    dir: PathBuf,
    key: [u8; 32],
}

impl ArtifactCache {
    /// Open (creating it 0700 if missing) the cache directory and its key.
    /// Refuses a directory other users can write to or that we do not own.
    pub fn open(dir: &Path) -> Result<Self> {
        if !dir.exists() {
            fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
                .with_context(|| format!("making {} private", dir.display()))?;
        }
        let meta = fs::metadata(dir).with_context(|| format!("reading {}", dir.display()))?;
        if !meta.is_dir() {
            bail!("{} is not a directory", dir.display());
        }
        if meta.mode() & 0o022 != 0 {
            bail!(
                "{} is writable by other users (mode {:o}): anyone who can write there could make the relay run their code; \
                 `chmod 700` it or point relay.cache_dir at a private directory",
                dir.display(),
                meta.mode() & 0o777
            );
        }
        let me = probe_uid(dir)?;
        if meta.uid() != me {
            bail!(
                "{} belongs to user {} (the relay runs as {me}); use a directory the relay owns",
                dir.display(),
                meta.uid()
            );
        }
        let key = load_or_create_key(&dir.join(KEY_FILE), me)?;
        Ok(ArtifactCache {
            dir: dir.to_path_buf(),
            key,
        })
    }

    /// Where the artifact for `cache_key` lives.
    pub fn path(&self, cache_key: &str) -> PathBuf {
        self.dir.join(format!("{cache_key}.cwasm"))
    }

    fn mac(&self, cache_key: &str, artifact: &[u8]) -> HmacSha256 {
        // `new_from_slice` accepts any key length; 32 bytes cannot fail.
        let mut mac = <HmacSha256 as Mac>::new_from_slice(&self.key)
            .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
        mac.update(cache_key.as_bytes());
        mac.update(&[0]);
        mac.update(artifact);
        mac
    }

    /// The verified artifact for `cache_key`, if there is one. A file that
    /// fails verification is deleted (and logged).
    pub fn load(&self, cache_key: &str) -> Option<Vec<u8>> {
        let path = self.path(cache_key);
        let mut bytes = fs::read(&path).ok()?;
        if bytes.len() > MAC_LEN
            && self
                .mac(cache_key, &bytes[MAC_LEN..])
                .verify_slice(&bytes[..MAC_LEN])
                .is_ok()
        {
            bytes.drain(..MAC_LEN);
            return Some(bytes);
        }
        tracing::warn!(
            file = %path.display(),
            "cached plugin artifact failed verification (tampered, corrupt or not written by this installation for this plugin); \
             deleting it and recompiling"
        );
        let _ = fs::remove_file(&path);
        None
    }

    /// Store an artifact (atomically: written beside, then renamed).
    pub fn store(&self, cache_key: &str, artifact: &[u8]) -> Result<()> {
        let path = self.path(cache_key);
        let tmp = temp_beside(&path);
        let tag = self.mac(cache_key, artifact).finalize().into_bytes();
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(&tag)?;
        f.write_all(artifact)?;
        f.sync_data()?;
        fs::rename(&tmp, &path)?;
        Ok(())
    }
}

/// Our effective uid, read off a file we create in `dir` (no libc needed).
fn probe_uid(dir: &Path) -> Result<u32> {
    let probe = dir.join(format!(".probe{}", std::process::id()));
    let f = File::create(&probe)
        .with_context(|| format!("cannot write to the plugin cache {}", dir.display()))?;
    let uid = f.metadata()?.uid();
    drop(f);
    let _ = fs::remove_file(&probe);
    Ok(uid)
}

/// A fresh name beside `path` for writing before an atomic rename/link
/// (random, so relays sharing a volume never share a temporary file).
fn temp_beside(path: &Path) -> PathBuf {
    path.with_extension(format!("tmp{:016x}", rand::rng().next_u64()))
}

fn load_or_create_key(path: &Path, me: u32) -> Result<[u8; 32]> {
    match fs::symlink_metadata(path) {
        Ok(meta) => {
            if !meta.is_file() {
                bail!("{} is not a regular file", path.display());
            }
            if meta.mode() & 0o077 != 0 || meta.uid() != me {
                bail!(
                    "{} must be private to the relay's user (mode 600)",
                    path.display()
                );
            }
            let bytes = fs::read(path)?;
            bytes
                .try_into()
                .map_err(|_| anyhow::anyhow!("{} is not a 32-byte key", path.display()))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let mut key = [0u8; 32];
            rand::rng().fill_bytes(&mut key);
            // Written beside and linked into place: a relay starting at the
            // same moment either wins or reads the winner's whole key.
            let tmp = temp_beside(path);
            let mut f = OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&tmp)
                .with_context(|| format!("creating {}", tmp.display()))?;
            f.write_all(&key)?;
            f.sync_all()?;
            let linked = fs::hard_link(&tmp, path);
            let _ = fs::remove_file(&tmp);
            match linked {
                Ok(()) => Ok(key),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    load_or_create_key(path, me)
                }
                Err(e) => Err(e).with_context(|| format!("creating {}", path.display())),
            }
        }
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}
