//! The relay's background tasks, beside the batch workers: the lease keeper
//! (which lanes this relay owns, renewed every `lease_ttl / 3`, `/ 2` asleep), the
//! backlog gauge, plugin hot reload, the retention purge (one relay at a
//! time), the route quarantine records (`quarantine.rs`), the claim floors
//! (`store/postgres/floor.rs`) and the LISTEN task (wake-ups, and a sleeping
//! source's lease rounds on the same connection). Each runs until shutdown.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{Notify, mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;

use super::sleep::{IdleTurn, WAKE_CHANNEL};
use super::{Relay, sleep_or_cancel};
use crate::metrics as m;
use crate::pipeline::LeaseView;
use crate::plugin::PluginHandle;
use crate::store::Store;
use crate::store::postgres::{CAPTURE_LANE, ORPHAN_ROUNDS, ORPHAN_SWEEP_INTERVAL};

/// Work a sleeping source hands its LISTEN task, to run on that connection
/// so that the pool's can close: its lease rounds, its claims (so the
/// first event after a quiet spell waits for no new connection), and the
/// once-a-minute rounds (backlog gauge, quarantine records, claim floors,
/// orphan sweeps) that would
/// otherwise open a pooled connection (a TLS handshake and a backend)
/// every minute.
pub(super) enum QuietJob {
    LeaseRound(oneshot::Sender<anyhow::Result<crate::store::Leases>>),
    Claim {
        lanes: Vec<i32>,
        limit: u32,
        reply: oneshot::Sender<anyhow::Result<crate::store::Claimed>>,
    },
    /// The backlog gauge's count (once a minute while asleep).
    Backlog(oneshot::Sender<anyhow::Result<(i64, Option<f64>)>>),
    /// The route quarantine records (once a minute while asleep).
    Quarantines(oneshot::Sender<anyhow::Result<Vec<crate::store::QuarantinedRoute>>>),
    /// A floor round (once a minute while asleep): whether a floor was
    /// lowered.
    Floors {
        lanes: Vec<i32>,
        reply: oneshot::Sender<anyhow::Result<bool>>,
    },
    /// One round of an orphan sweep.
    Orphans {
        lanes: Vec<i32>,
        after: Vec<i64>,
        reply: oneshot::Sender<anyhow::Result<crate::store::postgres::OrphanWalk>>,
    },
}

/// The failed-events series this process has set, per source (route,
/// owner): a relay rebuilt by a reload zeroes its predecessor's that are
/// gone, not only its own.
static FAILED_SHOWN: std::sync::Mutex<BTreeMap<String, BTreeSet<(String, String)>>> =
    std::sync::Mutex::new(BTreeMap::new());

/// How often a relay reads the store's quarantine records.
const QUARANTINE_FOLLOW: Duration = Duration::from_secs(2);

impl Relay {
    /// Follow the store's quarantine records: adopt a quarantine another
    /// relay decided, drop one resumed by a probe elsewhere or by
    /// `outroute route resume`; keep `/readyz` and the gauge current.
    pub(super) async fn follow_quarantines(
        self: Arc<Self>,
        quiet: Option<mpsc::Sender<QuietJob>>,
        shutdown: CancellationToken,
    ) {
        while !shutdown.is_cancelled() {
            let records = self.quiet_or_pool(
                quiet.as_ref(),
                "reading quarantines",
                QuietJob::Quarantines,
                self.store.quarantined_routes(),
            );
            match records.await {
                Ok(rows) => {
                    let records = rows
                        .into_iter()
                        .map(|q| (q.route, (q.reason, q.since)))
                        .collect();
                    for (route, quarantined) in self.quarantine.follow(&records) {
                        if quarantined {
                            tracing::warn!(route = %route, "route quarantined by another relay: its events wait");
                        } else {
                            tracing::info!(route = %route, "route resumed");
                            // Events this relay deferred while the resume
                            // was being recorded are due too.
                            if let Err(e) = self.store.make_waiting_due(&route).await {
                                tracing::warn!(route = %route, "could not make the route's waiting events due: {e:#}");
                            }
                        }
                        metrics::gauge!(m::ROUTE_QUARANTINED, "route" => route)
                            .set(if quarantined { 1.0 } else { 0.0 });
                    }
                }
                Err(e) => tracing::debug!("could not read route quarantines: {e:#}"),
            }
            self.health.set_quarantined(self.quarantine.quarantined());
            self.background_pause(QUARANTINE_FOLLOW, IdleTurn::Quarantine, &shutdown)
                .await;
        }
    }

