//! `outroute-bench`: throughput, latency and memory of outroute, measured side
//! by side in one run against the real PostgreSQL, tansu (Kafka protocol)
//! and NATS JetStream, as ratios (this machine is shared and noisy):
//!
//! 1. plugin cost per event (order-router, schema-gate; single and batch);
//! 2. the database ceiling: the relay's own claim + mark SQL in a tight
//!    loop, no routing or publishing (marking through the pending queue,
//!    by UPDATE and by DELETE);
//! 3. the broker ceiling: raw produce of the same messages with acks;
//! 4. outroute draining 100,000 × 1 KB events to Kafka and to JetStream
//!    (events/s, CPU cores used, peak RSS);
//! 5. the naive baseline: seed article 000's relay, written as the article
//!    describes it and as a careful team would run it (lease 100 rows with
//!    `FOR UPDATE SKIP LOCKED` over a partial index, send them, await the
//!    acks, mark them in one statement; as many workers as the relay);
//! 6. steady-state latency at 1,000 events/s from 4 writers;
//! 7. log-based capture (`capture = "logical"`) beside lease mode on the
//!    same `wal_level = logical` cluster: drains, latency, producer commits;
//! 8. one source's database stopped mid-run: the other source's
//!    commit→ack under steady load, with and without the outage.
//!
//! It prints one table and writes every figure to a JSON file.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Parser;
use outroute::config::{KafkaSinkConfig, NatsMode, NatsSinkConfig};
use outroute::event::Event;
use outroute::plugin::{Answer, Limits, PluginHandle, Runtime};
use outroute::sink::{Outgoing, Sink, kafka::KafkaSink, nats::NatsSink};
use outroute_e2e::{
    KAFKA, NATS, Relay, TestDb, create_topic, nats_stream, plugin, seed, tag, test_dir,
    write_config,
};
use serde_json::{Value, json};
use sqlx::postgres::PgPool;

mod baseline;
mod consumer;

#[derive(Parser)]
#[command(
    about = "Benchmark outroute against the database ceiling, the broker ceiling and a naive baseline"
)]
struct Args {
    /// Events per drain run.
    #[arg(long, default_value_t = 100_000)]
    events: usize,
    /// Seconds of steady-state load for the latency run (0 skips it).
    #[arg(long, default_value_t = 60)]
    latency_secs: u64,
    /// Events per second in the latency run.
    #[arg(long, default_value_t = 1000)]
    rate: u64,
    /// Relay workers (`relay.concurrency`); the ceiling runs as many loops.
    #[arg(long, default_value_t = 2)]
    concurrency: u32,
    /// Where to write the figures.
    #[arg(long, default_value = "bench-results.json")]
    json: PathBuf,
    /// Only these sections (plugin, ceiling, produce, drain, marking, sources, tables,
    /// baseline, wakeup, latency, backlog, history, logical, outage, huge-txn).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Distinct aggregates in the pre-filled backlogs; 0: one per event (the
    /// hardest case for ordering bookkeeping, and the default).
    #[arg(long, default_value_t = 0)]
    aggregates: usize,
    /// `relay.ordering` of the drain runs: aggregate, strict or none (what
    /// strict ordering costs shows with `--aggregates`).
    #[arg(long, default_value = "aggregate")]
    ordering: String,
    /// ANALYZE pre-filled tables. Off by default: a backlog that just built
    /// up (burst, broker outage) has no planner statistics yet, and this
    /// machine's PostgreSQL runs with autovacuum off.
    #[arg(long)]
    analyse: bool,
    /// Events in the `backlog` run (drain rate across a deep backlog).
    #[arg(long, default_value_t = 1_000_000)]
    backlog: usize,
    /// Published rows kept in the table for the `history` run.
    #[arg(long, default_value_t = 10_000_000)]
    history: usize,
    /// `sslmode` of the relay's PostgreSQL URL in the drain runs (e.g.
    /// `disable`); unset: the URL's default, `prefer` — TLS whenever the
    /// server offers it, as this machine's PostgreSQL does.
    #[arg(long)]
    pg_sslmode: Option<String>,
    /// Payload bytes of each history row.
    #[arg(long, default_value_t = 200)]
    history_payload: usize,
    /// How the canonical table marks published rows in the drain, backlog,
    /// latency, history and wakeup runs: `queue` (the default: pending rows
    /// listed in `outroute_queue` by an insert trigger) or `published_at`
    /// (the stamp; examples/outbox-published-at.toml).
    #[arg(long, default_value = "queue")]
    marking: String,
    /// The Kafka sink's `linger_ms` in every run (unset: the relay's default).
    #[arg(long)]
    linger_ms: Option<u32>,
    /// Where the latency and history runs publish: `kafka` (tansu) or
    /// `nats` (JetStream). Pickup waits for a free worker, and a worker's
    /// batch waits for the broker's acknowledgement, so the broker shows in
    /// pickup too.
    #[arg(long, default_value = "kafka", value_parser = ["kafka", "nats"])]
    latency_sink: String,
    /// Extra routes in the drain and latency runs that each select every
    /// event (copies to topics of their own): what a route costs, since
    /// routes are subscriptions.
    #[arg(long, default_value_t = 0)]
    extra_routes: usize,
    /// One more route, `payments` (the `hostile` plugin), that selects
    /// every event and, in the latency run, fails the first event of one
    /// aggregate (`w0-0`: retryable, then for good after 3 attempts, so
    /// its later events wait on that route). The latency figures stay the
    /// measured route's (`orders`), that aggregate's shown apart: whether
    /// one route's failure delays another's deliveries.
    #[arg(long)]
    failing_route: bool,
    /// Rows of the one producer transaction in the `huge-txn` run.
    #[arg(long, default_value_t = 300)]
    huge_rows: usize,
    /// Payload MiB of each of those rows.
    #[arg(long, default_value_t = 20)]
    huge_row_mib: usize,
    /// Seconds the `huge-txn` run keeps the sink failing after the commit
    /// (the relay backs off, holding what it read).
    #[arg(long, default_value_t = 20)]
    huge_stall_secs: u64,
}

/// How pre-filled tables are made (see `--aggregates`, `--analyse`).
#[derive(Clone, Copy)]
struct Fill {
    aggregates: usize,
    analyse: bool,
    ordering: &'static str,
}

static FILL: std::sync::OnceLock<Fill> = std::sync::OnceLock::new();
/// `--pg-sslmode`, for the drain runs' store URL.
static SSLMODE: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
/// `--linger-ms`, for every Kafka sink the runs configure.
static LINGER_MS: std::sync::OnceLock<Option<u32>> = std::sync::OnceLock::new();
/// `--extra-routes`.
static EXTRA_ROUTES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
/// `--failing-route`.
static FAILING_ROUTE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
/// `--latency-sink`.
static LATENCY_SINK: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Which PostgreSQL and which capture the drain, latency and wake-up runs
/// use: 0 the shared cluster (lease), 1 the `wal_level = logical` cluster
/// with lease capture, 2 that cluster with `capture = "logical"` (the
/// `logical` section runs 1 and 2 back to back).
static MODE: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// `--marking published_at`.
static STAMP: AtomicBool = AtomicBool::new(false);

/// The canonical table as `--marking` maps it (log-based capture reads the
/// table as it is).
fn canonical() -> Shape {
    if STAMP.load(Ordering::Relaxed) && MODE.load(Ordering::Relaxed) != 2 {
        Shape::CanonicalStamp
    } else {
        Shape::Canonical
    }
}

async fn bench_db() -> Result<TestDb> {
    match MODE.load(Ordering::Relaxed) {
        0 => TestDb::new().await,
        _ => TestDb::new_logical().await,
    }
}

/// `[store]` keys of the current mode.
fn store_keys() -> &'static str {
    match MODE.load(Ordering::Relaxed) {
        2 => "capture = \"logical\"",
        _ => "",
    }
}

/// `write_config` with the mode's `[store]` keys.
fn write_config_with(
    dir: &Path,
    store: &str,
    url: &str,
    relay: &str,
    body: &str,
) -> Result<PathBuf> {
    outroute_e2e::write_config_with(dir, url, store, relay, body)
}

/// The store URL the relay gets in the drain runs (`--pg-sslmode`).
fn relay_url(url: &str) -> String {
    match SSLMODE.get().and_then(|m| m.as_deref()) {
        Some(mode) if url.contains('?') => format!("{url}&sslmode={mode}"),
        Some(mode) => format!("{url}?sslmode={mode}"),
        None => url.to_string(),
    }
}

const PAYLOAD_BYTES: usize = 1024;

