//! The relay: the path every event takes, top to bottom.
//!
//! ```text
//!   claim rows ─► validate ─► every route that selects it ─► plugin ─► check messages
//!        ▲              (one delivery per event and route)               │
//!        │                                     hold later events of an aggregate on a
//!        │                                     route whose earlier event did not go
//!        │                                                               │
//!   record what is left ◄─ mark (every route delivered) ◄─ broker acks ◄─ publish
//! ```
//!
//! [`Relay::run`] starts a lease keeper (which lanes this relay owns), `relay.concurrency`
//! workers (each claims from the owned lanes that no other worker has a
//! batch in flight from, see [`InFlight`], so one aggregate is only ever in
//! one batch; an idle worker claims while the others publish, which keeps
//! pickup short), a plugin reloader, the retention
//! purger and the backlog gauge. [`Relay::process`] is one batch; read it to
//! learn what outroute does. Sending and the ordering rules live in
//! `pipeline.rs`; this file claims before it and marks after it. The tasks
//! beside the workers (leases, plugin reload, retention, backlog gauge,
//! LISTEN) are in `relay/background.rs`.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use chrono::Utc;
use futures::future::join_all;
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::backoff::jitter;
use crate::config::{Loaded, RelayConfig};
use crate::event::{Message, Outcome, Rejection};
use crate::failpoint;
use crate::health::{Health, Part};
use crate::metrics as m;
use crate::pipeline::{Fate, LeaseGuard, LeaseView, Pipeline, Plan, attempts_so_far};
use crate::plugin::{Answer, Limit, Limits, PluginHandle, PluginInputs, Runtime};
use crate::quarantine::{Admission, Change, Quarantine};
use crate::routing::{Route, Routes};
use crate::sink::Sinks;
use crate::store::{Claim, Failure, FailureKind, Store};

mod background;

/// How long the events of a route whose plugin is not loaded wait before
/// they are looked at again (the plugin's file is checked every second).
const PLUGIN_WAIT: Duration = Duration::from_secs(2);

/// The lanes with events in a batch in flight: a lane is in at most one
/// batch at a time, so the events of one aggregate are never in two
/// batches (the ordering rules in `pipeline.rs` work within a batch).
///
/// Workers claim at the same time (each from the lanes free when it
/// starts) and take a lane only if no batch had it since their claim
/// began: every release bumps the lane's generation, so a claim whose
/// snapshot may predate another batch's marks and failure records never
/// uses that lane; its rows there stay pending for the next claim.
#[derive(Debug, Default)]
pub struct InFlight(std::sync::Mutex<HashMap<i32, Lane>>);

/// One lane's place in [`InFlight`].
#[derive(Debug, Default, Clone, Copy)]
pub struct Lane {
    busy: bool,
    /// Releases so far.
    generation: u64,
}

/// The free lanes a claim starts from, with their generations.
pub struct Free(Vec<(i32, u64)>);

/// Lanes one worker took; given back when dropped (also on a panic).
pub struct Reserved<'a> {
    set: &'a InFlight,
    pub lanes: Vec<i32>,
}

impl InFlight {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<i32, Lane>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Those of `lanes` (in order) that no batch has now.
    pub fn free(&self, lanes: &[i32]) -> Free {
        let set = self.lock();
        Free(
            lanes
                .iter()
                .filter_map(|l| match set.get(l) {
                    Some(s) if s.busy => None,
                    s => Some((*l, s.map_or(0, |s| s.generation))),
                })
                .collect(),
        )
    }

    /// Take the lanes of `with_rows` that are still as `free` saw them;
    /// the others were taken (and maybe given back) meanwhile.
    pub fn take(&self, free: &Free, with_rows: &std::collections::HashSet<i32>) -> Reserved<'_> {
        let mut set = self.lock();
        let lanes = free
            .0
            .iter()
            .filter(|(l, _)| with_rows.contains(l))
            .filter_map(|(l, generation)| {
                let s = set.entry(*l).or_default();
                (!s.busy && s.generation == *generation).then(|| {
                    s.busy = true;
                    *l
                })
            })
            .collect();
        Reserved { set: self, lanes }
    }
}

impl Free {
    pub fn lanes(&self) -> Vec<i32> {
        self.0.iter().map(|(l, _)| *l).collect()
    }
}

impl Drop for Reserved<'_> {
    fn drop(&mut self) {
        let mut set = self.set.lock();
        for l in &self.lanes {
            let s = set.entry(*l).or_default();
            s.busy = false;
            s.generation += 1;
        }
    }
}

/// Everything a batch needs, shared by the workers.
pub struct Relay {
    /// The source (`[sources.<name>]`, `default` for `[store]`) this relay
    /// drains: a label on its metrics and log lines.
    pub source: String,
    pub store: Arc<Store>,
    pub routes: Arc<Routes>,
    /// One plugin handle per route (same index as `routes`).
    pub plugins: Vec<Arc<PluginHandle>>,
    /// Whether each route's plugin is loaded (same index): a route whose
    /// plugin could not be loaded waits, its events deferred.
    pub plugin_parts: Vec<Arc<Part>>,
    /// Per route, the candidate version run in its shadow (`plugins.X.shadow`).
    pub shadows: Vec<Option<Shadow>>,
    /// How often each route's plugin file is checked for a new version
    /// (`plugins.<name>.reload_interval`; `None`: never).
    pub reload: Vec<Option<Duration>>,
    pub sinks: Sinks,
    /// Sends a batch and decides what becomes of each event.
    pub pipeline: Pipeline,
    /// Which routes are quarantined (their plugin keeps breaking limits).
    pub quarantine: Quarantine,
    pub config: RelayConfig,
    pub health: Arc<Health>,
    /// Set before shutdown when a new relay of this process takes over the
    /// source (config reload): the lanes are kept, not released, and the
    /// successor renews them under the same relay id.
    pub handing_over: std::sync::atomic::AtomicBool,
    /// `capture = "logical"`: the slot this source streams from (see
    /// `capture/mod.rs`); `None`: lease mode.
    pub capture: Option<crate::config::Logical>,
    /// The source's config, its key (`store`, `sources.<name>`) and table
    /// mapping, for the replication connection and decoding rows.
    pub store_config: crate::config::StoreConfig,
    pub store_key: String,
    pub store_table: crate::config::TableConfig,
    pub relay_id: String,
    /// Lanes in a batch in flight (lease mode).
    pub in_flight: InFlight,
}

/// How many events a batch published, held and failed.
#[derive(Debug, Default)]
pub struct BatchReport {
    pub published: usize,
    pub held: usize,
    pub failed: usize,
    pub retried: usize,
    /// Every publish in the batch failed with a retryable error: the broker
    /// is likely down; the worker backs off.
    pub outage: bool,
    /// One of the errors behind an outage, for the log.
    pub outage_reason: Option<String>,
    /// Events whose first delivery was out of order (see `pipeline.rs`).
    pub order_risks: usize,
    /// Events of quarantined routes, recorded as waiting.
    pub deferred: usize,
    /// The routes those events wait for.
    pub deferred_routes: std::collections::BTreeSet<usize>,
    /// On an outage, the batch's claims, untouched, for the caller that
    /// must try them again (logical capture cannot leave them pending).
    pub unsent: Vec<Claim>,
}

/// A planned batch: one delivery per (event, route that selects it).
pub(crate) struct Planned {
    /// The deliveries, events in claim order, an event's side by side. An
    /// event no route takes is one delivery with no route; a malformed row
    /// is one, on the first route that selects what can be read of it.
    pub units: Vec<(Claim, Plan)>,
    /// Per event, in claim order: where its deliveries are in `units`
    /// (never empty).
    pub events: Vec<std::ops::Range<usize>>,
}

