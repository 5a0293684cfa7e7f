//! The plugin runtime: runs routing plugins (WebAssembly components of the
//! `router` world in `wit/`) safely and fast.
//!
//! * **Compile once.** Components are compiled by Cranelift once and the
//!   artifact is cached on disk, keyed by the component's SHA-256, the
//!   wasmtime version and the engine settings. An artifact is native code:
//!   it is loaded back only after its MAC under this installation's secret
//!   key checks out, from a directory only the relay's user can write
//!   (`plugin/cache.rs`).
//! * **Reuse instances.** Each route keeps a small pool of initialised
//!   instances; an event is routed on a warm instance (~µs, not the cost of a
//!   fresh instantiation).
//! * **Contain failures.** Every call runs under a CPU budget (epoch
//!   deadline: `cpu_budget` per event) and a linear-memory cap. A trap, a
//!   blown budget or an out-of-memory becomes a retryable rejection of *that
//!   event* with a clear reason; the poisoned instance is dropped and a fresh
//!   one made. When a batch call traps, the batch is re-routed one event at a
//!   time so only the guilty event is charged.
//! * **No ambient authority.** Plugins get the `host.log` import and an
//!   empty WASI context (no preopened dirs, no env, no args, no sockets, no
//!   inherited stdio; stderr goes to a small in-memory buffer that is quoted
//!   in trap reasons; the clocks are frozen at the Unix epoch, so routing
//!   cannot depend on the time — use the event's `created-at-ms`). std-built Rust guests import WASI even when they do no
//!   I/O, so WASI is linked but grants nothing.
//! * **Hot reload.** A [`PluginHandle`] checks its file now and then; a new
//!   version compiles in the background and takes over new batches, batches
//!   in flight finish on the old one, and a version that fails to compile or
//!   initialise is reported and ignored.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result, anyhow};
use sha2::{Digest, Sha256};
use wasmtime::component::{Component, HasSelf, Linker, ResourceTable};
use wasmtime::{Engine, Store, StoreLimits, StoreLimitsBuilder, Trap};
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use crate::event::{Event, Message, Outcome, Rejection};

mod cache;
pub use cache::ArtifactCache;

mod bindings {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "router",
    });
}

use bindings::outroute::router::host::{Host, Level};
use bindings::outroute::router::types as wit;

/// Epoch tick. CPU budgets are rounded up to whole ticks.
const TICK: Duration = Duration::from_millis(1);

/// Describes the engine settings that change generated code; part of the
/// cache key so an artifact is never loaded into an engine it was not made
/// for.
const ENGINE_FINGERPRINT: &str = "epoch-interruption;component-model;opt=speed;v1";

/// The cache key of a component (given its SHA-256 `hash`): the hash, the
/// wasmtime version and the engine settings that change generated code.
fn cache_key(hash: &str) -> String {
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
    engine: Engine,
    linker: Arc<Linker<HostState>>,
    /// `None`: compile in memory every time (`relay.plugin_cache = false`).
    cache: Option<Arc<ArtifactCache>>,
    _ticker: Arc<Ticker>,
}

struct Ticker {
    stop: Arc<AtomicBool>,
}

impl Drop for Ticker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// The only clock a plugin sees: stopped at the Unix epoch.
struct FrozenClock;

impl wasmtime_wasi::HostWallClock for FrozenClock {
    fn resolution(&self) -> Duration {
        Duration::from_secs(1)
    }
    fn now(&self) -> Duration {
        Duration::ZERO
    }
}

impl wasmtime_wasi::HostMonotonicClock for FrozenClock {
    fn resolution(&self) -> u64 {
        1_000_000_000
    }
    fn now(&self) -> u64 {
        0
    }
}

/// What a plugin instance may reach: its log, its limits, an empty WASI.
pub struct HostState {
    plugin: String,
    limits: StoreLimits,
    wasi: WasiCtx,
    table: ResourceTable,
    stderr: MemoryOutputPipe,
}

impl WasiView for HostState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