    /// Raise the owned lanes' claim floors every round interval, beside the
    /// workers (a claim never waits for a round); sweep orphaned queue
    /// entries every [`ORPHAN_SWEEP_INTERVAL`], the first one interval
    /// after the start (a relay starting on a backlog claims first).
    pub(super) async fn raise_floors(
        self: Arc<Self>,
        mut leases: watch::Receiver<LeaseView>,
        quiet: Option<mpsc::Sender<QuietJob>>,
        wake: Arc<Notify>,
        shutdown: CancellationToken,
    ) {
        let quiet = quiet.as_ref();
        let mut orphans_due = Instant::now() + ORPHAN_SWEEP_INTERVAL;
        let mut orphan_walk = HashMap::new();
        while !shutdown.is_cancelled() {
            let lanes = leases.borrow_and_update().lanes.clone();
            if !lanes.is_empty() {
                if Instant::now() >= orphans_due {
                    self.drop_orphans(&lanes, &mut orphan_walk, quiet).await;
                    orphans_due = Instant::now() + ORPHAN_SWEEP_INTERVAL;
                }
                let lowered = self.quiet_or_pool(
                    quiet,
                    "raising claim floors",
                    |reply| QuietJob::Floors {
                        lanes: lanes.clone(),
                        reply,
                    },
                    async { Ok(self.store.raise_floors(&lanes).await) },
                );
                if lowered.await.unwrap_or(false) && self.is_asleep() {
                    // A row below the floors, which no claim saw: the
                    // sleeping source claims now (its notification came
                    // and went).
                    wake.notify_waiters();
                }
            }
            // Asleep, once a minute: its sweep below the floors finds a row
            // committed late below them (its notification woke a claim
            // that cannot see it).
            // Awake with events coming slowly, every 2 s: few rows to pass
            // over have piled up since, and every round reads every lane.
            let every = crate::store::postgres::FLOOR_ROUND_INTERVAL;
            self.paced_pause(every, every * 8, IdleTurn::Floors, &shutdown)
                .await;
        }
    }

    /// One orphan sweep: queue entries whose row was deleted or failed by
    /// hand, in the owned lanes, removed in at most [`ORPHAN_ROUNDS`]
    /// rounds. `walk` keeps, per lane, where the last sweep stopped when
    /// it did not reach the lane's end; the others start from the lowest.
    async fn drop_orphans(
        &self,
        lanes: &[i32],
        walk: &mut HashMap<i32, i64>,
        quiet: Option<&mpsc::Sender<QuietJob>>,
    ) {
        walk.retain(|lane, _| lanes.contains(lane));
        let mut todo = lanes.to_vec();
        let mut dropped = 0;
        for _ in 0..ORPHAN_ROUNDS {
            let after: Vec<i64> = todo
                .iter()
                .map(|l| walk.get(l).copied().unwrap_or(i64::MIN))
                .collect();
            let round = self.quiet_or_pool(
                quiet,
                "removing orphaned queue entries",
                |reply| QuietJob::Orphans {
                    lanes: todo.clone(),
                    after: after.clone(),
                    reply,
                },
                self.store.drop_orphans(&todo, &after),
            );
            match round.await {
                Ok(round) => {
                    dropped += round.dropped;
                    for lane in &todo {
                        walk.remove(lane);
                    }
                    walk.extend(round.more.iter().copied());
                    todo = round.more.into_iter().map(|(lane, _)| lane).collect();
                }
                Err(e) => {
                    tracing::warn!("removing orphaned queue entries failed: {e:#}");
                    break;
                }
            }
            if todo.is_empty() {
                break;
            }
        }
        if dropped > 0 {
            tracing::info!(
                dropped,
                "removed pending-queue entries whose rows were deleted or failed by hand (claims stepped over them)"
            );
        }
    }

