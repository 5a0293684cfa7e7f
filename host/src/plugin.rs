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

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result, anyhow};
use sha2::{Digest, Sha256};
use wasmtime::component::{Component, HasSelf, Linker};
use wasmtime::{Engine, Store, Trap};

use crate::event::{Event, Message, Outcome, Rejection};

mod cache;
mod contract;
mod inspect;
mod reload;
mod runtime;
pub use cache::ArtifactCache;
pub use contract::*;
pub use inspect::*;
pub use reload::*;
pub use runtime::*;
mod sandbox;
pub use sandbox::Limit;
use sandbox::{Caps, HostState, TICK, WALL_FACTOR};

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

/// Name and version a plugin reports about itself.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct PluginInfo {
    pub name: String,
    pub version: String,
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
            .code
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