fn payload(i: usize) -> Value {
    // ~1 KB of JSON, v1 order shape (schema-gate upcasts it).
    let pad = "x".repeat(PAYLOAD_BYTES - 120);
    json!({"order_id": format!("o-{i}"), "customer": format!("c-{}", i % 977), "total": (i % 1000) as f64 + 0.5, "note": pad})
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let ordering: &'static str = match args.ordering.as_str() {
        "aggregate" => "aggregate",
        "strict" => "strict",
        "none" => "none",
        other => anyhow::bail!("--ordering: `{other}` is not aggregate, strict or none"),
    };
    let _ = FILL.set(Fill {
        aggregates: args.aggregates,
        analyse: args.analyse,
        ordering,
    });
    let _ = SSLMODE.set(args.pg_sslmode.clone());
    let _ = LINGER_MS.set(args.linger_ms);
    let _ = LATENCY_SINK.set(args.latency_sink.clone());
    let _ = EXTRA_ROUTES.set(args.extra_routes);
    let _ = FAILING_ROUTE.set(args.failing_route);
    match args.marking.as_str() {
        "queue" => {}
        "published_at" => STAMP.store(true, Ordering::Relaxed),
        other => anyhow::bail!("--marking: `{other}` is not queue or published_at"),
    }
    let want = |s: &str| args.only.is_empty() || args.only.iter().any(|o| o == s);
    let mut results = serde_json::Map::new();
    results.insert(
        "cores".into(),
        json!(
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(0)
        ),
    );
    results.insert("events".into(), json!(args.events));
    results.insert("payload_bytes".into(), json!(PAYLOAD_BYTES));
    results.insert("marking".into(), json!(args.marking));
    results.insert("extra_routes".into(), json!(args.extra_routes));
    let mut table: Vec<(String, String)> = Vec::new();

    if want("plugin") {
        eprintln!("== plugin cost");
        // Plugins run on blocking threads, as in the relay.
        let p = tokio::task::spawn_blocking(bench_plugins).await??;
        for (k, v) in p.as_object().into_iter().flatten() {
            table.push((
                format!("plugin {k}"),
                format!("{:.2} µs/event", v.as_f64().unwrap_or(0.0)),
            ));
        }
        results.insert("plugin_us_per_event".into(), p);
    }
    if want("ceiling") {
        eprintln!("== database ceiling");
        for (style, label) in [
            ("queue", "queue"),
            ("published_at", "update"),
            ("delete", "delete"),
        ] {
            for batch in [100u32, 500, 1000] {
                let r = db_ceiling(args.events, style, batch, args.concurrency).await?;
                table.push((
                    format!("db ceiling, mark by {label}, batch {batch}"),
                    format!("{r:.0} rows/s"),
                ));
                results.insert(
                    format!("db_ceiling_{label}_batch{batch}_rows_per_s"),
                    json!(r),
                );
            }
        }
    }
    if want("produce") {
        eprintln!("== broker ceiling");
        let k = kafka_ceiling(args.events).await?;
        let n = nats_ceiling(args.events).await?;
        table.push((
            "broker ceiling, Kafka (tansu) produce+ack".into(),
            format!("{k:.0} msgs/s"),
        ));
        table.push((
            "broker ceiling, JetStream publish+ack".into(),
            format!("{n:.0} msgs/s"),
        ));
        results.insert("kafka_produce_ceiling_msgs_per_s".into(), json!(k));
        results.insert("nats_publish_ceiling_msgs_per_s".into(), json!(n));
    }
    if want("drain") {
        for sink in ["kafka", "nats"] {
            eprintln!("== outroute drain → {sink}");
            let d = drain(args.events, sink, args.concurrency).await?;
            table.push((format!("outroute drain → {sink}"), rate_line(&d)));
            table.push((
                format!("  CPU per event → {sink}: relay + PostgreSQL"),
                cpu_line(&d),
            ));
            results.insert(format!("drain_{sink}"), d);
        }
    }
    if want("sources") {
        eprintln!("== outroute drain of 3 sources in one process → kafka");
        let d = drain_sources(args.events, 3, args.concurrency).await?;
        table.push((
            "outroute drain, 3 sources (1/3 each) → kafka".into(),
            rate_line(&d),
        ));
        table.push((
            "  CPU per event, 3 sources: relay + PostgreSQL".into(),
            cpu_line(&d),
        ));
        table.push((
            "  slowest source finished after the fastest".into(),
            format!("{:.2} s", d["finish_spread_s"].as_f64().unwrap_or(0.0)),
        ));
        results.insert("drain_3_sources_kafka".into(), d);
    }
    if want("marking") {
        // The same drain with the row stamped
        // (examples/outbox-published-at.toml), listed in the pending queue
        // (the default) or deleted once published
        // (examples/outbox-delete.toml): what marking costs PostgreSQL.
        for shape in [
            Shape::CanonicalStamp,
            Shape::Canonical,
            Shape::CanonicalDelete,
        ] {
            eprintln!("== outroute drain of {} → kafka", shape.name());
            let d = drain_table(args.events, "kafka", args.concurrency, shape).await?;
            let f = |k: &str| d[k].as_f64().unwrap_or(0.0);
            table.push((
                format!("outroute drain of {} → kafka", shape.name()),
                format!(
                    "{:.0} events/s; relay + PostgreSQL {}",
                    f("events_per_s"),
                    cpu_line(&d)
                ),
            ));
            let key = match shape {
                Shape::CanonicalDelete => "drain_kafka_marking_delete",
                Shape::CanonicalStamp => "drain_kafka_marking_update",
                _ => "drain_kafka_marking_queue",
            };
            results.insert(key.into(), d);
        }
    }
    if want("tables") {
        for shape in [Shape::TOutbox, Shape::OutboxEvents] {
            eprintln!("== outroute drain of {} → kafka", shape.name());
            let d = drain_table(args.events, "kafka", args.concurrency, shape).await?;
            let rate = d["events_per_s"].as_f64().unwrap_or(0.0);
            let canonical = results
                .get("drain_kafka")
                .and_then(|c| c["events_per_s"].as_f64());
            table.push((
                format!(
                    "outroute drain of {} (migrate --table) → kafka",
                    shape.name()
                ),
                match canonical {
                    Some(c) => format!(
                        "{rate:.0} events/s ({:.0} % of the canonical table)",
                        rate / c * 100.0
                    ),
                    None => format!("{rate:.0} events/s"),
                },
            ));
            results.insert(format!("drain_{}_kafka", shape.name()), d);
        }
    }
    if want("baseline") {
        eprintln!("== naive baseline (seed article 000's relay, indexed and batched)");
        let b = baseline::run(args.events, args.concurrency).await?;
        table.push((
            format!(
                "naive poller → Kafka ({} workers: lease 100 by SKIP LOCKED, send them, await the acks, mark them)",
                args.concurrency
            ),
            format!(
                "{:.0} events/s at the consumer, {:.0} events/s confirmed",
                b["events_per_s"].as_f64().unwrap_or(0.0),
                b["events_per_s_confirmed"].as_f64().unwrap_or(0.0)
            ),
        ));
        results.insert(
            "baseline_kafka_events_per_s".into(),
            b["events_per_s"].clone(),
        );
        results.insert("baseline_kafka".into(), b);
    }
    if want("wakeup") {
        eprintln!("== wake-up cost to producers");
        let w = wakeup_cost().await?;
        for (k, v) in w.as_object().into_iter().flatten() {
            table.push((
                format!("producer commits/s, 8 writers, {k}"),
                format!("{:.0}", v.as_f64().unwrap_or(0.0)),
            ));
        }
        results.insert("producer_commits_per_s".into(), w);
    }
    if want("latency") && args.latency_secs > 0 {
        eprintln!("== steady-state latency");
        let l = latency(args.latency_secs, args.rate, 0, 0, args.concurrency).await?;
        table.push((
            format!(
                "latency @{}/s → {} commit→consumer",
                args.rate, args.latency_sink
            ),
            format!(
                "p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
                l["commit_to_consumer_ms"]["p50"].as_f64().unwrap_or(0.0),
                l["commit_to_consumer_ms"]["p99"].as_f64().unwrap_or(0.0),
                l["commit_to_consumer_ms"]["max"].as_f64().unwrap_or(0.0)
            ),
        ));
        table.push((
            format!(
                "latency @{}/s commit→broker ack (relay histogram)",
                args.rate
            ),
            format!(
                "p50 ≤ {} ms, p99 ≤ {} ms; relay {:.2} cores",
                l["commit_to_ack_ms_bucket"]["p50"],
                l["commit_to_ack_ms_bucket"]["p99"],
                l["relay_cores"].as_f64().unwrap_or(0.0)
            ),
        ));
        if args.failing_route {
            let x = &l["failing_aggregate"];
            table.push((
                "  its aggregate w0-0 (failed on route payments)".into(),
                format!(
                    "{} of {} received; p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms; payments failed {}",
                    x["received"],
                    x["committed"],
                    x["commit_to_consumer_ms"]["p50"].as_f64().unwrap_or(0.0),
                    x["commit_to_consumer_ms"]["p99"].as_f64().unwrap_or(0.0),
                    x["commit_to_consumer_ms"]["max"].as_f64().unwrap_or(0.0),
                    x["failed_on_failing_route"]
                ),
            ));
        }
        push_claim_figures(&mut table, "", &l);
        results.insert("latency".into(), l);
    }
    if want("outage") && args.latency_secs > 0 {
        eprintln!("== one source's database stopped mid-run");
        let o = source_outage(args.latency_secs, args.rate).await?;
        table.push((
            format!(
                "source b's database stopped: source a @{}/s commit→ack (relay histogram)",
                args.rate
            ),
            format!(
                "p50 ≤ {} ms, p99 ≤ {} ms (b up: p50 ≤ {} ms, p99 ≤ {} ms); {} + {} events, all published",
                o["down"]["p50"],
                o["down"]["p99"],
                o["up"]["p50"],
                o["up"]["p99"],
                o["up"]["events"],
                o["down"]["events"]
            ),
        ));
        results.insert("source_outage".into(), o);
    }
    if want("history") && args.latency_secs > 0 {
        eprintln!("== steady state over {} published rows", args.history);
        let l = latency(
            args.latency_secs,
            args.rate,
            args.history,
            args.history_payload,
            args.concurrency,
        )
        .await?;
        let label = format!(
            ", {}M published rows of {} B kept",
            args.history / 1_000_000,
            args.history_payload
        );
        push_claim_figures(&mut table, &label, &l);
        results.insert("history".into(), l);
    }
    if want("logical") {
        // Log-based capture beside lease mode on the same `wal_level =
        // logical` cluster, same hour: drain, steady latency, producers.
        for (mode, label) in [(1u8, "lease"), (2u8, "logical")] {
            MODE.store(mode, Ordering::Relaxed);
            let mut out = serde_json::Map::new();
            for sink in ["kafka", "nats"] {
                eprintln!("== {label} capture: drain → {sink}");
                let d = drain(args.events, sink, args.concurrency).await?;
                table.push((
                    format!("{label} capture (5434): drain → {sink}"),
                    rate_line(&d),
                ));
                table.push((
                    format!("  CPU per event, {label} → {sink}: relay + PostgreSQL"),
                    cpu_line(&d),
                ));
                out.insert(format!("drain_{sink}"), d);
            }
            if args.latency_secs > 0 {
                eprintln!("== {label} capture: steady {}/s", args.rate);
                let l = latency(args.latency_secs, args.rate, 0, 0, args.concurrency).await?;
                let ms = |k: &str, q: &str| l[k][q].as_f64().unwrap_or(0.0);
                table.push((
                    format!("{label} capture @{}/s commit→consumer", args.rate),
                    format!(
                        "p50 {:.1} ms, p99 {:.1} ms; pickup p50 ≤ {} ms, p99 ≤ {} ms; commit→ack p50 ≤ {} ms, p99 ≤ {} ms; relay {:.2} cores, RSS {:.0} MiB",
                        ms("commit_to_consumer_ms", "p50"),
                        ms("commit_to_consumer_ms", "p99"),
                        l["pickup_ms_bucket"]["p50"],
                        l["pickup_ms_bucket"]["p99"],
                        l["commit_to_ack_ms_bucket"]["p50"],
                        l["commit_to_ack_ms_bucket"]["p99"],
                        l["relay_cores"].as_f64().unwrap_or(0.0),
                        l["peak_rss_mib"].as_f64().unwrap_or(0.0),
                    ),
                ));
                out.insert("latency".into(), l);
            }
            eprintln!("== {label} capture: producer commits/s");
            let w = wakeup_cost().await?;
            for k in ["no relay", "relay polling"] {
                table.push((
                    format!("{label} capture: producer commits/s, 8 writers, {k}"),
                    format!("{:.0}", w[k].as_f64().unwrap_or(0.0)),
                ));
            }
            out.insert("producer_commits_per_s".into(), w);
            results.insert(format!("capture_{label}"), Value::Object(out));
        }
        MODE.store(0, Ordering::Relaxed);
    }
    if want("huge-txn") {
        eprintln!(
            "== log capture of one transaction of {} × {} MiB",
            args.huge_rows, args.huge_row_mib
        );
        let h = huge_txn(args.huge_rows, args.huge_row_mib, args.huge_stall_secs).await?;
        let f = |k: &str| h[k].as_f64().unwrap_or(0.0);
        table.push((
            format!(
                "log capture, one txn of {} × {} MiB: relay peak RSS, sink failing {} s",
                args.huge_rows, args.huge_row_mib, args.huge_stall_secs
            ),
            format!("{:.0} MiB", f("stalled_peak_rss_mib")),
        ));
        table.push((
            "  then drained to a file: peak RSS, time".to_string(),
            format!(
                "{:.0} MiB, {:.1} s ({:.0} MiB/s)",
                f("drain_peak_rss_mib"),
                f("drain_seconds"),
                f("drain_mib_per_s")
            ),
        ));
        results.insert("huge_txn".into(), h);
    }
    if want("backlog") {
        eprintln!("== drain of a {}-event backlog → kafka", args.backlog);
        let b = drain_backlog(args.backlog, args.concurrency).await?;
        let f = |k: &str| b[k].as_f64().unwrap_or(0.0);
        table.push((
            format!("backlog {}: first publish after start", args.backlog),
            format!("{:.0} ms", f("first_publish_ms")),
        ));
        table.push((
            format!("backlog {}: first 100k / last 100k", args.backlog),
            format!(
                "{:.0} / {:.0} events/s (overall {:.0})",
                f("first_100k_per_s"),
                f("last_100k_per_s"),
                f("events_per_s")
            ),
        ));
        results.insert("backlog".into(), b);
    }

    // Ratios.
    let snapshot = results.clone();
    let get = |k: &str| snapshot.get(k).and_then(Value::as_f64);
    // The relay's batch size below, the drains' marking.
    let ceiling = get(match canonical() {
        Shape::CanonicalStamp => "db_ceiling_update_batch1000_rows_per_s",
        _ => "db_ceiling_queue_batch1000_rows_per_s",
    });
    for sink in ["kafka", "nats"] {
        let d = snapshot
            .get(&format!("drain_{sink}"))
            .and_then(|d| d["events_per_s"].as_f64());
        let broker = get(if sink == "kafka" {
            "kafka_produce_ceiling_msgs_per_s"
        } else {
            "nats_publish_ceiling_msgs_per_s"
        });
        if let (Some(d), Some(c), Some(b)) = (d, ceiling, broker) {
            let bound = c.min(b);
            table.push((
                format!("ratio drain→{sink} / min(db, broker ceiling)"),
                format!("{:.2}", d / bound),
            ));
            results.insert(format!("ratio_{sink}_to_ceiling"), json!(d / bound));
        }
    }
    if let (Some(d), Some(b)) = (
        snapshot
            .get("drain_kafka")
            .and_then(|d| d["events_per_s"].as_f64()),
        get("baseline_kafka_events_per_s"),
    ) {
        table.push((
            "ratio outroute / naive baseline (Kafka)".into(),
            format!("{:.1}×", d / b),
        ));
        results.insert("ratio_kafka_to_baseline".into(), json!(d / b));
    }

    println!(
        "\noutroute benchmark ({} cores, {} × {} B events)",
        results["cores"], args.events, PAYLOAD_BYTES
    );
    let w = table
        .iter()
        .map(|(k, _)| k.chars().count())
        .max()
        .unwrap_or(10);
    for (k, v) in &table {
        println!("  {k:<w$}  {v}");
    }
    std::fs::write(
        &args.json,
        serde_json::to_string_pretty(&Value::Object(results))?,
    )?;
    println!("figures written to {}", args.json.display());
    Ok(())
}

