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
//! `pipeline.rs`; this file claims before it and marks after it. Beside it:
//! `assemble.rs` (building a source's relay: its plugins and sinks),
//! `workers.rs` (the run loop: workers claiming batches), `lanes.rs` (which
//! lanes have a batch in flight), `settle.rs` (recording what a batch left:
//! retries, deferrals, failures), `dead_letter.rs` (telling a route's
//! dead-letter topic about an event that failed for good), `sleep.rs` (an idle source stops polling
//! until its next insert), `background.rs` (leases, plugin reload,
//! retention, backlog gauge, LISTEN).
//!
//! One concern, one file: one batch, claim to mark, read top to bottom; the
//! steps it calls are in the files named above.

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

mod assemble;
mod background;
pub mod dead_letter;
mod lanes;
mod settle;
mod sleep;
mod workers;
pub use assemble::*;
pub use lanes::*;
pub(crate) use workers::*;

/// How long the events of a route whose plugin is not loaded wait before
/// they are looked at again (the plugin's file is checked every second).
const PLUGIN_WAIT: Duration = Duration::from_secs(2);

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
    /// The source sleeps: idle, its workers wait for the insert trigger's
    /// notification instead of polling, and the background tasks slow down
    /// (`relay/sleep.rs`, `store/postgres/wake.rs`).
    pub asleep: watch::Sender<bool>,
    /// `outroute_wake` may say this source is asleep (recorded on the way
    /// to sleep): the next events claimed record it awake.
    pub recorded_asleep: std::sync::atomic::AtomicBool,
    /// Held while writing the asleep record, so a late "awake" never
    /// overwrites a newer "asleep".
    pub recording: tokio::sync::Mutex<()>,
    /// How many events the workers claimed lately: how often an awake
    /// source polls, and whether it may sleep (`relay/sleep.rs`).
    pub pace: std::sync::Mutex<sleep::Pace>,
    /// A worker found events coming fast (a full batch, or faster than a
    /// trickle): the other workers, waiting while they came slowly, poll
    /// again.
    pub hurry: Notify,
    /// A batch recorded events failed for good: the failed-events gauge
    /// is read again now, not at its next minute.
    pub failed_changed: Notify,
    /// The LISTEN task holds its connection (`outroute_source_connections`).
    pub listening: std::sync::atomic::AtomicBool,
    /// This relay holds the source's first lane (lane 0; the capture lease
    /// under log capture): it runs the source's one-at-a-time chores (the
    /// scheduled reconciliation).
    pub leads: std::sync::atomic::AtomicBool,
    /// A [`Relay::planner`]: plans only (reconciliation), so its plugin
    /// calls count in no metric and its breaches quarantine nothing.
    pub planning_only: bool,
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

impl Relay {
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
        if lease.as_deref_mut().is_some_and(|l| !l.still_valid()) {
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
        let mut letters: Vec<dead_letter::Letter<'_>> = Vec::new();
        let mut without_messages: HashMap<String, u64> = HashMap::new();
        let now = Utc::now();
        // Metric handles once per batch, counts added up per route/sink.
        let commit_to_ack = metrics::histogram!(m::COMMIT_TO_ACK, "source" => self.source.clone());
        let mut published: BTreeMap<usize, u64> = BTreeMap::new();
        let mut messages_sent: BTreeMap<(usize, &str), u64> = BTreeMap::new();
        let (mut latency_sum_us, mut latency_n) = (0u64, 0u64);
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
                    let took = seconds_since(at, now);
                    commit_to_ack.record(took);
                    latency_sum_us += (took * 1e6) as u64;
                    latency_n += 1;
                }
            } else if let Some(f) = self.left_over(event, fates, &mut report) {
                letters.extend(self.letters_of(failures.len(), &f, event, fates));
                failures.push(f);
            }
        }
        for (route, n) in published {
            let name = self.routes.0[route].name();
            self.health.count_route(name, n);
            metrics::counter!(m::EVENTS_PUBLISHED, "route" => name.to_string(), "source" => self.source.clone())
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
        self.health
            .count_published(to_mark.len() as u64, latency_sum_us, latency_n);
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
            // 8. An event failed for good on a route with a dead-letter
            //    topic is told about there first; until that is
            //    acknowledged it is retried, not recorded failed.
            self.send_dead_letters(&letters, &mut failures, &mut report)
                .await;
            let recorded = self.store.record_failures(&failures).await?;
            if report.failed > 0 {
                self.failed_changed.notify_one();
            }
            if self.streams() && (recorded as usize) < failures.len() {
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
                        if !self.planning_only {
                            if let Some(l) = limit {
                                metrics::counter!(m::LIMIT_BREACHES, "route" => route.name().to_string(), "limit" => l.as_str())
                                    .increment(1);
                            }
                            metrics::counter!(m::REJECTIONS, "route" => route.name().to_string(), "kind" => rejection.kind())
                                .increment(1);
                        }
                        Plan::Fail {
                            route: Some(route_idx),
                            rejection,
                        }
                    }
                };
            }
            if !self.planning_only {
                self.quarantine_change(route_idx, &breaches).await;
            }
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
        if !self.planning_only {
            metrics::histogram!(m::PLUGIN_CALL, "route" => route.clone()).record(per_event);
        }
        match result {
            Ok((answers, counts, plugin)) => {
                for (name, delta) in counts.into_iter().filter(|_| !self.planning_only) {
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
            let (differences, sides) = match would {
                Answer::Outcome(would) => {
                    let (a, b) = (checked(route, was.clone()), checked(route, would));
                    let d = crate::shadow::differences(&a, &b);
                    let sides = (!d.is_empty())
                        .then(|| (crate::shadow::trimmed(&a), crate::shadow::trimmed(&b)));
                    (d, sides)
                }
                Answer::Breach { reason, .. } => {
                    let d = vec![format!("candidate broke a limit: {reason}")];
                    let b = Err(crate::event::Rejection::Invalid(format!(
                        "broke a limit: {reason}"
                    )));
                    (d, Some((crate::shadow::trimmed(was), b)))
                }
                Answer::Later { .. } => continue,
            };
            compared.push((id.clone(), differences, sides));
        }
        crate::shadow::record(
            &self.source,
            self.routes.0[route_idx].name(),
            &shadow.file,
            compared,
        );
    }

    /// Events come from a stream (a replication slot or the binlog), not
    /// claims of lanes.
    pub(crate) fn streams(&self) -> bool {
        self.capture.is_some() || self.store.binlog().is_some()
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
