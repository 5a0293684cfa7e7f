//! The relay: the path every event takes, top to bottom.
//!
//! ```text
//!   claim rows ─► validate ─► select route ─► plugin ─► check messages
//!        ▲                                                   │
//!        │                                    hold later events of an aggregate
//!        │                                    whose earlier event did not go
//!        │                                                   │
//!   record failures ◄─ mark published ◄─ broker acks ◄─ publish to sinks
//! ```
//!
//! [`Relay::run`] starts a lease keeper (which lanes this relay owns), `relay.concurrency`
//! workers (each works the owned lanes `lane % concurrency == i`, so one
//! aggregate is only ever in one worker), a plugin reloader, the retention
//! purger and the backlog gauge. [`Relay::process`] is one batch; read it to
//! learn what outroute does.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use chrono::Utc;
use futures::future::join_all;
use rand::Rng;
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::config::{Loaded, OnFailure, Ordering, RelayConfig};
use crate::event::{Event, Message, Outcome, Rejection, envelope};
use crate::failpoint;
use crate::metrics::{self as m, Health};
use crate::plugin::{Limits, PluginHandle, Runtime};
use crate::routing::{Route, Routes};
use crate::sink::{Ack, Outgoing, PublishError, Sinks};
use crate::store::{Claim, Failure, FailureKind, Store};

/// Everything a batch needs, shared by the workers.
pub struct Relay {
    pub store: Arc<Store>,
    pub routes: Arc<Routes>,
    /// One plugin handle per route (same index as `routes`).
    pub plugins: Vec<Arc<PluginHandle>>,
    /// How often each route's plugin file is checked for a new version
    /// (`plugins.<name>.reload_interval`; `None`: never).
    pub reload: Vec<Option<Duration>>,
    pub sinks: Sinks,
    pub config: RelayConfig,
    /// CloudEvents `source` attribute.
    pub source: String,
    pub health: Arc<Health>,
}

/// What happens to one event of a batch.
#[derive(Debug)]
pub(crate) enum Plan {
    /// Publish these messages, then mark.
    Publish {
        route: usize,
        messages: Vec<Message>,
    },
    /// An earlier event of the same aggregate did not go through: leave this
    /// one pending (it is claimed again once the earlier one is resolved).
    Held,
    /// Record a failed attempt (retry or failed state).
    Fail {
        route: Option<usize>,
        rejection: Rejection,
    },
}

/// How many events a batch published, held and failed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
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
}

/// The lanes a batch was claimed from, checked again before publishing.
struct LeaseGuard {
    view: watch::Receiver<LeaseView>,
    lanes: Vec<i32>,
}

impl LeaseGuard {
    /// Every claimed lane is still in the current, unexpired lease view
    /// (lanes released over the fair share or lost leave the view at once).
    fn still_ours(&self) -> bool {
        let v = self.view.borrow();
        Instant::now() < v.valid_until && self.lanes.iter().all(|l| v.lanes.contains(l))
    }
}

/// The lanes a relay may claim from, and until when that is safe.
#[derive(Debug, Clone)]
struct LeaseView {
    lanes: Vec<i32>,
    valid_until: Instant,
}

impl Relay {
    /// Build routes, plugins and sinks from a loaded config.
    pub async fn build(loaded: &Loaded, store: Arc<Store>, health: Arc<Health>) -> Result<Self> {
        let config = &loaded.config;
        let routes = Routes::compile(config).map_err(anyhow::Error::msg)?;
        let runtime = Runtime::new(loaded.cache_dir())?;
        let mut plugins = Vec::new();
        let mut reload = Vec::new();
        for r in &routes.0 {
            let pc = config.plugins.get(&r.config.plugin).ok_or_else(|| {
                anyhow::anyhow!("routes.{}: no plugin `{}`", r.name(), r.config.plugin)
            })?;
            let limits = Limits {
                cpu_budget: r.config.cpu_budget,
                memory_bytes: (r.config.memory_mib as usize) << 20,
            };
            let handle = PluginHandle::load(
                &runtime,
                &loaded.resolve(&pc.path),
                r.config.config.clone(),
                limits,
            )
            .map_err(|e| anyhow::anyhow!("routes[{}] ({}): {e:#}", r.index, r.name()))?;
            reload.push(pc.reload_interval);
            plugins.push(Arc::new(handle));
        }
        let sinks = crate::sink::build_all(
            &config.sinks,
            &routes,
            &loaded.base_dir,
            config.relay.publish_timeout,
        )
        .await?;
        Ok(Relay {
            store,
            routes: Arc::new(routes),
            plugins,
            reload,
            sinks,
            config: config.relay.clone(),
            source: format!("/outroute/{}", config.store.table().name),
            health,
        })
    }