/// A route's shadow: the candidate plugin and its file, for reports.
pub struct Shadow {
    pub plugin: Arc<PluginHandle>,
    pub file: String,
}

/// Compile (or take from the cache) and `init` a plugin. Both run guest
/// code that may block (a WASI write): off the async workers, like every
/// other plugin call.
pub(crate) async fn load_plugin(
    runtime: &Runtime,
    path: std::path::PathBuf,
    config: serde_json::Value,
    limits: Limits,
) -> Result<PluginHandle> {
    let rt = runtime.clone();
    tokio::task::spawn_blocking(move || PluginHandle::load(&rt, &path, config, limits))
        .await
        .map_err(|e| anyhow::anyhow!("loading the plugin failed: {e}"))?
}

/// Seconds from `then` to `now` (0 if the clocks disagree).
pub(crate) fn seconds_since(then: chrono::DateTime<Utc>, now: chrono::DateTime<Utc>) -> f64 {
    ((now - then).num_microseconds().unwrap_or(0) as f64 / 1e6).max(0.0)
}

/// A task aborted when this is dropped: a task that must not outlive its
/// owner (a detached task would keep running after a shutdown gave up on
/// it).
pub(crate) struct AbortOnDrop<T = ()>(pub tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Spawn a task in the current span (so a source's background tasks and
/// workers log with its `source` field).
fn spawn_here<F>(f: F) -> tokio::task::JoinHandle<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    tokio::spawn(f.in_current_span())
}

/// The sinks of `loaded`, shared by every source's relay.
pub async fn build_sinks(loaded: &Loaded) -> Result<Sinks> {
    let routes = Routes::compile(&loaded.config).map_err(anyhow::Error::msg)?;
    crate::sink::build_all(
        &loaded.config.sinks,
        &routes,
        &loaded.base_dir,
        loaded.config.relay.publish_timeout,
    )
    .await
}

/// The routes that read one source with their plugins loaded: the part of
/// a relay that needs no store or sink, so it is loaded while those connect.
pub struct RoutePlugins {
    routes: Routes,
    /// One handle per route (same index as `routes`).
    plugins: Vec<Arc<PluginHandle>>,
    shadows: Vec<Option<Shadow>>,
    reload: Vec<Option<Duration>>,
    /// Why a route's plugin could not be loaded (its handle waits for the
    /// file), per route; only [`RoutePlugins::load_or_wait`] leaves any.
    errors: Vec<Option<String>>,
}

impl RoutePlugins {
    /// Compile (or take from the cache) and `init` the plugin of every
    /// route that reads `source`, all routes at once; any that fails is an
    /// error (one-shot commands: `replay`, the quickstart).
    pub async fn load(loaded: &Loaded, source: &str) -> Result<Self> {
        let p = Self::load_or_wait(loaded, source).await?;
        if let Some((i, e)) = p
            .errors
            .iter()
            .enumerate()
            .find_map(|(i, e)| Some((i, e.as_ref()?)))
        {
            anyhow::bail!("route `{}`: {e}", p.routes.0[i].name());
        }
        Ok(p)
    }

    /// As [`RoutePlugins::load`], but a route whose plugin cannot be loaded
    /// (file missing, not a component, `init` refusing its config) gets a
    /// waiting handle and its error: `run` serves the other routes, and
    /// that one once its file loads. A shadow that cannot be loaded is left
    /// out, with a warning (the route runs its active plugin).
    pub async fn load_or_wait(loaded: &Loaded, source: &str) -> Result<Self> {
        let config = &loaded.config;
        let mut routes = Routes::compile(config).map_err(anyhow::Error::msg)?;
        routes
            .0
            .retain(|r| crate::config::Config::route_reads(&r.config, source));
        // A team granted this source whose file is refused, with no last
        // known good copy running: a stand-in route holds its events.
        for refused in loaded.refused.iter().filter(|r| !r.last_good) {
            let Some(team) = refused.file.file_stem().map(|s| s.to_string_lossy()) else {
                continue;
            };
            let Some(grant) = config.grants.get(team.as_ref()) else {
                continue;
            };
            if !grant.sources.iter().any(|s| s == source) {
                continue;
            }
            if !grant.owns.is_empty() {
                routes
                    .0
                    .push(Route::waiting_for(&team, grant, true, 0).map_err(anyhow::Error::msg)?);
            }
            routes
                .0
                .push(Route::waiting_for(&team, grant, false, 0).map_err(anyhow::Error::msg)?);
        }
        // From here on a route's index is its place in this relay's list
        // (the plugin handles and quarantine slots follow it).
        for (i, r) in routes.0.iter_mut().enumerate() {
            r.index = i;
        }
        let runtime = Runtime::new(loaded.cache_dir())?;
        let loads = routes.0.iter().map(|r| {
            let runtime = &runtime;
            async move {
                if let Some(team) = r.waiting_team() {
                    let handle = PluginHandle::waiting(
                        runtime,
                        std::path::Path::new(""),
                        serde_json::Value::Null,
                        Limits::of(&r.config),
                    );
                    let why = format!(
                        "team `{team}`'s file is refused and no last known good copy of it runs: \
                         the events its grant selects wait for it"
                    );
                    return anyhow::Ok((Arc::new(handle), None, None, Some(why)));
                }
                let pc = config.plugins.get(&r.config.plugin).ok_or_else(|| {
                    anyhow::anyhow!("routes.{}: no plugin `{}`", r.name(), r.config.plugin)
                })?;
                let limits = Limits::of(&r.config);
                let path = loaded.resolve(&pc.path);
                let (handle, error) =
                    match load_plugin(runtime, path.clone(), r.config.config.clone(), limits).await
                    {
                        Ok(h) => (h, None),
                        Err(e) => (
                            PluginHandle::waiting(runtime, &path, r.config.config.clone(), limits),
                            Some(format!("plugin {}: {e:#}", path.display())),
                        ),
                    };
                let shadow = match &pc.shadow {
                    None => None,
                    Some(file) => {
                        let path = loaded.resolve(file);
                        let cfg = pc
                            .shadow_config
                            .clone()
                            .unwrap_or_else(|| r.config.config.clone());
                        match load_plugin(runtime, path.clone(), cfg, limits).await {
                            Ok(handle) => Some(Shadow {
                                plugin: Arc::new(handle),
                                file: path.display().to_string(),
                            }),
                            Err(e) => {
                                tracing::warn!(route = %r.name(), "shadow plugin {} not loaded, the route runs without it: {e:#}", path.display());
                                None
                            }
                        }
                    }
                };
                anyhow::Ok((Arc::new(handle), shadow, pc.reload_interval, error))
            }
        });
        let mut out = RoutePlugins {
            routes: Routes(Vec::new()),
            plugins: Vec::new(),
            shadows: Vec::new(),
            reload: Vec::new(),
            errors: Vec::new(),
        };
        for (handle, shadow, interval, error) in futures::future::try_join_all(loads).await? {
            out.plugins.push(handle);
            out.shadows.push(shadow);
            out.reload.push(interval);
            out.errors.push(error);
        }
        out.routes = routes;
        Ok(out)
    }
}

impl Relay {
    /// Build the relay of source `source`: the routes that read it, their
    /// plugins, over the process's shared `sinks` (see [`build_sinks`]).
    pub async fn build(
        loaded: &Loaded,
        source: &str,
        store: Arc<Store>,
        sinks: Sinks,
        health: Arc<Health>,
    ) -> Result<Self> {
        let plugins = RoutePlugins::load(loaded, source).await?;
        Self::assemble(loaded, source, store, sinks, health, plugins)
    }

    /// [`Relay::build`] from plugins already loaded.
    pub fn assemble(
        loaded: &Loaded,
        source: &str,
        store: Arc<Store>,
        sinks: Sinks,
        health: Arc<Health>,
        loaded_routes: RoutePlugins,
    ) -> Result<Self> {
        let config = &loaded.config;
        let RoutePlugins {
            routes,
            plugins,
            shadows,
            reload,
            errors,
        } = loaded_routes;
        let plugin_parts = routes
            .0
            .iter()
            .zip(&errors)
            .map(|(r, error)| {
                let part = health.plugin_part(r.name());
                match error {
                    None => {
                        part.set_up();
                    }
                    Some(e) => {
                        tracing::error!(route = %r.name(), "plugin not loaded, the route's events wait until its file loads: {e}");
                        part.set_down(e.clone());
                    }
                }
                part
            })
            .collect();
        let routes = Arc::new(routes);
        store.set_routes(routes.0.iter().map(|r| r.name().to_string()).collect());
        let store_config = config.source(source)?.clone();
        let relay_id = store.relay_id().to_string();
        let table = store_config.table().name;
        let pipeline = Pipeline {
            routes: routes.clone(),
            sinks: sinks.clone(),
            ordering: config.relay.ordering,
            publish_timeout: config.relay.publish_timeout,
            // CloudEvents `source`: the table, and the source's name when
            // the relay serves named sources.
            source: if config.store_shorthand {
                format!("/outroute/{table}")
            } else {
                format!("/outroute/{source}/{table}")
            },
        };
        Ok(Relay {
            source: source.to_string(),
            quarantine: Quarantine::new(&routes),
            store,
            routes,
            plugins,
            plugin_parts,
            shadows,
            reload,
            sinks,
            pipeline,
            config: config.relay.clone(),
            health,
            handing_over: std::sync::atomic::AtomicBool::new(false),
            capture: store_config.logical(source),
            store_key: config.source_key(source),
            store_table: store_config.table(),
            relay_id,
            store_config,
            in_flight: InFlight::default(),
        })
    }

    /// Run until `shutdown` is cancelled, then stop leasing, let in-flight
    /// batches finish (bounded by `relay.shutdown_timeout`) and give the lanes
    /// back.
    pub async fn run(self: Arc<Self>, shutdown: CancellationToken) -> Result<()> {
        let wake = Arc::new(Notify::new());
        let (lease_tx, lease_rx) = watch::channel(LeaseView {
            lanes: Vec::new(),
            epochs: Vec::new(),
            valid_until: Instant::now(),
        });
        let stop_leasing = CancellationToken::new();
        let mut background = vec![
            spawn_here(
                self.clone()
                    .keep_leases(lease_tx, stop_leasing.clone(), wake.clone()),
            ),
            spawn_here(self.clone().watch_backlog(shutdown.clone())),
            spawn_here(self.clone().reload_plugins(shutdown.clone())),
            spawn_here(self.clone().follow_quarantines(shutdown.clone())),
        ];
        if self.capture.is_some() {
            // One stream from the slot instead of lane workers.
            background.push(spawn_here(self.clone().watch_slot(shutdown.clone())));
            let capture = spawn_here(self.clone().run_capture(lease_rx, shutdown.clone()));
            shutdown.cancelled().await;
            tracing::info!(source = %self.source, "stopping: finishing the in-flight batch");
            let mut capture = AbortOnDrop(capture);
            if tokio::time::timeout(self.config.shutdown_timeout, &mut capture.0)
                .await
                .is_err()
            {
                // Stopped, not left running: a successor in this process
                // streams from the confirmed position under the same relay
                // id, and must not meet this session still publishing,
                // cleaning up or recording.
                capture.0.abort();
                let _ = (&mut capture.0).await;
                tracing::warn!(
                    "the in-flight batch did not finish in time: stopped; the slot re-reads it"
                );
            }
            stop_leasing.cancel();
            for t in background {
                t.abort();
            }
            for sink in self.sinks.values() {
                sink.flush().await;
            }
            if !self.handing_over.load(std::sync::atomic::Ordering::Acquire)
                && let Err(e) = self.store.release_all().await
            {
                tracing::warn!(
                    "could not release the capture lease (it lapses after lease_ttl): {e:#}"
                );
            }
            return Ok(());
        }
        // One warm plugin instance per worker, made while the first lease
        // round runs, so the workers' first batches do not instantiate.
        for plugin in self.plugins.iter().filter_map(|p| p.current()) {
            let workers = self.config.concurrency as usize;
            tokio::task::spawn_blocking(move || plugin.warm(workers));
        }
        if matches!(*self.store, Store::Postgres(_)) {
            background.push(spawn_here(
                self.clone()
                    .raise_floors(lease_rx.clone(), shutdown.clone()),
            ));
        }
        if let Some(retention) = self.config.retention {
            background.push(spawn_here(self.clone().purge(retention, shutdown.clone())));
        }
        if let Some(channel) = self.config.notify_channel.clone() {
            background.push(spawn_here(self.clone().listen(
                channel,
                wake.clone(),
                shutdown.clone(),
            )));
        }
        let mut workers = tokio::task::JoinSet::new();
        for i in 0..self.config.concurrency {
            workers.spawn(
                self.clone()
                    .supervise(i, lease_rx.clone(), wake.clone(), shutdown.clone())
                    .in_current_span(),
            );
        }

        shutdown.cancelled().await;
        tracing::info!(source = %self.source, "stopping: finishing in-flight batches");
        let drained = tokio::time::timeout(self.config.shutdown_timeout, async {
            while workers.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            // Stopped, not left running: a successor in this process (a
            // reload) claims the same lanes under the same relay id, and
            // must not meet these batches still publishing, marking or
            // recording a hold behind its back.
            workers.abort_all();
            while workers.join_next().await.is_some() {}
            tracing::warn!(
                timeout = ?self.config.shutdown_timeout,
                "in-flight batches did not finish in time: stopped; their rows stay pending (sent messages may go out again) and lanes lapse after lease_ttl"
            );
        }
        stop_leasing.cancel();
        for t in background {
            t.abort();
        }
        for sink in self.sinks.values() {
            sink.flush().await;
        }
        if drained.is_ok()
            && !self.handing_over.load(std::sync::atomic::Ordering::Acquire)
            && let Err(e) = self.store.release_all().await
        {
            tracing::warn!("could not release lanes (they lapse after lease_ttl): {e:#}");
        }
        Ok(())
    }

    /// Keep worker `index` running: a bug that panics inside a batch must not
    /// silently stop its lanes (they would stay leased and never move).
    async fn supervise(
        self: Arc<Self>,
        index: u32,
        leases: watch::Receiver<LeaseView>,
        wake: Arc<Notify>,
        shutdown: CancellationToken,
    ) {
        loop {
            // Aborted with its supervisor (a shutdown that timed out).
            let mut worker = AbortOnDrop(spawn_here(self.clone().work(
                index,
                leases.clone(),
                wake.clone(),
                shutdown.clone(),
            )));
            match (&mut worker.0).await {
                Ok(()) => return,
                Err(e) => {
                    tracing::error!(
                        worker = index,
                        "worker crashed, restarting it (its batch stays pending): {e}"
                    );
                    sleep_or_cancel(Duration::from_secs(1), &shutdown).await;
                    if shutdown.is_cancelled() {
                        return;
                    }
                }
            }
        }
    }

    /// One worker: claim → process → repeat, polling adaptively when idle.
    async fn work(
        self: Arc<Self>,
        index: u32,
        mut leases: watch::Receiver<LeaseView>,
        wake: Arc<Notify>,
        shutdown: CancellationToken,
    ) {
        let mut idle = self.config.poll_min;
        let mut outage_backoff = Duration::from_millis(100);
        // The claim walks the lanes in the order given and stops at a full
        // batch: start at the next lane each time so every lane gets its
        // turn at the front however deep the others' backlogs are.
        // Workers start at different places, so two claims at once mostly
        // walk different lanes.
        let mut turn = index as usize * 7;
        // Slow start: a worker's first claim takes an eighth of a batch and
        // each full one doubles it up to `relay.batch_size`, so after a
        // (re)start the first events go out after a short claim and a short
        // publish, not after a full batch of each.
        let mut size = (self.config.batch_size / 8).max(1);
        while !shutdown.is_cancelled() {
            let view = leases.borrow_and_update().clone();
            let mut lanes: Vec<i32> = if Instant::now() < view.valid_until {
                view.lanes.clone()
            } else {
                Vec::new()
            };
            if lanes.is_empty() {
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = leases.changed() => {},
                    _ = tokio::time::sleep(self.config.poll_max) => {},
                }
                continue;
            }
            let first = turn % lanes.len();
            lanes.rotate_left(first);
            turn = turn.wrapping_add(1);
            let free = self.in_flight.free(&lanes);
            let lanes = free.lanes();
            if lanes.is_empty() {
                // Every lane has a batch in flight in another worker.
                sleep_or_cancel(self.config.poll_min, &shutdown).await;
                continue;
            }
            // Listen for wake-ups from before the claim: a NOTIFY for a
            // commit the claim's snapshot missed still ends the idle wait.
            let notified = wake.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            let claim_started = Instant::now();
            let claims = match self.store.claim(&lanes, size).await {
                Ok(c) => {
                    metrics::histogram!(m::CLAIM_SECONDS, "source" => self.source.clone())
                        .record(claim_started.elapsed().as_secs_f64());
                    self.health.set_store_ok();
                    c
                }
                Err(e) => {
                    self.health.store_failed(&e);
                    tracing::warn!(worker = index, "claim failed: {e:#}");
                    sleep_or_cancel(Duration::from_secs(1), &shutdown).await;
                    continue;
                }
            };
            let with_rows: std::collections::HashSet<i32> = claims.iter().map(|c| c.lane).collect();
            let reserved = self.in_flight.take(&free, &with_rows);
            let claims = if reserved.lanes.len() < with_rows.len() {
                // Another worker took some of these lanes meanwhile: their
                // rows stay pending (its batch or the next claim has them).
                let taken: std::collections::HashSet<i32> =
                    reserved.lanes.iter().copied().collect();
                let kept: Vec<Claim> = claims
                    .into_iter()
                    .filter(|c| taken.contains(&c.lane))
                    .collect();
                if kept.is_empty() {
                    drop(reserved);
                    sleep_or_cancel(self.config.poll_min, &shutdown).await;
                    continue;
                }
                kept
            } else {
                claims
            };
            if claims.is_empty() {
                drop(reserved);
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = notified => idle = self.config.poll_min,
                    _ = tokio::time::sleep(idle) => idle = (idle * 2).min(self.config.poll_max),
                }
                continue;
            }
            let full = claims.len() as u32 >= size;
            if full {
                size = (size * 2).min(self.config.batch_size);
            }
            let now = Utc::now();
            let pickup = metrics::histogram!(m::PICKUP, "source" => self.source.clone());
            for ev in claims.iter().filter_map(|c| c.row.as_ref().ok()) {
                if ev.attempts == 0 {
                    pickup.record(seconds_since(ev.created_at, now));
                }
            }
            failpoint::hit("after-claim");
            // The lanes with the epochs of the view the claim was made under.
            let mut lease = LeaseGuard::new(leases.clone(), &view, reserved.lanes.clone());
            let mut claims = claims;
            lease.stamp(&mut claims);
            let span = tracing::info_span!("batch", worker = index, events = claims.len());
            match self
                .process(claims, Some(&mut lease))
                .instrument(span)
                .await
            {
                Ok(report) if report.outage => {
                    tracing::warn!(backoff = ?outage_backoff, reason = report.outage_reason.as_deref().unwrap_or(""), "every publish failed; backing off");
                    sleep_or_cancel(jitter(outage_backoff), &shutdown).await;
                    outage_backoff = (outage_backoff * 2).min(Duration::from_secs(10));
                }
                Ok(_) => {
                    drop(reserved);
                    outage_backoff = Duration::from_millis(100);
                    idle = self.config.poll_min;
                    if !full {
                        sleep_or_cancel(self.config.poll_min, &shutdown).await;
                    }
                }
                Err(e) => {
                    tracing::warn!(
                        worker = index,
                        "batch failed, its events stay pending: {e:#}"
                    );
                    sleep_or_cancel(Duration::from_secs(1), &shutdown).await;
                }
            }
        }
    }

    /// One batch, start to finish. `lease`: the lanes the batch was claimed
    /// from; nothing is sent for them once another relay may own them.
    pub(crate) async fn process(
        &self,
        claims: Vec<Claim>,
        mut lease: Option<&mut LeaseGuard>,
    ) -> Result<BatchReport> {
        let started = Instant::now();
        let mut report = BatchReport::default();

        // 1–4. Rows → events → routes → plugin → checked messages.
        let Planned {
            mut units,
            events: ranges,
        } = self.plan(claims).await;

        // 5–6. Messages → sinks → broker acks → what becomes of each
        //      delivery (order per aggregate and route is kept there: see
        //      pipeline.rs).
        if lease.as_deref_mut().is_some_and(|l| !l.held()) {
            anyhow::bail!(
                "lane lease expired before publishing; leaving the batch to the next owner"
            );
        }
        let delivery = self.pipeline.deliver(&mut units, lease).await;
        report.order_risks = delivery.order_risks;
        if let Some(reason) = delivery.outage {
            // Nothing went out: leave every event pending; the worker backs off.
            report.outage = true;
            report.outage_reason = Some(reason);
            let mut all = units.into_iter();
            for range in ranges {
                let mut copies = all.by_ref().take(range.len()).map(|(c, _)| c);
                if let Some(mut claim) = copies.next() {
                    claim.route = None;
                    report.unsent.push(claim);
                }
                copies.for_each(drop);
            }
            return Ok(report);
        }
        failpoint::hit("after-ack");

        // 7. An event every route delivered → mark; otherwise record what
        //    is left (retry later, wait, or the failed state), keeping the
        //    routes that went through so they are not run again.
        let mut to_mark: Vec<&Claim> = Vec::new();
        let mut failures: Vec<Failure> = Vec::new();
        let mut without_messages: HashMap<String, u64> = HashMap::new();
        let now = Utc::now();
        // Metric handles once per batch, counts added up per route/sink.
        let commit_to_ack = metrics::histogram!(m::COMMIT_TO_ACK, "source" => self.source.clone());
        let mut published: BTreeMap<usize, u64> = BTreeMap::new();
        let mut messages_sent: BTreeMap<(usize, &str), u64> = BTreeMap::new();
        for range in ranges {
            let event = &units[range.clone()];
            let fates = &delivery.fates[range];
            for ((_, plan), fate) in event.iter().zip(fates) {
                if let (Fate::Publish, Plan::Publish { route, messages }) = (fate, plan) {
                    *published.entry(*route).or_default() += 1;
                    if messages.is_empty() {
                        let r = self.routes.0[*route].name().to_string();
                        *without_messages.entry(r).or_default() += 1;
                    }
                    for msg in messages {
                        *messages_sent
                            .entry((*route, msg.sink.as_str()))
                            .or_default() += 1;
                    }
                }
            }
            let claim = &event[0].0;
            if fates.iter().all(|f| matches!(f, Fate::Publish)) {
                to_mark.push(claim);
                if let Some(at) = claim.committed_at() {
                    commit_to_ack.record(seconds_since(at, now));
                }
            } else if let Some(f) = self.left_over(event, fates, &mut report) {
                failures.push(f);
            }
        }
        for (route, n) in published {
            let r = self.routes.0[route].name().to_string();
            metrics::counter!(m::EVENTS_PUBLISHED, "route" => r, "source" => self.source.clone())
                .increment(n);
        }
        for ((route, sink), n) in messages_sent {
            let r = self.routes.0[route].name().to_string();
            metrics::counter!(m::MESSAGES_PUBLISHED, "route" => r, "sink" => sink.to_string())
                .increment(n);
        }
        for (r, n) in &without_messages {
            metrics::counter!(m::EVENTS_WITHOUT_MESSAGES, "route" => r.clone()).increment(*n);
        }
        let marked = self.mark(&to_mark).await?;
        report.published = to_mark.len();
        if (marked as usize) < to_mark.len() {
            let fenced = to_mark.len() - marked as usize;
            metrics::counter!(m::MARK_FENCED, "source" => self.source.clone())
                .increment(fenced as u64);
            tracing::warn!(
                fenced,
                "lane lease lost: rows were published but not marked (they will be re-published with the same ids)"
            );
        }
        if marked > 0 || report.deferred > 0 {
            // Deferring a quarantined route's events is handling them too.
            self.health.progressed();
        }
        if !without_messages.is_empty() {
            let counts: Vec<(String, u64)> = without_messages.into_iter().collect();
            if let Err(e) = self.store.count_without_messages(&counts).await {
                tracing::warn!("could not count events published without messages: {e:#}");
            }
        }
        if !failures.is_empty() {
            let recorded = self.store.record_failures(&failures).await?;
            if self.capture.is_some() && (recorded as usize) < failures.len() {
                anyhow::bail!(
                    "capture lease lost while recording failed and waiting events; the slot is not confirmed"
                );
            }
            // A route resumed (by a probe elsewhere or `outroute route
            // resume`) while this batch was deferring its events: the
            // resume made due what was recorded before it, these were
            // recorded after. Make them due too, or they would wait a
            // whole probe interval. (`follow_quarantines` covers the
            // deferrals recorded before this relay heard of the resume.)
            for r in &report.deferred_routes {
                if !self.quarantine.is_quarantined(*r) {
                    let name = self.routes.0[*r].name();
                    if let Err(e) = self.store.make_waiting_due(name).await {
                        tracing::warn!(route = %name, "could not make the route's waiting events due: {e:#}");
                    }
                }
            }
        }
        metrics::histogram!(m::BATCH_SECONDS, "source" => self.source.clone())
            .record(started.elapsed().as_secs_f64());
        Ok(report)
    }

    /// Steps 1–4 of a batch: rows → events (malformed rows fail) → the
    /// routes that select each (every one of them: routes are
    /// subscriptions) → plugin (one batch call per route) → messages checked
    /// against the route's allow-list. Also used by `replay`.
    pub(crate) async fn plan(&self, claims: Vec<Claim>) -> Planned {
        // 1. Rows → events. A malformed row fails right away, with the reason.
        let mut planned = Planned {
            units: Vec::with_capacity(claims.len()),
            events: Vec::with_capacity(claims.len()),
        };
        let units = &mut planned.units;
        let mut to_route: Vec<(usize, usize)> = Vec::new(); // (index in batch, route)
        for mut claim in claims {
            let start = units.len();
            let plan = match &claim.row {
                Err(bad) => {
                    tracing::warn!(event_id = %bad.id, reason = %bad.reason, "malformed outbox row");
                    let route = self
                        .routes
                        .0
                        .iter()
                        .position(|r| r.selects(&bad.aggregate_type, &bad.event_type));
                    Plan::Fail {
                        route,
                        rejection: Rejection::Invalid(format!("malformed row: {}", bad.reason)),
                    }
                }
                // 2. Event → every route that selects it, each a delivery
                //    of its own (a copy of the claim per extra route).
                Ok(ev) => {
                    // (Most units have one route: no list is made for them.)
                    let mut selecting = self.routes.selecting(&ev.aggregate_type, &ev.event_type);
                    match selecting.next() {
                        Some(first) => {
                            let more: Vec<usize> = selecting.collect();
                            // Copies for every route but the last, which
                            // takes the claim itself.
                            let (last, others) = match more.split_last() {
                                Some((last, rest)) => (*last, Some(rest)),
                                None => (first, None),
                            };
                            let others = others.into_iter().flat_map(|rest| {
                                std::iter::once(first).chain(rest.iter().copied())
                            });
                            for route in others {
                                let mut copy = claim.clone();
                                copy.route = Some(route);
                                let plan =
                                    self.first_plan(&copy, route, units.len(), &mut to_route);
                                units.push((copy, plan));
                            }
                            claim.route = Some(last);
                            let plan = self.first_plan(&claim, last, units.len(), &mut to_route);
                            units.push((claim, plan));
                            planned.events.push(start..units.len());
                            continue;
                        }
                        None => Plan::Fail {
                            route: None,
                            rejection: Rejection::Invalid(format!(
                                "no route selects aggregate type `{}` / event type `{}`",
                                ev.aggregate_type, ev.event_type
                            )),
                        },
                    }
                }
            };
            if let Plan::Fail { route, .. } = &plan {
                claim.route = *route;
            }
            units.push((claim, plan));
            planned.events.push(start..units.len());
        }

        // 3. Route → plugin: one call per route, all routes at once, each on
        //    a blocking thread; a quarantined route's units wait instead.
        let mut by_route: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for (i, r) in &to_route {
            by_route.entry(*r).or_default().push(*i);
        }
        let mut calls = Vec::new();
        for (route_idx, mut idxs) in by_route {
            // A route whose plugin is not loaded: its units wait for it.
            if let Some((why, _)) = self.plugin_parts[route_idx].why_down() {
                let reason = match self.routes.0[route_idx].waiting_team() {
                    Some(_) => why,
                    None => format!("plugin not loaded: {why}"),
                };
                for i in idxs {
                    units[i].1 = Plan::Defer {
                        route: Some(route_idx),
                        reason: reason.clone(),
                        delay: PLUGIN_WAIT,
                    };
                }
                continue;
            }
            let (deferred, why) = match self.quarantine.admit(route_idx) {
                Admission::All => (Vec::new(), None),
                Admission::Probe { reason, delay } => (idxs.split_off(1), Some((reason, delay))),
                Admission::Defer { reason, delay } => {
                    (std::mem::take(&mut idxs), Some((reason, delay)))
                }
            };
            if let Some((reason, delay)) = why {
                for i in deferred {
                    units[i].1 = Plan::Defer {
                        route: Some(route_idx),
                        reason: reason.clone(),
                        delay,
                    };
                }
            }
            if idxs.is_empty() {
                continue;
            }
            // Made here, once: the units stay in the batch, their WIT
            // records go to the plugin's thread.
            let batch = PluginInputs::from_events(
                idxs.iter().filter_map(|i| units[*i].0.row.as_ref().ok()),
            );
            calls.push(async move {
                let answers = match &self.shadows[route_idx] {
                    None => self.call_plugin(route_idx, batch).await,
                    Some(shadow) => {
                        let ids = batch.ids();
                        let (candidate, answers) = futures::join!(
                            self.call_shadow(shadow, batch.clone()),
                            self.call_plugin(route_idx, batch)
                        );
                        self.compare_shadow(route_idx, shadow, &ids, &answers, candidate);
                        answers
                    }
                };
                (route_idx, idxs, answers)
            });
        }
        for (route_idx, idxs, answers) in join_all(calls).await {
            let route = &self.routes.0[route_idx];
            let mut breaches: Vec<Option<String>> = Vec::with_capacity(idxs.len());
            for (i, answer) in idxs.into_iter().zip(answers) {
                // 4. Plugin messages → checked against the route's limits and
                //    allow-list.
                let checked = match answer {
                    Answer::Later { .. } => {
                        units[i].1 = Plan::Held;
                        continue;
                    }
                    Answer::Breach { limit, reason } => {
                        Err((Rejection::Retryable(reason), Some(limit)))
                    }
                    Answer::Outcome(o) => o
                        .map_err(|r| (r, None))
                        .and_then(|msgs| check_messages(route, msgs)),
                };
                units[i].1 = match checked {
                    Ok(messages) => {
                        breaches.push(None);
                        Plan::Publish {
                            route: route_idx,
                            messages,
                        }
                    }
                    Err((rejection, limit)) => {
                        // A plugin's own rejection or a trap keeps within
                        // the limits; only a broken limit counts.
                        breaches.push(limit.map(|_| rejection.reason().to_string()));
                        if let Some(l) = limit {
                            metrics::counter!(m::LIMIT_BREACHES, "route" => route.name().to_string(), "limit" => l.as_str())
                                .increment(1);
                        }
                        metrics::counter!(m::REJECTIONS, "route" => route.name().to_string(), "kind" => rejection.kind())
                            .increment(1);
                        Plan::Fail {
                            route: Some(route_idx),
                            rejection,
                        }
                    }
                };
            }
            self.quarantine_change(route_idx, &breaches).await;
        }

        // A batch publishes at most `relay.max_batch_bytes`: the units after
        // the one that reaches it wait for the next batch.
        let mut bytes: u64 = 0;
        for (_, plan) in units.iter_mut() {
            if let Plan::Publish { messages, .. } = plan {
                if bytes >= self.config.max_batch_bytes {
                    *plan = Plan::Held;
                    continue;
                }
                bytes += messages.iter().map(|m| m.payload.len() as u64).sum::<u64>();
            }
        }

        planned
    }

    /// A delivery's plan before its plugin answers: already delivered by an
    /// earlier attempt (`Done`), or queued for the route's plugin call.
    fn first_plan(
        &self,
        claim: &Claim,
        route: usize,
        at: usize,
        to_route: &mut Vec<(usize, usize)>,
    ) -> Plan {
        let name = self.routes.0[route].name();
        let done = !claim.done_legs.is_empty()
            && claim.done_legs.contains(&crate::store::route_done(name));
        if done {
            Plan::Done
        } else if !claim.held.is_empty() && claim.held.iter().any(|h| h == "*" || h == name) {
            // An earlier event of its aggregate holds this route back.
            Plan::Held
        } else {
            to_route.push((at, route));
            Plan::Held // placeholder until the plugin answers
        }
    }

    /// Count a route's breaches; quarantine or resume it (recorded in the
    /// store so every relay and `outroute status` follow).
    async fn quarantine_change(&self, route_idx: usize, breaches: &[Option<String>]) {
        let name = self.routes.0[route_idx].name().to_string();
        match self.quarantine.record(route_idx, breaches) {
            Change::None => {}
            Change::Quarantined { reason } => {
                tracing::error!(route = %name, %reason, "route quarantined: its events wait (no attempts counted) until a probe gets through or `outroute route resume`");
                metrics::gauge!(m::ROUTE_QUARANTINED, "route" => name.clone()).set(1.0);
                match self.store.quarantine_route(&name, &reason).await {
                    Ok(()) => self.quarantine.recorded(route_idx),
                    Err(e) => {
                        tracing::warn!(route = %name, "could not record the quarantine: {e:#}")
                    }
                }
            }
            Change::Resumed => {
                tracing::info!(route = %name, "route resumed: a probe event kept within its limits");
                metrics::gauge!(m::ROUTE_QUARANTINED, "route" => name.clone()).set(0.0);
                if let Err(e) = self.store.resume_route(&name).await {
                    tracing::warn!(route = %name, "could not record the resume: {e:#}");
                }
            }
        }
    }

    async fn call_plugin(&self, route_idx: usize, batch: PluginInputs) -> Vec<Answer> {
        let n = batch.len();
        let Some(plugin) = self.plugins[route_idx].current() else {
            return (0..n)
                .map(|_| Answer::Outcome(Err(Rejection::Retryable("plugin unavailable".into()))))
                .collect();
        };
        let route = self.routes.0[route_idx].name().to_string();
        let started = Instant::now();
        let result = tokio::task::spawn_blocking(move || {
            let answers = plugin.route_inputs(&batch);
            (answers, plugin.take_counts(), plugin)
        })
        .await;
        let per_event = started.elapsed().as_secs_f64() / n.max(1) as f64;
        metrics::histogram!(m::PLUGIN_CALL, "route" => route.clone()).record(per_event);
        match result {
            Ok((answers, counts, plugin)) => {
                for (name, delta) in counts {
                    metrics::counter!(m::PLUGIN_COUNT, "route" => route.clone(), "plugin" => plugin.info.name.clone(), "name" => name)
                        .increment(delta);
                }
                answers
            }
            Err(e) => (0..n)
                .map(|_| {
                    Answer::Outcome(Err(Rejection::Retryable(format!(
                        "plugin call panicked: {e}"
                    ))))
                })
                .collect(),
        }
    }

    /// The shadow's answers to a batch (its limits are the route's; an
    /// unusable candidate answers nothing and is not compared).
    async fn call_shadow(&self, shadow: &Shadow, batch: PluginInputs) -> Option<Vec<Answer>> {
        let plugin = shadow.plugin.current()?;
        tokio::task::spawn_blocking(move || plugin.route_inputs(&batch))
            .await
            .ok()
    }

    /// Compare the candidate's answers with the active plugin's (events the
    /// active plugin answered; nothing of the candidate's is published).
    fn compare_shadow(
        &self,
        route_idx: usize,
        shadow: &Shadow,
        ids: &[String],
        answers: &[Answer],
        candidate: Option<Vec<Answer>>,
    ) {
        let Some(candidate) = candidate else {
            return;
        };
        let route = &self.routes.0[route_idx];
        let mut compared = Vec::with_capacity(ids.len());
        for ((id, was), would) in ids.iter().zip(answers).zip(candidate) {
            let Answer::Outcome(was) = was else {
                continue;
            };
            // Both as the route would take them: a candidate's message the
            // route may not send shows as the rejection it would be.
            let differences = match would {
                Answer::Outcome(would) => {
                    crate::shadow::differences(&checked(route, was.clone()), &checked(route, would))
                }
                Answer::Breach { reason, .. } => vec![format!("candidate broke a limit: {reason}")],
                Answer::Later { .. } => continue,
            };
            compared.push((id.clone(), differences));
        }
        crate::shadow::record(
            &self.source,
            self.routes.0[route_idx].name(),
            &shadow.file,
            compared,
        );
    }

    async fn mark(&self, claims: &[&Claim]) -> Result<u64> {
        if let Some(pg) = self.store.logical() {
            // Streamed events are marked by confirming the slot (capture
            // loop); parked ones by removing them from the queue.
            let (parked, streamed): (Vec<&Claim>, Vec<&Claim>) = claims
                .iter()
                .partition(|c| c.captured.is_some_and(|c| c.parked));
            let unparked = if parked.is_empty() {
                0
            } else {
                pg.bounded("marking parked events published", pg.unpark(&parked))
                    .await?
            };
            return Ok(streamed.len() as u64 + unparked);
        }
        if failpoint::armed("mid-mark") && claims.len() > 1 {
            let (a, b) = claims.split_at(claims.len() / 2);
            let n = self.store.mark_published(a).await?;
            failpoint::hit("mid-mark");
            return Ok(n + self.store.mark_published(b).await?);
        }
        self.store.mark_published(claims).await
    }

    /// What to record for an event some route did not deliver: `None` when
    /// nothing changed (every delivery not done was held back, so the event
    /// simply stays pending). Otherwise one record for the event: the
    /// routes that went through are kept (`route:done` in its done legs,
    /// with every acknowledged leg), and the event comes back for the rest
    /// — failed for good only once no route is left to retry or wait for.
    fn left_over(
        &self,
        units: &[(Claim, Plan)],
        fates: &[Fate],
        report: &mut BatchReport,
    ) -> Option<Failure> {
        let claim = &units[0].0;
        let mut done_legs = claim.done_legs.clone();
        let mut parts: Vec<Failure> = Vec::new();
        let (mut delivered, mut held, mut deferred) = (Vec::new(), Vec::new(), false);
        let mut wait: Option<Duration> = None;
        // The routes still to deliver (`None`: every route — a delivery
        // with no route stands for them all).
        // A row that is not an event holds every route: which ones would
        // select it is not known.
        let mut waiting: Option<Vec<String>> = claim.row.is_ok().then(Vec::new);
        for ((unit, plan), fate) in units.iter().zip(fates) {
            if !matches!(fate, Fate::Publish) {
                match (unit.route, waiting.as_mut()) {
                    (Some(r), Some(w)) => w.push(self.routes.0[r].name().to_string()),
                    _ => waiting = None,
                }
            }
            match fate {
                Fate::Publish => {
                    if let Plan::Publish { route, .. } = plan {
                        let name = self.routes.0[*route].name();
                        delivered.push(name);
                        done_legs.push(crate::store::route_done(name));
                    }
                }
                Fate::Held => held.push(unit.route),
                Fate::Fail {
                    route,
                    rejection,
                    broker_retry,
                    done_legs: legs,
                } => {
                    done_legs.extend(legs.iter().cloned());
                    let f = self.failure(claim, *route, rejection, report, *broker_retry);
                    if let FailureKind::Retry { delay } = f.kind {
                        wait = Some(wait.map_or(delay, |w| w.min(delay)));
                    }
                    parts.push(f);
                }
                Fate::Defer {
                    route,
                    reason,
                    delay,
                } => {
                    deferred = true;
                    if let Some(r) = route {
                        report.deferred_routes.insert(*r);
                    }
                    let name = route.map_or("-", |r| self.routes.0[r].name()).to_string();
                    metrics::counter!(m::EVENTS_DEFERRED, "route" => name, "source" => self.source.clone())
                        .increment(1);
                    wait = Some(wait.map_or(*delay, |w| w.min(*delay)));
                    parts.push(self.deferral(claim, *route, reason, *delay));
                }
            }
        }
        done_legs.sort_unstable();
        done_legs.dedup();
        if deferred {
            report.deferred += 1;
        }
        let held_names = || {
            held.iter()
                .map(|r| r.map_or("-", |r| self.routes.0[r].name()))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let mut record = match parts.len() {
            0 if delivered.is_empty() => {
                // Nothing went out and nothing failed: it stays pending. A
                // streamed event cannot (the slot moves on): it waits in the
                // parked queue (once). Nor can one claimed although earlier
                // events hold routes of it, for the routes that do not take
                // it: it is recorded as waiting for its own routes (once),
                // so claims step over it until they are free.
                report.held += 1;
                let streamed = claim.captured.is_some_and(|c| !c.parked);
                if streamed || (!claim.held.is_empty() && !claim.has_state) {
                    let mut f = self.waiting(claim);
                    f.done_legs = done_legs;
                    f.waiting_routes = waiting;
                    return Some(f);
                }
                return None;
            }
            0 => {
                report.held += 1;
                let first = held.first().copied().flatten();
                self.record(
                    claim,
                    first,
                    attempts_so_far(claim),
                    format!(
                        "delivered on route(s) {}; route(s) {} wait behind an earlier event of its aggregate",
                        delivered.join(", "),
                        held_names()
                    ),
                    FailureKind::Retry {
                        delay: Duration::ZERO,
                    },
                )
            }
            1 => parts.remove(0),
            _ => {
                let reason = parts
                    .iter()
                    .map(|p| {
                        format!(
                            "route `{}`: {}",
                            p.route.as_deref().unwrap_or("-"),
                            p.reason
                        )
                    })
                    .collect::<Vec<_>>()
                    .join("; ");
                let attempts = parts.iter().map(|p| p.attempts).max().unwrap_or(0);
                let hold = parts
                    .iter()
                    .any(|p| matches!(p.kind, FailureKind::Failed { hold: true }));
                let mut first = parts.remove(0);
                first.reason = reason;
                first.attempts = attempts;
                first.kind = FailureKind::Failed { hold };
                first
            }
        };
        // Failed for good only when no route is left to retry or wait for:
        // a route that may still deliver comes back (a route that failed
        // for good is run again then, and fails again or goes through).
        if let Some(delay) = wait {
            record.kind = FailureKind::Retry { delay };
        } else if !held.is_empty() && matches!(record.kind, FailureKind::Failed { .. }) {
            record.kind = FailureKind::Retry {
                delay: Duration::ZERO,
            };
            record.reason = format!(
                "{} (route(s) {} wait behind an earlier event of its aggregate)",
                record.reason,
                held_names()
            );
        }
        record.done_legs = done_legs;
        record.waiting_routes = waiting;
        Some(record)
    }

    /// The record of an event whose route is quarantined: it waits `delay`
    /// with its attempts unchanged, holding its aggregate.
    fn deferral(
        &self,
        claim: &Claim,
        route: Option<usize>,
        reason: &str,
        delay: Duration,
    ) -> Failure {
        let attempts = attempts_so_far(claim);
        self.record(
            claim,
            route,
            attempts,
            reason.to_string(),
            FailureKind::Retry { delay },
        )
    }

    /// The failure record for an event: retry with backoff, or failed.
    fn failure(
        &self,
        claim: &Claim,
        route: Option<usize>,
        rejection: &Rejection,
        report: &mut BatchReport,
        broker_retry: bool,
    ) -> Failure {
        let route_name = route
            .map(|i| self.routes.0[i].name().to_string())
            .unwrap_or_else(|| "-".into());
        let verdict = self
            .pipeline
            .verdict(route, rejection, attempts_so_far(claim), broker_retry);
        let (kind, attempts) = (verdict.kind, verdict.attempts);
        match kind {
            FailureKind::Retry { .. } => {
                report.retried += 1;
                metrics::counter!(m::RETRIES, "route" => route_name.clone(), "source" => self.source.clone()).increment(1);
            }
            FailureKind::Failed { .. } => {
                report.failed += 1;
                metrics::counter!(m::EVENTS_FAILED, "route" => route_name.clone(), "source" => self.source.clone()).increment(1);
                tracing::warn!(event_id = %claim.id(), route = %route_name, attempts, reason = %rejection.reason(), "event failed");
            }
        }
        let reason = match (&kind, rejection) {
            (FailureKind::Failed { .. }, Rejection::Retryable(r)) => {
                format!("gave up after {attempts} attempts: {r}")
            }
            _ => rejection.reason().to_string(),
        };
        self.record(claim, route, attempts, reason, kind)
    }

    /// What the store keeps about an event that did not go out.
    pub(crate) fn record(
        &self,
        claim: &Claim,
        route: Option<usize>,
        attempts: u32,
        reason: String,
        kind: FailureKind,
    ) -> Failure {
        let r: Option<&Route> = route.map(|i| &self.routes.0[i]);
        let (aggregate_type, aggregate_id, event_type, sequence) = match &claim.row {
            Ok(e) => (
                e.aggregate_type.clone(),
                e.aggregate_id.clone(),
                e.event_type.clone(),
                e.sequence,
            ),
            Err(b) => (
                b.aggregate_type.clone(),
                b.aggregate_id.clone(),
                b.event_type.clone(),
                b.sequence,
            ),
        };
        let plugin = route
            .and_then(|i| self.plugins[i].current())
            .map(|p| p.info.clone());
        // Bounded: reasons come from plugins and brokers.
        let reason: String = if reason.chars().count() > 2000 {
            format!("{}…", reason.chars().take(2000).collect::<String>())
        } else {
            reason
        };
        Failure {
            id: claim.id().to_string(),
            lane: claim.lane,
            epoch: claim.epoch,
            aggregate_type,
            aggregate_id,
            event_type,
            sequence,
            attempts,
            reason,
            route: r.map(|r| r.name().to_string()),
            waiting_routes: r.map(|r| vec![r.name().to_string()]),
            plugin: plugin.as_ref().map(|p| p.name.clone()),
            plugin_version: plugin.map(|p| p.version),
            kind,
            done_legs: Vec::new(),
            // A streamed event is written whole to the parked queue (the
            // slot moves past it); one read back from the queue is there.
            parked: claim
                .captured
                .filter(|c| !c.parked)
                .map(|c| (c.commit_lsn, crate::store::ParkedEvent::of(&claim.row))),
        }
    }
}

/// The route's limits and allow-list, checked before anything is sent.
/// A broken limit (not a refused name) is also returned, for the quarantine.
/// A plugin's outcome as the route takes it: messages that fail
/// [`check_messages`] make it that rejection (for comparing a shadow or a
/// `plugin try` candidate with the active plugin).
pub(crate) fn checked(route: &Route, outcome: Outcome) -> Outcome {
    outcome.and_then(|messages| check_messages(route, messages).map_err(|(r, _)| r))
}

/// What the relay checks of a plugin's messages before anything of the
/// event is sent: the route's per-event caps, then each message against
/// the route's allow-list and the sink's naming rules.
fn check_messages(
    route: &Route,
    messages: Vec<Message>,
) -> Result<Vec<Message>, (Rejection, Option<Limit>)> {
    let c = &route.config;
    if messages.len() > c.max_messages_per_event as usize {
        return Err((
            Rejection::Invalid(format!(
                "route `{}`: the plugin returned {} messages for one event (routes[].max_messages_per_event = {})",
                route.name(),
                messages.len(),
                c.max_messages_per_event
            )),
            Some(Limit::MessagesPerEvent),
        ));
    }
    let bytes: u64 = messages.iter().map(|m| m.payload.len() as u64).sum();
    if bytes > c.max_bytes_per_event {
        return Err((
            Rejection::Invalid(format!(
                "route `{}`: the plugin returned {bytes} payload bytes for one event (routes[].max_bytes_per_event = {})",
                route.name(),
                c.max_bytes_per_event
            )),
            Some(Limit::BytesPerEvent),
        ));
    }
    for m in &messages {
        route.check(m).map_err(|r| (Rejection::Invalid(r), None))?;
    }
    Ok(messages)
}

pub(crate) async fn sleep_or_cancel(d: Duration, shutdown: &CancellationToken) {
    tokio::select! {
        _ = shutdown.cancelled() => {},
        _ = tokio::time::sleep(d) => {},
    }
}

impl Relay {
    /// Re-publish already-published events (operator `replay`): plan and
    /// publish, never mark and never record failures. Returns the ids that
    /// went out and the ones that did not, with reasons.
    pub async fn replay_batch(
        &self,
        claims: Vec<Claim>,
        run: &str,
    ) -> (Vec<String>, Vec<(String, String)>) {
        let planned = self.plan(claims).await;
        let acks = self
            .pipeline
            .send_all(&planned.units, Some(run), None)
            .await
            .acks;
        let mut ok = Vec::new();
        let mut failed = Vec::new();
        // An event went out when every route that selects it sent it.
        for range in planned.events {
            let id = planned.units[range.start].0.id().to_string();
            let mut why: Vec<String> = Vec::new();
            for i in range {
                let (claim, plan) = &planned.units[i];
                let route = claim.route.map_or("-", |r| self.routes.0[r].name());
                let reason = match (plan, acks.get(&i)) {
                    (Plan::Publish { .. }, Some(Ok(()))) | (Plan::Done, _) => continue,
                    (Plan::Publish { .. }, None) => "not sent".to_string(),
                    (Plan::Publish { .. }, Some(Err(e))) => e.to_string(),
                    (Plan::Fail { rejection, .. }, _) => rejection.reason().to_string(),
                    (Plan::Held, _) => "held".into(),
                    (Plan::Defer { reason, .. }, _) => reason.clone(),
                };
                why.push(format!("route `{route}`: {reason}"));
            }
            if why.is_empty() {
                ok.push(id);
            } else {
                failed.push((id, why.join("; ")));
            }
        }
        (ok, failed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn a_lane_is_in_one_batch_and_never_taken_from_a_claim_older_than_its_last_batch() {
        let f = InFlight::default();
        let all = [0, 1, 2, 3];
        // Two workers claim at once from the same free lanes.
        let a_free = f.free(&all);
        let b_free = f.free(&all);
        let a = f.take(&a_free, &HashSet::from([0, 1]));
        assert_eq!(a.lanes, vec![0, 1]);
        // B's claim also found rows in lane 1: A has it, so B keeps only 2.
        let b = f.take(&b_free, &HashSet::from([1, 2]));
        assert_eq!(b.lanes, vec![2]);
        assert_eq!(f.free(&all).lanes(), vec![3]);
        // A's batch ends; lane 0 is free again, but a claim that began while
        // A had it (or before A gave it back) may not take it.
        let stale = f.free(&[3]);
        let before_release = Free(vec![(0, 0)]);
        drop(a);
        assert!(
            f.take(&before_release, &HashSet::from([0]))
                .lanes
                .is_empty()
        );
        let fresh = f.free(&[0]);
        assert_eq!(f.take(&fresh, &HashSet::from([0])).lanes, vec![0]);
        // Lanes without rows are never taken.
        assert!(f.take(&stale, &HashSet::new()).lanes.is_empty());
        drop(b);
        assert_eq!(f.free(&all).lanes(), vec![0, 1, 2, 3]);
    }
}
