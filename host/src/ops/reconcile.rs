//! `outroute reconcile`: does what the outbox says was published match what
//! the brokers hold?
//!
//! For a window of events (by creation time) the outbox's published events
//! are planned again exactly as the relay planned them — the same routes and
//! plugins answer which messages each event makes, on which sink and
//! topic — and each topic is read back over the same window: Kafka by the
//! offsets of the window's start time up to the end of each partition,
//! JetStream by start time up to the stream's last message. Then, per topic:
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
//! Exit status 1 when anything is missing or out of order, or a topic
//! could not be read (nothing could be proved there). What it can prove
//! depends on the marking: rows marked by `published_at`/`status`/the
//! queue (and logical capture with `cleanup = "keep"`) stay in the table;
//! under `marking = "delete"` (or `cleanup = "delete"`) the published rows
//! are gone, so nothing can be found missing — only duplicates, order
//! breaks and messages the outbox no longer knows (reported as unexpected).
//! File sinks and core NATS keep nothing to read back: their messages are
//! counted as not checked.

use std::collections::{BTreeMap, HashMap, HashSet};

use serde::Serialize;

use super::*;
use crate::config::SinkConfig;
use crate::pipeline::Plan;
use crate::sink::read_back::Held;

#[derive(Args)]
pub struct ReconcileArgs {
    #[command(flatten)]
    config: ConfigArg,
    /// Events created at or after this time (RFC 3339).
    #[arg(long)]
    since: DateTime<Utc>,
    /// Events created before this time (RFC 3339). Default: now.
    #[arg(long)]
    until: Option<DateTime<Utc>>,
    /// Only the messages of this route.
    #[arg(long)]
    route: Option<String>,
    /// Print the whole report as JSON.
    #[arg(long)]
    json: bool,
}

/// How far before the window a topic is read: producer and broker clocks
/// may disagree with the database's by this much.
const CLOCK_SLACK: chrono::Duration = chrono::Duration::seconds(60);

/// What the outbox says one topic should hold: per event id, how many
/// messages, its aggregate and sequence.
#[derive(Default)]
struct Wanted {
    events: HashMap<String, (usize, String, i64)>,
}

/// One topic's findings.
#[derive(Debug, Default, Serialize)]
struct TopicReport {
    source: String,
    sink: String,
    topic: String,
    expected: usize,
    found: usize,
    missing: Vec<String>,
    duplicated: Vec<Duplicate>,
    out_of_order: Vec<OutOfOrder>,
    unexpected: Vec<String>,
    /// Why the topic could not be read back (nothing is proved for it).
    #[serde(skip_serializing_if = "Option::is_none")]
    not_checked: Option<String>,
}

#[derive(Debug, Serialize)]
struct Duplicate {
    event_id: String,
    copies: usize,
}

#[derive(Debug, Serialize)]
struct OutOfOrder {
    event_id: String,
    aggregate: String,
    partition: i32,
    offset: i64,
    seq: i64,
    after_seq: i64,
}

