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
//! * **Contain failures.** Every call runs under a CPU budget (thread CPU
//!   time, `cpu_budget` per event), one memory cap over all its memories
//!   and tables, and log limits (`plugin/sandbox.rs`). A trap or a broken
//!   limit becomes a retryable rejection of *that event* with a clear reason
//!   naming the limit; the poisoned instance is dropped and a fresh one made.
//!   When a batch call fails, the batch is re-routed one event at a time so
//!   only the guilty event is charged, and once one event used up its CPU
//!   budget the route's other events in the batch wait for the next batch
//!   (a looping plugin costs other routes one budget per batch, not one per
//!   event). A batch call's own deadline follows the plugin's measured cost
//!   per event, so a loop inside `route-batch` is found in a few times what
//!   the batch should take, not in events × budget.
//! * **No ambient authority.** Plugins get the `host` imports (`log`,
//!   `count`) and an
//!   empty WASI context (no preopened dirs, no env, no args, no sockets, no
//!   inherited stdio; frozen clocks whose waits are over at once;
//!   deterministic randomness). std-built Rust guests import WASI even when
//!   they do no I/O, so WASI is linked but grants nothing.
//! * **Hot reload.** A [`PluginHandle`] checks its file now and then; a new
//!   version compiles in the background and takes over new batches, batches
//!   in flight finish on the old one, and a version that fails to compile or
//!   initialise is reported and ignored.
//! * **One contract, versioned.** A plugin built against any 0.1.x up to
//!   [`CONTRACT`] runs (wasmtime's linker resolves its older imports to the
//!   newer interfaces); one built against a newer contract is refused with
//!   both versions named, before anything else can go wrong.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result, anyhow};
use sha2::{Digest, Sha256};
use wasmtime::component::{Component, HasSelf, Linker};
use wasmtime::{Engine, Store, Trap};

use crate::event::{Event, Message, Outcome, Rejection};

mod cache;
pub use cache::ArtifactCache;
mod sandbox;
pub use sandbox::Limit;
use sandbox::{Caps, HostState, TICK, WALL_FACTOR};

/// The contract this relay speaks: the `package` line of `wit/router.wit`
/// (a unit test keeps them equal).
pub const CONTRACT: &str = "outroute:router@0.1.1";

/// The contract version a component was built against, read from its
/// `outroute:router/…@x.y.z` imports (`None` if it imports none).
pub fn contract_of(imports: &[String]) -> Option<String> {
    imports.iter().find_map(|i| {
        let (iface, version) = i.strip_prefix("outroute:router/")?.split_once('@')?;
        (!iface.is_empty()).then(|| format!("outroute:router@{version}"))
    })
}

/// Whether a plugin built against `theirs` (`outroute:router@x.y.z`) runs
/// on this relay: same semver-compatible series (for 0.x, the same minor),
/// and not newer than [`CONTRACT`].
pub fn contract_supported(theirs: &str) -> bool {
    let parse = |c: &str| {
        c.strip_prefix("outroute:router@")
            .and_then(|v| semver::Version::parse(v).ok())
    };
    match (parse(theirs), parse(CONTRACT)) {
        (Some(t), Some(h)) => {
            let series = |v: &semver::Version| {
                if v.major == 0 {
                    (0, v.minor)
                } else {
                    (v.major, 0)
                }
            };
            t.pre.is_empty() && series(&t) == series(&h) && t <= h
        }
        _ => false,
    }
}

mod bindings {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "router",
        imports: {
            "outroute:router/host.log": trappable,
            "outroute:router/host.count": trappable,
        },
    });
}

use bindings::outroute::router::types as wit;

/// Longest plugin name and version `describe` may return (they are copied
/// into every failure record).
const MAX_NAME_BYTES: usize = 128;
const MAX_VERSION_BYTES: usize = 64;

/// The plugin's cost per event assumed before any batch was measured.
const INITIAL_COST_PER_EVENT: Duration = Duration::from_micros(50);