fn event(i: usize, version: u32) -> Event {
    Event {
        id: uuid::Uuid::new_v4().to_string(),
        sequence: i as i64,
        aggregate_type: "order".into(),
        aggregate_id: format!("o-{}", i % 500),
        event_type: "order-created".into(),
        event_version: version,
        payload: payload(i).to_string().into_bytes(),
        headers: vec![(
            "traceparent".into(),
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
        )],
        created_at: chrono::Utc::now(),
        attempts: 0,
    }
}

/// Per-event cost on a warm instance, single calls and batches of 100.
fn bench_plugins() -> Result<Value> {
    let rt = Runtime::new(Some(std::env::temp_dir().join("outroute-bench-cache")))?;
    let limits = Limits {
        cpu_budget: Duration::from_millis(100),
        ..Limits::default()
    };
    let mut out = serde_json::Map::new();
    let cases = [
        (
            "order-router",
            json!({"sink": "kafka", "topic": "orders.{event_type}"}),
            1u32,
            20_000usize,
        ),
        (
            "schema-gate",
            json!({"sink": "kafka", "topic": "orders.v2"}),
            1,
            20_000,
        ),
        (
            "python-router",
            json!({"sink": "kafka", "prefix": "orders"}),
            1,
            2_000,
        ),
        (
            "js-router",
            json!({"sink": "kafka", "prefix": "orders"}),
            1,
            2_000,
        ),
    ];
    for (name, config, version, n) in cases {
        let path = plugin(name);
        let handle = PluginHandle::load(&rt, &path, config, limits)?;
        let p = handle.current().context("plugin")?;
        let events: Vec<Event> = (0..100).map(|i| event(i, version)).collect();
        for e in &events {
            let r = p.route_batch(std::slice::from_ref(e));
            anyhow::ensure!(
                matches!(r[0], Answer::Outcome(Ok(_))),
                "{name} rejected the bench event: {:?}",
                r[0]
            );
        }
        let t = Instant::now();
        for i in 0..n {
            let _ = p.route_batch(std::slice::from_ref(&events[i % 100]));
        }
        out.insert(
            format!("{name} single"),
            json!(t.elapsed().as_secs_f64() * 1e6 / n as f64),
        );
        let t = Instant::now();
        for _ in 0..n / 100 {
            let _ = p.route_batch(&events);
        }
        out.insert(
            format!("{name} batch100"),
            json!(t.elapsed().as_secs_f64() * 1e6 / n as f64),
        );
    }
    Ok(Value::Object(out))
}

