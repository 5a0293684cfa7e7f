//! Reconciliation: does what the outbox says was published match what the
//! brokers hold?
//!
//! For a window of events (by creation time) the outbox's published events
//! are planned again exactly as the relay planned them — the same routes and
//! plugins answer which messages each event makes, on which sink and
//! topic — and each topic is read back over the same window: Kafka by the
//! offsets of the window's start time up to the end of each partition (or
//! to its first message sent after the check began), JetStream by start
//! time up to the stream's last message. Then, per topic:
//!
//! * **missing**: an event the outbox marked published that the topic does
//!   not hold (a lost message);
//! * **duplicated**: an event the topic holds more often than its route
//!   sends it (a re-send after a crash, a replay: at-least-once made
//!   visible; not an error);
//! * **out of order**: within one partition an aggregate's event after a
//!   later one of it (by the outbox's sequence, first copies only);
//! * **unexpected**: a message of this source (its `ce_source`) created in
//!   the window whose event the outbox does not list as published.
//!
//! What it can prove depends on the marking: rows marked by
//! `published_at`/`status`/the queue (and logical capture with
//! `cleanup = "keep"`) stay in the table; under `marking = "delete"` (or
//! `cleanup = "delete"`) the published rows are gone, so nothing can be
//! found missing — only duplicates, order breaks and messages the outbox no
//! longer knows (reported as unexpected). File sinks and core NATS keep
//! nothing to read back: their messages are counted as not checked.
//!
//! Two callers: `outroute reconcile` (`ops/reconcile.rs`: a window from the
//! command line, a table or JSON) and the scheduled check
//! (`relay.reconcile_every`, [`every`]: each window after the last, on the
//! relay that holds the source's first lane, exported as
//! `outroute_reconcile_*` gauges).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Result, anyhow};
use chrono::{DateTime, Utc};
use indicatif::ProgressBar;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::config::{NatsMode, SinkConfig};
use crate::metrics as m;
use crate::pipeline::Plan;
use crate::relay::Relay;
use crate::sink::read_back::Held;
use crate::store::{Cursor, Filter};

/// How far before the window a topic is read: producer and broker clocks
/// may disagree with the database's by this much.
pub const CLOCK_SLACK: chrono::Duration = chrono::Duration::seconds(60);

/// How far past the check's start a Kafka partition is read: a message
/// sent later cannot be one the outbox listed as published when the check
/// began (marks follow acks), unless the sending relay's clock runs ahead
/// by more than this.
const READ_PAST_START: chrono::Duration = chrono::Duration::seconds(10);

/// One event the outbox says a topic should hold.
struct WantedEvent {
    /// Messages its route sends there.
    copies: usize,
    route: String,
    seq: i64,
}

/// What the outbox says one topic should hold, per event id.
#[derive(Default)]
struct Wanted {
    events: HashMap<String, WantedEvent>,
}

/// One topic's findings.
#[derive(Debug, Default, Serialize)]
pub struct TopicReport {
    pub source: String,
    pub sink: String,
    pub topic: String,
    pub expected: usize,
    pub found: usize,
    pub missing: Vec<String>,
    pub duplicated: Vec<Duplicate>,
    pub out_of_order: Vec<OutOfOrder>,
    pub unexpected: Vec<String>,
    /// Why the topic could not be read back (nothing is proved for it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub not_checked: Option<String>,
    /// The findings per route (for the scheduled check's gauges).
    #[serde(skip)]
    pub by_route: BTreeMap<String, RouteCounts>,
}

/// A route's share of one topic's findings.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RouteCounts {
    pub expected: usize,
    pub missing: usize,
    pub duplicated: usize,
    pub out_of_order: usize,
    /// Messages on a topic that could not be read back.
    pub unchecked: usize,
}

impl RouteCounts {
    fn add(&mut self, o: &RouteCounts) {
        self.expected += o.expected;
        self.missing += o.missing;
        self.duplicated += o.duplicated;
        self.out_of_order += o.out_of_order;
        self.unchecked += o.unchecked;
    }
}

#[derive(Debug, Serialize)]
pub struct Duplicate {
    pub event_id: String,
    pub copies: usize,
}