/// A batch call may take this many times the plugin's measured cost before
/// it is stopped and the batch re-routed one event at a time.
const BATCH_SLACK: u32 = 20;

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

    fn new_store(&self, plugin: &str, caps: Caps) -> Store<HostState> {
        let mut store = Store::new(&self.engine, HostState::new(plugin, caps));
        store.limiter(|s| &mut s.limiter);
        store.epoch_deadline_callback(HostState::on_deadline);
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
    /// The contract the plugin was built against (from its imports).
    pub contract: String,
    /// The contract this relay speaks.
    pub host_contract: &'static str,
    pub name: String,
    pub version: String,
    pub imports: Vec<String>,
    pub exports: Vec<String>,
}

/// The least CPU time instantiation and `init` get, each, whatever the
/// route's per-event budget (a plugin may build tables once there).
const SETUP_MIN_BUDGET: Duration = Duration::from_millis(100);

/// Per-route limits for instances.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub cpu_budget: Duration,
    /// All memories and tables of one instance together.
    pub memory_bytes: usize,
    pub log_lines_per_event: u32,
    pub log_bytes_per_event: u64,
    /// Idle instances kept for reuse, by their memory together.
    pub max_idle_bytes: usize,
}

impl Default for Limits {
    /// The defaults of a route's config.
    fn default() -> Self {
        Limits {
            cpu_budget: Duration::from_millis(50),
            memory_bytes: 64 << 20,
            log_lines_per_event: 100,
            log_bytes_per_event: 64 << 10,
            max_idle_bytes: 64 << 20,
        }
    }
}

impl Limits {
    /// The limits a route's config sets.
    pub fn of(route: &crate::config::RouteConfig) -> Self {
        Limits {
            cpu_budget: route.cpu_budget,
            memory_bytes: (route.memory_mib as usize) << 20,
            log_lines_per_event: route.max_log_lines_per_event,
            log_bytes_per_event: route.max_log_bytes_per_event,
            max_idle_bytes: (route.max_idle_memory_mib as usize) << 20,
        }
    }

    fn caps(&self) -> Caps {
        Caps {
            memory_bytes: self.memory_bytes,
            log_lines_per_event: self.log_lines_per_event,
            log_bytes_per_event: self.log_bytes_per_event,
        }
    }
}

/// What became of one event handed to the plugin.
#[derive(Debug)]
pub enum Answer {
    /// The plugin answered (messages or its own rejection).
    Outcome(Outcome),
    /// The call was stopped by a limit (a retryable failure of this event,
    /// counted towards the route's quarantine).
    Breach { limit: Limit, reason: String },
    /// Not routed in this batch: an earlier event of the route (`after`,
    /// its id) used up its CPU budget, so the rest wait for the next batch.
    Later { after: String },
}

impl Answer {
    /// As an outcome: a breach is a retryable rejection with its reason.
    pub fn into_outcome(self) -> Outcome {
        match self {
            Answer::Outcome(o) => o,
            Answer::Breach { reason, .. } => Err(Rejection::Retryable(reason)),
            Answer::Later { after } => Err(Rejection::Retryable(format!(
                "not routed: event {after}, earlier in the batch, used up the CPU budget"
            ))),
        }
    }
}

struct Instance {
    store: Store<HostState>,
    router: bindings::Router,
}

impl Instance {
    fn memory_bytes(&self) -> usize {
        self.store.data().limiter.used
    }
}

/// Warm instances, bounded in count and in memory.
#[derive(Default)]
struct Pool {
    idle: Vec<Instance>,
    bytes: usize,
}

/// One plugin version bound to one route's config, with its warm instances.
pub struct Plugin {
    runtime: Runtime,
    compiled: Compiled,
    pub info: PluginInfo,
    config_json: String,
    limits: Limits,
    pool: Mutex<Pool>,
    max_idle: usize,
    /// Measured CPU time per event of batch calls (ns, moving average).
    cost_ns: AtomicU64,
    /// `host.count` totals of successful calls not yet taken by the relay.
    counts: Mutex<Vec<(String, u64)>>,
}