/// Insert `n` 1 KB events quickly (multi-row INSERTs from 4 connections),
/// one aggregate per event unless `--aggregates` says otherwise.
async fn fill(pool: &PgPool, n: usize) -> Result<()> {
    let how = FILL.get().copied().unwrap_or(Fill {
        aggregates: 0,
        analyse: false,
        ordering: "aggregate",
    });
    let per = n.div_ceil(4);
    let mut tasks = Vec::new();
    for w in 0..4 {
        let pool = pool.clone();
        tasks.push(tokio::spawn(async move {
            let lo = w * per;
            let hi = ((w + 1) * per).min(n);
            let mut i = lo;
            while i < hi {
                let end = (i + 500).min(hi);
                let mut qb = sqlx::QueryBuilder::new(
                    "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) ",
                );
                qb.push_values(i..end, |mut b, k| {
                    b.push_bind(uuid::Uuid::new_v4())
                        .push_bind("order")
                        .push_bind(match how.aggregates {
                            0 => format!("o-{k}"),
                            a => format!("o-{}", k % a),
                        })
                        .push_bind("order-created")
                        .push_bind(payload(k));
                });
                qb.build().execute(&pool).await?;
                i = end;
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    if how.analyse {
        sqlx::query("VACUUM ANALYZE outbox").execute(pool).await?;
    }
    Ok(())
}

fn file_sink_body(dir: &Path) -> String {
    format!(
        "[http]\nlisten = \"\"\n[sinks.file]\nkind = \"file\"\npath = \"{}\"\n[plugins.p]\npath = \"{}\"\n[[routes]]\nname = \"r\"\nplugin = \"p\"\nallow = {{ file = [\"**\"] }}\n",
        dir.join("out.jsonl").display(),
        plugin("order-router").display()
    )
}

/// The relay's own claim + mark SQL in a tight loop: the most the database
/// allows for this table, with no routing or publishing.
async fn db_ceiling(n: usize, marking: &str, batch: u32, workers: u32) -> Result<f64> {
    let db = TestDb::new().await?;
    let dir = test_dir("ceiling");
    let table = match marking {
        "delete" => Shape::CanonicalDelete,
        "published_at" => Shape::CanonicalStamp,
        _ => Shape::Canonical,
    }
    .mapping();
    let config = write_config(
        &dir,
        &db.url,
        &format!("batch_size = {batch}"),
        &format!("{table}{}", file_sink_body(&dir)),
    )?;
    db.migrate(&config)?;
    fill(&db.pool, n).await?;
    // A mapped table: its lane index (`migrate` set up the default's queue).
    let c = config.to_string_lossy().to_string();
    let (code, out, err) = outroute_e2e::cli(&["migrate", "--table", "-c", &c])?;
    anyhow::ensure!(code == 0, "migrate --table: {out}{err}");
    let loaded = outroute::config::load(&config).map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut store = outroute::store::Store::connect(
        &loaded.config,
        outroute::config::DEFAULT_SOURCE,
        "ceiling",
    )
    .await?;
    store.check_table().await?;
    let lanes = store.lease_round().await?.lanes;
    let store = Arc::new(store);
    // As many loops over disjoint lanes as the relay has workers.
    let workers = workers as i32;
    let t = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..workers {
        let store = store.clone();
        let mine: Vec<i32> = lanes.iter().copied().filter(|l| l % workers == w).collect();
        tasks.push(tokio::spawn(async move {
            let mut done = 0usize;
            loop {
                let claims = store.claim(&mine, batch).await?;
                if claims.is_empty() {
                    break;
                }
                let refs: Vec<&outroute::store::Claim> = claims.iter().collect();
                done += store.mark_published(&refs).await? as usize;
            }
            anyhow::Ok(done)
        }));
    }
    let mut done = 0;
    for task in tasks {
        done += task.await??;
    }
    let rate = done as f64 / t.elapsed().as_secs_f64();
    anyhow::ensure!(done == n, "ceiling drained {done} of {n}");
    db.drop_db().await;
    Ok(rate)
}

fn headers(i: usize) -> Vec<outroute::sink::Header<'static>> {
    vec![
        ("ce_id", format!("bench-{i}").into()),
        ("ce_type", "order-created".into()),
        ("ce_source", "/outroute/outbox".into()),
        ("ce_specversion", "1.0".into()),
    ]
}

/// Raw produce with acks through the relay's own Kafka sink, no database.
async fn kafka_ceiling(n: usize) -> Result<f64> {
    let topic = format!("bench{}.raw", tag());
    create_topic(&topic, 3).await?;
    let cfg = KafkaSinkConfig {
        brokers: KAFKA.into(),
        max_message_bytes: 1 << 20,
        compression: "none".into(),
        linger_ms: 5,
        max_in_flight: 10_000,
        options: Default::default(),
        tls: None,
        sasl: None,
    };
    let sink = Arc::new(KafkaSink::build("kafka", &cfg, Duration::from_secs(30))?);
    let body = payload(0).to_string().into_bytes();
    // Warm up: metadata and producer id before the clock starts.
    let h = headers(0);
    let warm = Outgoing {
        topic: &topic,
        key: None,
        partition: None,
        headers: &h,
        payload: &body,
        dedup_id: "warm",
    };
    sink.send(warm, None).await?.wait().await?;
    let t = Instant::now();
    let mut acks = Vec::with_capacity(n);
    for i in 0..n {
        let h = headers(i);
        let key = format!("o-{}", i % 500);
        let id = format!("bench-{i}");
        let out = Outgoing {
            topic: &topic,
            key: Some(key.as_bytes()),
            partition: None,
            headers: &h,
            payload: &body,
            dedup_id: &id,
        };
        acks.push(sink.send(out, None).await?);
        if acks.len() >= 5_000 {
            for a in acks.drain(..) {
                a.wait().await?;
            }
        }
    }
    for a in acks {
        a.wait().await?;
    }
    Ok(n as f64 / t.elapsed().as_secs_f64())
}

async fn nats_ceiling(n: usize) -> Result<f64> {
    let t0 = tag();
    nats_stream(&format!("BENCH{t0}"), vec![format!("bench{t0}.>")]).await?;
    let cfg = NatsSinkConfig {
        url: NATS.into(),
        mode: NatsMode::Jetstream,
        max_message_bytes: 1 << 20,
        max_in_flight: 10_000,
        create_stream: None,
        tls: None,
        auth: None,
    };
    let sink = NatsSink::build("nats", &cfg, &[], Duration::from_secs(30)).await?;
    let subject = format!("bench{t0}.raw");
    let body = payload(0).to_string().into_bytes();
    let h = headers(0);
    let warm = Outgoing {
        topic: &subject,
        key: None,
        partition: None,
        headers: &h,
        payload: &body,
        dedup_id: "warm",
    };
    sink.send(warm, None).await?.wait().await?;
    let t = Instant::now();
    let mut acks = Vec::new();
    for i in 0..n {
        let h = headers(i);
        let id = format!("bench-{i}");
        let out = Outgoing {
            topic: &subject,
            key: None,
            partition: None,
            headers: &h,
            payload: &body,
            dedup_id: &id,
        };
        acks.push(sink.send(out, None).await?);
        if acks.len() >= 5_000 {
            futures::future::try_join_all(acks.drain(..).map(|a| a.wait())).await?;
        }
    }
    futures::future::try_join_all(acks.into_iter().map(|a| a.wait())).await?;
    let rate = n as f64 / t.elapsed().as_secs_f64();
    outroute_e2e::drop_nats_stream(&format!("BENCH{t0}")).await;
    Ok(rate)
}

/// CPU seconds (user + system) and peak RSS of a process.
fn proc_stats(pid: u32) -> (f64, f64) {
    let ticks = 100.0; // CLK_TCK on Linux
    let cpu = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            let after = s.rsplit_once(')')?.1.split_whitespace().collect::<Vec<_>>();
            let ut: f64 = after.get(11)?.parse().ok()?;
            let st: f64 = after.get(12)?.parse().ok()?;
            Some((ut + st) / ticks)
        })
        .unwrap_or(0.0);
    let hwm = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .unwrap_or(0.0)
        / 1024.0;
    (cpu, hwm)
}

fn relay_body(sink: &str, t: &str, http: &str) -> String {
    let sink_cfg = match sink {
        "kafka" => format!(
            "[sinks.kafka]\nkind = \"kafka\"\nbrokers = \"{KAFKA}\"\n{}",
            match LINGER_MS.get().copied().flatten() {
                Some(ms) => format!("linger_ms = {ms}\n"),
                None => String::new(),
            }
        ),
        _ => format!("[sinks.nats]\nkind = \"nats\"\nurl = \"{NATS}\"\n"),
    };
    let mut copies = String::new();
    for i in 1..=EXTRA_ROUTES.get().copied().unwrap_or(0) {
        copies.push_str(&format!(
            "[[routes]]\nname = \"copy{i}\"\nplugin = \"order-router\"\nconfig = {{ sink = \"{sink}\", topic = \"b{t}.c{i}.{{event_type}}\" }}\nallow = {{ {sink} = [\"b{t}.c{i}.*\"] }}\n"
        ));
    }
    if FAILING_ROUTE.get().copied().unwrap_or(false) {
        copies.push_str(&format!(
            "[plugins.hostile]\npath = \"{}\"\n[[routes]]\nname = \"payments\"\nplugin = \"hostile\"\n\
             config = {{ sink = \"{sink}\", topic = \"b{t}.pay.{{event_type}}\" }}\nallow = {{ {sink} = [\"b{t}.pay.*\"] }}\n\
             max_attempts = 3\nbackoff_min = \"1s\"\nbackoff_max = \"2s\"\n",
            plugin("hostile").display()
        ));
    }
    format!(
        "[http]\nlisten = \"{http}\"\n{sink_cfg}[plugins.order-router]\npath = \"{}\"\n[[routes]]\nname = \"orders\"\nplugin = \"order-router\"\nconfig = {{ sink = \"{sink}\", topic = \"b{t}.{{event_type}}\" }}\nallow = {{ {sink} = [\"b{t}.*\"] }}\n{copies}",
        plugin("order-router").display()
    )
}

/// Create the Kafka topic of the bench's route and of each extra route.
async fn create_topics(t: &str) -> Result<()> {
    create_topic(&format!("b{t}.order-created"), 3).await?;
    for i in 1..=EXTRA_ROUTES.get().copied().unwrap_or(0) {
        create_topic(&format!("b{t}.c{i}.order-created"), 3).await?;
    }
    if FAILING_ROUTE.get().copied().unwrap_or(false) {
        create_topic(&format!("b{t}.pay.order-created"), 3).await?;
    }
    Ok(())
}

/// CPU seconds used so far by every process whose command line matches.
fn group_cpu(pattern: &str) -> f64 {
    std::process::Command::new("pgrep")
        .args(["-f", pattern])
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter_map(|l| l.trim().parse::<u32>().ok())
                .map(|pid| proc_stats(pid).0)
                .sum()
        })
        .unwrap_or(0.0)
}

const GROUPS: [(&str, &str); 2] = [("tansu", "tansu broker"), ("nats-server", "nats-server")];

/// Fields of `/proc/<pid>/stat` after the command name.
fn stat_fields(pid: u32) -> Option<Vec<String>> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    Some(
        s.rsplit_once(')')?
            .1
            .split_whitespace()
            .map(str::to_string)
            .collect(),
    )
}

/// CPU seconds PostgreSQL has used so far: the postmaster, every live
/// child (backends, parallel workers, background processes), and every
/// child that already exited (the postmaster's cumulative children time,
/// which is where short-lived parallel query workers end up).
async fn pg_cpu(pool: &PgPool) -> f64 {
    let ticks = 100.0;
    let Ok(backend) = sqlx::query_scalar::<_, i32>("SELECT pg_backend_pid()")
        .fetch_one(pool)
        .await
    else {
        return 0.0;
    };
    let Some(postmaster) =
        stat_fields(backend as u32).and_then(|f| f.get(1).and_then(|p| p.parse::<u32>().ok()))
    else {
        return 0.0;
    };
    let num = |f: &[String], i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    let own = stat_fields(postmaster)
        .map(|f| num(&f, 11) + num(&f, 12) + num(&f, 13) + num(&f, 14))
        .unwrap_or(0.0);
    let children: f64 = std::fs::read_dir("/proc")
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
                .filter_map(stat_fields)
                .filter(|f| f.get(1).and_then(|p| p.parse::<u32>().ok()) == Some(postmaster))
                .map(|f| num(&f, 11) + num(&f, 12))
                .sum()
        })
        .unwrap_or(0.0);
    (own + children) / ticks
}

/// outroute draining `n` pre-inserted events through order-router.
/// The outbox table a drain reads: the canonical one, or one of the seed
/// articles' existing shapes (given its lane index by `migrate --table`).
#[derive(Clone, Copy, PartialEq)]
enum Shape {
    /// The canonical table, pending rows listed in `outroute_queue` (the default).
    Canonical,
    /// The canonical table, rows deleted once published (`marking = delete`).
    CanonicalDelete,
    /// The canonical table, rows stamped by `published_at`.
    CanonicalStamp,
    TOutbox,
    OutboxEvents,
}

impl Shape {
    fn name(self) -> &'static str {
        match self {
            Shape::Canonical => "outbox, marking queue",
            Shape::CanonicalDelete => "outbox, marking delete",
            Shape::CanonicalStamp => "outbox, marking published_at",
            Shape::TOutbox => "t_outbox",
            Shape::OutboxEvents => "outbox_events",
        }
    }

    fn mapping(self) -> String {
        // The canonical table's columns, mapped explicitly to pick a marking.
        let canonical = |marking: &str| {
            format!(
                "[store.table]\nname = \"outbox\"\nid = \"id\"\nsequence = \"seq\"\n\
                 aggregate_type = \"aggregate_type\"\naggregate_id = \"aggregate_id\"\n\
                 event_type = \"event_type\"\nevent_version = \"event_version\"\n\
                 payload = \"payload\"\nheaders = \"headers\"\ncreated_at = \"created_at\"\n\
                 attempts = \"attempts\"\nlast_error = \"last_error\"\nfailed_at = \"failed_at\"\n\
                 marking = {marking}\n"
            )
        };
        match self {
            Shape::Canonical => String::new(),
            Shape::CanonicalDelete => canonical("{ style = \"delete\" }"),
            Shape::CanonicalStamp => canonical("{ style = \"published_at\" }"),
            Shape::TOutbox => seed::T_OUTBOX_MAPPING.into(),
            Shape::OutboxEvents => seed::OUTBOX_EVENTS_MAPPING.into(),
        }
    }

    fn pending(self) -> &'static str {
        match self {
            Shape::Canonical => "SELECT count(*) FROM outroute_queue WHERE source = 'outbox'",
            Shape::CanonicalDelete => "SELECT count(*) FROM outbox",
            Shape::CanonicalStamp => "SELECT count(*) FROM outbox WHERE published_at IS NULL",
            Shape::TOutbox => "SELECT count(*) FROM t_outbox WHERE status = 'PENDING'",
            Shape::OutboxEvents => "SELECT count(*) FROM outbox_events WHERE published_at IS NULL",
        }
    }

    /// Create the existing table and fill it with `n` ~1 KB events, one
    /// aggregate each, in the seed articles' DDL.
    async fn create_and_fill(self, pool: &PgPool, n: usize) -> Result<()> {
        let (create, insert) = match self {
            Shape::Canonical | Shape::CanonicalDelete | Shape::CanonicalStamp => {
                return fill(pool, n).await;
            }
            Shape::TOutbox => (
                seed::T_OUTBOX_DDL,
                "INSERT INTO t_outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
                 SELECT gen_random_uuid()::text, 'order', 'o-' || g, 'order-created', \
                        json_build_object('order_id', 'o-' || g, 'total', g, 'note', repeat('x', 900))::text \
                 FROM generate_series($1::bigint, $2::bigint) g",
            ),
            Shape::OutboxEvents => (
                seed::OUTBOX_EVENTS_DDL,
                "INSERT INTO outbox_events (id, event_type, aggregate_id, payload) \
                 SELECT gen_random_uuid(), 'order-created', gen_random_uuid(), \
                        json_build_object('order_id', 'o-' || g, 'total', g, 'note', repeat('x', 900)) \
                 FROM generate_series($1::bigint, $2::bigint) g",
            ),
        };
        sqlx::query(create).execute(pool).await?;
        let mut done = 0;
        while done < n {
            let end = (done + 50_000).min(n);
            sqlx::query(insert)
                .bind(done as i64)
                .bind(end as i64 - 1)
                .execute(pool)
                .await?;
            done = end;
        }
        Ok(())
    }
}

