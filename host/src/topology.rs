//! The topology: the sources this process drains, each with its own relay
//! (store pool, leases, workers), over one shared set of sinks — and how a
//! new config replaces the running one without a restart.
//!
//! Sources are independent: each has `relay.concurrency` workers of its own
//! and its own connection pool, so a big backlog in one source never holds
//! up another's events (the runtime shares the CPU between them).
//!
//! A reload ([`Topology::reload`], on SIGHUP or a config file change) is all
//! or nothing. The new config was loaded and validated whole; then
//! everything it needs that is new is built first — new or changed sinks,
//! stores of new or changed sources, the relays of affected sources (their
//! plugins compiled). If any of that fails, the running topology is left
//! exactly as it was. Only then is it switched over: a source whose relay is
//! rebuilt hands over *within the process* — its old relay stops claiming,
//! finishes its in-flight batches and keeps its lanes; the new relay, under
//! the same relay id, renews them — so no lease changes hands and nothing is
//! published twice. Sources the change does not touch keep running
//! untouched; plugins of untouched routes are checked for a new file.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::config::{self, Diff, Loaded};
use crate::metrics::{Health, Readiness, ReadyView};
use crate::relay::{Relay, RoutePlugins};
use crate::sink::{Sink, Sinks};
use crate::store::Store;

/// One source's running relay.
struct Running {
    relay: Arc<Relay>,
    stop: CancellationToken,
    task: JoinHandle<Result<()>>,
}

pub struct Topology {
    relay_id: String,
    loaded: Loaded,
    sinks: Sinks,
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
    if let Some(pg) = store.postgres() {
        // Open the connections the workers and the lease keeper will use
        // now, beside the checks below, not when the first batch needs them.
        let pool = pg.pool().clone();
        let n = (loaded.config.relay.concurrency as usize + 1)
            .min(pool.options().get_max_connections() as usize);
        tokio::spawn(async move {
            let held = futures::future::join_all((0..n).map(|_| pool.acquire())).await;
            drop(held);
        });
    }
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
    Ok(store)
}

impl Topology {
    /// Build and start every source of `loaded`.
    pub async fn start(loaded: Loaded, relay_id: String, ready: Readiness) -> Result<Self> {
        let names: Vec<String> = loaded
            .config
            .sources
            .keys()
            .filter(|s| routed(&loaded, s))
            .cloned()
            .collect();
        // The sinks (a first broker round trip), the stores (migrations,
        // table check) and the plugins (compile or cache, `init`) are
        // independent: set them up at the same time, so the first batch goes
        // out sooner after a (re)start.
        let (sinks, stores, plugins) = tokio::try_join!(
            crate::relay::build_sinks(&loaded),
            futures::future::try_join_all(names.iter().map(|name| {
                let loaded = &loaded;
                let relay_id = &relay_id;
                async move {
                    open_store(loaded, name, relay_id)
                        .await
                        .with_context(|| format!("source `{name}`"))
                }
            })),
            futures::future::try_join_all(names.iter().map(|name| {
                let loaded = &loaded;
                async move {
                    RoutePlugins::load(loaded, name)
                        .await
                        .with_context(|| format!("source `{name}`"))
                }
            })),
        )?;
        let mut t = Topology {
            relay_id,
            loaded,
            sinks,
            sources: BTreeMap::new(),
            ready,
        };
        let mut built = Vec::new();
        for ((name, store), plugins) in names.iter().zip(stores).zip(plugins) {
            let health = Health::new(t.loaded.config.relay.stall_after);
            let relay = Relay::assemble(
                &t.loaded,
                name,
                Arc::new(store),
                t.sinks.clone(),
                health,
                plugins,
            )
            .with_context(|| format!("source `{name}`"))?;
            built.push((name.clone(), relay));
        }
        for (name, relay) in built {
            t.spawn(name, relay);
        }
        t.publish_readiness();
        Ok(t)
    }

    async fn build_relay(&self, loaded: &Loaded, name: &str, store: Arc<Store>) -> Result<Relay> {
        let health = Health::new(loaded.config.relay.stall_after);
        Relay::build(loaded, name, store, self.sinks.clone(), health)
            .await
            .with_context(|| format!("source `{name}`"))
    }

    fn spawn(&mut self, name: String, relay: Relay) {
        let relay = Arc::new(relay);
        let stop = CancellationToken::new();
        let span = tracing::info_span!("source", source = %name);
        let task = tokio::spawn(tracing::Instrument::instrument(
            relay.clone().run(stop.clone()),
            span,
        ));
        tracing::info!(source = %name, routes = relay.routes.0.len(), "source started");
        self.sources.insert(name, Running { relay, stop, task });
    }

    fn publish_readiness(&self) {
        self.ready.set(ReadyView {
            sources: self
                .sources
                .iter()
                .map(|(n, r)| (n.clone(), r.relay.health.clone(), r.relay.store.clone()))
                .collect(),
            sinks: self.sinks.clone(),
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
    /// nothing did.
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
            self.refresh_plugins().await;
            return Ok(d);
        }
        // 1. Build everything new; the running topology is untouched so far.
        let sinks = self.next_sinks(&new, &d).await?;
        let previous_sinks = std::mem::replace(&mut self.sinks, sinks);
        let mut next: Vec<(String, Relay, bool)> = Vec::new();
        let mut unrouted = Vec::new();
        for name in &d.affected_sources {
            if !routed(&new, name) {
                unrouted.push(name.clone());
                continue;
            }
            let reuse = self
                .sources
                .get(name)
                .filter(|_| !d.sources.changed.contains(name) && !d.sources.added.contains(name))
                .map(|r| r.relay.store.clone());
            let fresh = reuse.is_none();
            let store = match reuse {
                Some(s) => s,
                None => match open_store(&new, name, &self.relay_id).await {
                    Ok(s) => Arc::new(s),
                    Err(e) => {
                        self.sinks = previous_sinks;
                        return Err(e.context(format!("source `{name}`")));
                    }
                },
            };
            match self.build_relay(&new, name, store).await {
                Ok(r) => next.push((name.clone(), r, fresh)),
                Err(e) => {
                    self.sinks = previous_sinks;
                    return Err(e);
                }
            }
        }
        // 2. Switch over. Removed sources give their lanes back; rebuilt
        // ones hand over in place (a changed store: the old one releases).
        for name in d.sources.removed.iter().chain(&unrouted) {
            if let Some(r) = self.sources.remove(name) {
                stop(name, r, false).await;
            }
        }
        for (name, relay, fresh_store) in next {
            if let Some(r) = self.sources.remove(&name) {
                stop(&name, r, !fresh_store).await;
            }
            self.spawn(name, relay);
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
        for r in self.sources.values() {
            for (i, handle) in r.relay.plugins.iter().enumerate() {
                r.relay.reload_plugin(i, handle).await;
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

/// Stop one source's relay; with `handover` its lanes are kept for the
/// relay that replaces it in this process.
async fn stop(name: &str, r: Running, handover: bool) {
    r.relay.handing_over.store(handover, Ordering::Release);
    r.stop.cancel();
    match r.task.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(source = %name, "source stopped with an error: {e:#}"),
        Err(e) => tracing::warn!(source = %name, "source task failed: {e}"),
    }
}