impl bindings::outroute::router::types::Host for HostState {}

impl Host for HostState {
    fn log(&mut self, level: Level, message: String) {
        let message: String = message.chars().take(4096).collect();
        let plugin = self.plugin.as_str();
        match level {
            Level::Trace => tracing::trace!(plugin, "{message}"),
            Level::Debug => tracing::debug!(plugin, "{message}"),
            Level::Info => tracing::info!(plugin, "{message}"),
            Level::Warn => tracing::warn!(plugin, "{message}"),
            Level::Error => tracing::error!(plugin, "{message}"),
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

    fn new_store(&self, plugin: &str, memory_bytes: usize) -> Store<HostState> {
        let stderr = MemoryOutputPipe::new(4096);
        let wasi = wasmtime_wasi::WasiCtxBuilder::new()
            .stderr(stderr.clone())
            .allow_tcp(false)
            .allow_udp(false)
            .allow_ip_name_lookup(false)
            .wall_clock(FrozenClock)
            .monotonic_clock(FrozenClock)
            .build();
        let limits = StoreLimitsBuilder::new()
            .memory_size(memory_bytes)
            .instances(16)
            .tables(64)
            .memories(16)
            .trap_on_grow_failure(true)
            .build();
        let mut store = Store::new(
            &self.engine,
            HostState {
                plugin: plugin.to_string(),
                limits,
                wasi,
                table: ResourceTable::new(),
                stderr,
            },
        );
        store.limiter(|s| &mut s.limits);
        store.epoch_deadline_trap();
        store
    }
}

fn wasmtime_version() -> &'static str {
    // The crate version pinned in Cargo.lock; bumping wasmtime changes it.
    "48"
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A compiled component, ready to instantiate.
pub struct Compiled {
    component: Component,
    pre: bindings::RouterPre<HostState>,
    pub hash: String,
    pub path: PathBuf,
    /// Loaded from the verified disk cache rather than compiled now.
    pub from_cache: bool,
}

/// Name and version a plugin reports about itself.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct PluginInfo {
    pub name: String,
    pub version: String,
}

/// What `outroute plugin inspect` shows.
#[derive(Debug, serde::Serialize)]
pub struct Inspection {
    pub file: String,
    pub sha256: String,
    pub world: &'static str,
    pub name: String,
    pub version: String,
    pub imports: Vec<String>,
    pub exports: Vec<String>,
}

/// Per-route limits for instances.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub cpu_budget: Duration,
    pub memory_bytes: usize,
}

struct Instance {
    store: Store<HostState>,
    router: bindings::Router,
}

/// One plugin version bound to one route's config, with its warm instances.
pub struct Plugin {
    runtime: Runtime,
    compiled: Compiled,
    pub info: PluginInfo,
    config_json: String,
    limits: Limits,
    pool: Mutex<Vec<Instance>>,
    max_idle: usize,
}

impl Plugin {
    /// Instantiate once to read `describe` and check that `init` accepts the
    /// route config; the instance is kept for reuse.
    pub fn new(
        runtime: &Runtime,
        compiled: Compiled,
        config: &serde_json::Value,
        limits: Limits,
    ) -> Result<Self> {
        let config_json = if config.is_null() {
            String::new()
        } else {
            config.to_string()
        };
        let mut plugin = Plugin {
            runtime: runtime.clone(),
            compiled,
            info: PluginInfo {
                name: String::new(),
                version: String::new(),
            },
            config_json,
            limits,
            pool: Mutex::new(Vec::new()),
            max_idle: 8,
        };
        let mut inst = plugin.instantiate()?;
        inst.store.set_epoch_deadline(ticks(limits.cpu_budget, 1));
        let info = inst.router.call_describe(&mut inst.store).map_err(|e| {
            anyhow!(
                "plugin {} failed in describe: {}",
                plugin.compiled.path.display(),
                trap_reason(&e, &inst.store, limits)
            )
        })?;
        plugin.info = PluginInfo {
            name: info.name,
            version: info.version,
        };
        plugin.checkin(inst);
        Ok(plugin)
    }

