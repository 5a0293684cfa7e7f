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
//!    commit→ack under steady load, with and without the outage;
//! 9. (`--only console`) the operator console's cost to the relay at a
//!    steady rate: off, on with nobody looking, and a browser on it;
//! 10. (`--only peers`) outroute beside mq-bridge, the fastest other relay
//!     measured here, on the same table shape, topic and consumer, in
//!     alternating rounds: drain rates, CPU per event of relay, PostgreSQL
//!     and broker, peak RSS, and the ratios.
//!
//! It prints one table and writes every figure to a JSON file.
//!
//! Files: this one parses the arguments, runs the chosen sections and prints
//! the table; each section is its own file (`plugins.rs`, `ceilings.rs`,
//! `drain.rs`, `baseline.rs`, `latency.rs`, `outage.rs`, `wakeup.rs`, `console.rs`,
//! `peers.rs`), on
//! `setup.rs` (databases, shapes, configs), `measure.rs` (CPU, RSS,
//! histograms) and `consumer.rs` (the independent consumer that stops the
//! clock). One concern, one file: the command line and the order of the
//! sections — every section's own work lives in its file, and what stays
//! here is one `if` per section, which grows with each new one.

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
mod ceilings;
mod console;
mod consumer;
mod drain;
mod latency;
mod measure;
mod mysql;
mod outage;
mod peers;
mod plugins;
mod scale;
mod setup;
mod skew;
mod wakeup;
use ceilings::*;
use console::*;
use drain::*;
use latency::*;
use measure::*;
use mysql::*;
use outage::*;
use peers::*;
use plugins::*;
use scale::*;
use setup::*;
use skew::*;
use wakeup::*;

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
    /// `--only mysql`: the pre-filled backlog whose first and last tenth's
    /// claim cost are compared (0 skips it; the figure is 1000000).
    #[arg(long, default_value_t = 0)]
    mysql_backlog: usize,
    /// Relay workers (`relay.concurrency`); the ceiling runs as many loops.
    #[arg(long, default_value_t = 2)]
    concurrency: u32,
    /// Where to write the figures.
    #[arg(long, default_value = "bench-results.json")]
    json: PathBuf,
    /// Only these sections (plugin, ceiling, produce, drain, marking, sources, tables,
    /// baseline, wakeup, latency, backlog, history, logical, outage, huge-txn;
    /// `scale`, `skew`, `mysql`, `console` and `peers` run only when named).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// `--only scale`: the numbers of idle sources one relay serves.
    #[arg(long, value_delimiter = ',', default_value = "1,10,100,200")]
    scale_sources: Vec<usize>,
    /// `--only scale`: seconds of idleness measured.
    #[arg(long, default_value_t = 60)]
    scale_idle_secs: u64,
    /// `wakeup`: runs of each case (interleaved; medians reported).
    #[arg(long, default_value_t = 3)]
    wakeup_reps: usize,
    /// `wakeup`: commits/s the paced writers offer (0 skips the paced cases).
    #[arg(long, default_value_t = 2000)]
    wakeup_paced: u64,
    /// `--only console`: seconds of each measured window.
    #[arg(long, default_value_t = 30)]
    console_secs: u64,
    /// `--only peers`: rounds of the four alternating drains (outroute's
    /// logical and lease capture, mq-bridge's CDC and polling inputs).
    #[arg(long, default_value_t = 3)]
    peer_rounds: usize,
    /// `--only peers`: which of the four runs to make (`cdc`, `logical`,
    /// `polling`, `lease`); ratios need both of a pair.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "cdc,logical,polling,lease"
    )]
    peer_runs: Vec<String>,
    /// `--only skew`: quiet sources beside the one with a backlog.
    #[arg(long, default_value_t = 99)]
    skew_quiet: usize,
    /// `--only skew`: events in the one source's backlog.
    #[arg(long, default_value_t = 1_000_000)]
    skew_backlog: usize,
    /// `--only skew`: events/s committed to each quiet source.
    #[arg(long, default_value_t = 10)]
    skew_rate: u64,
    /// `--only skew`: seconds the quiet sources are measured alone.
    #[arg(long, default_value_t = 30)]
    skew_secs: u64,
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