#[derive(Debug, Serialize)]
pub struct OutOfOrder {
    pub event_id: String,
    pub aggregate: String,
    pub partition: i32,
    pub offset: i64,
    pub seq: i64,
    pub after_seq: i64,
}

/// One source's window, checked.
#[derive(Debug, Default)]
pub struct Findings {
    pub topics: Vec<TopicReport>,
    /// Events of the window the outbox lists as published.
    pub published: usize,
    /// Published events their route would not send now, with why.
    pub not_planned: Vec<(String, String)>,
}

impl Findings {
    /// Anything missing, out of order, or a topic that could not be read.
    pub fn bad(&self) -> bool {
        self.topics
            .iter()
            .any(|r| !r.missing.is_empty() || !r.out_of_order.is_empty() || r.not_checked.is_some())
    }

    /// The findings per route, summed over topics.
    pub fn by_route(&self) -> BTreeMap<String, RouteCounts> {
        let mut out: BTreeMap<String, RouteCounts> = BTreeMap::new();
        for t in &self.topics {
            for (route, c) in &t.by_route {
                out.entry(route.clone()).or_default().add(c);
            }
        }
        out
    }
}

/// Check `planner`'s source over `[since, until)`: plan its published
/// events again, read back each topic they went to, compare. `planner` is
/// a [`Relay::planner`] (it counts and quarantines nothing); `route`
/// keeps one route's messages only; `bar` counts the events planned.
pub async fn check(
    planner: &Relay,
    sinks: &BTreeMap<String, SinkConfig>,
    since: DateTime<Utc>,
    until: DateTime<Utc>,
    route: Option<&str>,
    bar: &ProgressBar,
) -> Result<Findings> {
    let started = Utc::now();
    let store = &planner.store;
    let filter = Filter {
        since: Some(since),
        until: Some(until),
        ..Filter::default()
    };
    // 1. What the outbox says went out, planned as the relay did.
    bar.set_length(store.published_count(&filter).await?.max(0) as u64);
    let mut findings = Findings::default();
    let mut wanted: BTreeMap<(String, String), Wanted> = BTreeMap::new();
    let mut published: HashSet<String> = HashSet::new();
    let mut after: Option<Cursor> = None;
    loop {
        let page = store.published(&filter, after.as_ref(), 1000).await?;
        let Some(last) = page.last() else { break };
        after = Some(Cursor::after(last));
        bar.inc(page.len() as u64);
        published.extend(page.iter().map(|c| c.id().to_string()));
        let planned = planner.plan(page).await;
        for (claim, plan) in &planned.units {
            let name = claim.route.map_or("-", |r| planner.routes.0[r].name());
            if route.is_some_and(|r| r != name) {
                continue;
            }
            let Ok(ev) = &claim.row else { continue };
            match plan {
                Plan::Publish { messages, .. } => {
                    for msg in messages {
                        let w = wanted
                            .entry((msg.sink.clone(), msg.topic.clone()))
                            .or_default();
                        w.events
                            .entry(ev.id.clone())
                            .or_insert_with(|| WantedEvent {
                                copies: 0,
                                route: name.to_string(),
                                seq: ev.sequence,
                            })
                            .copies += 1;
                    }
                }
                Plan::Done => {}
                Plan::Fail { rejection, .. } => findings.not_planned.push((
                    ev.id.clone(),
                    format!("route `{name}` now refuses it: {}", rejection.reason()),
                )),
                Plan::Held | Plan::Defer { .. } => findings
                    .not_planned
                    .push((ev.id.clone(), format!("route `{name}` cannot run now"))),
            }
        }
    }
    bar.finish_and_clear();
    findings.published = published.len();
    // 2. What each topic holds over the window, and the comparison.
    let ce_source = &planner.pipeline.source;
    let read_until = started + READ_PAST_START;
    for ((sink, topic), want) in wanted {
        let mut report = TopicReport {
            source: planner.source.clone(),
            sink: sink.clone(),
            topic: topic.clone(),
            expected: want.events.values().map(|w| w.copies).sum(),
            ..TopicReport::default()
        };
        let from = since - CLOCK_SLACK;
        let held = match sinks.get(&sink) {
            Some(SinkConfig::Kafka(k)) => {
                let (k, topic) = (k.clone(), topic.clone());
                tokio::task::spawn_blocking(move || {
                    crate::sink::read_back::kafka(&k, &topic, from, read_until)
                })
                .await
                .map_err(|e| anyhow!("reading the topic: {e}"))
                .and_then(|r| r)
            }
            Some(SinkConfig::Nats(n)) if n.mode != NatsMode::Core => {
                crate::sink::read_back::jetstream(&sink, n, &topic, from).await
            }
            Some(_) => Err(anyhow!("this kind of sink keeps nothing to read back")),
            None => Err(anyhow!("no sink `{sink}` in the configuration")),
        };
        match held {
            Ok(held) => compare(
                &mut report,
                &want,
                &held,
                &published,
                ce_source,
                since,
                until,
            ),
            Err(e) => {
                report.not_checked = Some(format!("{e:#}"));
                for w in want.events.values() {
                    report
                        .by_route
                        .entry(w.route.clone())
                        .or_default()
                        .unchecked += w.copies;
                }
            }
        }
        findings.topics.push(report);
    }
    Ok(findings)
}