impl Plugin {
    /// Instantiate once to read `describe` and check that `init` accepts the
    /// route config; the instance is kept for reuse. `describe` (which must
    /// not depend on the config, says the contract) comes first, so even the
    /// first `init`'s log lines carry the plugin's own name.
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
            pool: Mutex::new(Pool::default()),
            max_idle: 8,
            cost_ns: AtomicU64::new(INITIAL_COST_PER_EVENT.as_nanos() as u64),
            counts: Mutex::new(Vec::new()),
        };
        let stem = plugin
            .compiled
            .path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let mut inst = plugin.instantiate_bare(&stem)?;
        let deadline = inst.store.data_mut().begin_call(limits.cpu_budget, 1);
        inst.store.set_epoch_deadline(deadline);
        let info = inst.router.call_describe(&mut inst.store).map_err(|e| {
            anyhow!(
                "plugin {} failed in describe: {}",
                plugin.compiled.path.display(),
                trap_reason(&e, &inst.store, limits, "for describe")
            )
        })?;
        if info.name.len() > MAX_NAME_BYTES || info.version.len() > MAX_VERSION_BYTES {
            anyhow::bail!(
                "plugin {}: describe() returned a name of {} bytes and a version of {} bytes (at most {MAX_NAME_BYTES} and {MAX_VERSION_BYTES})",
                plugin.compiled.path.display(),
                info.name.len(),
                info.version.len()
            );
        }
        inst.store.data_mut().rename(&info.name);
        plugin.info = PluginInfo {
            name: info.name,
            version: info.version,
        };
        plugin.init(&mut inst)?;
        plugin.checkin(inst);
        Ok(plugin)
    }

    /// A new instance, ready for events.
    fn instantiate(&self) -> Result<Instance> {
        let mut inst = self.instantiate_bare(&self.info.name)?;
        self.init(&mut inst)?;
        Ok(inst)
    }

    /// A new instance before `init`; `name` labels its log lines.
    fn instantiate_bare(&self, name: &str) -> Result<Instance> {
        let mut store = self.runtime.new_store(name, self.limits.caps());
        // Instantiation and `init` get at least SETUP_MIN_BUDGET each (a
        // plugin may build tables once there).
        let deadline = store
            .data_mut()
            .begin_call(self.limits.cpu_budget.max(SETUP_MIN_BUDGET), 1);
        store.set_epoch_deadline(deadline);
        let router = self
            .compiled
            .pre
            .instantiate(&mut store)
            .map_err(|e| anyhow!("instantiating {}: {e:#}", self.compiled.path.display()))?;
        Ok(Instance { store, router })
    }

    /// Hand the route config to a new instance's `init`.
    fn init(&self, inst: &mut Instance) -> Result<()> {
        let Instance { store, router } = inst;
        let limits = Limits {
            cpu_budget: self.limits.cpu_budget.max(SETUP_MIN_BUDGET),
            ..self.limits
        };
        let deadline = store.data_mut().begin_call(limits.cpu_budget, 1);
        store.set_epoch_deadline(deadline);
        router
            .call_init(&mut *store, &self.config_json)
            .map_err(|e| {
                anyhow!(
                    "plugin init trapped: {}",
                    trap_reason(&e, store, limits, "for init")
                )
            })?
            .map_err(|e| anyhow!("plugin refused its route config: {e}"))?;
        Ok(())
    }

    fn checkout(&self) -> Result<Instance> {
        let pooled = self.pool.lock().ok().and_then(|mut p| {
            let inst = p.idle.pop()?;
            p.bytes = p.bytes.saturating_sub(inst.memory_bytes());
            Some(inst)
        });
        match pooled {
            Some(i) => Ok(i),
            None => self.instantiate(),
        }
    }

    fn checkin(&self, inst: Instance) {
        let bytes = inst.memory_bytes();
        if let Ok(mut p) = self.pool.lock()
            && p.idle.len() < self.max_idle
            && p.bytes.saturating_add(bytes) <= self.limits.max_idle_bytes
        {
            p.bytes += bytes;
            p.idle.push(inst);
        }
    }

    /// Make warm instances until `n` are idle (within the pool's bounds),
    /// so the first batches of `n` workers at once do not wait for
    /// instantiation and `init`. Blocking.
    pub fn warm(&self, n: usize) {
        while self.idle().0 < n.min(self.max_idle) {
            let before = self.idle().0;
            match self.instantiate() {
                Ok(inst) => self.checkin(inst),
                Err(e) => {
                    tracing::debug!(
                        "warming a plugin instance failed (calls make their own): {e:#}"
                    );
                    return;
                }
            }
            if self.idle().0 <= before {
                return; // the pool's memory bound: no more instances kept
            }
        }
    }

    /// Idle instances kept and their memory (for tests and diagnostics).
    pub fn idle(&self) -> (usize, usize) {
        self.pool
            .lock()
            .map(|p| (p.idle.len(), p.bytes))
            .unwrap_or_default()
    }

    /// Route a batch of events; one answer per event, in order. Blocking:
    /// call from a blocking thread.
    pub fn route_batch(&self, events: &[Event]) -> Vec<Answer> {
        self.route_inputs(&PluginInputs::from_events(events.iter()))
    }

    /// [`PluginHandle::route_batch`] for events already in the plugin's
    /// form (the relay makes them on its own thread, so the events
    /// themselves need not be copied to the plugin's).
    pub fn route_inputs(&self, inputs: &PluginInputs) -> Vec<Answer> {
        let events = inputs.0.as_slice();
        match events {
            [] => Vec::new(),
            [one] => vec![self.route_one(one)],
            _ => self.route_many(events),
        }
    }

    /// One `route-batch` call, stopped if it takes much longer than the
    /// plugin's measured cost says it should; then one event at a time.
    fn route_many(&self, events: &[wit::Event]) -> Vec<Answer> {
        let n = events.len();
        let mut inst = match self.checkout() {
            Ok(i) => i,
            Err(e) => return self.not_instantiated(n, &e),
        };
        let cost = Duration::from_nanos(self.cost_ns.load(Ordering::Relaxed));
        let allowed = cost
            .saturating_mul(BATCH_SLACK)
            .saturating_mul(n as u32)
            .max(self.limits.cpu_budget)
            .min(self.limits.cpu_budget.saturating_mul(n as u32));
        let deadline = inst.store.data_mut().begin_call(allowed, n);
        inst.store.set_epoch_deadline(deadline);
        match inst.router.call_route_batch(&mut inst.store, events) {
            Ok(outcomes) if outcomes.len() == n => {
                self.measured(inst.store.data().cpu_used(), n);
                self.keep_counts(&mut inst);
                self.checkin(inst);
                outcomes
                    .into_iter()
                    .map(|o| Answer::Outcome(from_wit(o)))
                    .collect()
            }
            Ok(outcomes) => {
                // A plugin bug in `route-batch`; `route` may still be right.
                self.checkin(inst);
                tracing::error!(
                    plugin = %self.info.name,
                    version = %self.info.version,
                    "plugin bug: route-batch returned {} outcomes for {} events; routing them one at a time",
                    outcomes.len(),
                    n
                );
                self.one_at_a_time(events)
            }
            Err(_) => {
                // A trap (the instance is poisoned: dropped), a limit, or
                // slower than its measured cost: find the guilty event.
                drop(inst);
                self.one_at_a_time(events)
            }
        }
    }

    fn one_at_a_time(&self, events: &[wit::Event]) -> Vec<Answer> {
        let mut stopped: Option<&str> = None;
        events
            .iter()
            .map(|e| {
                if let Some(after) = stopped {
                    return Answer::Later {
                        after: after.to_string(),
                    };
                }
                let a = self.route_one(e);
                if let Answer::Breach { limit, .. } = &a
                    && limit.costs_time()
                {
                    stopped = Some(&e.id);
                }
                a
            })
            .collect()
    }

    fn route_one(&self, event: &wit::Event) -> Answer {
        let mut inst = match self.checkout() {
            Ok(i) => i,
            Err(e) => return self.not_instantiated(1, &e).remove(0),
        };
        let deadline = inst.store.data_mut().begin_call(self.limits.cpu_budget, 1);
        inst.store.data_mut().call.event_id = Some(event.id.clone());
        inst.store.set_epoch_deadline(deadline);
        match inst.router.call_route(&mut inst.store, event) {
            Ok(outcome) => {
                self.measured(inst.store.data().cpu_used(), 1);
                self.keep_counts(&mut inst);
                self.checkin(inst);
                Answer::Outcome(from_wit(outcome))
            }
            Err(e) => {
                // The instance is poisoned after a trap: dropped here.
                let reason = format!(
                    "plugin {} {}",
                    self.info.name,
                    trap_reason(&e, &inst.store, self.limits, "per event")
                );
                match inst.store.data().breach() {
                    Some(limit) => Answer::Breach { limit, reason },
                    None => Answer::Outcome(Err(Rejection::Retryable(reason))),
                }
            }
        }
    }

    /// Keep the `host.count` increments of a call that succeeded.
    fn keep_counts(&self, inst: &mut Instance) {
        let made = std::mem::take(&mut inst.store.data_mut().call.counts);
        if made.is_empty() {
            return;
        }
        if let Ok(mut kept) = self.counts.lock() {
            for (name, delta) in made {
                match kept.iter_mut().find(|(n, _)| *n == name) {
                    Some((_, total)) => *total = total.saturating_add(delta),
                    None => kept.push((name, delta)),
                }
            }
        }
    }

    /// The `host.count` totals since the last call, by name (the relay
    /// adds them to `outroute_plugin_count_total`).
    pub fn take_counts(&self) -> Vec<(String, u64)> {
        self.counts
            .lock()
            .map(|mut c| std::mem::take(&mut *c))
            .unwrap_or_default()
    }

    fn not_instantiated(&self, n: usize, e: &anyhow::Error) -> Vec<Answer> {
        let reason = format!("plugin {} could not be instantiated: {e:#}", self.info.name);
        (0..n)
            .map(|_| Answer::Outcome(Err(Rejection::Retryable(reason.clone()))))
            .collect()
    }

    fn measured(&self, cpu: Duration, events: usize) {
        let sample = (cpu.as_nanos() / events.max(1) as u128) as u64;
        let old = self.cost_ns.load(Ordering::Relaxed);
        self.cost_ns
            .store((old.saturating_mul(7) + sample) / 8, Ordering::Relaxed);
    }
}

