//! The topology: the sources this process drains, each with its own relay
//! (store pool, leases, workers), over one shared set of sinks — and how a
//! new config replaces the running one without a restart.
//!
//! Sources are independent: each has `relay.concurrency` workers of its own
//! and its own connection pool, so a big backlog in one source never holds
//! up another's events (the runtime shares the CPU between them).
//!
//! **Every part comes up on its own.** A shared relay serves many teams'
//! databases, brokers and plugins, and one of them is always in a
//! maintenance window. So nothing but a broken configuration stops the
//! relay at start or on reload: each source is brought up by a task of its
//! own ([`bring_up`]), which opens its store — retrying with backoff while
//! the database is unreachable, reporting why in `/readyz` and
//! `outroute_source_up` — and then runs its relay; a sink that cannot be
//! built yet waits in the background (`sink/starting.rs`), holding only the
//! routes that publish to it; a route whose plugin cannot be loaded waits
//! for its file, holding only its own events. Once up, a source whose
//! database goes away keeps retrying on its own (`relay/mod.rs`), its lanes
//! lapsing for other relays to take.
//!
//! A reload ([`Topology::reload`], on SIGHUP or a config file change) first
//! builds what the new config needs that is new — new or changed sinks, the
//! relays of affected sources whose store stays (their plugins compiled).
//! A broken setting there leaves the running topology exactly as it was.
//! Then it switches over: a source whose relay is rebuilt on the same store
//! hands over *within the process* — its old relay stops claiming, finishes
//! its in-flight batches and keeps its lanes; the new relay, under the
//! same relay id, renews them — so no lease changes hands and nothing is
//! published twice. A source with a new store is stopped and brought up
//! anew. Sources the change does not touch keep running untouched; plugins
//! of untouched routes are checked for a new file.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::config::{self, Diff, Loaded};
use crate::health::{Health, Readiness, ReadyView};
use crate::plugin::Runtime;
use crate::relay::{Relay, RoutePlugins};
use crate::sink::{Sink, Sinks};
use crate::store::Store;

/// One source: the task that brings it up and runs it.
struct Running {
    health: Arc<Health>,
    /// Its relay, once its store opened.
    relay: Arc<OnceLock<Arc<Relay>>>,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl Running {
    fn relay(&self) -> Option<&Arc<Relay>> {
        self.relay.get()
    }
}

pub struct Topology {
    relay_id: String,
    loaded: Arc<Loaded>,
    sinks: Sinks,
    /// The plugin engine every source's routes run on (one per process:
    /// one epoch ticker, one copy of each plugin's code).
    runtime: Runtime,
    sources: BTreeMap<String, Running>,
    ready: Readiness,
}

/// Does any route read source `name`? A source no route reads is not
/// started: its events wait (rather than fail for want of a route) until a
/// reload adds a route for it.
fn routed(loaded: &Loaded, name: &str) -> bool {
    let yes = loaded
        .config
        .routes
        .iter()
        .any(|r| config::Config::route_reads(r, name));
    if !yes {
        tracing::warn!(source = %name, "no route reads this source: it is not started, its events wait");
    }
    yes
}

/// Connect to source `name`, apply the coordination migrations, check the
/// table and warn when the claim has no lane index.
pub async fn open_store(loaded: &Loaded, name: &str, relay_id: &str) -> Result<Store> {
    let mut store = Store::connect(&loaded.config, name, relay_id).await?;
    store.migrate(false).await?;
    store.check_table().await?;
    if let Some(ddl) = store.missing_index() {
        if store.queue_marking() {
            anyhow::bail!(
                "source `{name}`: marking style `queue` (the canonical table's default on PostgreSQL) needs \
                 its insert trigger on the table, or new events would never be listed: run `outroute migrate \
                 --table -c <config>` (stop relays of an older version first: events they publish meanwhile \
                 would go out again), or run:\n{ddl}\nTo keep stamping `published_at` instead, map the table \
                 as examples/outbox-published-at.toml does"
            );
        }
        tracing::warn!(
            source = %name,
            "no usable lane index: every claim scans and sorts the whole backlog. \
             Run `outroute migrate --table -c <config>`, or: {ddl}"
        );
    }
    if let Some(pg) = store.postgres() {
        // Open the connections the workers and the lease keeper will use
        // now, not when the first batch needs them — once the checks
        // passed: a source that is refused and tried again every 30 s
        // must not open a pool's worth of connections each time.
        let pool = pg.pool().clone();
        let n = (loaded.config.relay.concurrency as usize + 1)
            .min(pool.options().get_max_connections() as usize);
        tokio::spawn(async move {
            let held = futures::future::join_all((0..n).map(|_| pool.acquire())).await;
            drop(held);
        });
    }
    Ok(store)
}

/// The database could not be reached at all (as opposed to answering with
/// a refusal: a missing table, a setting): worth trying again soon.
pub fn unreachable(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>().is_some()
            || matches!(
                c.downcast_ref::<sqlx::Error>(),
                Some(sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed)
            )
            || matches!(
                c.downcast_ref::<sqlx::Error>(),
                Some(sqlx::Error::Database(d))
                    // too_many_connections, cannot_connect_now, admin_shutdown
                    if matches!(d.code().as_deref(), Some("53300" | "57P03" | "57P01"))
            )
    })
}

