//! The engine plugins run on: one wasmtime engine per process with epoch
//! interruption (a ticker advances the epoch every [`TICK`]), components
//! compiled by Cranelift once and cached on disk (`cache.rs`), and the
//! [`Compiled`] component a route's instances are made from.

use super::*;

/// Describes the engine settings that change generated code; part of the
/// cache key so an artifact is never loaded into an engine it was not made
/// for.
pub(super) const ENGINE_FINGERPRINT: &str = "epoch-interruption;component-model;opt=speed;v1";

/// The cache key of a component (given its SHA-256 `hash`): the hash, the
/// wasmtime version and the engine settings that change generated code.
pub(super) fn cache_key(hash: &str) -> String {
    hex(&Sha256::digest(
        format!(
            "{hash};wasmtime-{};{ENGINE_FINGERPRINT}",
            wasmtime_version()
        )
        .as_bytes(),
    ))
}

/// Shared compilation engine with its epoch ticker.
#[derive(Clone)]
pub struct Runtime {
    pub(super) engine: Engine,
    pub(super) linker: Arc<Linker<HostState>>,
    /// `None`: compile in memory every time (`relay.plugin_cache = false`).
    pub(super) cache: Option<Arc<ArtifactCache>>,
    pub(super) _ticker: Arc<Ticker>,
}

pub(super) struct Ticker {
    stop: Arc<AtomicBool>,
}

impl Drop for Ticker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

impl Runtime {
    /// A runtime caching compiled plugins in `cache_dir` (`None`: no disk
    /// cache). A cache directory that is not private to this user is
    /// refused with the reason.
    pub fn new(cache_dir: Option<PathBuf>) -> Result<Self> {
        let cache = match cache_dir {
            Some(d) => Some(Arc::new(ArtifactCache::open(&d).with_context(|| {
                format!(
                    "relay.cache_dir: cannot use {} for compiled plugins",
                    d.display()
                )
            })?)),
            None => None,
        };
        let mut cfg = wasmtime::Config::new();
        cfg.wasm_component_model(true);
        cfg.epoch_interruption(true);
        cfg.cranelift_opt_level(wasmtime::OptLevel::Speed);
        let engine =
            Engine::new(&cfg).map_err(|e| anyhow!("creating the wasmtime engine: {e:#}"))?;
        let mut linker: Linker<HostState> = Linker::new(&engine);
        wasmtime_wasi::p2::add_to_linker_sync(&mut linker)
            .map_err(|e| anyhow!("linking WASI: {e:#}"))?;
        sandbox::add_clock_waits(&mut linker)
            .map_err(|e| anyhow!("linking the plugin clock: {e:#}"))?;
        bindings::Router::add_to_linker::<_, HasSelf<_>>(&mut linker, |s| s)
            .map_err(|e| anyhow!("linking the outroute host interface: {e:#}"))?;

        let stop = Arc::new(AtomicBool::new(false));
        let (e, s) = (engine.clone(), stop.clone());
        std::thread::Builder::new()
            .name("outroute-epoch".into())
            .spawn(move || {
                while !s.load(Ordering::Relaxed) {
                    std::thread::sleep(TICK);
                    e.increment_epoch();
                }
            })
            .context("starting the epoch ticker")?;
        Ok(Runtime {
            engine,
            linker: Arc::new(linker),
            cache,
            _ticker: Arc::new(Ticker { stop }),
        })
    }

    /// Compile (or load from the cache) the component at `path`.
    pub fn compile(&self, path: &Path) -> Result<Compiled> {
        let bytes =
            std::fs::read(path).with_context(|| format!("reading plugin {}", path.display()))?;
        let hash = hex(&Sha256::digest(&bytes));
        let key = cache_key(&hash);
        let (component, from_cache) = match self.load_cached(&key) {
            Some(c) => (c, true),
            None => {
                if let Some(why) = not_a_component(&bytes) {
                    anyhow::bail!("{} {why}", path.display());
                }
                let started = Instant::now();
                let artifact = self
                    .engine
                    .precompile_component(&bytes)
                    .map_err(|e| anyhow!("{} is not a valid component: {e:#}", path.display()))?;
                if let Some(cache) = &self.cache
                    && let Err(e) = cache.store(&key, &artifact)
                {
                    tracing::warn!(file = %cache.path(&key).display(), "cannot cache compiled plugin: {e:#}");
                }
                tracing::info!(plugin = %path.display(), ms = started.elapsed().as_millis() as u64, "compiled plugin");
                // SAFETY: `artifact` was produced just now by this engine.
                (
                    unsafe { Component::deserialize(&self.engine, &artifact) }?,
                    false,
                )
            }
        };
        let imports: Vec<String> = component
            .component_type()
            .imports(&self.engine)
            .map(|(n, _)| n.to_string())
            .collect();
        if let Some(theirs) = contract_of(&imports)
            && !contract_supported(&theirs)
        {
            anyhow::bail!(
                "{} was built against {theirs}, but this relay speaks {} (it runs plugins built against 0.1.0 up to {}): build the plugin against a contract this relay knows, or upgrade the relay",
                path.display(),
                CONTRACT.trim_start_matches("outroute:router@"),
                CONTRACT.trim_start_matches("outroute:router@"),
            );
        }
        let pre = self.linker.instantiate_pre(&component).map_err(|e| {
            anyhow!(
                "{} does not fit the outroute `router` world: {e:#}",
                path.display()
            )
        })?;
        let pre = bindings::RouterPre::new(pre).map_err(|e| {
            anyhow!(
                "{} does not export the `router` world: {e:#}",
                path.display()
            )
        })?;
        Ok(Compiled {
            component,
            pre,
            hash,
            path: path.to_path_buf(),
            from_cache,
        })
    }

    /// Where the compiled artifact of the component at `path` is cached
    /// (for operators and tests); `None` without a disk cache.
    pub fn artifact_path(&self, path: &Path) -> Result<Option<PathBuf>> {
        let bytes =
            std::fs::read(path).with_context(|| format!("reading plugin {}", path.display()))?;
        Ok(self
            .cache
            .as_ref()
            .map(|c| c.path(&cache_key(&hex(&Sha256::digest(&bytes))))))
    }

    fn load_cached(&self, key: &str) -> Option<Component> {
        let artifact = self.cache.as_ref()?.load(key)?;
        // SAFETY: the bytes carry a valid MAC under this installation's
        // private key over (cache key, artifact): this runtime's engine
        // compiled them from this exact component with these settings.
        match unsafe { Component::deserialize(&self.engine, &artifact) } {
            Ok(c) => Some(c),
            Err(e) => {
                tracing::warn!(key, "ignoring unusable cached plugin artifact: {e:#}");
                None
            }
        }
    }

    pub(super) fn new_store(&self, plugin: &str, caps: Caps) -> Store<HostState> {
        let mut store = Store::new(&self.engine, HostState::new(plugin, caps));
        store.limiter(|s| &mut s.limiter);
        store.epoch_deadline_callback(HostState::on_deadline);
        store
    }
}

pub(super) fn wasmtime_version() -> &'static str {
    // The crate version pinned in Cargo.lock; bumping wasmtime changes it.
    "48"
}

pub(super) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A compiled component, ready to instantiate.
pub struct Compiled {
    pub(super) component: Component,
    pub(super) pre: bindings::RouterPre<HostState>,
    pub hash: String,
    pub path: PathBuf,
    /// Loaded from the verified disk cache rather than compiled now.
    pub from_cache: bool,
}