/// Partitions of the drain's Kafka topic: 3, or 1 in the `peers` section
/// (the workload the peer comparison was first measured on).
static PARTITIONS: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(3);

/// `--marking published_at`.
static STAMP: AtomicBool = AtomicBool::new(false);

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
    // The peers section compares relays on loopback: neither talks TLS to
    // PostgreSQL there (mq-bridge's CDC input does not by default), unless
    // `--pg-sslmode` says otherwise.
    let peers_only = args.only.iter().any(|o| o == "peers");
    let _ = SSLMODE.set(
        args.pg_sslmode
            .clone()
            .or_else(|| peers_only.then(|| "disable".to_string())),
    );
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
            if let Some(r) = d["reconcile"].as_object() {
                table.push((
                    format!("  reconcile of the drained window → {sink}"),
                    format!(
                        "{:.1} s for {} events, {}",
                        r["seconds"].as_f64().unwrap_or(0.0),
                        r["published"],
                        if r["clean"] == true {
                            "clean"
                        } else {
                            "NOT clean"
                        }
                    ),
                ));
            }
            table.push((format!("  CPU per event → {sink}"), cpu_line(&d)));
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
        table.push(("  CPU per event, 3 sources".into(), cpu_line(&d)));
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
                format!("{:.0} events/s; {}", f("events_per_s"), cpu_line(&d)),
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
    if args.only.iter().any(|o| o == "scale") {
        eprintln!("== scale: idle sources in one relay");
        let mut runs = Vec::new();
        for &n in &args.scale_sources {
            let s = scale_one(n, args.scale_idle_secs).await?;
            table.extend(scale_rows(n, &s));
            runs.push(s);
        }
        results.insert("scale".into(), json!(runs));
    }
    if args.only.iter().any(|o| o == "mysql") {
        let (rows, figures) = mysql_section(
            args.events,
            args.concurrency,
            (args.wakeup_reps, args.wakeup_paced),
            (args.latency_secs, args.rate),
            args.mysql_backlog,
        )
        .await?;
        table.extend(rows);
        results.extend(figures);
    }
    if args.only.iter().any(|o| o == "console") {
        eprintln!("== console: its cost to the relay at a steady rate");
        let c = console_cost(args.console_secs, args.rate).await?;
        table.extend(console_rows(&c));
        results.insert("console".into(), c);
    }
    if args.only.iter().any(|o| o == "peers") {
        let p = peers(
            args.events,
            args.peer_rounds,
            &args.peer_runs,
            args.concurrency,
            args.rate,
            args.latency_secs,
        )
        .await?;
        table.extend(peers_rows(&p));
        results.insert("peers".into(), p);
    }
    if args.only.iter().any(|o| o == "skew") {
        eprintln!("== skew: one deep backlog beside quiet sources");
        let s = skew(
            args.skew_quiet,
            args.skew_backlog,
            args.skew_rate,
            args.skew_secs,
        )
        .await?;
        table.extend(skew_rows(&s));
        results.insert("skew".into(), s);
    }
    if want("wakeup") {
        eprintln!("== wake-up cost to producers");
        let w = wakeup_cost(args.wakeup_reps, args.wakeup_paced).await?;
        table.extend(wakeup_rows("", &w));
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
                table.push((format!("  CPU per event, {label} → {sink}"), cpu_line(&d)));
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
            let w = wakeup_cost(1, 0).await?;
            for (name, v) in wakeup_rows(&format!("{label} capture: "), &w) {
                if name.ends_with("flat out, no relay") || name.ends_with("flat out, relay polling")
                {
                    table.push((name, v));
                }
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