/// Compare one topic's messages with what the outbox wants there.
fn compare(
    report: &mut TopicReport,
    want: &Wanted,
    held: &[Held],
    published: &HashSet<String>,
    ce_source: &str,
    since: DateTime<Utc>,
    until: DateTime<Utc>,
) {
    let mine = |h: &Held| h.source == ce_source;
    let mut copies: HashMap<&str, usize> = HashMap::new();
    for h in held.iter().filter(|h| mine(h)) {
        *copies.entry(h.event_id.as_str()).or_default() += 1;
    }
    for (id, w) in &want.events {
        let counts = report.by_route.entry(w.route.clone()).or_default();
        counts.expected += w.copies;
        match copies.get(id.as_str()) {
            None => {
                report.missing.push(id.clone());
                counts.missing += 1;
            }
            Some(c) if *c > w.copies => {
                report.duplicated.push(Duplicate {
                    event_id: id.clone(),
                    copies: *c,
                });
                counts.duplicated += 1;
            }
            Some(_) => {}
        }
        report.found += copies.get(id.as_str()).copied().unwrap_or(0).min(w.copies);
    }
    // Order: per partition in offset order, the first copy of each event,
    // an aggregate's sequence numbers must rise.
    let mut by_partition: BTreeMap<i32, Vec<&Held>> = BTreeMap::new();
    for h in held
        .iter()
        .filter(|h| mine(h) && want.events.contains_key(&h.event_id))
    {
        by_partition.entry(h.partition).or_default().push(h);
    }
    for (_, mut msgs) in by_partition {
        msgs.sort_by_key(|h| h.offset);
        let mut seen: HashSet<&str> = HashSet::new();
        let mut last: HashMap<&str, i64> = HashMap::new();
        for h in msgs {
            if !seen.insert(h.event_id.as_str()) {
                continue;
            }
            let Some(w) = want.events.get(&h.event_id) else {
                continue;
            };
            if let Some(prev) = last.get(h.aggregate.as_str())
                && *prev > w.seq
            {
                report.out_of_order.push(OutOfOrder {
                    event_id: h.event_id.clone(),
                    aggregate: h.aggregate.clone(),
                    partition: h.partition,
                    offset: h.offset,
                    seq: w.seq,
                    after_seq: *prev,
                });
                report
                    .by_route
                    .entry(w.route.clone())
                    .or_default()
                    .out_of_order += 1;
            }
            let e = last.entry(h.aggregate.as_str()).or_insert(w.seq);
            *e = (*e).max(w.seq);
        }
    }
    // Messages of this source from the window that the outbox does not
    // list as published.
    let mut unexpected: HashSet<&str> = HashSet::new();
    for h in held.iter().filter(|h| mine(h)) {
        let in_window = h.time.is_some_and(|t| t >= since && t < until);
        if in_window && !published.contains(&h.event_id) && unexpected.insert(&h.event_id) {
            report.unexpected.push(h.event_id.clone());
        }
    }
    report.missing.sort();
    report.unexpected.sort();
}