    fn instantiate(&self) -> Result<Instance> {
        let mut store = self
            .runtime
            .new_store(&self.info.name, self.limits.memory_bytes);
        store.set_epoch_deadline(ticks(self.limits.cpu_budget, 1).max(100));
        let router = self
            .compiled
            .pre
            .instantiate(&mut store)
            .map_err(|e| anyhow!("instantiating {}: {e:#}", self.compiled.path.display()))?;
        router
            .call_init(&mut store, &self.config_json)
            .map_err(|e| {
                anyhow!(
                    "plugin init trapped: {}",
                    trap_reason(&e, &store, self.limits)
                )
            })?
            .map_err(|e| anyhow!("plugin refused its route config: {e}"))?;
        Ok(Instance { store, router })
    }

    fn checkout(&self) -> Result<Instance> {
        let pooled = self.pool.lock().ok().and_then(|mut p| p.pop());
        match pooled {
            Some(i) => Ok(i),
            None => self.instantiate(),
        }
    }

    fn checkin(&self, inst: Instance) {
        if let Ok(mut p) = self.pool.lock()
            && p.len() < self.max_idle
        {
            p.push(inst);
        }
    }

    /// Route a batch of events; one outcome per event, in order. Blocking:
    /// call from a blocking thread.
    pub fn route_batch(&self, events: &[Event]) -> Vec<Outcome> {
        if events.is_empty() {
            return Vec::new();
        }
        let wit_events: Vec<wit::Event> = events.iter().map(to_wit).collect();
        let mut inst = match self.checkout() {
            Ok(i) => i,
            Err(e) => {
                let reason = format!("plugin {} could not be instantiated: {e:#}", self.info.name);
                return events
                    .iter()
                    .map(|_| Err(Rejection::Retryable(reason.clone())))
                    .collect();
            }
        };
        inst.store
            .set_epoch_deadline(ticks(self.limits.cpu_budget, events.len()));
        let result = if wit_events.len() == 1 {
            inst.router
                .call_route(&mut inst.store, &wit_events[0])
                .map(|o| vec![o])
        } else {
            inst.router.call_route_batch(&mut inst.store, &wit_events)
        };
        match result {
            Ok(outcomes) if outcomes.len() == events.len() => {
                self.checkin(inst);
                outcomes.into_iter().map(from_wit).collect()
            }
            Ok(outcomes) => {
                // A plugin bug in `route-batch`; `route` may still be right:
                // route one event at a time instead of failing them all.
                self.checkin(inst);
                tracing::error!(
                    plugin = %self.info.name,
                    version = %self.info.version,
                    "plugin bug: route-batch returned {} outcomes for {} events; routing them one at a time",
                    outcomes.len(),
                    events.len()
                );
                events
                    .iter()
                    .flat_map(|e| self.route_batch(std::slice::from_ref(e)))
                    .collect()
            }
            Err(e) if events.len() == 1 => {
                // The instance is poisoned after a trap: drop it.
                let reason = trap_reason(&e, &inst.store, self.limits);
                vec![Err(Rejection::Retryable(format!(
                    "plugin {} {reason}",
                    self.info.name
                )))]
            }
            Err(_) => {
                // Find the guilty event(s): route one at a time.
                drop(inst);
                events
                    .iter()
                    .flat_map(|e| self.route_batch(std::slice::from_ref(e)))
                    .collect()
            }
        }
    }
}

fn ticks(budget: Duration, events: usize) -> u64 {
    let per = budget.as_micros().div_ceil(TICK.as_micros()).max(1) as u64;
    per.saturating_mul(events.max(1) as u64).saturating_add(1)
}