/// Longest wait between two attempts to open a store whose database is
/// unreachable, and one whose database answered with a refusal (checked
/// less often: each attempt runs statements on a producer's database).
const UNREACHABLE_BACKOFF: Duration = Duration::from_secs(2);
const REFUSED_BACKOFF: Duration = Duration::from_secs(30);

/// How many sources start at once. A relay serving hundreds of databases
/// of one server would otherwise open them all at the same moment, each
/// with its checks, connections and first fast polls, and a small server
/// (measured: 200 sources on 2 cores) then answers so slowly that lease
/// rounds time out, their connections are replaced, and the new
/// connections' start-up cost keeps it saturated. A source holds its turn
/// from opening its store until it first falls asleep or
/// [`STARTING_HOLD`] has passed.
const STARTING_AT_ONCE: usize = 16;
const STARTING_HOLD: Duration = Duration::from_secs(3);

fn starting() -> Arc<tokio::sync::Semaphore> {
    static STARTING: OnceLock<Arc<tokio::sync::Semaphore>> = OnceLock::new();
    STARTING
        .get_or_init(|| Arc::new(tokio::sync::Semaphore::new(STARTING_AT_ONCE)))
        .clone()
}

/// Open source `name`'s store, trying again with backoff until it opens
/// (`None`: stopped first), each attempt in its turn among the sources
/// starting (returned with the store). Every failure is shown on the
/// source's health.
async fn open_until_up(
    loaded: &Loaded,
    name: &str,
    relay_id: &str,
    health: &Health,
    stop: &CancellationToken,
) -> Option<(Arc<Store>, tokio::sync::OwnedSemaphorePermit)> {
    let mut backoff = Duration::from_millis(250);
    let mut logged = String::new();
    loop {
        let attempt = tokio::select! {
            _ = stop.cancelled() => return None,
            r = async {
                let turn = starting().acquire_owned().await;
                (open_store(loaded, name, relay_id).await, turn)
            } => r,
        };
        let e = match attempt {
            (Ok(store), Ok(turn)) => return Some((Arc::new(store), turn)),
            (Ok(_), Err(e)) => anyhow::anyhow!("{e}"),
            (Err(e), _) => e,
        };
        let why = crate::error::describe(&e);
        let limit = if unreachable(&e) {
            UNREACHABLE_BACKOFF
        } else {
            REFUSED_BACKOFF
        };
        if why != logged {
            tracing::error!(source = %name, retry_within = ?limit, "source not started, its events wait (every other source runs): {why}");
            logged = why.clone();
        }
        health.database.set_down(why);
        tokio::select! {
            _ = stop.cancelled() => return None,
            _ = tokio::time::sleep(crate::backoff::jitter(backoff)) => {},
        }
        backoff = (backoff * 2).min(limit);
    }
}

/// What a source task needs to bring its source up.
struct Setup {
    loaded: Arc<Loaded>,
    name: String,
    relay_id: String,
    sinks: Sinks,
    runtime: Runtime,
    health: Arc<Health>,
}