/// Why a file plainly is no component, from its first bytes (a clearer
/// reason than the parser's); `None` leaves the judgement to the parser.
fn not_a_component(bytes: &[u8]) -> Option<&'static str> {
    if bytes.len() < 8 || &bytes[..4] != b"\0asm" {
        return Some(
            "is not a WebAssembly file (it does not start with the `\\0asm` header): \
             give the `.wasm` a plugin build wrote (target wasm32-wasip2)",
        );
    }
    // Bytes 6-7: the layer, 0 for a core module, 1 for a component.
    if bytes[6..8] == [0, 0] {
        return Some(
            "is a core WebAssembly module, not a component: build the plugin for the \
             wasm32-wasip2 target (or wrap the module with `wasm-tools component new`)",
        );
    }
    None
}

/// A clear, specific reason for a failed call.
/// `during`: what the budget was for ("per event", "for init", …).
fn trap_reason(
    err: &wasmtime::Error,
    store: &Store<HostState>,
    limits: Limits,
    during: &str,
) -> String {
    let state = store.data();
    let stderr = String::from_utf8_lossy(&state.stderr.contents())
        .trim()
        .to_string();
    let stderr = if stderr.is_empty() {
        String::new()
    } else {
        format!("; plugin stderr (last lines): {}", tail(&stderr, 512))
    };
    match state.breach() {
        Some(Limit::CpuBudget) => {
            return format!(
                "exceeded its CPU budget ({} ms of CPU time {during}, routes[].cpu_budget) and was stopped",
                limits.cpu_budget.as_millis()
            );
        }
        Some(Limit::WallClock) => {
            return format!(
                "was stopped after {} ms of wall time ({WALL_FACTOR}× its CPU budget; the host may be overloaded)",
                (limits.cpu_budget * WALL_FACTOR).as_millis()
            );
        }
        Some(Limit::Memory) => {
            return format!(
                "exceeded its memory cap of {} MiB (routes[].memory_mib: all memories and tables together)",
                limits.memory_bytes >> 20
            );
        }
        Some(Limit::Log) => {
            return format!(
                "wrote more than {} log lines or {} log bytes for one event (routes[].max_log_lines_per_event, max_log_bytes_per_event)",
                limits.log_lines_per_event, limits.log_bytes_per_event
            );
        }
        _ => {}
    }
    if let Some(trap) = err.downcast_ref::<Trap>() {
        return match trap {
            Trap::Interrupt => "was interrupted".to_string(),
            Trap::StackOverflow => format!("overflowed its stack{stderr}"),
            other => format!("trapped: {other}{stderr}"),
        };
    }
    format!("failed: {}{stderr}", truncate(&format!("{err:#}"), 512))
}