/// Rows the database has not yet confirmed as handled: the shape's
/// pending rows in lease mode; under log capture (which deletes what it
/// handled) the rows still in the table.
fn confirmation_pending(shape: Shape) -> &'static str {
    if MODE.load(Ordering::Relaxed) == 2 {
        "SELECT count(*) FROM outbox"
    } else {
        shape.pending()
    }
}

async fn drain(n: usize, sink: &str, concurrency: u32) -> Result<Value> {
    drain_table(n, sink, concurrency, canonical()).await
}

/// After `outroute migrate`: `migrate --table` for a mapped table (its lane
/// index, or the pending queue's trigger and backfill).
fn migrate_table(shape: Shape, config: &Path) -> Result<()> {
    if shape != Shape::Canonical {
        let c = config.to_string_lossy().to_string();
        let (code, out, err) = outroute_e2e::cli(&["migrate", "--table", "-c", &c])?;
        anyhow::ensure!(code == 0, "migrate --table: {out}{err}");
    }
    Ok(())
}

async fn drain_table(n: usize, sink: &str, concurrency: u32, shape: Shape) -> Result<Value> {
    let db = bench_db().await?;
    let t = tag();
    if sink == "kafka" {
        create_topics(&t).await?;
    } else {
        nats_stream(&format!("B{t}"), vec![format!("b{t}.>")]).await?;
    }
    let dir = test_dir("drain");
    let http = outroute_e2e::free_addr();
    let config = write_config_with(
        &dir,
        store_keys(),
        &relay_url(&db.url),
        &format!(
            "batch_size = 1000\nconcurrency = {concurrency}\nlanes = 64\nordering = \"{}\"",
            FILL.get().map(|f| f.ordering).unwrap_or("aggregate")
        ),
        &format!("{}{}", shape.mapping(), relay_body(sink, &t, &http)),
    )?;
    db.migrate(&config)?;
    shape.create_and_fill(&db.pool, n).await?;
    migrate_table(shape, &config)?;
    // One clock for every mode: from the relay's start to the last event
    // at an independent consumer, and to the database's confirmation of
    // the last (its mark, or under log capture its cleanup).
    let deadline = Instant::now() + Duration::from_secs(600);
    let consumer = consumer::start(sink, &t, n, deadline);
    let group0: Vec<f64> = GROUPS.iter().map(|(_, p)| group_cpu(p)).collect();
    let pg0 = pg_cpu(&db.pool).await;
    let spawned = Instant::now();
    let mut relay = Relay::start(&config, &[("RUST_LOG", "warn")])?;
    let pid = relay.child.id();
    let mut first_publish: Option<Instant> = None;
    let confirmed = loop {
        // Watch the relay's own counter (no load on the database) until
        // it says all were sent, then the database until it confirms.
        let (_, m) = outroute_e2e::http_get(&http, "/metrics")
            .await
            .unwrap_or_default();
        let published =
            outroute_e2e::metric(&m, "outroute_events_published_total{route=\"orders\"}")
                .unwrap_or(0.0) as usize;
        if first_publish.is_none() && published > 0 {
            first_publish = Some(Instant::now());
        }
        if published >= n && db.count(confirmation_pending(shape)).await == 0 {
            break Some(Instant::now());
        }
        if Instant::now() > deadline {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // A run that misses its deadline is a failure, not a figure.
    let received = consumer.await;
    let (confirmed, received) = match (confirmed, received) {
        (Some(c), Ok(Ok(r))) => (c, r),
        (None, _) => {
            relay.terminate(Duration::from_secs(15));
            anyhow::bail!("drain: the database did not confirm all {n} events within 600 s");
        }
        (_, Ok(Err(e))) => {
            relay.terminate(Duration::from_secs(15));
            anyhow::bail!("drain: {e:#}");
        }
        (_, Err(e)) => {
            relay.terminate(Duration::from_secs(15));
            anyhow::bail!("drain: the consumer task failed: {e}");
        }
    };
    let secs = (received - spawned).as_secs_f64().max(1e-3);
    let secs_confirmed = (confirmed - spawned).as_secs_f64().max(1e-3);
    let window = secs.max(secs_confirmed);
    let (cpu, rss) = proc_stats(pid);
    let pg = pg_cpu(&db.pool).await - pg0;
    let others: serde_json::Map<String, Value> = GROUPS
        .iter()
        .zip(group0.iter().chain(std::iter::repeat(&0.0)))
        .map(|((name, p), c0)| (name.to_string(), json!((group_cpu(p) - c0) / window)))
        .collect();
    let done = n;
    let (_, metrics) = outroute_e2e::http_get(&http, "/metrics")
        .await
        .unwrap_or_default();
    relay.terminate(Duration::from_secs(15));
    db.drop_db().await;
    if sink == "nats" {
        outroute_e2e::drop_nats_stream(&format!("B{t}")).await;
    }
    Ok(json!({
        "other_cores": others,
        "batch_seconds_sum": outroute_e2e::metric(&metrics, "outroute_batch_seconds_sum"),
        "batch_count": outroute_e2e::metric(&metrics, "outroute_batch_seconds_count"),
        "events": done,
        "clock": "relay start → last event at an independent consumer (events_per_s); → the database's confirmation of the last (events_per_s_confirmed)",
        "seconds": secs,
        "events_per_s": done as f64 / secs,
        "seconds_confirmed": secs_confirmed,
        "events_per_s_confirmed": done as f64 / secs_confirmed,
        "first_publish_ms": first_publish.map(|f| (f - spawned).as_secs_f64() * 1e3),
        "cores": cpu / window,
        "postgres_cores": pg / window,
        "relay_us_per_event": cpu * 1e6 / done.max(1) as f64,
        "postgres_us_per_event": pg * 1e6 / done.max(1) as f64,
        "peak_rss_mib": rss,
        "plugin_call_seconds_sum": outroute_e2e::metric(&metrics, "outroute_plugin_call_seconds_sum{route=\"orders\"}"),
    }))
}

/// Log-based capture of one producer transaction of `rows` rows of
/// `mib` MiB payload each (the "300 × 20 MB"): first with a sink
/// that fails every write (`/dev/full`; the relay backs off and holds what
/// it read), the relay's peak RSS after `stall_secs`; then a fresh relay
/// drains it to a file: its peak RSS and the time until the table is empty.
async fn huge_txn(rows: usize, mib: usize, stall_secs: u64) -> Result<Value> {
    MODE.store(2, Ordering::Relaxed);
    let db = bench_db().await?;
    let dir = test_dir("huge-txn");
    let config = |path: &str| {
        write_config_with(
            &dir,
            store_keys(),
            &db.url,
            "concurrency = 2",
            &format!(
                "[http]\nlisten = \"\"\n[sinks.file]\nkind = \"file\"\npath = \"{path}\"\nmax_message_bytes = {}\n\
                 [plugins.p]\npath = \"{}\"\n[[routes]]\nname = \"orders\"\nplugin = \"p\"\n\
                 config = {{ sink = \"file\", topic = \"orders.{{event_type}}\" }}\n\
                 allow = {{ file = [\"orders.*\"] }}\nmemory_mib = 512\nmax_bytes_per_event = {}\n",
                (mib as u64 + 1) << 20,
                plugin("order-router").display(),
                (mib as u64 + 1) << 20,
            ),
        )
    };
    let stalled = config("/dev/full")?;
    db.migrate(&stalled)?;
    let mut relay = Relay::start(&stalled, &[("RUST_LOG", "warn")])?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let base = proc_stats(relay.child.id()).1;
    // Highly compressible: cheap for the database to store, full size on
    // the replication stream and in the relay.
    sqlx::query(&format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), 'order', 'o-' || g, 'order-created', \
                json_build_object('pad', repeat(md5(g::text), {} / 32)) \
         FROM generate_series(1, {rows}) g",
        mib << 20
    ))
    .execute(&db.pool)
    .await?;
    eprintln!("   committed; sink failing for {stall_secs} s");
    tokio::time::sleep(Duration::from_secs(stall_secs)).await;
    let stalled_rss = proc_stats(relay.child.id()).1;
    relay.terminate(Duration::from_secs(15));
    let file = dir.join("out.jsonl");
    let flowing = config(&file.display().to_string())?;
    let mut relay = Relay::start(&flowing, &[("RUST_LOG", "warn")])?;
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_secs(1800);
    while db.count("SELECT count(*) FROM outbox").await > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let secs = t0.elapsed().as_secs_f64();
    let drain_rss = proc_stats(relay.child.id()).1;
    let left = db.count("SELECT count(*) FROM outbox").await;
    relay.terminate(Duration::from_secs(15));
    let written = std::fs::metadata(&file).map(|m| m.len()).unwrap_or(0);
    let _ = std::fs::remove_file(&file);
    db.drop_db().await;
    MODE.store(0, Ordering::Relaxed);
    anyhow::ensure!(
        left == 0,
        "{left} rows were still in the table after 30 min"
    );
    Ok(json!({
        "rows": rows,
        "row_mib": mib,
        "idle_rss_mib": base,
        "stalled_peak_rss_mib": stalled_rss,
        "drain_peak_rss_mib": drain_rss,
        "drain_seconds": secs,
        "drain_mib_per_s": (rows * mib) as f64 / secs.max(1e-3),
        "file_bytes": written,
    }))
}