/// The scheduled check of one source (`relay.reconcile_every`), run beside
/// its relay until `stop`. Every `every` the relay that holds the source's
/// first lane (lane 0; the capture lease under log capture) checks the
/// window from where its last check ended to `reconcile_settle` ago (the
/// first one: `every` long), and exports what it found as the
/// `outroute_reconcile_*` gauges; missing and out-of-order events are
/// logged with their ids. A check that fails (a broker down) leaves the
/// window to the next one. A relay that takes the first lane over starts
/// with a fresh window: a piece of the last owner's may go unchecked or be
/// checked twice.
pub async fn every(
    relay: Arc<Relay>,
    sinks: BTreeMap<String, SinkConfig>,
    stop: CancellationToken,
) {
    let Some(every) = relay.config.reconcile_every else {
        return;
    };
    let settle = chrono::Duration::from_std(relay.config.reconcile_settle)
        .unwrap_or(chrono::Duration::seconds(60));
    let span = chrono::Duration::from_std(every).unwrap_or(chrono::Duration::seconds(300));
    let planner = relay.planner();
    let source = relay.source.clone();
    let routes: Vec<String> = relay
        .routes
        .0
        .iter()
        .map(|r| r.name().to_string())
        .collect();
    let mut next_since: Option<DateTime<Utc>> = None;
    // Sources of one process do not all check at the same moment.
    let mut pause = crate::backoff::jitter(every);
    loop {
        crate::relay::sleep_or_cancel(pause, &stop).await;
        if stop.is_cancelled() {
            return;
        }
        pause = every;
        if !relay.leads() {
            // No longer this relay's to check: its gauges stop saying
            // anything (the relay that leads now exports its own).
            if next_since.take().is_some() {
                export(&source, &routes, &Findings::default());
            }
            continue;
        }
        let until = Utc::now() - settle;
        let since = next_since.unwrap_or(until - span);
        if until <= since {
            continue;
        }
        let started = std::time::Instant::now();
        let bar = ProgressBar::hidden();
        let checked = tokio::select! {
            _ = stop.cancelled() => return,
            c = check(&planner, &sinks, since, until, None, &bar) => c,
        };
        match checked {
            Ok(f) => {
                next_since = Some(until);
                export(&source, &routes, &f);
                let result = if f.bad() { "findings" } else { "clean" };
                metrics::counter!(m::RECONCILE_RUNS, "source" => source.clone(), "result" => result)
                    .increment(1);
                metrics::gauge!(m::RECONCILE_CHECKED_UNTIL, "source" => source.clone())
                    .set(until.timestamp() as f64);
                log(&f, since, until, started.elapsed());
            }
            Err(e) => {
                metrics::counter!(m::RECONCILE_RUNS, "source" => source.clone(), "result" => "error")
                    .increment(1);
                tracing::warn!(%since, %until, "reconciliation failed, the window is checked again next time: {e:#}");
            }
        }
    }
}

/// Set the gauges of the last checked window: every route of the source,
/// zero where nothing was found.
fn export(source: &str, routes: &[String], f: &Findings) {
    let by_route = f.by_route();
    for route in routes {
        let c = by_route.get(route).copied().unwrap_or_default();
        let (s, r) = (source.to_string(), route.clone());
        metrics::gauge!(m::RECONCILE_MISSING, "source" => s.clone(), "route" => r.clone())
            .set(c.missing as f64);
        metrics::gauge!(m::RECONCILE_DUPLICATED, "source" => s.clone(), "route" => r.clone())
            .set(c.duplicated as f64);
        metrics::gauge!(m::RECONCILE_OUT_OF_ORDER, "source" => s.clone(), "route" => r.clone())
            .set(c.out_of_order as f64);
        metrics::gauge!(m::RECONCILE_UNCHECKED, "source" => s, "route" => r)
            .set(c.unchecked as f64);
    }
    let unexpected: usize = f.topics.iter().map(|t| t.unexpected.len()).sum();
    metrics::gauge!(m::RECONCILE_UNEXPECTED, "source" => source.to_string()).set(unexpected as f64);
}