/// The last `n` characters of `s`.
fn tail(s: &str, n: usize) -> String {
    let count = s.chars().count();
    if count <= n {
        s.to_string()
    } else {
        format!("…{}", s.chars().skip(count - n).collect::<String>())
    }
}

fn truncate(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        format!("{}…", s.chars().take(n).collect::<String>())
    }
}

/// A batch of events as a plugin receives them (WIT `event` records).
#[derive(Clone)]
pub struct PluginInputs(Vec<wit::Event>);

impl PluginInputs {
    pub fn from_events<'e>(events: impl Iterator<Item = &'e Event>) -> Self {
        PluginInputs(events.map(to_wit).collect())
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The event ids, in order.
    pub fn ids(&self) -> Vec<String> {
        self.0.iter().map(|e| e.id.clone()).collect()
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
    let imports: Vec<String> = ty.imports(engine).map(|(n, _)| n.to_string()).collect();
    let exports = ty.exports(engine).map(|(n, _)| n.to_string()).collect();
    let hash = compiled.hash.clone();
    let limits = Limits {
        cpu_budget: Duration::from_secs(1),
        memory_bytes: 256 << 20,
        log_lines_per_event: 100,
        log_bytes_per_event: 64 << 10,
        max_idle_bytes: 0,
    };
    let mut store = runtime.new_store("inspect", limits.caps());
    let deadline = store.data_mut().begin_call(limits.cpu_budget, 1);
    store.set_epoch_deadline(deadline);
    let router = compiled.pre.instantiate(&mut store)?;
    let info = router.call_describe(&mut store).map_err(|e| {
        anyhow!(
            "describe failed: {}",
            trap_reason(&e, &store, limits, "for describe")
        )
    })?;
    Ok(Inspection {
        file: path.display().to_string(),
        sha256: hash,
        world: "outroute:router/router",
        contract: contract_of(&imports)
            .unwrap_or_else(|| "none (imports no outroute interface)".into()),
        host_contract: CONTRACT,
        name: info.name,
        version: info.version,
        imports,
        exports,
    })
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contract_matches_the_wit_package() {
        let wit = include_str!("../../wit/router.wit");
        assert!(
            wit.lines()
                .any(|l| l.trim() == format!("package {CONTRACT};")),
            "wit/router.wit's package line is not `package {CONTRACT};`"
        );
    }

    #[test]
    fn older_minors_of_the_series_are_supported_newer_and_other_series_not() {
        assert!(contract_supported("outroute:router@0.1.0"));
        assert!(contract_supported(CONTRACT));
        assert!(!contract_supported("outroute:router@0.1.99"));
        assert!(!contract_supported("outroute:router@0.2.0"));
        assert!(!contract_supported("outroute:router@1.0.0"));
        assert!(!contract_supported("outroute:router@0.1.0-rc1"));
        assert!(!contract_supported("outroute:router@zero"));
    }

    #[test]
    fn the_contract_is_read_from_the_imports() {
        let imports = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            contract_of(&imports(&[
                "wasi:io/error@0.2.6",
                "outroute:router/types@0.1.0"
            ]))
            .as_deref(),
            Some("outroute:router@0.1.0")
        );
        assert_eq!(contract_of(&imports(&["wasi:io/error@0.2.6"])), None);
    }
}
