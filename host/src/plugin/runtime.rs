//! The engine plugins run on: one wasmtime engine per process with epoch
//! interruption (a ticker advances the epoch every [`TICK`] while a plugin
//! call may be running, and sleeps while none can be), components
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

/// Where one component's loaded code is kept while any route runs it;
/// locked while it loads, so others wait for that load.
type Slot = Arc<Mutex<Weak<Code>>>;

/// Shared compilation engine with its epoch ticker.
#[derive(Clone)]
pub struct Runtime {
    pub(super) engine: Engine,
    pub(super) linker: Arc<Linker<HostState>>,
    /// `None`: compile in memory every time (`relay.plugin_cache = false`).
    pub(super) cache: Option<Arc<ArtifactCache>>,
    pub(super) ticker: Arc<Ticker>,
    /// Components loaded in this process, by cache key: every route (of
    /// every source) that runs the same component shares its code, and
    /// sources starting together wait for one compile instead of each
    /// compiling it (200 sources of one plugin: one copy, not 200).
    loaded: Arc<Mutex<HashMap<String, Slot>>>,
}

pub(super) struct Ticker {
    shared: Arc<Ticking>,
}

impl Drop for Ticker {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.shared.thread.get() {
            t.unpark();
        }
    }
}

/// What the epoch ticker thread and the calls share. The ticker advances
/// the epoch only until `until` (the wall-clock limit of the latest call
/// begun, plus a second); past it, it parks until a call begins. An idle
/// relay then costs no thread wake-ups (a thousand a second otherwise),
/// and a running call still gets every tick its limits need: its wall-clock
/// limit is the longest it may run.
pub(crate) struct Ticking {
    stop: AtomicBool,
    origin: Instant,
    /// Nanoseconds after `origin` until which to tick.
    until: AtomicU64,
    thread: std::sync::OnceLock<std::thread::Thread>,
}

impl Ticking {
    fn now(&self) -> u64 {
        self.origin.elapsed().as_nanos() as u64
    }

    /// A call begins that may run for `longest`: tick until it is over.
    pub(crate) fn call_begins(&self, longest: Duration) {
        let now = self.now();
        let until = now.saturating_add(
            (longest + Duration::from_secs(1))
                .as_nanos()
                .min(u64::MAX as u128) as u64,
        );
        // Ticking was due to stop before now: the thread may be parked.
        if self.until.fetch_max(until, Ordering::AcqRel) <= now
            && let Some(t) = self.thread.get()
        {
            t.unpark();
        }
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

        let shared = Arc::new(Ticking {
            stop: AtomicBool::new(false),
            origin: Instant::now(),
            until: AtomicU64::new(0),
            thread: std::sync::OnceLock::new(),
        });
        let (e, s) = (engine.clone(), shared.clone());
        let thread = std::thread::Builder::new()
            .name("outroute-epoch".into())
            .spawn(move || {
                while !s.stop.load(Ordering::Relaxed) {
                    if s.now() < s.until.load(Ordering::Acquire) {
                        std::thread::sleep(TICK);
                        e.increment_epoch();
                    } else {
                        // Woken by the next call (or by the drop); the
                        // timeout only bounds a missed wake-up's cost.
                        std::thread::park_timeout(Duration::from_secs(1));
                    }
                }
            })
            .context("starting the epoch ticker")?;
        let _ = shared.thread.set(thread.thread().clone());
        Ok(Runtime {
            engine,
            linker: Arc::new(linker),
            cache,
            ticker: Arc::new(Ticker { shared }),
            loaded: Arc::default(),
        })
    }

    /// Compile (or load from the cache) the component at `path`; a
    /// component already loaded in this process is shared, not loaded again.
    pub fn compile(&self, path: &Path) -> Result<Compiled> {
        let bytes =
            std::fs::read(path).with_context(|| format!("reading plugin {}", path.display()))?;
        let hash = hex(&Sha256::digest(&bytes));
        let key = cache_key(&hash);
        let slot = {
            // A panic elsewhere leaves the table as it was: still usable.
            let mut loaded = self.loaded.lock().unwrap_or_else(|p| p.into_inner());
            // Forget components no route runs any more.
            loaded.retain(|k, s| {
                k == &key
                    || Arc::strong_count(s) > 1
                    || s.try_lock().map_or(true, |w| w.strong_count() > 0)
            });
            loaded.entry(key.clone()).or_default().clone()
        };
        // One load per component at a time; the others wait for it.
        // A load that panicked stored nothing: this one loads again.
        let mut slot = slot.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(code) = slot.upgrade() {
            return Ok(Compiled {
                code,
                hash,
                path: path.to_path_buf(),
                from_cache: true,
            });
        }
        let (code, from_cache) = self.load(path, &bytes, &key)?;
        let code = Arc::new(code);
        *slot = Arc::downgrade(&code);
        Ok(Compiled {
            code,
            hash,
            path: path.to_path_buf(),
            from_cache,
        })
    }

    /// [`Runtime::compile`] from the disk cache or Cranelift.
    fn load(&self, path: &Path, bytes: &[u8], key: &str) -> Result<(Code, bool)> {
        let (component, from_cache) = match self.load_cached(key) {
            Some(c) => (c, true),
            None => {
                if let Some(why) = not_a_component(bytes) {
                    anyhow::bail!("{} {why}", path.display());
                }
                let started = Instant::now();
                let artifact = self
                    .engine
                    .precompile_component(bytes)
                    .map_err(|e| anyhow!("{} is not a valid component: {e:#}", path.display()))?;
                if let Some(cache) = &self.cache
                    && let Err(e) = cache.store(key, &artifact)
                {
                    tracing::warn!(file = %cache.path(key).display(), "cannot cache compiled plugin: {e:#}");
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
        Ok((Code { component, pre }, from_cache))
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
        let mut store = Store::new(
            &self.engine,
            HostState::new(plugin, caps, self.ticker.shared.clone()),
        );
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

/// A compiled component's code, shared by every route that runs it.
pub(super) struct Code {
    pub(super) component: Component,
    pub(super) pre: bindings::RouterPre<HostState>,
}

/// A compiled component, ready to instantiate.
pub struct Compiled {
    pub(super) code: Arc<Code>,
    pub hash: String,
    pub path: PathBuf,
    /// Loaded from the verified disk cache, or shared with a route that
    /// loaded it, rather than compiled now.
    pub from_cache: bool,
}