/// Bring source `setup.name` up — open its store while its plugins load,
/// or take the `relay` already built on a kept store — and run it until
/// `stop`.
async fn bring_up(
    setup: Setup,
    relay: Option<Relay>,
    slot: Arc<OnceLock<Arc<Relay>>>,
    stop: CancellationToken,
) {
    let Setup {
        loaded,
        name,
        relay_id,
        sinks,
        runtime,
        health,
    } = setup;
    let mut turn = None;
    let relay = match relay {
        Some(r) => r,
        None => {
            let (store, plugins) = tokio::join!(
                open_until_up(&loaded, &name, &relay_id, &health, &stop),
                RoutePlugins::load_or_wait(&loaded, &name, &runtime)
            );
            let Some((store, starting)) = store else {
                return;
            };
            turn = Some(starting);
            let assembled = plugins.and_then(|plugins| {
                Relay::assemble(&loaded, &name, store, sinks, health.clone(), plugins)
            });
            match assembled {
                Ok(r) => r,
                Err(e) => {
                    // Only a config the validation let through can get here.
                    health
                        .database
                        .set_down(format!("cannot build the relay: {e:#}"));
                    tracing::error!(source = %name, "cannot build the source's relay: {e:#}");
                    return;
                }
            }
        }
    };
    health.opened(relay.store.clone());
    let relay = Arc::new(relay);
    let _ = slot.set(relay.clone());
    tracing::info!(source = %name, routes = relay.routes.0.len(), "source started");
    if let Some(turn) = turn {
        // The next source's turn once this one is asleep or has run a while.
        let mut asleep = relay.asleep.subscribe();
        tokio::spawn(async move {
            let _ = tokio::time::timeout(STARTING_HOLD, asleep.wait_for(|a| *a)).await;
            drop(turn);
        });
    }
    // The scheduled reconciliation (`relay.reconcile_every`), beside it.
    let reconciling = loaded.config.relay.reconcile_every.map(|_| {
        tokio::spawn(tracing::Instrument::in_current_span(
            crate::reconcile::every(relay.clone(), loaded.config.sinks.clone(), stop.clone()),
        ))
    });
    if let Err(e) = relay.run(stop).await {
        tracing::warn!(source = %name, "source stopped with an error: {e:#}");
    }
    if let Some(r) = reconciling {
        r.abort();
    }
}

impl Topology {
    /// Start every source of `loaded`, each on its own (see the module
    /// docs); only a broken setting is an error.
    pub async fn start(loaded: Loaded, relay_id: String, ready: Readiness) -> Result<Self> {
        let loaded = Arc::new(loaded);
        let sinks = crate::relay::build_sinks(&loaded).await?;
        let runtime = Runtime::new(loaded.cache_dir())?;
        let mut t = Topology {
            relay_id,
            loaded: loaded.clone(),
            sinks,
            runtime,
            sources: BTreeMap::new(),
            ready,
        };
        for name in loaded.config.sources.keys() {
            if routed(&loaded, name) {
                t.spawn(&loaded, name.clone(), None);
            }
        }
        t.publish_readiness();
        Ok(t)
    }

    /// Start source `name`'s task: with `relay` (built on a kept store) it
    /// runs at once, else it opens its store first.
    fn spawn(&mut self, loaded: &Arc<Loaded>, name: String, relay: Option<Relay>) {
        let health = match &relay {
            Some(r) => r.health.clone(),
            None => Health::new(&name, loaded.config.relay.stall_after),
        };
        let slot = Arc::new(OnceLock::new());
        let stop = CancellationToken::new();
        let setup = Setup {
            loaded: loaded.clone(),
            name: name.clone(),
            relay_id: self.relay_id.clone(),
            sinks: self.sinks.clone(),
            runtime: self.runtime.clone(),
            health: health.clone(),
        };
        let span = tracing::info_span!("source", source = %name);
        let task = tokio::spawn(tracing::Instrument::instrument(
            bring_up(setup, relay, slot.clone(), stop.clone()),
            span,
        ));
        self.sources.insert(
            name,
            Running {
                health,
                relay: slot,
                stop,
                task,
            },
        );
    }

    fn publish_readiness(&self) {
        self.ready.set(ReadyView {
            sources: self
                .sources
                .iter()
                .map(|(n, r)| (n.clone(), r.health.clone()))
                .collect(),
            sinks: self.sinks.clone(),
            routes: self
                .loaded
                .config
                .routes
                .iter()
                .map(|r| (r.name.clone(), r.allow.keys().cloned().collect()))
                .collect(),
            teams_refused: self.loaded.refused_lines(),
            loaded: Some(self.loaded.clone()),
        });
    }

    /// The config running.
    pub fn loaded(&self) -> &Loaded {
        &self.loaded
    }

    /// The routes running, over all sources.
    pub fn route_count(&self) -> usize {
        self.loaded.config.routes.len()
    }