/// A clear, specific reason for a failed call.
fn trap_reason(err: &wasmtime::Error, store: &Store<HostState>, limits: Limits) -> String {
    let stderr = String::from_utf8_lossy(&store.data().stderr.contents())
        .trim()
        .to_string();
    let stderr = if stderr.is_empty() {
        String::new()
    } else {
        format!("; plugin stderr: {}", truncate(&stderr, 512))
    };
    let text = format!("{err:#}");
    if let Some(trap) = err.downcast_ref::<Trap>() {
        return match trap {
            Trap::Interrupt => format!(
                "exceeded its CPU budget ({} ms per event) and was stopped",
                limits.cpu_budget.as_millis()
            ),
            Trap::StackOverflow => format!("overflowed its stack{stderr}"),
            other => format!("trapped: {other}{stderr}"),
        };
    }
    if text.contains("memory") && (text.contains("grow") || text.contains("limit")) {
        return format!(
            "exceeded its memory cap of {} MiB",
            limits.memory_bytes / (1024 * 1024)
        );
    }
    format!("failed: {}{stderr}", truncate(&text, 512))
}

fn truncate(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        format!("{}…", s.chars().take(n).collect::<String>())
    }
}

fn to_wit(e: &Event) -> wit::Event {
    wit::Event {
        id: e.id.clone(),
        sequence: e.sequence,
        aggregate_type: e.aggregate_type.clone(),
        aggregate_id: e.aggregate_id.clone(),
        event_type: e.event_type.clone(),
        event_version: e.event_version,
        payload: e.payload.clone(),
        headers: e.headers.clone(),
        created_at_ms: e.created_at.timestamp_millis(),
        attempt: e.attempts.saturating_add(1),
    }
}

fn from_wit(o: wit::Outcome) -> Outcome {
    match o {
        Ok(msgs) => Ok(msgs
            .into_iter()
            .map(|m| Message {
                sink: m.sink,
                topic: m.topic,
                key: m.key,
                partition: m.partition,
                headers: m.headers,
                payload: m.payload,
            })
            .collect()),
        Err(wit::Rejection::Retryable(r)) => Err(Rejection::Retryable(r)),
        Err(wit::Rejection::Invalid(r)) => Err(Rejection::Invalid(r)),
    }
}

/// Read a component's imports/exports and its self-description.
pub fn inspect(runtime: &Runtime, path: &Path) -> Result<Inspection> {
    let compiled = runtime.compile(path)?;
    let ty = compiled.component.component_type();
    let engine = &runtime.engine;
    let imports = ty.imports(engine).map(|(n, _)| n.to_string()).collect();
    let exports = ty.exports(engine).map(|(n, _)| n.to_string()).collect();
    let hash = compiled.hash.clone();
    let limits = Limits {
        cpu_budget: Duration::from_secs(1),
        memory_bytes: 256 << 20,
    };
    let mut store = runtime.new_store("inspect", limits.memory_bytes);
    store.set_epoch_deadline(ticks(limits.cpu_budget, 1));
    let router = compiled.pre.instantiate(&mut store)?;
    let info = router
        .call_describe(&mut store)
        .map_err(|e| anyhow!("describe failed: {}", trap_reason(&e, &store, limits)))?;
    Ok(Inspection {
        file: path.display().to_string(),
        sha256: hash,
        world: "outroute:router/router@0.1.0",
        name: info.name,
        version: info.version,
        imports,
        exports,
    })
}

/// A route's plugin, swappable at run time (hot reload).
pub struct PluginHandle {
    current: RwLock<Arc<Plugin>>,
    runtime: Runtime,
    path: PathBuf,
    config: serde_json::Value,
    limits: Limits,
    stamp: Mutex<FileStamp>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct FileStamp {
    modified: Option<SystemTime>,
    len: u64,
}

fn stamp(path: &Path) -> FileStamp {
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
            current: RwLock::new(Arc::new(plugin)),
            runtime: runtime.clone(),
            path: path.to_path_buf(),
            config,
            limits,
            stamp: Mutex::new(st),
        })
    }

    /// The version new batches should use.
    pub fn current(&self) -> Option<Arc<Plugin>> {
        self.current.read().ok().map(|p| p.clone())
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
            *cur = Arc::new(plugin);
        }
        Ok(Some(info))
    }
}