    /// Renew leases every `lease_ttl / 3` (`/ 2` while the source
    /// sleeps); publish the owned lanes.
    pub(super) async fn keep_leases(
        self: Arc<Self>,
        tx: watch::Sender<LeaseView>,
        quiet: Option<mpsc::Sender<QuietJob>>,
        stop: CancellationToken,
        wake: Arc<Notify>,
    ) {
        let ttl = self.config.lease_ttl;
        let every = ttl / 3;
        let mut retry = Duration::from_millis(250);
        loop {
            let round_started = Instant::now();
            // A sleeping source renews every `lease_ttl / 2`: a third
            // fewer rounds for the sources that are most of a platform
            // relay's, with one retry left before the lease lapses (and a
            // lapsed lease of a sleeping source costs only a handover: no
            // batch is in flight). After a failed round, try again soon:
            // the lease is still valid for a while, and a round lost to a
            // dead connection succeeds on another one (see the backoff
            // below).
            let mut pause = if self.is_asleep() { ttl / 2 } else { every };
            match self.lease_round(quiet.as_ref()).await {
                Ok(l) => {
                    self.health.set_store_ok();
                    retry = Duration::from_millis(250);
                    if l.acquired > 0 {
                        metrics::counter!(m::LEASE_HANDOVERS, "source" => self.source.clone())
                            .increment(l.acquired as u64);
                        tracing::info!(
                            acquired = l.acquired,
                            owned = l.lanes.len(),
                            relays = l.relays,
                            "acquired lanes"
                        );
                        wake.notify_waiters();
                    }
                    metrics::gauge!(m::LANES_OWNED, "source" => self.source.clone())
                        .set(l.lanes.len() as f64);
                    self.leads.store(
                        l.lanes.contains(&0) || l.lanes.contains(&CAPTURE_LANE),
                        std::sync::atomic::Ordering::Release,
                    );
                    // Stop using the lease a safety margin before it lapses.
                    let valid_until =
                        round_started + ttl - every.min(Duration::from_secs(2)).max(ttl / 10);
                    let _ = tx.send(LeaseView {
                        lanes: l.lanes,
                        epochs: l.epochs,
                        valid_until,
                    });
                }
                Err(e) => {
                    self.health.store_failed(&e);
                    tracing::warn!("lease renewal failed: {e:#}");
                    // Backing off (jittered): a server too busy to answer
                    // in time is not helped by every source asking again
                    // at once.
                    pause = crate::backoff::jitter(retry).min(every);
                    retry = (retry * 2).min(every);
                }
            }
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tokio::time::sleep(pause) => {},
            }
        }
    }

    /// One lease round: while the source sleeps, on the LISTEN connection
    /// (`quiet`), so a sleeping source holds that one connection and its
    /// pool empties; otherwise, or if the LISTEN task does not answer in
    /// time (reconnecting), on the pool.
    async fn lease_round(
        &self,
        quiet: Option<&mpsc::Sender<QuietJob>>,
    ) -> anyhow::Result<crate::store::Leases> {
        self.quiet_or_pool(
            quiet,
            "lease round",
            QuietJob::LeaseRound,
            self.store.lease_round(),
        )
        .await
    }

    /// `job` on the LISTEN connection while the source sleeps (see
    /// [`Relay::ask_quiet`]; answered within `lease_ttl / 4`), otherwise —
    /// or if that connection fails or does not answer — `on_pool`.
    async fn quiet_or_pool<T>(
        &self,
        quiet: Option<&mpsc::Sender<QuietJob>>,
        what: &str,
        job: impl FnOnce(oneshot::Sender<anyhow::Result<T>>) -> QuietJob,
        on_pool: impl std::future::Future<Output = anyhow::Result<T>>,
    ) -> anyhow::Result<T> {
        let wait = self.config.lease_ttl / 4;
        match self.ask_quiet(quiet, what, wait, job).await {
            Some(t) => Ok(t),
            None => on_pool.await,
        }
    }

    /// A logical source's slot: how much WAL it keeps (every second; every
    /// 4 s while events come slowly).
    pub(super) async fn watch_slot(self: Arc<Self>, shutdown: CancellationToken) {
        let Some(pg) = self.store.logical() else {
            return;
        };
        while !shutdown.is_cancelled() {
            match pg.slot_status().await {
                Ok(Some(s)) => {
                    metrics::gauge!(m::SLOT_LAG_BYTES, "source" => self.source.clone())
                        .set(s.lag_bytes as f64);
                    if s.wal_status.as_deref() == Some("lost") {
                        tracing::error!(slot = %s.slot, "the replication slot lost WAL it needed (max_slot_wal_keep_size): events may be missing; see the guide, \"Operating the replication slot\"");
                    }
                }
                Ok(None) => tracing::warn!("the replication slot is gone (dropped?)"),
                Err(e) => tracing::debug!("slot query failed: {e:#}"),
            }
            self.paced_pause(
                Duration::from_secs(1),
                Duration::from_secs(4),
                IdleTurn::Slot,
                &shutdown,
            )
            .await;
        }
    }

    /// The failed-events gauge (`outroute_failed_events{source,route,owner}`):
    /// read once a minute while the source is awake, and right after a
    /// batch recorded events failed (a sleeping source fails none, and its
    /// database is left alone). A series no longer current (its failed
    /// events retried or discarded, its route removed or given another
    /// owner by a reload) is set to 0, whichever relay of this process set it.
    pub(super) async fn watch_failed(self: Arc<Self>, shutdown: CancellationToken) {
        while !shutdown.is_cancelled() {
            if !self.is_asleep() {
                match self.store.failed_by_route().await {
                    Ok(counts) => self.show_failed(counts),
                    Err(e) => tracing::debug!("could not count failed events: {e:#}"),
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => {},
                _ = self.failed_changed.notified() => {},
                _ = tokio::time::sleep(Duration::from_secs(60)) => {},
            }
        }
    }

    fn show_failed(&self, counts: Vec<(String, i64)>) {
        let owner_of = |route: &str| {
            self.routes
                .0
                .iter()
                .find(|r| r.name() == route)
                .map_or("-".to_string(), |r| r.config.owner().to_string())
        };
        let now: Vec<((String, String), i64)> = counts
            .into_iter()
            .map(|(route, n)| {
                let owner = owner_of(&route);
                ((route, owner), n)
            })
            .collect();
        let mut shown = FAILED_SHOWN.lock().unwrap_or_else(|p| p.into_inner());
        let before = shown.entry(self.source.clone()).or_default();
        let current: BTreeSet<(String, String)> = now.iter().map(|(k, _)| k.clone()).collect();
        for (route, owner) in before.difference(&current) {
            metrics::gauge!(m::FAILED_EVENTS, "source" => self.source.clone(), "route" => route.clone(), "owner" => owner.clone())
                .set(0.0);
        }
        for ((route, owner), n) in now {
            metrics::gauge!(m::FAILED_EVENTS, "source" => self.source.clone(), "route" => route, "owner" => owner)
                .set(n as f64);
        }
        *before = current;
    }

    pub(super) async fn watch_backlog(
        self: Arc<Self>,
        quiet: Option<mpsc::Sender<QuietJob>>,
        shutdown: CancellationToken,
    ) {
        while !shutdown.is_cancelled() {
            if let Some(pooled) = self.store.pool_connections() {
                let listening = self.listening.load(std::sync::atomic::Ordering::Relaxed);
                metrics::gauge!(m::SOURCE_CONNECTIONS, "source" => self.source.clone())
                    .set(f64::from(pooled) + if listening { 1.0 } else { 0.0 });
            }
            let backlog = self.quiet_or_pool(
                quiet.as_ref(),
                "counting the backlog",
                QuietJob::Backlog,
                self.store.backlog(),
            );
            match backlog.await {
                Ok((n, oldest)) => {
                    metrics::gauge!(m::BACKLOG, "source" => self.source.clone()).set(n as f64);
                    metrics::gauge!(m::OLDEST_PENDING_AGE, "source" => self.source.clone())
                        .set(oldest.unwrap_or(0.0));
                    self.health.set_backlog(n, oldest);
                    self.health.set_store_ok();
                }
                Err(e) => {
                    self.health.store_failed(&e);
                    tracing::debug!("backlog query failed: {e:#}");
                }
            }
            // Every second; every 4 s while events come slowly (the
            // backlog can hardly build then: a burst makes them fast).
            self.paced_pause(
                Duration::from_secs(1),
                Duration::from_secs(4),
                IdleTurn::Backlog,
                &shutdown,
            )
            .await;
        }
    }

    /// Check each route's plugin file for a new version every
    /// `plugins.<name>.reload_interval`, and a plugin that is not loaded
    /// yet every second.
    pub(super) async fn reload_plugins(self: Arc<Self>, shutdown: CancellationToken) {
        let interval = |i: usize| {
            if self.plugins[i].is_waiting() {
                Some(Duration::from_secs(1))
            } else {
                self.reload[i]
            }
        };
        let Some(every) = (0..self.plugins.len()).filter_map(interval).min() else {
            return;
        };
        let mut next: Vec<Instant> = (0..self.plugins.len())
            .map(|i| Instant::now() + interval(i).unwrap_or_default())
            .collect();
        while !shutdown.is_cancelled() {
            sleep_or_cancel(every.min(Duration::from_secs(1)), &shutdown).await;
            for (i, handle) in self.plugins.iter().enumerate() {
                let Some(wait) = interval(i) else {
                    continue;
                };
                if Instant::now() < next[i] {
                    continue;
                }
                next[i] = Instant::now() + wait;
                self.reload_plugin(i, handle).await;
            }
        }
    }

    /// Switch route `i`'s plugin to a new version of its file, if there is
    /// one (a bad file keeps the running version).
    pub(crate) async fn reload_plugin(&self, i: usize, handle: &Arc<PluginHandle>) {
        let h = handle.clone();
        let route = self.routes.0[i].name().to_string();
        match tokio::task::spawn_blocking(move || h.reload_if_changed()).await {
            Ok(Ok(Some(info))) => {
                metrics::counter!(m::PLUGIN_RELOADS, "route" => route.clone(), "result" => "ok")
                    .increment(1);
                if self.plugin_parts[i].set_up() {
                    tracing::info!(%route, plugin = %info.name, version = %info.version, "plugin loaded: the route's waiting events go out");
                } else {
                    tracing::info!(%route, plugin = %info.name, version = %info.version, "plugin reloaded");
                }
            }
            Ok(Ok(None)) => {}
            Ok(Err(e)) if handle.is_waiting() => {
                metrics::counter!(m::PLUGIN_RELOADS, "route" => route.clone(), "result" => "error")
                    .increment(1);
                tracing::error!(%route, "plugin still not loaded, the route's events keep waiting: {e:#}");
                self.plugin_parts[i].set_down(format!("{e:#}"));
            }
            Ok(Err(e)) => {
                metrics::counter!(m::PLUGIN_RELOADS, "route" => route.clone(), "result" => "error")
                    .increment(1);
                tracing::error!(%route, "plugin reload failed, the previous version keeps running: {e:#}");
            }
            Err(e) => tracing::error!(%route, "plugin reload panicked: {e}"),
        }
    }

    pub(super) async fn purge(self: Arc<Self>, retention: Duration, shutdown: CancellationToken) {
        while !shutdown.is_cancelled() {
            loop {
                match self.store.purge_published(retention, 1000).await {
                    Ok(p) => {
                        metrics::counter!(m::PURGED, "source" => self.source.clone())
                            .increment(p.deleted);
                        if !p.more {
                            break;
                        }
                    }
                    Err(e) => {
                        tracing::warn!("retention purge failed: {e:#}");
                        break;
                    }
                }
                tokio::task::yield_now().await;
            }
            self.background_pause(Duration::from_secs(60), IdleTurn::Retention, &shutdown)
                .await;
        }
    }

    /// LISTEN wake-ups (PostgreSQL only), on a connection of its own: the
    /// pending queue's trigger waking a sleeping source ([`WAKE_CHANNEL`],
    /// payload the table's name; others' are ignored) and the opt-in
    /// `relay.notify_channel`. A LISTEN connection that goes silent (a
    /// partition, a failover that leaves the old address dark) would stop
    /// wake-ups with no error: after `store.statement_timeout` with neither a
    /// notification nor a lease round it is asked a `SELECT 1`, and one that does not answer
    /// within that long is given up and replaced. Workers are woken whenever
    /// a LISTEN starts, in case a notification was missed.
    pub(super) async fn listen(
        self: Arc<Self>,
        channels: Vec<String>,
        mut jobs: mpsc::Receiver<QuietJob>,
        wake: Arc<Notify>,
        shutdown: CancellationToken,
    ) {
        let Store::Postgres(pg) = self.store.as_ref() else {
            return;
        };
        let quiet = pg.statement_timeout();
        while !shutdown.is_cancelled() {
            // Its own one-connection pool: sqlx's `PgListener` sends
            // `UNLISTEN *` when dropped, with no deadline, so a listener
            // given up on a dead connection would hold that connection's
            // pool slot until the kernel gives up on the socket.
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(1)
                .acquire_timeout(quiet)
                .connect_lazy_with((*pg.pool().connect_options()).clone());
            let mut listener = match sqlx::postgres::PgListener::connect_with(&pool).await {
                Ok(l) => l,
                Err(e) => {
                    tracing::warn!("LISTEN connection failed: {e:#}");
                    sleep_or_cancel(Duration::from_secs(1), &shutdown).await;
                    continue;
                }
            };
            if let Err(e) = pg
                .bounded(&format!("LISTEN {}", channels.join(", ")), async {
                    Ok(listener
                        .listen_all(channels.iter().map(String::as_str))
                        .await?)
                })
                .await
            {
                tracing::warn!("{e:#}");
                sleep_or_cancel(Duration::from_secs(1), &shutdown).await;
                continue;
            }
            wake.notify_waiters();
            self.listening
                .store(true, std::sync::atomic::Ordering::Relaxed);
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    // A sleeping source's lease round, claim, backlog count
                    // or quarantine read (which also prove the connection
                    // alive: no probe while they come).
                    Some(job) = jobs.recv() => {
                        // Answer a job; a failed statement means the
                        // connection may be gone: a new one is opened.
                        macro_rules! answer {
                            ($reply:expr, $what:literal, $limit:expr, $statement:expr) => {{
                                let r = pg.bounded_by($limit, $what, $statement).await;
                                let lost = r.is_err();
                                let _ = $reply.send(r);
                                lost
                            }};
                        }
                        let whole = pg.statement_timeout();
                        let lost = match job {
                            QuietJob::LeaseRound(reply) => answer!(reply,
                                "renewing lane leases on the LISTEN connection",
                                pg.lease_ttl() / 4, pg.lease_round_on(&mut listener)),
                            QuietJob::Claim { lanes, limit, reply } => answer!(reply,
                                "claiming events on the LISTEN connection",
                                whole, pg.claim_on(&mut listener, &lanes, limit)),
                            QuietJob::Backlog(reply) => answer!(reply,
                                "counting the backlog on the LISTEN connection",
                                whole, pg.backlog_on(&mut listener)),
                            QuietJob::Quarantines(reply) => answer!(reply,
                                "reading quarantines on the LISTEN connection",
                                whole, pg.quarantined_routes_on(&mut listener)),
                            QuietJob::Floors { lanes, reply } => answer!(reply,
                                "raising claim floors on the LISTEN connection",
                                whole, async { Ok(pg.raise_floors_on(&mut listener, &lanes).await) }),
                            QuietJob::Orphans { lanes, after, reply } => answer!(reply,
                                "removing orphaned queue entries on the LISTEN connection",
                                whole, pg.drop_orphans_on(&mut listener, &lanes, &after)),
                        };
                        if lost {
                            tracing::warn!("a statement on the LISTEN connection failed; opening a new one");
                            break;
                        }
                    }
                    n = tokio::time::timeout(quiet, listener.try_recv()) => match n {
                        Ok(Ok(Some(n))) => {
                            // Another table's in the same database: not ours.
                            if n.channel() != WAKE_CHANNEL || n.payload() == pg.source_key() {
                                wake.notify_waiters();
                            }
                        }
                        // The connection closed; sqlx reconnects and listens
                        // again. Notifications meanwhile were missed.
                        Ok(Ok(None)) => {
                            tracing::warn!("LISTEN connection closed; listening again on a new one");
                            wake.notify_waiters();
                        }
                        Ok(Err(e)) => {
                            tracing::warn!("LISTEN connection lost, reconnecting: {e:#}");
                            break;
                        }
                        // Quiet for a while: is anyone still there?
                        Err(_) => {
                            let probe = pg.bounded("checking the LISTEN connection", async {
                                sqlx::query("SELECT 1").execute(&mut listener).await?;
                                Ok(())
                            });
                            if let Err(e) = probe.await {
                                tracing::warn!("{e:#}; opening a new LISTEN connection");
                                break;
                            }
                        }
                    }
                }
            }
            self.listening
                .store(false, std::sync::atomic::Ordering::Relaxed);
        }
    }
}