/// `n` events split over `k` sources (databases with the canonical table)
/// drained by one relay process to Kafka: total rate, CPU per event, and
/// how far apart the sources finished (fair scheduling keeps it small).
async fn drain_sources(n: usize, k: usize, concurrency: u32) -> Result<Value> {
    let t = tag();
    create_topics(&t).await?;
    let mut dbs = Vec::new();
    for _ in 0..k {
        dbs.push(TestDb::new().await?);
    }
    let dir = test_dir("drain-sources");
    let http = outroute_e2e::free_addr();
    let mut body = format!(
        "[relay]\ncache_dir = \"{}\"\nbatch_size = 1000\nconcurrency = {concurrency}\nlanes = 64\n",
        std::env::temp_dir().join("outroute-test-cache").display()
    );
    for (i, db) in dbs.iter().enumerate() {
        body.push_str(&format!("[sources.s{i}]\nurl = \"{}\"\n", db.url));
    }
    body.push_str(&relay_body("kafka", &t, &http));
    std::fs::create_dir_all(&dir)?;
    let config = dir.join("outroute.toml");
    std::fs::write(&config, body)?;
    dbs[0].migrate(&config)?;
    let per = n / k;
    for db in &dbs {
        fill(&db.pool, per).await?;
    }
    let total = per * k;
    // The drain's clock (see `drain_table`): relay start → last event at
    // an independent consumer, and → every database's confirmation.
    let deadline = Instant::now() + Duration::from_secs(600);
    let consumer = consumer::start("kafka", &t, total, deadline);
    let pg0 = pg_cpu(&dbs[0].pool).await;
    let spawned = Instant::now();
    let mut relay = Relay::start(&config, &[("RUST_LOG", "warn")])?;
    let pid = relay.child.id();
    let mut finished: Vec<Option<Instant>> = vec![None; k];
    let confirmed = loop {
        let (_, m) = outroute_e2e::http_get(&http, "/metrics")
            .await
            .unwrap_or_default();
        let mut published = 0usize;
        for (i, f) in finished.iter_mut().enumerate() {
            let p = outroute_e2e::metric(
                &m,
                &format!("outroute_events_published_total{{route=\"orders\",source=\"s{i}\"}}"),
            )
            .unwrap_or(0.0) as usize;
            if p >= per && f.is_none() {
                *f = Some(Instant::now());
            }
            published += p;
        }
        if published >= total {
            let mut pending = 0;
            for db in &dbs {
                pending += db.count(Shape::Canonical.pending()).await;
            }
            if pending == 0 {
                break Some(Instant::now());
            }
        }
        if Instant::now() > deadline {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let received = consumer.await;
    let (confirmed, received) = match (confirmed, received) {
        (Some(c), Ok(Ok(r))) => (c, r),
        (c, r) => {
            relay.terminate(Duration::from_secs(15));
            anyhow::bail!(
                "drain of {k} sources: not done within 600 s (confirmed: {}, consumer: {})",
                c.is_some(),
                match r {
                    Ok(Ok(_)) => "all received".to_string(),
                    Ok(Err(e)) => format!("{e:#}"),
                    Err(e) => e.to_string(),
                }
            );
        }
    };
    let secs = (received - spawned).as_secs_f64().max(1e-3);
    let secs_confirmed = (confirmed - spawned).as_secs_f64().max(1e-3);
    let window = secs.max(secs_confirmed);
    let (cpu, rss) = proc_stats(pid);
    let pg = pg_cpu(&dbs[0].pool).await - pg0;
    let done = total;
    let ends: Vec<Instant> = finished.iter().flatten().copied().collect();
    let spread = match (ends.iter().min(), ends.iter().max()) {
        (Some(a), Some(b)) => (*b - *a).as_secs_f64(),
        _ => f64::NAN,
    };
    relay.terminate(Duration::from_secs(15));
    for db in dbs {
        db.drop_db().await;
    }
    Ok(json!({
        "sources": k,
        "events": done,
        "seconds": secs,
        "events_per_s": done as f64 / secs,
        "seconds_confirmed": secs_confirmed,
        "events_per_s_confirmed": done as f64 / secs_confirmed,
        "cores": cpu / window,
        "postgres_cores": pg / window,
        "relay_us_per_event": cpu * 1e6 / done.max(1) as f64,
        "postgres_us_per_event": pg * 1e6 / done.max(1) as f64,
        "peak_rss_mib": rss,
        "finish_spread_s": spread,
    }))
}

/// Claim and pickup figures of a latency run, as table rows.
fn push_claim_figures(table: &mut Vec<(String, String)>, label: &str, l: &Value) {
    let rate = l["achieved_rate"].as_f64().unwrap_or(0.0).round();
    for (what, key) in [
        ("claim statement", "claim_ms_bucket"),
        ("batch (claimed→marked)", "batch_ms_bucket"),
        ("pickup (commit→claim)", "pickup_ms_bucket"),
    ] {
        table.push((
            format!("latency @{rate}/s {what}{label}"),
            format!(
                "p50 ≤ {} ms, p99 ≤ {} ms{}",
                l[key]["p50"],
                l[key]["p99"],
                match l[key]["share_over_2ms"].as_f64() {
                    Some(s) => format!(" ({:.2} % over 2 ms)", s * 100.0),
                    None => String::new(),
                }
            ),
        ));
    }
    table.push((
        format!("latency @{rate}/s producer transaction (BEGIN→COMMIT){label}"),
        format!(
            "p50 {:.1} ms, p99 {:.1} ms (inside lease mode's pickup: created_at is the start)",
            l["producer_tx_ms"]["p50"].as_f64().unwrap_or(0.0),
            l["producer_tx_ms"]["p99"].as_f64().unwrap_or(0.0)
        ),
    ));
}

/// A deep backlog drained to Kafka: is the last 100k as fast as the
/// first, and how soon after start does the first batch go out?
async fn drain_backlog(n: usize, concurrency: u32) -> Result<Value> {
    let db = TestDb::new().await?;
    let t = tag();
    create_topics(&t).await?;
    let dir = test_dir("backlog");
    let http = outroute_e2e::free_addr();
    let config = write_config(
        &dir,
        &db.url,
        &format!("batch_size = 1000\nconcurrency = {concurrency}\nlanes = 64"),
        &format!(
            "{}{}",
            canonical().mapping(),
            relay_body("kafka", &t, &http)
        ),
    )?;
    db.migrate(&config)?;
    migrate_table(canonical(), &config)?;
    let mut done = 0;
    while done < n {
        let step = (n - done).min(100_000);
        fill(&db.pool, step).await?;
        done += step;
        eprintln!("   backlog: {done} events");
    }
    let spawned = Instant::now();
    let mut relay = Relay::start(&config, &[("RUST_LOG", "warn")])?;
    let mut samples: Vec<(f64, f64)> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(1800);
    loop {
        let (_, m) = outroute_e2e::http_get(&http, "/metrics")
            .await
            .unwrap_or_default();
        let published =
            outroute_e2e::metric(&m, "outroute_events_published_total{route=\"orders\"}")
                .unwrap_or(0.0);
        samples.push((spawned.elapsed().as_secs_f64(), published));
        if published as usize >= n || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Then the database's confirmation of the last.
    let confirmed = loop {
        if db.count(Shape::Canonical.pending()).await == 0 {
            break Some(spawned.elapsed().as_secs_f64());
        }
        if Instant::now() > deadline {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    relay.terminate(Duration::from_secs(15));
    // Time at which the published count first reached `k`.
    let at = |k: f64| samples.iter().find(|(_, p)| *p >= k).map(|(t, _)| *t);
    let Some(confirmed) = confirmed.filter(|_| at(n as f64).is_some()) else {
        db.drop_db().await;
        anyhow::bail!("backlog: not all {n} events published and confirmed within 1800 s");
    };
    let first = at(1.0).unwrap_or(0.0);
    let end = at(n as f64).unwrap_or(0.0);
    let span = 100_000f64.min(n as f64);
    let rate = |a: f64, b: f64| match (at(a), at(b)) {
        (Some(x), Some(y)) if y > x => (b - a) / (y - x),
        _ => 0.0,
    };
    db.drop_db().await;
    Ok(json!({
        "events": n,
        "first_publish_ms": first * 1000.0,
        "first_100k_per_s": rate(1.0, span),
        "last_100k_per_s": rate(n as f64 - span, n as f64),
        "last_ack_s": end,
        "confirmed_s": confirmed,
        "clock": "relay start → the database's confirmation of the last event",
        "events_per_s": n as f64 / confirmed.max(1e-3),
    }))
}

/// "N events/s, C cores, peak RSS M MiB" of a drain's figures.
fn rate_line(d: &Value) -> String {
    let f = |k: &str| d[k].as_f64().unwrap_or(0.0);
    format!(
        "{:.0} events/s, {:.2} cores, peak RSS {:.0} MiB",
        f("events_per_s"),
        f("cores"),
        f("peak_rss_mib")
    )
}

/// "relay + PostgreSQL = total µs" CPU per event of a drain's figures.
fn cpu_line(d: &Value) -> String {
    let f = |k: &str| d[k].as_f64().unwrap_or(0.0);
    let (relay, pg) = (f("relay_us_per_event"), f("postgres_us_per_event"));
    format!("{relay:.1} + {pg:.1} = {:.1} µs", relay + pg)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// The share of histogram `name`'s observations above bucket bound `le`
/// (seconds; must be one of its bounds): "p99 ≤ 2 ms" holds when the share
/// above 0.002 is at most 1 %.
fn bucket_share_above(metrics: &str, name: &str, le: f64) -> Option<f64> {
    let count = |bound: &str| {
        metrics
            .lines()
            .filter(|l| l.starts_with(&format!("{name}_bucket")))
            .filter(|l| l.split("le=\"").nth(1).and_then(|x| x.split('"').next()) == Some(bound))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    let total = count("+Inf");
    (total > 0.0).then(|| 1.0 - count(&le.to_string()) / total)
}

/// The metrics text `after` with every histogram bucket less its count in
/// `before`: the histograms of what happened between the two reads (the
/// history run's measured window, not the history's own drain).
fn buckets_since(before: &str, after: &str) -> String {
    let earlier: HashMap<&str, f64> = before
        .lines()
        .filter(|l| l.contains("_bucket{"))
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((k, v.parse().ok()?))
        })
        .collect();
    after
        .lines()
        .map(|l| match l.rsplit_once(' ') {
            Some((k, v)) if l.contains("_bucket{") => {
                let v: f64 = v.parse().unwrap_or(0.0);
                format!("{k} {}", v - earlier.get(k).copied().unwrap_or(0.0))
            }
            _ => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Upper bound (ms) of the histogram bucket holding quantile `q`.
fn bucket_quantile(metrics: &str, name: &str, q: f64) -> Value {
    quantile_of(&buckets(metrics, name, ""), q)
}

/// Histogram `name`'s cumulative buckets `(le, count)`, summed over the
/// series whose labels contain `labels` (e.g. `source="a"`).
fn buckets(metrics: &str, name: &str, labels: &str) -> Vec<(f64, f64)> {
    let mut sums: Vec<(f64, f64)> = Vec::new();
    for (le, v) in metrics
        .lines()
        .filter(|l| l.starts_with(&format!("{name}_bucket")) && l.contains(labels))
        .filter_map(|l| {
            let le = l.split("le=\"").nth(1)?.split('"').next()?;
            let le: f64 = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            let v: f64 = l.rsplit(' ').next()?.parse().ok()?;
            Some((le, v))
        })
    {
        match sums.iter_mut().find(|(b, _)| *b == le) {
            Some(slot) => slot.1 += v,
            None => sums.push((le, v)),
        }
    }
    sums.sort_by(|a, b| a.0.total_cmp(&b.0));
    sums
}

/// Upper bound (ms) of the bucket of cumulative `buckets` holding
/// quantile `q`.
fn quantile_of(buckets: &[(f64, f64)], q: f64) -> Value {
    let total = buckets.last().map(|b| b.1).unwrap_or(0.0);
    buckets
        .iter()
        .find(|(_, c)| *c >= q * total)
        .map(|(le, _)| {
            if le.is_finite() {
                json!(le * 1000.0)
            } else {
                json!("inf")
            }
        })
        .unwrap_or(Value::Null)
}

/// `rate` events/s committed by 4 writers for `secs` seconds; commit →
/// consumer-received measured per event.
///
/// `history`: that many already-published rows (`history_payload` bytes of
/// payload each) are in the table first, as after months without retention.
async fn latency(
    secs: u64,
    rate: u64,
    history: usize,
    history_payload: usize,
    concurrency: u32,
) -> Result<Value> {
    let db = bench_db().await?;
    let t = tag();
    let topic = format!("b{t}.order-created");
    let sink = LATENCY_SINK.get().map_or("kafka", String::as_str);
    if sink == "nats" {
        nats_stream(&format!("B{t}"), vec![format!("b{t}.>")]).await?;
    } else {
        create_topics(&t).await?;
    }
    let failing = FAILING_ROUTE.get().copied().unwrap_or(false);
    let dir = test_dir("latency");
    let http = outroute_e2e::free_addr();
    let mut body = relay_body(sink, &t, &http);
    if history > 0 {
        // The measured routes read the measured events only.
        for plugin in ["order-router", "hostile"] {
            body = body.replace(
                &format!("plugin = \"{plugin}\"\n"),
                &format!("plugin = \"{plugin}\"\naggregate_types = [\"order\"]\n"),
            );
        }
        body.push_str(&format!(
            "[plugins.quiet]\npath = \"{}\"\n[[routes]]\nname = \"history\"\nplugin = \"quiet\"\n\
             aggregate_types = [\"history\"]\nconfig = {{ mode = \"nothing\" }}\nallow = {{ {sink} = [\"b{t}.history\"] }}\n",
            plugin("hostile").display()
        ));
    }
    let config = write_config_with(
        &dir,
        store_keys(),
        &db.url,
        &format!("concurrency = {concurrency}"),
        &format!("{}{body}", canonical().mapping()),
    )?;
    db.migrate(&config)?;
    migrate_table(canonical(), &config)?;
    // History the way production leaves it: rows the relay itself
    // published (through a route whose plugin sends nothing, so the broker
    // is not filled), then kept. Written before the relay starts, drained
    // before the measured run begins.
    let mut chunk = 0;
    while chunk < history {
        let end = (chunk + 500_000).min(history);
        sqlx::query(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
             SELECT gen_random_uuid(), 'history', 'h-' || g, 'order-created', jsonb_build_object('pad', repeat('x', $3)) \
             FROM generate_series($1::bigint, $2::bigint) g",
        )
        .bind(chunk as i64)
        .bind(end as i64 - 1)
        .bind(history_payload as i32)
        .execute(&db.pool)
        .await?;
        chunk = end;
        eprintln!("   history: {chunk} rows written");
    }
    let mut relay = Relay::start(&config, &[("RUST_LOG", "warn")])?;
    if history > 0 {
        let built = Instant::now();
        loop {
            let (_, m) = outroute_e2e::http_get(&http, "/metrics")
                .await
                .unwrap_or_default();
            let done =
                outroute_e2e::metric(&m, "outroute_events_published_total{route=\"history\"}")
                    .unwrap_or(0.0) as usize;
            if done >= history && db.count(canonical().pending()).await == 0 {
                break;
            }
            if built.elapsed() > Duration::from_secs(3600) {
                relay.terminate(Duration::from_secs(15));
                anyhow::bail!(
                    "history: the relay published {done} of {history} rows within an hour"
                );
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        eprintln!(
            "   history: {history} rows published by the relay in {:.0} s",
            built.elapsed().as_secs_f64()
        );
    }
    tokio::time::sleep(Duration::from_secs(1)).await;

    // Consumer thread: id → receive instant.
    let stop = Arc::new(AtomicBool::new(false));
    let (tx, rx) = std::sync::mpsc::channel::<(String, Instant)>();
    // JetStream: a core subscription on the stream's subjects gets each
    // message as the server routes it to the stream (microseconds apart
    // from the store; the stream's PubAck is what the relay waits for).
    let nats_consumer = if sink == "nats" {
        let sub = async_nats::connect(NATS)
            .await?
            .subscribe(format!("b{t}.>"))
            .await?;
        let tx = tx.clone();
        Some(tokio::spawn(async move {
            use futures::StreamExt;
            let mut sub = sub;
            while let Some(m) = sub.next().await {
                let now = Instant::now();
                if let Some(id) = m.headers.as_ref().and_then(|h| h.get("ce_id")) {
                    let _ = tx.send((id.to_string(), now));
                }
            }
        }))
    } else {
        None
    };
    let consumer = {
        let stop = stop.clone();
        let topic = topic.clone();
        let kafka = sink == "kafka";
        std::thread::spawn(move || -> Result<()> {
            if !kafka {
                return Ok(());
            }
            use rdkafka::consumer::{BaseConsumer, Consumer};
            use rdkafka::message::{Headers, Message};
            let c: BaseConsumer = rdkafka::ClientConfig::new()
                .set("bootstrap.servers", KAFKA)
                .set("group.id", format!("bench-{}", tag()))
                .set("fetch.min.bytes", "1")
                .set("fetch.wait.max.ms", "5")
                .create()?;
            let mut tpl = rdkafka::TopicPartitionList::new();
            for p in 0..3 {
                tpl.add_partition_offset(&topic, p, rdkafka::Offset::Beginning)?;
            }
            c.assign(&tpl)?;
            while !stop.load(Ordering::Relaxed) {
                if let Some(Ok(m)) = c.poll(Duration::from_millis(20)) {
                    let now = Instant::now();
                    let id = m.headers().and_then(|h| {
                        h.iter()
                            .find(|x| x.key == "ce_id")
                            .and_then(|x| x.value.map(|v| String::from_utf8_lossy(v).into_owned()))
                    });
                    if let Some(id) = id {
                        let _ = tx.send((id, now));
                    }
                }
            }
            Ok(())
        })
    };

    // One warm-up event, awaited at the consumer before the measured
    // writers start: a Kafka consumer takes 0.3–0.5 s to join its
    // partitions, and the events committed meanwhile made the p99 of
    // commit→consumer (300–460 ms against a p50 of 10–15 ms) a measure of
    // the consumer's start, not of the relay.
    let warm_up = uuid::Uuid::new_v4();
    sqlx::query("INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1, 'order', 'warm-up', 'order-created', '{}')")
        .bind(warm_up)
        .execute(&db.pool)
        .await?;
    let warm_up = warm_up.to_string();
    let waited = Instant::now();
    loop {
        match rx.try_recv() {
            Ok((id, _)) if id == warm_up => break,
            Ok(_) => {}
            Err(std::sync::mpsc::TryRecvError::Empty) => {
                anyhow::ensure!(
                    waited.elapsed() < Duration::from_secs(60),
                    "the warm-up event did not reach the consumer within 60 s"
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Err(e) => anyhow::bail!("the consumer stopped before the warm-up event: {e}"),
        }
    }

    // The relay's histograms so far (history drain, warm-up), taken off
    // the figures at the end.
    let (_, before) = outroute_e2e::http_get(&http, "/metrics")
        .await
        .unwrap_or_default();
    // 4 writers, each at rate/4 events/s, each event its own transaction.
    let per_writer = Duration::from_secs_f64(4.0 / rate as f64);
    let pid = relay.child.id();
    let (cpu0, t0) = (proc_stats(pid).0, Instant::now());
    let end = t0 + Duration::from_secs(secs);
    let mut writers = Vec::new();
    for w in 0..4 {
        let pool = db.pool.clone();
        writers.push(tokio::spawn(async move {
            // (id, committed at, of the aggregate the failing route fails)
            let mut committed: Vec<(String, Instant, bool)> = Vec::new();
            let mut tx_ms: Vec<f64> = Vec::new();
            let mut next = Instant::now();
            let mut i = 0usize;
            while Instant::now() < end {
                let id = uuid::Uuid::new_v4();
                let mut conn = pool.acquire().await?;
                // After the pool's acquire (and its ping): from BEGIN on.
                let began = Instant::now();
                let mut tx = sqlx::Connection::begin(&mut *conn).await?;
                let failing_aggregate = w == 0 && i.is_multiple_of(100);
                let mut body = payload(i);
                if failing && failing_aggregate && i == 0 {
                    body["hostile"] = json!("retry");
                }
                sqlx::query("INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1, 'order', $2, 'order-created', $3)")
                    .bind(id)
                    .bind(format!("w{w}-{}", i % 100))
                    .bind(body)
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
                let done = Instant::now();
                committed.push((id.to_string(), done, failing_aggregate));
                tx_ms.push(done.duration_since(began).as_secs_f64() * 1000.0);
                i += 1;
                next += per_writer;
                tokio::time::sleep_until(next.into()).await;
            }
            anyhow::Ok((committed, tx_ms))
        }));
    }
    let mut committed: HashMap<String, (Instant, bool)> = HashMap::new();
    // BEGIN to COMMIT acknowledged, per producer transaction: lease mode's
    // pickup starts at `created_at` (the transaction's start), so it
    // includes this.
    let mut tx_ms: Vec<f64> = Vec::new();
    for w in writers {
        let (c, t) = w.await??;
        committed.extend(c.into_iter().map(|(id, at, x)| (id, (at, x))));
        tx_ms.extend(t);
    }
    tx_ms.sort_by(f64::total_cmp);
    // Every committed event must reach the consumer: percentiles are over
    // all of them, and one missing is a failed run, not a dropped sample.
    // The first receipt of each event counts (a re-sent duplicate would
    // count again).
    let mut first: HashMap<String, Instant> = HashMap::with_capacity(committed.len());
    let tail = Instant::now() + Duration::from_secs(60);
    loop {
        for (id, at) in rx.try_iter() {
            if committed.contains_key(&id) {
                first.entry(id).or_insert(at);
            }
        }
        if first.len() == committed.len() {
            break;
        }
        if Instant::now() > tail {
            stop.store(true, Ordering::Relaxed);
            relay.terminate(Duration::from_secs(15));
            anyhow::bail!(
                "latency: {} of {} committed events never reached the consumer within 60 s of the last commit",
                committed.len() - first.len(),
                committed.len()
            );
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The relay's CPU from the first commit to the last receipt.
    let relay_cores = (proc_stats(pid).0 - cpu0) / t0.elapsed().as_secs_f64().max(1e-3);
    stop.store(true, Ordering::Relaxed);
    let _ = consumer.join();
    if let Some(c) = nats_consumer {
        c.abort();
    }
    let mut lat: Vec<f64> = Vec::new();
    // The same, for the events of the aggregate `--failing-route` fails.
    let mut lat_x: Vec<f64> = Vec::new();
    for (id, at) in &first {
        if let Some((c, x)) = committed.get(id) {
            let ms = at.saturating_duration_since(*c).as_secs_f64() * 1000.0;
            lat.push(ms);
            if *x {
                lat_x.push(ms);
            }
        }
    }
    lat.sort_by(f64::total_cmp);
    lat_x.sort_by(f64::total_cmp);
    let of_x = committed.values().filter(|(_, x)| *x).count();
    let (_, metrics) = outroute_e2e::http_get(&http, "/metrics")
        .await
        .unwrap_or_default();
    let metrics = buckets_since(&before, &metrics);
    let rss = proc_stats(pid).1;
    relay.terminate(Duration::from_secs(15));
    db.drop_db().await;
    if sink == "nats" {
        outroute_e2e::drop_nats_stream(&format!("B{t}")).await;
    }
    Ok(json!({
        "sink": sink,
        "producer_tx_ms": {"p50": percentile(&tx_ms, 0.5), "p99": percentile(&tx_ms, 0.99)},
        "relay_cores": relay_cores,
        "committed": committed.len(),
        "received": lat.len(),
        "achieved_rate": committed.len() as f64 / secs as f64,
        "commit_to_consumer_ms": {"p50": percentile(&lat, 0.5), "p99": percentile(&lat, 0.99), "max": lat.last().copied().unwrap_or(0.0)},
        "failing_aggregate": {
            "committed": of_x,
            "received": lat_x.len(),
            "commit_to_consumer_ms": {"p50": percentile(&lat_x, 0.5), "p99": percentile(&lat_x, 0.99), "max": lat_x.last().copied().unwrap_or(0.0)},
            "failed_on_failing_route": outroute_e2e::metric(&metrics, "outroute_events_failed_total{route=\"payments\"}"),
        },
        "commit_to_ack_ms_bucket": {
            "p50": bucket_quantile(&metrics, "outroute_commit_to_ack_seconds", 0.5),
            "p99": bucket_quantile(&metrics, "outroute_commit_to_ack_seconds", 0.99),
        },
        "claim_ms_bucket": {
            "p50": bucket_quantile(&metrics, "outroute_claim_seconds", 0.5),
            "p99": bucket_quantile(&metrics, "outroute_claim_seconds", 0.99),
            "share_over_2ms": bucket_share_above(&metrics, "outroute_claim_seconds", 0.002),
        },
        "pickup_ms_bucket": {
            "p50": bucket_quantile(&metrics, "outroute_pickup_seconds", 0.5),
            "p99": bucket_quantile(&metrics, "outroute_pickup_seconds", 0.99),
        },
        "batch_ms_bucket": {
            "p50": bucket_quantile(&metrics, "outroute_batch_seconds", 0.5),
            "p99": bucket_quantile(&metrics, "outroute_batch_seconds", 0.99),
        },
        "history_rows": history,
        "history_payload_bytes": history_payload,
        "peak_rss_mib": rss,
    }))
}

/// `rate` events/s for `secs` seconds into `pool`'s outbox, from 4 writers,
/// one transaction each; returns how many were committed.
async fn steady_writes(pool: &PgPool, rate: u64, secs: u64, prefix: &str) -> Result<usize> {
    let per_writer = Duration::from_secs_f64(4.0 / rate.max(1) as f64);
    let end = Instant::now() + Duration::from_secs(secs);
    let mut writers = Vec::new();
    for w in 0..4 {
        let pool = pool.clone();
        let prefix = prefix.to_string();
        writers.push(tokio::spawn(async move {
            let mut next = Instant::now();
            let mut i = 0usize;
            while Instant::now() < end {
                sqlx::query("INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1, 'order', $2, 'order-created', $3)")
                    .bind(uuid::Uuid::new_v4())
                    .bind(format!("{prefix}{w}-{}", i % 100))
                    .bind(payload(i))
                    .execute(&pool)
                    .await?;
                i += 1;
                next += per_writer;
                tokio::time::sleep_until(next.into()).await;
            }
            anyhow::Ok(i)
        }));
    }
    let mut n = 0;
    for w in writers {
        n += w.await??;
    }
    Ok(n)
}

/// Two sources in one relay, `a` on the shared cluster and `b` on a
/// cluster of its own; `rate` events/s into `a` for `secs` seconds with
/// `b`'s database up, then `secs` more with it stopped. `a`'s
/// commit→broker-ack quantiles (the relay's histogram, per phase) show
/// what `b`'s outage costs the other source; every event of `a` must be
/// published within 60 s of the writers stopping, or the run fails.
async fn source_outage(secs: u64, rate: u64) -> Result<Value> {
    let cluster = outroute_e2e::OwnCluster::start("outroute_bench_outage", 5437)?;
    let a = TestDb::new().await?;
    let b = TestDb::new_at(&cluster.admin_url()).await?;
    let t = tag();
    create_topics(&t).await?;
    let dir = test_dir("outage");
    let http = outroute_e2e::free_addr();
    let body = format!(
        "[relay]\ncache_dir = \"{}\"\n[sources.a]\nurl = \"{}\"\n[sources.b]\nurl = \"{}\"\n{}",
        std::env::temp_dir().join("outroute-test-cache").display(),
        a.url,
        b.url,
        relay_body("kafka", &t, &http)
    );
    std::fs::create_dir_all(&dir)?;
    let config = dir.join("outroute.toml");
    std::fs::write(&config, body)?;
    a.migrate(&config)?;
    let mut relay = Relay::start(&config, &[("RUST_LOG", "warn")])?;
    // Warm: both sources publishing.
    for db in [&a, &b] {
        sqlx::query("INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1, 'order', 'warm-up', 'order-created', '{}')")
            .bind(uuid::Uuid::new_v4())
            .execute(&db.pool)
            .await?;
    }
    let warm = Instant::now();
    while a.unpublished("").await + b.unpublished("").await > 0 {
        anyhow::ensure!(
            warm.elapsed() < Duration::from_secs(60),
            "the warm-up events were not published within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let histogram = || async {
        let (_, m) = outroute_e2e::http_get(&http, "/metrics")
            .await
            .unwrap_or_default();
        buckets(&m, "outroute_commit_to_ack_seconds", "source=\"a\"")
    };
    let diff = |before: &[(f64, f64)], after: &[(f64, f64)]| -> Vec<(f64, f64)> {
        after
            .iter()
            .map(|(le, c)| {
                let was = before
                    .iter()
                    .find(|(b, _)| b == le)
                    .map_or(0.0, |(_, c)| *c);
                (*le, c - was)
            })
            .collect()
    };
    let h0 = histogram().await;
    let up_events = steady_writes(&a.pool, rate, secs, "up").await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let h1 = histogram().await;
    b.pool.close().await;
    cluster.stop()?;
    let stopped = Instant::now();
    let down_events = steady_writes(&a.pool, rate, secs, "down").await?;
    let drained = Instant::now();
    while a.unpublished("").await > 0 {
        if drained.elapsed() > Duration::from_secs(60) {
            cluster.restart()?;
            anyhow::bail!(
                "source a still had {} unpublished events 60 s after its writers stopped, b's database down",
                a.unpublished("").await
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let h2 = histogram().await;
    let downtime = stopped.elapsed().as_secs_f64();
    cluster.restart()?;
    relay.terminate(Duration::from_secs(15));
    a.drop_db().await;
    let b = TestDb {
        pool: sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect_lazy(&b.url)?,
        ..b
    };
    b.drop_db().await;
    let (up, down) = (diff(&h0, &h1), diff(&h1, &h2));
    Ok(json!({
        "rate": rate,
        "seconds_per_phase": secs,
        "up": {"events": up_events, "p50": quantile_of(&up, 0.5), "p99": quantile_of(&up, 0.99)},
        "down": {"events": down_events, "p50": quantile_of(&down, 0.5), "p99": quantile_of(&down, 0.99)},
        "b_down_s": downtime,
    }))
}

/// What waking the relay costs producers: commits/s of 8 writer connections
/// (one outbox insert per transaction) with no relay, with the relay polling
/// adaptively, and with a NOTIFY in every transaction (relay listening).
async fn wakeup_cost() -> Result<Value> {
    async fn writers(pool: &PgPool, notify: bool, secs: u64) -> Result<f64> {
        let end = Instant::now() + Duration::from_secs(secs);
        let mut tasks = Vec::new();
        for w in 0..8 {
            let pool = pool.clone();
            tasks.push(tokio::spawn(async move {
                let mut n = 0u64;
                while Instant::now() < end {
                    let mut tx = pool.begin().await?;
                    sqlx::query("INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1, 'order', $2, 'order-created', '{}')")
                        .bind(uuid::Uuid::new_v4())
                        .bind(format!("w{w}-{}", n % 50))
                        .execute(&mut *tx)
                        .await?;
                    if notify {
                        sqlx::query("NOTIFY outbox_new").execute(&mut *tx).await?;
                    }
                    tx.commit().await?;
                    n += 1;
                }
                anyhow::Ok(n)
            }));
        }
        let mut total = 0;
        for t in tasks {
            total += t.await??;
        }
        Ok(total as f64 / secs as f64)
    }
    let mut out = serde_json::Map::new();
    for (label, relay_mode) in [
        ("no relay", None),
        ("relay polling", Some(false)),
        ("NOTIFY per commit + LISTEN", Some(true)),
    ] {
        let db = bench_db().await?;
        let dir = test_dir("wakeup");
        let relay_cfg = if relay_mode == Some(true) {
            "notify_channel = \"outbox_new\""
        } else {
            ""
        };
        let config = write_config_with(
            &dir,
            store_keys(),
            &db.url,
            relay_cfg,
            &format!("{}{}", canonical().mapping(), file_sink_body(&dir)),
        )?;
        db.migrate(&config)?;
        migrate_table(canonical(), &config)?;
        let relay = match relay_mode {
            Some(_) => Some(Relay::start(&config, &[("RUST_LOG", "warn")])?),
            None => None,
        };
        tokio::time::sleep(Duration::from_millis(500)).await;
        let rate = writers(&db.pool, relay_mode == Some(true), 8).await?;
        out.insert(label.into(), json!(rate));
        if let Some(mut r) = relay {
            r.terminate(Duration::from_secs(15));
        }
        db.drop_db().await;
    }
    Ok(Value::Object(out))
}