    /// Apply `new` (loaded and validated). Returns what changed; on an error
    /// (a broken setting) nothing did. A source whose database is down is
    /// no error: it comes up on its own.
    pub async fn reload(&mut self, new: Loaded) -> Result<Diff> {
        let started = Instant::now();
        let d = config::diff(&self.loaded.config, &new.config);
        if !d.restart.is_empty() {
            bail!(
                "these settings need a restart, so the reload is refused (nothing changed): {}",
                d.restart.join(", ")
            );
        }
        if d.is_empty() {
            // Nothing runs differently, but which team files were refused
            // (and which copies are good) may have changed.
            self.loaded = Arc::new(new);
            self.publish_readiness();
            self.refresh_plugins().await;
            return Ok(d);
        }
        let new = Arc::new(new);
        // 1. Build everything new; the running topology is untouched so far.
        let sinks = self.next_sinks(&new, &d).await?;
        let previous_sinks = std::mem::replace(&mut self.sinks, sinks);
        // Per affected source: the relay built on its kept store, or `None`
        // (a new or changed store: its task opens it).
        let mut next: Vec<(String, Option<Relay>)> = Vec::new();
        let mut unrouted = Vec::new();
        for name in &d.affected_sources {
            if !routed(&new, name) {
                unrouted.push(name.clone());
                continue;
            }
            let kept = self
                .sources
                .get(name)
                .filter(|_| !d.sources.changed.contains(name) && !d.sources.added.contains(name))
                .and_then(|r| r.relay())
                .map(|r| r.store.clone());
            let Some(store) = kept else {
                next.push((name.clone(), None));
                continue;
            };
            let health = Health::new(name, new.config.relay.stall_after);
            health.opened(store.clone());
            let built = match RoutePlugins::load_or_wait(&new, name, &self.runtime).await {
                Ok(plugins) => Relay::assemble(
                    &new,
                    name,
                    store,
                    self.sinks.clone(),
                    health.clone(),
                    plugins,
                ),
                Err(e) => Err(e),
            };
            match built {
                Ok(r) => next.push((name.clone(), Some(r))),
                Err(e) => {
                    self.sinks = previous_sinks;
                    return Err(e.context(format!("source `{name}`")));
                }
            }
        }
        // 2. Switch over. Removed sources give their lanes back; rebuilt
        // ones on a kept store hand over in place.
        for name in d.sources.removed.iter().chain(&unrouted) {
            if let Some(r) = self.sources.remove(name) {
                stop(name, r, false).await;
            }
        }
        for (name, built) in next {
            if let Some(r) = self.sources.remove(&name) {
                stop(&name, r, built.is_some()).await;
            }
            self.spawn(&new, name, built);
        }
        self.loaded = new;
        self.publish_readiness();
        // Untouched sources: their plugin files may have changed too.
        self.refresh_plugins().await;
        tracing::debug!(took = ?started.elapsed(), "topology switched");
        Ok(d)
    }

    /// The sinks of `new`: unchanged ones kept (the same connections),
    /// added and changed ones built.
    async fn next_sinks(&self, new: &Loaded, d: &Diff) -> Result<Sinks> {
        let mut fresh_configs = BTreeMap::new();
        for name in d.sinks.added.iter().chain(&d.sinks.changed) {
            if let Some(c) = new.config.sinks.get(name) {
                fresh_configs.insert(name.clone(), c.clone());
            }
        }
        let routes = crate::routing::Routes::compile(&new.config).map_err(anyhow::Error::msg)?;
        let fresh = crate::sink::build_all(
            &fresh_configs,
            &routes,
            &new.base_dir,
            new.config.relay.publish_timeout,
        )
        .await?;
        let mut out: BTreeMap<String, Arc<dyn Sink>> = BTreeMap::new();
        for name in new.config.sinks.keys() {
            let sink = match fresh.get(name) {
                Some(s) => s.clone(),
                None => match self.sinks.get(name) {
                    Some(s) => s.clone(),
                    None => bail!("sink `{name}` was neither kept nor built"),
                },
            };
            out.insert(name.clone(), sink);
        }
        Ok(Arc::new(out))
    }

    /// Check every running plugin's file for a new version.
    async fn refresh_plugins(&self) {
        for relay in self.sources.values().filter_map(Running::relay) {
            for (i, handle) in relay.plugins.iter().enumerate() {
                relay.reload_plugin(i, handle).await;
            }
        }
    }

    /// Stop every source: in-flight batches finish, lanes are released.
    pub async fn stop(mut self) {
        let all = std::mem::take(&mut self.sources);
        let stopping = all
            .into_iter()
            .map(|(n, r)| async move { stop(&n, r, false).await });
        futures::future::join_all(stopping).await;
    }
}

/// Stop one source's relay (or its bringing up); with `handover` its
/// lanes are kept for the relay that replaces it in this process.
async fn stop(name: &str, r: Running, handover: bool) {
    if let Some(relay) = r.relay() {
        relay.handing_over.store(handover, Ordering::Release);
    }
    r.stop.cancel();
    if let Err(e) = r.task.await {
        tracing::warn!(source = %name, "source task failed: {e}");
    }
}