    /// Run until `shutdown` is cancelled, then stop leasing, let in-flight
    /// batches finish (bounded by `relay.shutdown_timeout`) and give the lanes
    /// back.
    pub async fn run(self: Arc<Self>, shutdown: CancellationToken) -> Result<()> {
        let wake = Arc::new(Notify::new());
        let (lease_tx, lease_rx) = watch::channel(LeaseView {
            lanes: Vec::new(),
            valid_until: Instant::now(),
        });
        let stop_leasing = CancellationToken::new();
        let mut background = Vec::new();
        background.push(tokio::spawn(self.clone().keep_leases(
            lease_tx,
            stop_leasing.clone(),
            wake.clone(),
        )));
        background.push(tokio::spawn(self.clone().watch_backlog(shutdown.clone())));
        background.push(tokio::spawn(self.clone().reload_plugins(shutdown.clone())));
        if let Some(retention) = self.config.retention {
            background.push(tokio::spawn(
                self.clone().purge(retention, shutdown.clone()),
            ));
        }
        if let Some(channel) = self.config.notify_channel.clone() {
            background.push(tokio::spawn(self.clone().listen(
                channel,
                wake.clone(),
                shutdown.clone(),
            )));
        }
        let workers: Vec<_> = (0..self.config.concurrency)
            .map(|i| {
                tokio::spawn(self.clone().supervise(
                    i,
                    lease_rx.clone(),
                    wake.clone(),
                    shutdown.clone(),
                ))
            })
            .collect();

        shutdown.cancelled().await;
        tracing::info!("shutting down: finishing in-flight batches");
        let drained = tokio::time::timeout(self.config.shutdown_timeout, join_all(workers)).await;
        if drained.is_err() {
            tracing::warn!(
                timeout = ?self.config.shutdown_timeout,
                "in-flight batches did not finish in time; their rows stay pending and lanes lapse after lease_ttl"
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
            let worker = tokio::spawn(self.clone().work(
                index,
                leases.clone(),
                wake.clone(),
                shutdown.clone(),
            ));
            match worker.await {
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
        let n = self.config.concurrency as i32;
        let mut idle = self.config.poll_min;
        let mut outage_backoff = Duration::from_millis(100);
        // The claim walks the lanes in the order given and stops at a full
        // batch: start at the next lane each time so every lane gets its
        // turn at the front however deep the others' backlogs are.
        let mut turn = 0usize;
        while !shutdown.is_cancelled() {
            let view = leases.borrow_and_update().clone();
            let mut lanes: Vec<i32> = if Instant::now() < view.valid_until {
                view.lanes
                    .iter()
                    .copied()
                    .filter(|l| l % n == index as i32)
                    .collect()
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
            let claim_started = Instant::now();
            let claims = match self.store.claim(&lanes, self.config.batch_size).await {
                Ok(c) => {
                    metrics::histogram!(m::CLAIM_SECONDS)
                        .record(claim_started.elapsed().as_secs_f64());
                    self.health.set_store_ok(true);
                    c
                }
                Err(e) => {
                    self.health.set_store_ok(false);
                    tracing::warn!(worker = index, "claim failed: {e:#}");
                    sleep_or_cancel(Duration::from_secs(1), &shutdown).await;
                    continue;
                }
            };
            if claims.is_empty() {
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = wake.notified() => idle = self.config.poll_min,
                    _ = tokio::time::sleep(idle) => idle = (idle * 2).min(self.config.poll_max),
                }
                continue;
            }
            let full = claims.len() as u32 >= self.config.batch_size;
            let now = Utc::now();
            for ev in claims.iter().filter_map(|c| c.row.as_ref().ok()) {
                if ev.attempts == 0 {
                    let age = (now - ev.created_at).num_microseconds().unwrap_or(0) as f64 / 1e6;
                    metrics::histogram!(m::PICKUP).record(age.max(0.0));
                }
            }
            failpoint::hit("after-claim");
            let lease = LeaseGuard {
                view: leases.clone(),
                lanes,
            };
            let span = tracing::info_span!("batch", worker = index, events = claims.len());
            match self.process(claims, Some(&lease)).instrument(span).await {
                Ok(report) if report.outage => {
                    tracing::warn!(backoff = ?outage_backoff, reason = report.outage_reason.as_deref().unwrap_or(""), "every publish failed; backing off");
                    sleep_or_cancel(jitter(outage_backoff), &shutdown).await;
                    outage_backoff = (outage_backoff * 2).min(Duration::from_secs(10));
                }
                Ok(_) => {
                    outage_backoff = Duration::from_millis(100);
                    idle = self.config.poll_min;
                    if !full {
                        sleep_or_cancel(self.config.poll_min, &shutdown).await;
                    }
                }
                Err(e) => {
                    self.health.set_store_ok(false);
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
    /// from must still be ours when publishing starts (another relay may own
    /// them by then).
    async fn process(&self, claims: Vec<Claim>, lease: Option<&LeaseGuard>) -> Result<BatchReport> {
        let started = Instant::now();
        let mut report = BatchReport::default();

        // 1–4. Rows → events → route → plugin → checked messages.
        let mut events = self.plan(claims).await;

        // 5. Per-aggregate order: once an event of an aggregate does not go
        //    through, later events of that aggregate in this batch wait.
        if self.config.ordering == Ordering::Aggregate {
            let mut blocked: HashSet<(String, String)> = HashSet::new();
            for (claim, plan) in events.iter_mut() {
                let key = aggregate_key(claim);
                if blocked.contains(&key) {
                    *plan = Plan::Held;
                } else if let Plan::Fail { route, rejection } = plan
                    && self.holds_aggregate(*route, rejection, claim)
                {
                    blocked.insert(key);
                }
            }
        }

        // 6. Messages → sinks, all at once; each resolves on its broker ack.
        if lease.is_some_and(|l| !l.still_ours()) {
            anyhow::bail!(
                "lane lease expired before publishing; leaving the batch to the next owner"
            );
        }
        let acks = self.publish(&events, None, lease).await;
        // Every message failed because its broker is unreachable: an outage.
        // (Refusals of particular messages are recorded per event below.)
        report.outage = !acks.is_empty()
            && acks
                .values()
                .all(|r| matches!(r, Err(PublishError::Unavailable(_))));
        if report.outage {
            report.outage_reason = acks
                .values()
                .find_map(|r| r.as_ref().err().map(|e| e.to_string()));
            // Nothing went out: leave every event pending; the worker backs off.
            return Ok(report);
        }
        failpoint::hit("after-ack");

        // 7. Acks → mark. An event is marked only when every message of it was
        //    acknowledged and no earlier event of its aggregate failed.
        let mut blocked: HashSet<(String, String)> = HashSet::new();
        let mut to_mark: Vec<&Claim> = Vec::new();
        let mut failures: Vec<Failure> = Vec::new();
        let now = Utc::now();
        for (i, (claim, plan)) in events.iter().enumerate() {
            let key = aggregate_key(claim);
            let ordered = self.config.ordering == Ordering::Aggregate;
            if ordered && blocked.contains(&key) {
                report.held += 1;
                continue;
            }
            match plan {
                Plan::Held => {
                    report.held += 1;
                    if ordered {
                        blocked.insert(key);
                    }
                }
                Plan::Publish { route, messages } => match acks.get(&i) {
                    // Never sent (publishing stopped early): stays pending.
                    None => {
                        report.held += 1;
                        if ordered {
                            blocked.insert(key);
                        }
                    }
                    Some(Ok(())) => {
                        to_mark.push(claim);
                        if let Ok(ev) = &claim.row {
                            let age =
                                (now - ev.created_at).num_microseconds().unwrap_or(0) as f64 / 1e6;
                            metrics::histogram!(m::COMMIT_TO_ACK).record(age.max(0.0));
                        }
                        let r = self.routes.0[*route].name().to_string();
                        metrics::counter!(m::EVENTS_PUBLISHED, "route" => r.clone()).increment(1);
                        for msg in messages {
                            metrics::counter!(m::MESSAGES_PUBLISHED, "route" => r.clone(), "sink" => msg.sink.clone())
                                .increment(1);
                        }
                    }
                    Some(Err(e)) => {
                        let rejection = match e {
                            PublishError::Unavailable(r) | PublishError::Retryable(r) => {
                                Rejection::Retryable(r.clone())
                            }
                            PublishError::Permanent(r) => Rejection::Invalid(r.clone()),
                        };
                        // A broker that is unreachable is an infrastructure
                        // problem, not the event's: it waits with backoff for
                        // as long as it takes and never uses up attempts.
                        let broker_retry = matches!(e, PublishError::Unavailable(_));
                        if ordered
                            && (broker_retry
                                || self.holds_aggregate(Some(*route), &rejection, claim))
                        {
                            blocked.insert(key);
                        }
                        failures.push(self.failure(
                            claim,
                            Some(*route),
                            &rejection,
                            &mut report,
                            broker_retry,
                        ));
                    }
                },
                Plan::Fail { route, rejection } => {
                    if ordered && self.holds_aggregate(*route, rejection, claim) {
                        blocked.insert(key);
                    }
                    failures.push(self.failure(claim, *route, rejection, &mut report, false));
                }
            }
        }
        let marked = self.mark(&to_mark).await?;
        report.published = to_mark.len();
        if (marked as usize) < to_mark.len() {
            let fenced = to_mark.len() - marked as usize;
            metrics::counter!(m::MARK_FENCED).increment(fenced as u64);
            tracing::warn!(
                fenced,
                "lane lease lost: rows were published but not marked (they will be re-published with the same ids)"
            );
        }
        if marked > 0 {
            self.health.progressed();
        }

        // 8. Failures → retry later (backoff) or the failed state.
        if !failures.is_empty() {
            self.store.record_failures(&failures).await?;
        }
        metrics::histogram!(m::BATCH_SECONDS).record(started.elapsed().as_secs_f64());
        Ok(report)
    }

    /// Steps 1–4 of a batch: rows → events (malformed rows fail) → route
    /// (first match) → plugin (one batch call per route) → messages checked
    /// against the route's allow-list. Also used by `replay`.
    pub(crate) async fn plan(&self, claims: Vec<Claim>) -> Vec<(Claim, Plan)> {
        // 1. Rows → events. A malformed row fails right away, with the reason.
        let mut events: Vec<(Claim, Plan)> = Vec::with_capacity(claims.len());
        let mut to_route: Vec<(usize, usize)> = Vec::new(); // (index in batch, route)
        for claim in claims {
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
                // 2. Event → route (first match in config order).
                Ok(ev) => match self.routes.select(&ev.aggregate_type, &ev.event_type) {
                    Some(route) => {
                        to_route.push((events.len(), route.index));
                        Plan::Held // placeholder until the plugin answers
                    }
                    None => Plan::Fail {
                        route: None,
                        rejection: Rejection::Invalid(format!(
                            "no route selects aggregate type `{}` / event type `{}`",
                            ev.aggregate_type, ev.event_type
                        )),
                    },
                },
            };
            events.push((claim, plan));
        }

        // 3. Route → plugin: one batch call per route, on a blocking thread.
        let mut by_route: HashMap<usize, Vec<usize>> = HashMap::new();
        for (i, r) in &to_route {
            by_route.entry(*r).or_default().push(*i);
        }
        for (route_idx, idxs) in by_route {
            let batch: Vec<Event> = idxs
                .iter()
                .filter_map(|i| events[*i].0.row.as_ref().ok().cloned())
                .collect();
            let outcomes = self.call_plugin(route_idx, batch).await;
            let route = &self.routes.0[route_idx];
            for (i, outcome) in idxs.into_iter().zip(outcomes) {
                // 4. Plugin messages → checked against the route's allow-list.
                events[i].1 = match outcome.and_then(|msgs| check_messages(route, msgs)) {
                    Ok(messages) => Plan::Publish {
                        route: route_idx,
                        messages,
                    },
                    Err(rejection) => {
                        metrics::counter!(m::REJECTIONS, "route" => route.name().to_string(), "kind" => rejection.kind())
                            .increment(1);
                        Plan::Fail {
                            route: Some(route_idx),
                            rejection,
                        }
                    }
                };
            }
        }

        events
    }

    async fn call_plugin(&self, route_idx: usize, batch: Vec<Event>) -> Vec<Outcome> {
        let n = batch.len();
        let Some(plugin) = self.plugins[route_idx].current() else {
            return (0..n)
                .map(|_| Err(Rejection::Retryable("plugin unavailable".into())))
                .collect();
        };
        let route = self.routes.0[route_idx].name().to_string();
        let started = Instant::now();
        let result = tokio::task::spawn_blocking(move || plugin.route_batch(&batch)).await;
        let per_event = started.elapsed().as_secs_f64() / n.max(1) as f64;
        metrics::histogram!(m::PLUGIN_CALL, "route" => route).record(per_event);
        match result {
            Ok(outcomes) => outcomes,
            Err(e) => (0..n)
                .map(|_| Err(Rejection::Retryable(format!("plugin call panicked: {e}"))))
                .collect(),
        }
    }

    /// Publish every message of every `Plan::Publish`; result per event
    /// index. Messages are handed to the brokers one by one in batch order
    /// (so an aggregate's events keep their order on a partition/stream),
    /// then all acknowledgements are awaited together.
    ///
    /// `replay`: tags broker-side dedup ids (JetStream `Nats-Msg-Id`) so a
    /// deliberate re-publish is not dropped as a duplicate; consumers still
    /// see the same `ce_id`.
    async fn publish(
        &self,
        events: &[(Claim, Plan)],
        replay: Option<&str>,
        lease: Option<&LeaseGuard>,
    ) -> HashMap<usize, Result<(), PublishError>> {
        let mut acks: HashMap<usize, Result<(), PublishError>> = HashMap::new();
        let mut pending: Vec<(usize, &str, Ack)> = Vec::new();
        'events: for (i, (claim, plan)) in events.iter().enumerate() {
            let (Plan::Publish { messages, route }, Ok(ev)) = (plan, &claim.row) else {
                continue;
            };
            acks.insert(i, Ok(()));
            // One span per event: event id, aggregate, route and the trace id
            // from its `traceparent`, on everything logged while publishing it.
            let span = tracing::debug_span!(
                "event",
                event_id = %ev.id,
                aggregate = %format_args!("{}/{}", ev.aggregate_type, ev.aggregate_id),
                route = self.routes.0[*route].name(),
                trace_id = ev.traceparent().and_then(|t| t.split('-').nth(1)).unwrap_or(""),
            );
            let mut seen: HashMap<(&str, &str), usize> = HashMap::new();
            for msg in messages {
                let Some(sink) = self.sinks.get(&msg.sink) else {
                    record(
                        &mut acks,
                        i,
                        &msg.sink,
                        PublishError::Permanent(format!("no sink `{}`", msg.sink)),
                    );
                    continue;
                };
                let headers = envelope(ev, &self.source, &msg.headers);
                // Broker-side dedup id (JetStream `Nats-Msg-Id`): event id and
                // subject (plus a count for repeats), so the same message
                // re-sent after a crash is dropped, while a plugin that changes
                // its fan-out between attempts can never reuse an id.
                let n = seen
                    .entry((msg.sink.as_str(), msg.topic.as_str()))
                    .or_insert(0);
                let mut dedup = match *n {
                    0 => format!("{}:{}", ev.id, msg.topic),
                    n => format!("{}:{}:{n}", ev.id, msg.topic),
                };
                *n += 1;
                if let Some(tag) = replay {
                    dedup = format!("{dedup}:replay-{tag}");
                }
                let out = Outgoing {
                    topic: &msg.topic,
                    key: msg.key.as_deref(),
                    partition: msg.partition,
                    headers: &headers,
                    payload: &msg.payload,
                    dedup_id: &dedup,
                };
                // An in-flight slot; if none is free, our own unacknowledged
                // messages may be holding them: settle those first.
                let permit = match sink.try_reserve() {
                    Some(p) => p,
                    None => {
                        self.settle(std::mem::take(&mut pending), &mut acks).await;
                        let reserved = sink.reserve().await;
                        // That may have taken a while: stop if the lanes
                        // moved to another relay meanwhile.
                        if lease.is_some_and(|l| !l.still_ours()) {
                            let lost = PublishError::Unavailable(
                                "lane lease lost while publishing".into(),
                            );
                            record(&mut acks, i, &msg.sink, lost);
                            break 'events;
                        }
                        match reserved {
                            Ok(p) => p,
                            Err(e) => {
                                record(&mut acks, i, &msg.sink, e);
                                continue;
                            }
                        }
                    }
                };
                match sink.send(out, permit).instrument(span.clone()).await {
                    Ok(ack) => pending.push((i, msg.sink.as_str(), ack)),
                    Err(e) => record(&mut acks, i, &msg.sink, e),
                }
            }
        }
        failpoint::hit("before-ack");
        self.settle(pending, &mut acks).await;
        acks
    }

    /// Wait for these acknowledgements (bounded by `publish_timeout`) and
    /// note every failure against its event.
    async fn settle(
        &self,
        pending: Vec<(usize, &str, Ack)>,
        acks: &mut HashMap<usize, Result<(), PublishError>>,
    ) {
        let timeout = self.config.publish_timeout + Duration::from_secs(5);
        let waits = pending.into_iter().map(|(i, sink, ack)| async move {
            match tokio::time::timeout(timeout, ack.wait()).await {
                Ok(r) => (i, sink, r),
                Err(_) => (
                    i,
                    sink,
                    Err(PublishError::Unavailable(format!(
                        "no acknowledgement within {timeout:?}"
                    ))),
                ),
            }
        });
        for (i, sink, r) in join_all(waits).await {
            if let Err(e) = r {
                record(acks, i, sink, e);
            }
        }
    }

    async fn mark(&self, claims: &[&Claim]) -> Result<u64> {
        if failpoint::armed("mid-mark") && claims.len() > 1 {
            let (a, b) = claims.split_at(claims.len() / 2);
            let n = self.store.mark_published(a).await?;
            failpoint::hit("mid-mark");
            return Ok(n + self.store.mark_published(b).await?);
        }
        self.store.mark_published(claims).await
    }

    /// Does this failure hold back later events of its aggregate? A retry
    /// always does (the event comes back); a final failure does under the
    /// route's `block` policy.
    fn holds_aggregate(&self, route: Option<usize>, rejection: &Rejection, claim: &Claim) -> bool {
        let attempts = claim.row.as_ref().map(|e| e.attempts).unwrap_or(0) + 1;
        match rejection {
            Rejection::Retryable(_) if attempts < self.max_attempts(route) => true,
            _ => {
                route
                    .map(|r| self.routes.0[r].config.on_failure)
                    .unwrap_or(OnFailure::Block)
                    == OnFailure::Block
            }
        }
    }

    fn max_attempts(&self, route: Option<usize>) -> u32 {
        route
            .map(|r| self.routes.0[r].config.max_attempts)
            .unwrap_or(1)
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
        let r: Option<&Route> = route.map(|i| &self.routes.0[i]);
        let route_name = r
            .map(|r| r.name().to_string())
            .unwrap_or_else(|| "-".into());
        let (aggregate_type, aggregate_id, event_type, sequence, prior) = match &claim.row {
            Ok(e) => (
                e.aggregate_type.clone(),
                e.aggregate_id.clone(),
                e.event_type.clone(),
                e.sequence,
                e.attempts,
            ),
            Err(b) => (
                b.aggregate_type.clone(),
                b.aggregate_id.clone(),
                b.event_type.clone(),
                b.sequence,
                0,
            ),
        };
        // Waiting for an unavailable broker is not an attempt of the event.
        let attempts = if broker_retry { prior } else { prior + 1 };
        let plugin = route
            .and_then(|i| self.plugins[i].current())
            .map(|p| p.info.clone());
        let kind = match rejection {
            Rejection::Retryable(_) if broker_retry || attempts < self.max_attempts(route) => {
                let (min, max) = r
                    .map(|r| (r.config.backoff_min, r.config.backoff_max))
                    .unwrap_or_default();
                let exponent = if broker_retry {
                    3
                } else {
                    attempts.saturating_sub(1).min(20)
                };
                let delay = jitter(min.saturating_mul(1 << exponent).min(max));
                report.retried += 1;
                metrics::counter!(m::RETRIES, "route" => route_name.clone()).increment(1);
                FailureKind::Retry { delay }
            }
            _ => {
                report.failed += 1;
                metrics::counter!(m::EVENTS_FAILED, "route" => route_name.clone()).increment(1);
                let policy = r.map(|r| r.config.on_failure).unwrap_or(OnFailure::Block);
                let hold =
                    policy == OnFailure::Block && self.config.ordering == Ordering::Aggregate;
                tracing::warn!(event_id = %claim.id(), route = %route_name, attempts, reason = %rejection.reason(), "event failed");
                FailureKind::Failed { hold }
            }
        };
        let reason = match (&kind, rejection) {
            (FailureKind::Failed { .. }, Rejection::Retryable(r)) => {
                format!("gave up after {attempts} attempts: {r}")
            }
            _ => rejection.reason().to_string(),
        };
        // Bounded: reasons come from plugins and brokers.
        let reason: String = if reason.chars().count() > 2000 {
            format!("{}…", reason.chars().take(2000).collect::<String>())
        } else {
            reason
        };
        Failure {
            id: claim.id().to_string(),
            lane: claim.lane,
            aggregate_type,
            aggregate_id,
            event_type,
            sequence,
            attempts,
            reason,
            route: r.map(|r| r.name().to_string()),
            plugin: plugin.as_ref().map(|p| p.name.clone()),
            plugin_version: plugin.map(|p| p.version),
            kind,
        }
    }

    /// Renew leases every `lease_ttl / 3`; publish the owned lanes.
    async fn keep_leases(
        self: Arc<Self>,
        tx: watch::Sender<LeaseView>,
        stop: CancellationToken,
        wake: Arc<Notify>,
    ) {
        let ttl = self.config.lease_ttl;
        let every = ttl / 3;
        loop {
            let round_started = Instant::now();
            match self.store.lease_round().await {
                Ok(l) => {
                    self.health.set_store_ok(true);
                    if l.acquired > 0 {
                        metrics::counter!(m::LEASE_HANDOVERS).increment(l.acquired as u64);
                        tracing::info!(
                            acquired = l.acquired,
                            owned = l.lanes.len(),
                            relays = l.relays,
                            "acquired lanes"
                        );
                        wake.notify_waiters();
                    }
                    metrics::gauge!(m::LANES_OWNED).set(l.lanes.len() as f64);
                    // Stop using the lease a safety margin before it lapses.
                    let valid_until =
                        round_started + ttl - every.min(Duration::from_secs(2)).max(ttl / 10);
                    let _ = tx.send(LeaseView {
                        lanes: l.lanes,
                        valid_until,
                    });
                }
                Err(e) => {
                    self.health.set_store_ok(false);
                    tracing::warn!("lease renewal failed: {e:#}");
                }
            }
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tokio::time::sleep(every) => {},
            }
        }
    }

    async fn watch_backlog(self: Arc<Self>, shutdown: CancellationToken) {
        while !shutdown.is_cancelled() {
            match self.store.backlog().await {
                Ok((n, oldest)) => {
                    metrics::gauge!(m::BACKLOG).set(n as f64);
                    metrics::gauge!(m::OLDEST_PENDING_AGE).set(oldest.unwrap_or(0.0));
                    self.health.set_backlog(n);
                    self.health.set_store_ok(true);
                }
                Err(e) => {
                    self.health.set_store_ok(false);
                    tracing::debug!("backlog query failed: {e:#}");
                }
            }
            sleep_or_cancel(Duration::from_secs(1), &shutdown).await;
        }
    }

    async fn reload_plugins(self: Arc<Self>, shutdown: CancellationToken) {
        let Some(every) = self.reload.iter().flatten().min().copied() else {
            return;
        };
        let mut next: Vec<Instant> = self
            .reload
            .iter()
            .map(|r| Instant::now() + r.unwrap_or_default())
            .collect();
        while !shutdown.is_cancelled() {
            sleep_or_cancel(every.min(Duration::from_secs(1)), &shutdown).await;
            for (i, handle) in self.plugins.iter().enumerate() {
                let Some(interval) = self.reload[i] else {
                    continue;
                };
                if Instant::now() < next[i] {
                    continue;
                }
                next[i] = Instant::now() + interval;
                let h = handle.clone();
                let route = self.routes.0[i].name().to_string();
                match tokio::task::spawn_blocking(move || h.reload_if_changed()).await {
                    Ok(Ok(Some(info))) => {
                        metrics::counter!(m::PLUGIN_RELOADS, "route" => route.clone(), "result" => "ok").increment(1);
                        tracing::info!(%route, plugin = %info.name, version = %info.version, "plugin reloaded");
                    }
                    Ok(Ok(None)) => {}
                    Ok(Err(e)) => {
                        metrics::counter!(m::PLUGIN_RELOADS, "route" => route.clone(), "result" => "error").increment(1);
                        tracing::error!(%route, "plugin reload failed, the previous version keeps running: {e:#}");
                    }
                    Err(e) => tracing::error!(%route, "plugin reload panicked: {e}"),
                }
            }
        }
    }

    async fn purge(self: Arc<Self>, retention: Duration, shutdown: CancellationToken) {
        while !shutdown.is_cancelled() {
            loop {
                match self.store.purge_published(retention, 1000).await {
                    Ok(n) => {
                        metrics::counter!(m::PURGED).increment(n);
                        if n < 1000 {
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
            sleep_or_cancel(Duration::from_secs(60), &shutdown).await;
        }
    }

    /// Opt-in LISTEN wake-up (PostgreSQL only).
    async fn listen(
        self: Arc<Self>,
        channel: String,
        wake: Arc<Notify>,
        shutdown: CancellationToken,
    ) {
        let Store::Postgres(pg) = self.store.as_ref() else {
            return;
        };
        while !shutdown.is_cancelled() {
            let mut listener = match sqlx::postgres::PgListener::connect_with(pg.pool()).await {
                Ok(l) => l,
                Err(e) => {
                    tracing::warn!("LISTEN connection failed: {e:#}");
                    sleep_or_cancel(Duration::from_secs(1), &shutdown).await;
                    continue;
                }
            };
            if let Err(e) = listener.listen(&channel).await {
                tracing::warn!("LISTEN {channel} failed: {e:#}");
                sleep_or_cancel(Duration::from_secs(1), &shutdown).await;
                continue;
            }
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    n = listener.recv() => match n {
                        Ok(_) => wake.notify_waiters(),
                        Err(_) => break,
                    }
                }
            }
        }
    }
}

/// Note a failed message of event `i` (permanent beats retryable).
fn record(
    acks: &mut HashMap<usize, Result<(), PublishError>>,
    i: usize,
    sink: &str,
    e: PublishError,
) {
    let kind = match e {
        PublishError::Permanent(_) => "permanent",
        PublishError::Retryable(_) => "retryable",
        PublishError::Unavailable(_) => "unavailable",
    };
    metrics::counter!(m::PUBLISH_ERRORS, "sink" => sink.to_string(), "kind" => kind).increment(1);
    tracing::debug!(sink, "publish failed: {e}");
    let slot = acks.entry(i).or_insert(Ok(()));
    if !matches!(slot, Err(PublishError::Permanent(_))) {
        *slot = Err(e);
    }
}

fn check_messages(route: &Route, messages: Vec<Message>) -> Result<Vec<Message>, Rejection> {
    for m in &messages {
        route.check(m).map_err(Rejection::Invalid)?;
    }
    Ok(messages)
}

fn aggregate_key(c: &Claim) -> (String, String) {
    match &c.row {
        Ok(e) => (e.aggregate_type.clone(), e.aggregate_id.clone()),
        Err(b) => (b.aggregate_type.clone(), b.aggregate_id.clone()),
    }
}

/// Between 50% and 100% of `d` ("equal jitter"), so retries spread out.
fn jitter(d: Duration) -> Duration {
    let f: f64 = rand::rng().random_range(0.5..=1.0);
    d.mul_f64(f)
}

async fn sleep_or_cancel(d: Duration, shutdown: &CancellationToken) {
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
        let events = self.plan(claims).await;
        let acks = self.publish(&events, Some(run), None).await;
        let mut ok = Vec::new();
        let mut failed = Vec::new();
        for (i, (claim, plan)) in events.iter().enumerate() {
            match (plan, acks.get(&i)) {
                (Plan::Publish { .. }, Some(Ok(()))) => ok.push(claim.id().to_string()),
                (Plan::Publish { .. }, None) => {
                    failed.push((claim.id().to_string(), "not sent".into()))
                }
                (Plan::Publish { .. }, Some(Err(e))) => {
                    failed.push((claim.id().to_string(), e.to_string()))
                }
                (Plan::Fail { rejection, .. }, _) => {
                    failed.push((claim.id().to_string(), rejection.reason().to_string()))
                }
                (Plan::Held, _) => failed.push((claim.id().to_string(), "held".into())),
            }
        }
        (ok, failed)
    }
}