/// One log line per check; the ids of what is missing or out of order (the
/// first 20 of each topic), with what to do.
fn log(f: &Findings, since: DateTime<Utc>, until: DateTime<Utc>, took: Duration) {
    for t in &f.topics {
        let at = format!("{}/{}", t.sink, t.topic);
        if !t.missing.is_empty() {
            let ids: Vec<&str> = t.missing.iter().take(20).map(String::as_str).collect();
            tracing::error!(
                topic = %at, missing = t.missing.len(), %since, %until, ids = %ids.join(","),
                "reconciliation: events marked published are not in the topic (`outroute replay --since … --until …` sends the window's events again, same ids)"
            );
        }
        if !t.out_of_order.is_empty() {
            let ids: Vec<&str> = t
                .out_of_order
                .iter()
                .take(20)
                .map(|o| o.event_id.as_str())
                .collect();
            tracing::error!(topic = %at, out_of_order = t.out_of_order.len(), %since, %until, ids = %ids.join(","), "reconciliation: events out of per-aggregate order");
        }
        if let Some(why) = &t.not_checked {
            tracing::warn!(topic = %at, %since, %until, "reconciliation could not read the topic: {why}");
        }
    }
    let (dup, unexp): (usize, usize) = f.topics.iter().fold((0, 0), |(d, u), t| {
        (d + t.duplicated.len(), u + t.unexpected.len())
    });
    tracing::info!(
        %since, %until, published = f.published, topics = f.topics.len(),
        duplicated = dup, unexpected = unexp, seconds = took.as_secs_f64(),
        "reconciled: {}",
        if f.bad() { "NOT clean" } else { "clean" }
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(partition: i32, offset: i64, id: &str, aggregate: &str, source: &str) -> Held {
        Held {
            partition,
            offset,
            event_id: id.into(),
            source: source.into(),
            aggregate: aggregate.into(),
            seq: None,
            time: Some(Utc::now()),
        }
    }

    /// Each finding lands on the route that sends the event there, and the
    /// topic's lists name exactly the events concerned.
    #[test]
    fn findings_are_counted_per_route() {
        let mut want = Wanted::default();
        for (id, route, seq) in [
            ("e1", "pay", 1),
            ("e2", "pay", 2),
            ("e3", "ship", 3),
            ("e4", "ship", 4),
        ] {
            want.events.insert(
                id.into(),
                WantedEvent {
                    copies: 1,
                    route: route.into(),
                    seq,
                },
            );
        }
        let src = "/outroute/outbox";
        // e1 lost; e2 twice; e4 before e3 of the same aggregate; a message
        // of another source with e1's id changes nothing; e9 unexpected.
        let held = vec![
            held(0, 1, "e2", "Order/1", src),
            held(0, 2, "e2", "Order/1", src),
            held(1, 1, "e4", "Order/2", src),
            held(1, 2, "e3", "Order/2", src),
            held(1, 3, "e1", "Order/1", "/outroute/other"),
            held(1, 4, "e9", "Order/3", src),
        ];
        let published: HashSet<String> = ["e1", "e2", "e3", "e4"].map(String::from).into();
        let mut r = TopicReport::default();
        let now = Utc::now();
        compare(
            &mut r,
            &want,
            &held,
            &published,
            src,
            now - chrono::Duration::hours(1),
            now + chrono::Duration::hours(1),
        );
        assert_eq!(r.missing, vec!["e1".to_string()]);
        assert_eq!(r.duplicated.len(), 1);
        assert_eq!(
            (r.duplicated[0].event_id.as_str(), r.duplicated[0].copies),
            ("e2", 2)
        );
        assert_eq!(r.out_of_order.len(), 1);
        assert_eq!(
            (
                r.out_of_order[0].event_id.as_str(),
                r.out_of_order[0].after_seq
            ),
            ("e3", 4)
        );
        assert_eq!(r.unexpected, vec!["e9".to_string()]);
        assert_eq!(
            r.found, 3,
            "found counts the copies wanted, not the extra ones"
        );
        let pay = r.by_route["pay"];
        let ship = r.by_route["ship"];
        assert_eq!(
            (pay.expected, pay.missing, pay.duplicated, pay.out_of_order),
            (2, 1, 1, 0)
        );
        assert_eq!(
            (
                ship.expected,
                ship.missing,
                ship.duplicated,
                ship.out_of_order
            ),
            (2, 0, 0, 1)
        );
        let f = Findings {
            topics: vec![r],
            ..Findings::default()
        };
        assert!(f.bad(), "a missing event makes the window bad");
        assert_eq!(f.by_route()["pay"].missing, 1);
    }
}