pub async fn reconcile(a: ReconcileArgs) -> Result<ExitCode> {
    let loaded = a.config.load()?;
    init_logging(loaded.config.log.format, "warn");
    let until = a.until.unwrap_or_else(Utc::now);
    if until <= a.since {
        bail!("--until ({until}) must be after --since ({})", a.since);
    }
    if let Some(r) = &a.route
        && !loaded.config.routes.iter().any(|x| &x.name == r)
    {
        bail!("no route named `{r}` in the configuration");
    }
    let started = std::time::Instant::now();
    let mut reports: Vec<TopicReport> = Vec::new();
    let mut published_total = 0usize;
    let mut unplanned: Vec<(String, String)> = Vec::new();
    for source in sources(&loaded) {
        let store = Arc::new(open_for_command(&loaded, &source, "reconcile").await?);
        let sc = loaded.config.source(&source)?;
        let ce_source = crate::relay::ce_source(&loaded.config, &source, &sc.table().name);
        let relay = Relay::build(
            &loaded,
            &source,
            store.clone(),
            Arc::new(BTreeMap::new()),
            Health::new(&source, Duration::from_secs(3600)),
        )
        .await?;
        let filter = Filter {
            since: Some(a.since),
            until: Some(until),
            ..Filter::default()
        };
        // 1. What the outbox says went out, planned as the relay did.
        let total = store.published_count(&filter).await?;
        let bar = if a.json {
            ProgressBar::hidden()
        } else {
            ProgressBar::new(total as u64).with_style(
                ProgressStyle::with_template(
                    "{bar:40} {pos}/{len} published events planned ({per_sec})",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
            )
        };
        let mut wanted: BTreeMap<(String, String), Wanted> = BTreeMap::new();
        let mut published: HashSet<String> = HashSet::new();
        let mut after: Option<Cursor> = None;
        loop {
            let page = store.published(&filter, after.as_ref(), 1000).await?;
            let Some(last) = page.last() else { break };
            after = Some(Cursor::after(last));
            bar.inc(page.len() as u64);
            published.extend(page.iter().map(|c| c.id().to_string()));
            let planned = relay.plan(page).await;
            for (claim, plan) in &planned.units {
                let route = claim.route.map_or("-", |r| relay.routes.0[r].name());
                if a.route.as_deref().is_some_and(|r| r != route) {
                    continue;
                }
                let Ok(ev) = &claim.row else { continue };
                match plan {
                    Plan::Publish { messages, .. } => {
                        for m in messages {
                            let w = wanted.entry((m.sink.clone(), m.topic.clone())).or_default();
                            let e = w.events.entry(ev.id.clone()).or_insert((
                                0,
                                format!("{}/{}", ev.aggregate_type, ev.aggregate_id),
                                ev.sequence,
                            ));
                            e.0 += 1;
                        }
                    }
                    Plan::Done => {}
                    Plan::Fail { rejection, .. } => unplanned.push((
                        ev.id.clone(),
                        format!("route `{route}` now refuses it: {}", rejection.reason()),
                    )),
                    Plan::Held | Plan::Defer { .. } => {
                        unplanned.push((ev.id.clone(), format!("route `{route}` cannot run now")))
                    }
                }
            }
        }
        bar.finish_and_clear();
        published_total += published.len();
        // 2. What each topic holds over the window, and the comparison.
        for ((sink, topic), want) in wanted {
            let mut report = TopicReport {
                source: source.clone(),
                sink: sink.clone(),
                topic: topic.clone(),
                expected: want.events.values().map(|(n, _, _)| n).sum(),
                ..TopicReport::default()
            };
            let held = match loaded.config.sinks.get(&sink) {
                Some(SinkConfig::Kafka(k)) => {
                    let (k, topic) = (k.clone(), topic.clone());
                    let since = a.since - CLOCK_SLACK;
                    tokio::task::spawn_blocking(move || {
                        crate::sink::read_back::kafka(&k, &topic, since)
                    })
                    .await
                    .map_err(|e| anyhow!("reading the topic: {e}"))
                    .and_then(|r| r)
                }
                Some(SinkConfig::Nats(n)) if n.mode != crate::config::NatsMode::Core => {
                    crate::sink::read_back::jetstream(&sink, n, &topic, a.since - CLOCK_SLACK).await
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
                    &ce_source,
                    a.since,
                    until,
                ),
                Err(e) => report.not_checked = Some(format!("{e:#}")),
            }
            reports.push(report);
        }
    }
    let bad = reports
        .iter()
        .any(|r| !r.missing.is_empty() || !r.out_of_order.is_empty() || r.not_checked.is_some());
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "since": a.since,
                "until": until,
                "published": published_total,
                "topics": reports,
                "not_planned": unplanned.iter().map(|(id, why)| serde_json::json!({"event_id": id, "reason": why})).collect::<Vec<_>>(),
                "clean": !bad,
                "seconds": started.elapsed().as_secs_f64(),
            }))?
        );
    } else {
        print_report(&reports, published_total, &unplanned, started.elapsed());
    }
    Ok(if bad {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
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
    for (id, (n, _, _)) in &want.events {
        match copies.get(id.as_str()) {
            None => report.missing.push(id.clone()),
            Some(c) if c > n => report.duplicated.push(Duplicate {
                event_id: id.clone(),
                copies: *c,
            }),
            Some(_) => {}
        }
        report.found += copies.get(id.as_str()).copied().unwrap_or(0).min(*n);
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
            let seq = want.events.get(&h.event_id).map_or(0, |(_, _, s)| *s);
            if let Some(prev) = last.get(h.aggregate.as_str())
                && *prev > seq
            {
                report.out_of_order.push(OutOfOrder {
                    event_id: h.event_id.clone(),
                    aggregate: h.aggregate.clone(),
                    partition: h.partition,
                    offset: h.offset,
                    seq,
                    after_seq: *prev,
                });
            }
            let e = last.entry(h.aggregate.as_str()).or_insert(seq);
            *e = (*e).max(seq);
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

fn print_report(
    reports: &[TopicReport],
    published: usize,
    unplanned: &[(String, String)],
    took: Duration,
) {
    println!(
        "{:<12} {:<10} {:<32} {:>9} {:>9} {:>8} {:>10} {:>12} {:>10}",
        "source",
        "sink",
        "topic",
        "expected",
        "found",
        "missing",
        "duplicated",
        "out of order",
        "unexpected"
    );
    for r in reports {
        match &r.not_checked {
            Some(why) => println!(
                "{:<12} {:<10} {:<32} {:>9}  not checked: {why}",
                r.source, r.sink, r.topic, r.expected
            ),
            None => println!(
                "{:<12} {:<10} {:<32} {:>9} {:>9} {:>8} {:>10} {:>12} {:>10}",
                r.source,
                r.sink,
                r.topic,
                r.expected,
                r.found,
                r.missing.len(),
                r.duplicated.len(),
                r.out_of_order.len(),
                r.unexpected.len()
            ),
        }
    }
    let show = |what: &str, ids: Vec<String>| {
        for id in ids.iter().take(20) {
            println!("  {what}: {id}");
        }
        if ids.len() > 20 {
            println!("  … and {} more {what}", ids.len() - 20);
        }
    };
    for r in reports {
        let at = format!("{}/{}", r.sink, r.topic);
        show(
            "missing",
            r.missing.iter().map(|id| format!("{id} on {at}")).collect(),
        );
        show(
            "duplicated",
            r.duplicated
                .iter()
                .map(|d| format!("{} on {at} ({} copies)", d.event_id, d.copies))
                .collect(),
        );
        show(
            "out of order",
            r.out_of_order
                .iter()
                .map(|o| {
                    format!(
                        "{} ({} seq {}) after seq {} on {at} partition {} offset {}",
                        o.event_id, o.aggregate, o.seq, o.after_seq, o.partition, o.offset
                    )
                })
                .collect(),
        );
        show(
            "unexpected",
            r.unexpected
                .iter()
                .map(|id| format!("{id} on {at}"))
                .collect(),
        );
    }
    show(
        "not planned",
        unplanned
            .iter()
            .map(|(id, why)| format!("{id}: {why}"))
            .collect(),
    );
    let bad = reports
        .iter()
        .any(|r| !r.missing.is_empty() || !r.out_of_order.is_empty() || r.not_checked.is_some());
    println!(
        "{published} published event(s) in the window, {} topic(s), {:.1}s: {}",
        reports.len(),
        took.as_secs_f64(),
        if bad { "NOT clean" } else { "clean" }
    );
}
