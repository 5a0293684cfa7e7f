//! Hot reload: a [`PluginHandle`] is a route's current plugin, checked
//! against its file now and then; a new version compiles in the background
//! and takes over new batches while batches in flight finish on the old one,
//! and a version that fails to compile or initialise is reported and ignored.

use super::*;

/// A route's plugin, swappable at run time (hot reload). A relay that
/// could not load a route's plugin at start holds a handle without one
/// ([`PluginHandle::waiting`]): the route's events wait until its file is
/// there and loads.
pub struct PluginHandle {
    current: RwLock<Option<Arc<Plugin>>>,
    runtime: Runtime,
    path: PathBuf,
    config: serde_json::Value,
    limits: Limits,
    stamp: Mutex<FileStamp>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct FileStamp {
    modified: Option<SystemTime>,
    len: u64,
}

pub(super) fn stamp(path: &Path) -> FileStamp {
    let md = std::fs::metadata(path).ok();
    FileStamp {
        modified: md.as_ref().and_then(|m| m.modified().ok()),
        len: md.map(|m| m.len()).unwrap_or(0),
    }
}

impl PluginHandle {
    pub fn load(
        runtime: &Runtime,
        path: &Path,
        config: serde_json::Value,
        limits: Limits,
    ) -> Result<Self> {
        let st = stamp(path);
        let compiled = runtime.compile(path)?;
        let plugin = Plugin::new(runtime, compiled, &config, limits)
            .with_context(|| format!("starting plugin {}", path.display()))?;
        Ok(PluginHandle {
            current: RwLock::new(Some(Arc::new(plugin))),
            runtime: runtime.clone(),
            path: path.to_path_buf(),
            config,
            limits,
            stamp: Mutex::new(st),
        })
    }

    /// A handle whose plugin could not be loaded (its file missing or
    /// unusable): it loads once the file at `path` changes.
    pub fn waiting(
        runtime: &Runtime,
        path: &Path,
        config: serde_json::Value,
        limits: Limits,
    ) -> Self {
        PluginHandle {
            current: RwLock::new(None),
            runtime: runtime.clone(),
            path: path.to_path_buf(),
            config,
            limits,
            stamp: Mutex::new(stamp(path)),
        }
    }

    /// The version new batches should use; `None` while none is loaded.
    pub fn current(&self) -> Option<Arc<Plugin>> {
        self.current.read().ok().and_then(|p| p.clone())
    }

    /// No version is loaded yet.
    pub fn is_waiting(&self) -> bool {
        self.current.read().map(|p| p.is_none()).unwrap_or(false)
    }

    /// If the file changed, compile and switch to the new version. Returns
    /// `Ok(Some(info))` on a switch, `Ok(None)` when nothing changed, `Err`
    /// when the new file is unusable (the old version keeps running).
    pub fn reload_if_changed(&self) -> Result<Option<PluginInfo>> {
        let now = stamp(&self.path);
        {
            let Ok(mut last) = self.stamp.lock() else {
                return Ok(None);
            };
            if *last == now {
                return Ok(None);
            }
            *last = now;
        }
        let compiled = self.runtime.compile(&self.path)?;
        if self
            .current()
            .is_some_and(|p| p.compiled.hash == compiled.hash)
        {
            return Ok(None);
        }
        let plugin = Plugin::new(&self.runtime, compiled, &self.config, self.limits)?;
        let info = plugin.info.clone();
        if let Ok(mut cur) = self.current.write() {
            *cur = Some(Arc::new(plugin));
        }
        Ok(Some(info))
    }
}
