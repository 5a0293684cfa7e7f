//! Section `peers` (issue 47): outroute beside the fastest other relay
//! measured on this machine, mq-bridge (PyPI), on one workload — `n` ~1 KB
//! events already in the outbox, one aggregate per event, a 1-partition
//! Kafka topic on tansu, `acks=all` — in alternating rounds: mq-bridge's
//! CDC input, outroute's log-based capture, mq-bridge's polling input
//! (`delete_after_read`), outroute's lease mode. Every run is timed by the
//! same independent consumer (start → the last event read back) and
//! charged the CPU of its relay process, of PostgreSQL and of tansu, so
//! each outroute figure has its peer's beside it and the ratio is printed.
//!
//! The peer runs from `benches/peers/mq_bridge_run.py` in the venv
//! `scripts/bench` installs (`OUTROUTE_MQ_BRIDGE_PYTHON` names its
//! interpreter). Both relays read the `wal_level = logical` cluster.

use super::*;

/// The four relays of one round, in the order they run.
const RUNS: [(&str, &str); 4] = [
    ("mq-bridge CDC", "cdc"),
    ("outroute logical", "logical"),
    ("mq-bridge polling", "polling"),
    ("outroute lease", "lease"),
];

/// `rounds` rounds of the four drains of `n` events; the medians and
/// each run's figures.
pub(crate) async fn peers(
    n: usize,
    rounds: usize,
    only: &[String],
    concurrency: u32,
    rate: u64,
    steady_secs: u64,
) -> Result<Value> {
    if let Some(bad) = only.iter().find(|o| !RUNS.iter().any(|(_, k)| k == o)) {
        anyhow::bail!("--peer-runs: unknown run `{bad}` (cdc, logical, polling or lease)");
    }
    let chosen = || {
        RUNS.into_iter()
            .filter(|(_, k)| only.iter().any(|o| o == k))
    };
    // mq-bridge is needed only for its runs (`--peer-runs logical` works
    // without it).
    let python = if chosen().any(|(_, k)| k == "cdc" || k == "polling") {
        mq_bridge_python()?
    } else {
        PathBuf::new()
    };
    let mut runs: HashMap<&str, Vec<Value>> = HashMap::new();
    PARTITIONS.store(1, Ordering::Relaxed);
    let result = async {
        for round in 1..=rounds {
            for (label, kind) in chosen() {
                eprintln!("== peers round {round}/{rounds}: {label}");
                let d = match kind {
                    "logical" | "lease" => as_outroute(kind, drain(n, "kafka", concurrency)).await?,
                    _ => mq_bridge_drain(&python, kind, n).await?,
                };
                let io = |k: &str| d["broker_traffic_per_event"][k].as_f64().unwrap_or(0.0);
                eprintln!(
                    "   {:.0} events/s; {}; peak RSS {:.0} MiB; broker took in {:.0} B in {:.3} segments per event, sent {:.0} B",
                    d["events_per_s"].as_f64().unwrap_or(0.0),
                    cpu_line(&d),
                    d["peak_rss_mib"].as_f64().unwrap_or(0.0),
                    io("bytes_in"),
                    io("segments_in"),
                    io("bytes_out"),
                );
                runs.entry(kind).or_default().push(d);
            }
        }
        anyhow::Ok(())
    }
    .await;
    // Steady state: `rate` events/s, each relay's CPU (and outroute's
    // pickup), one run each, same order.
    let mut steady = serde_json::Map::new();
    let result = match result {
        Ok(()) if steady_secs > 0 => {
            async {
                for (label, kind) in chosen() {
                    eprintln!("== peers steady {rate}/s: {label}");
                    let s = match kind {
                        "logical" | "lease" => {
                            let l =
                                as_outroute(kind, latency(steady_secs, rate, 0, 0, concurrency))
                                    .await?;
                            json!({
                                "rate": rate,
                                "relay_cores": l["relay_cores"],
                                "peak_rss_mib": l["peak_rss_mib"],
                                "pickup_ms_bucket": l["pickup_ms_bucket"],
                                "commit_to_consumer_ms": l["commit_to_consumer_ms"],
                            })
                        }
                        _ => mq_bridge_steady(&python, kind, rate, steady_secs).await?,
                    };
                    eprintln!(
                        "   relay {:.3} cores",
                        s["relay_cores"].as_f64().unwrap_or(0.0)
                    );
                    steady.insert(kind.into(), s);
                }
                anyhow::Ok(())
            }
            .await
        }
        other => other,
    };
    PARTITIONS.store(3, Ordering::Relaxed);
    result?;
    let median = |kind: &str, key: &str| {
        let mut v: Vec<f64> = runs
            .get(kind)
            .into_iter()
            .flatten()
            .filter_map(|d| d[key].as_f64())
            .collect();
        v.sort_by(f64::total_cmp);
        percentile(&v, 0.5)
    };
    let mut out = serde_json::Map::new();
    for (_, kind) in chosen().filter(|(_, k)| runs.contains_key(k)) {
        let mut m = serde_json::Map::new();
        for key in [
            "events_per_s",
            "relay_us_per_event",
            "postgres_us_per_event",
            "broker_us_per_event",
            "peak_rss_mib",
        ] {
            m.insert(key.into(), json!(median(kind, key)));
        }
        m.insert(
            "whole_path_us_per_event".into(),
            json!(
                median(kind, "relay_us_per_event")
                    + median(kind, "postgres_us_per_event")
                    + median(kind, "broker_us_per_event")
            ),
        );
        m.insert(
            "runs".into(),
            json!(runs.get(kind).cloned().unwrap_or_default()),
        );
        out.insert(kind.into(), Value::Object(m));
    }
    // A ratio only where both of its pair ran.
    for (ours, theirs, key) in [
        ("logical", "cdc", "logical_over_cdc"),
        ("lease", "polling", "lease_over_polling"),
    ] {
        if runs.contains_key(ours) && runs.contains_key(theirs) {
            let r = median(ours, "events_per_s") / median(theirs, "events_per_s").max(1e-9);
            out.insert(key.into(), json!(r));
        }
        if steady.contains_key(ours) && steady.contains_key(theirs) {
            let cores = |kind: &str| steady[kind]["relay_cores"].as_f64().unwrap_or(0.0);
            let r = cores(ours) / cores(theirs).max(1e-9);
            out.insert(format!("steady_{key}_cpu"), json!(r));
        }
    }
    out.insert("steady".into(), Value::Object(steady));
    out.insert("rounds".into(), json!(rounds));
    out.insert("events".into(), json!(n));
    Ok(Value::Object(out))
}

/// Run `f` (a drain or steady run of outroute) on the logical cluster with
/// `kind`'s capture: `logical` or lease mode.
async fn as_outroute<T>(kind: &str, f: impl std::future::Future<Output = Result<T>>) -> Result<T> {
    MODE.store(if kind == "logical" { 2 } else { 1 }, Ordering::Relaxed);
    let r = f.await;
    MODE.store(0, Ordering::Relaxed);
    r
}

/// The table rows of [`peers`]' result.
pub(crate) fn peers_rows(p: &Value) -> Vec<(String, String)> {
    let mut rows = Vec::new();
    for (label, kind) in RUNS.into_iter().filter(|(_, k)| p[k].is_object()) {
        let d = &p[kind];
        let f = |k: &str| d[k].as_f64().unwrap_or(0.0);
        rows.push((
            format!("peers (medians of {}): {label}", p["rounds"]),
            format!(
                "{:.0} events/s; relay {:.1} + PostgreSQL {:.1} + broker {:.1} = {:.1} µs/event; peak RSS {:.0} MiB",
                f("events_per_s"),
                f("relay_us_per_event"),
                f("postgres_us_per_event"),
                f("broker_us_per_event"),
                f("whole_path_us_per_event"),
                f("peak_rss_mib"),
            ),
        ));
    }
    // "n/a" where a pair did not both run (`--peer-runs`).
    let r = |k: &str| {
        p[k].as_f64()
            .map_or_else(|| "n/a".to_string(), |v| format!("{v:.2}×"))
    };
    let either = |a: &str, b: &str| p[a].is_number() || p[b].is_number();
    if either("logical_over_cdc", "lease_over_polling") {
        rows.push((
            "peers: outroute ÷ mq-bridge drain rate".into(),
            format!(
                "logical ÷ CDC {}, lease ÷ polling {} (goal ≥ 1.2× each)",
                r("logical_over_cdc"),
                r("lease_over_polling")
            ),
        ));
    }
    if let Some(steady) = p["steady"].as_object().filter(|s| !s.is_empty()) {
        for (label, kind) in RUNS.into_iter().filter(|(_, k)| steady.contains_key(*k)) {
            let s = &steady[kind];
            let pickup = if s["pickup_ms_bucket"].is_null() {
                String::new()
            } else {
                format!(
                    "; pickup p50 ≤ {} ms, p99 ≤ {} ms",
                    s["pickup_ms_bucket"]["p50"], s["pickup_ms_bucket"]["p99"]
                )
            };
            rows.push((
                format!("peers steady {}/s: {label}", s["rate"]),
                format!(
                    "relay {:.1} % of a core{pickup}",
                    s["relay_cores"].as_f64().unwrap_or(0.0) * 100.0
                ),
            ));
        }
        if either(
            "steady_logical_over_cdc_cpu",
            "steady_lease_over_polling_cpu",
        ) {
            rows.push((
                "peers steady: outroute ÷ mq-bridge relay CPU".into(),
                format!(
                    "logical ÷ CDC {}, lease ÷ polling {} (goal ≤ 1.2×)",
                    r("steady_logical_over_cdc_cpu"),
                    r("steady_lease_over_polling_cpu")
                ),
            ));
        }
    }
    rows
}

/// The interpreter of the venv `scripts/bench` installed mq-bridge into.
fn mq_bridge_python() -> Result<PathBuf> {
    let python = match std::env::var_os("OUTROUTE_MQ_BRIDGE_PYTHON") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(std::env::var("HOME").context("HOME is not set")?)
            .join(".cache/outroute/tools/mq-bridge-1.2.0/bin/python"),
    };
    anyhow::ensure!(
        python.exists(),
        "--only peers: {} is missing; `scripts/bench --only peers` installs mq-bridge there",
        python.display()
    );
    Ok(python)
}

/// One mq-bridge set-up: a fresh database on the logical cluster with the
/// table its input reads, and a 1-partition topic.
struct Peer {
    kind: &'static str,
    db: TestDb,
    topic: String,
    slot: String,
}

/// The row the polling input's queue table holds per event: the canonical
/// row as JSON (~1.1 KB), what the CDC input sends for a row of the other.
const POLLING_ROW: &str = "convert_to(json_build_object(\
    'id', gen_random_uuid(), 'aggregate_type', 'order', 'aggregate_id', 'o-' || g, \
    'event_type', 'order-created', 'event_version', 1, 'payload', \
    json_build_object('order_id', 'o-' || g, 'customer', 'c-' || (g % 977), \
      'total', (g % 1000) + 0.5, 'note', repeat('x', 904)), \
    'headers', '{}'::json, 'created_at', now())::text, 'UTF8')";

impl Peer {
    async fn set_up(kind: &'static str) -> Result<Peer> {
        let db = TestDb::new_logical().await?;
        let t = tag();
        let topic = format!("b{t}.order-created");
        create_topic(&topic, 1).await?;
        let slot = format!("mqb_{t}");
        if kind == "cdc" {
            // The canonical table's columns, without outroute's migrations
            // (no queue trigger): the peer streams its inserts as they are.
            sqlx::query(
                "CREATE TABLE outbox (
                    seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                    id uuid NOT NULL UNIQUE, aggregate_type text NOT NULL,
                    aggregate_id text NOT NULL, event_type text NOT NULL,
                    event_version integer NOT NULL DEFAULT 1, payload jsonb NOT NULL,
                    headers jsonb NOT NULL DEFAULT '{}', created_at timestamptz NOT NULL DEFAULT now())",
            )
            .execute(&db.pool)
            .await?;
            sqlx::query("CREATE PUBLICATION mqb_pub FOR TABLE outbox")
                .execute(&db.pool)
                .await?;
            sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput')")
                .bind(&slot)
                .execute(&db.pool)
                .await?;
        } else {
            // The polling input reads only its own queue table (`id`,
            // `payload`, `locked_until`: the shape it creates itself).
            for sql in [
                "CREATE TABLE outbox (id BIGSERIAL PRIMARY KEY, payload BYTEA NOT NULL, \
                 locked_until TIMESTAMPTZ, created_at TIMESTAMPTZ DEFAULT NOW())",
                "CREATE INDEX outbox_locked_until ON outbox (locked_until)",
            ] {
                sqlx::query(sql).execute(&db.pool).await?;
            }
        }
        Ok(Peer {
            kind,
            db,
            topic,
            slot,
        })
    }

    /// `n` events written before the peer starts.
    async fn fill(&self, n: usize) -> Result<()> {
        if self.kind == "cdc" {
            return fill(&self.db.pool, n).await;
        }
        let mut done = 0;
        while done < n {
            let end = (done + 50_000).min(n);
            sqlx::query(&format!(
                "INSERT INTO outbox (payload) SELECT {POLLING_ROW} FROM generate_series($1::bigint, $2::bigint) g"
            ))
            .bind(done as i64)
            .bind(end as i64 - 1)
            .execute(&self.db.pool)
            .await?;
            done = end;
        }
        Ok(())
    }

    /// The statement a steady writer commits per event (`$1`: its number).
    fn insert_one(&self) -> String {
        if self.kind == "cdc" {
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
             SELECT gen_random_uuid(), 'order', 'o-' || g, 'order-created', \
             json_build_object('order_id', 'o-' || g, 'customer', 'c-' || (g % 977), \
               'total', (g % 1000) + 0.5, 'note', repeat('x', 904)) FROM (SELECT $1::bigint AS g) s"
                .into()
        } else {
            format!(
                "INSERT INTO outbox (payload) SELECT {POLLING_ROW} FROM (SELECT $1::bigint AS g) s"
            )
        }
    }

    fn start(&self, python: &Path) -> Result<std::process::Child> {
        let script = outroute_e2e::workspace().join("benches/peers/mq_bridge_run.py");
        let mut cmd = std::process::Command::new(python);
        // The same store URL outroute gets (`--pg-sslmode`).
        cmd.arg(&script).arg(self.kind).arg(relay_url(&self.db.url));
        if self.kind == "cdc" {
            cmd.args(["mqb_pub", &self.slot]);
        } else {
            cmd.arg("outbox");
        }
        cmd.args([KAFKA, &self.topic])
            .env("RUST_LOG", "warn")
            .stdin(std::process::Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", script.display()))
    }

    /// SIGTERM stops the route; a peer that does not stop is killed. Then
    /// the database goes.
    async fn stop(self, mut child: std::process::Child) {
        let _ = std::process::Command::new("kill")
            .arg(child.id().to_string())
            .status();
        let stopping = Instant::now();
        while child.try_wait().ok().flatten().is_none()
            && stopping.elapsed() < Duration::from_secs(10)
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let _ = child.kill();
        let _ = child.wait();
        self.db.drop_db().await;
    }
}

/// mq-bridge draining `n` pre-inserted events: `cdc` from a publication
/// and slot made before the rows were written, `polling` deleting what it
/// published. Timed and charged as [`drain_table`] times and charges
/// outroute.
async fn mq_bridge_drain(python: &Path, kind: &'static str, n: usize) -> Result<Value> {
    let peer = Peer::set_up(kind).await?;
    peer.fill(n).await?;
    let deadline = Instant::now() + Duration::from_secs(600);
    let consumer = tokio::task::spawn_blocking({
        let topic = peer.topic.clone();
        move || consumer::kafka_last_arrival(&topic, 1, "mq_bridge.message_id", n, deadline)
    });
    let group0 = group_cpu("tansu broker");
    let traffic0 = broker_traffic(9092);
    let pg0 = pg_cpu(&peer.db.pool).await;
    let spawned = Instant::now();
    let child = peer.start(python)?;
    let pid = child.id();
    let received = consumer.await;
    // Polling deletes what it published: its "confirmation" is an empty
    // table (CDC leaves the rows; nothing more to wait for).
    if kind == "polling" {
        let until = Instant::now() + Duration::from_secs(60);
        while peer.db.count("SELECT count(*) FROM outbox").await > 0 && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let confirmed = Instant::now();
    let (cpu, rss) = proc_stats(pid);
    let pg = pg_cpu(&peer.db.pool).await - pg0;
    let broker = group_cpu("tansu broker") - group0;
    let traffic = traffic_per_event(&traffic0, &broker_traffic(9092), n);
    peer.stop(child).await;
    let received = match received {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => anyhow::bail!("mq-bridge {kind}: {e:#}"),
        Err(e) => anyhow::bail!("mq-bridge {kind}: the consumer task failed: {e}"),
    };
    let secs = (received - spawned).as_secs_f64().max(1e-3);
    let window = secs.max((confirmed - spawned).as_secs_f64());
    let mut d = cost_figures(n, window, [cpu, pg, broker], traffic, rss);
    d.insert("events".into(), json!(n));
    d.insert(
        "clock".into(),
        json!("peer start → last event at an independent consumer"),
    );
    d.insert("seconds".into(), json!(secs));
    d.insert("events_per_s".into(), json!(n as f64 / secs));
    Ok(Value::Object(d))
}

/// mq-bridge at a steady `rate` events/s from 4 writers for `secs`
/// seconds (after 3 s of warm-up): its process's CPU, in cores.
async fn mq_bridge_steady(
    python: &Path,
    kind: &'static str,
    rate: u64,
    secs: u64,
) -> Result<Value> {
    let peer = Peer::set_up(kind).await?;
    let child = peer.start(python)?;
    let pid = child.id();
    let stop = Arc::new(AtomicBool::new(false));
    let writers = steady_writers(&peer.db.pool, &peer.insert_one(), rate, stop.clone());
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (cpu0, _) = proc_stats(pid);
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(secs)).await;
    let (cpu1, rss) = proc_stats(pid);
    let window = t0.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let mut written = 0u64;
    for w in writers {
        written += w.await.unwrap_or(0);
    }
    peer.stop(child).await;
    Ok(json!({
        "rate": rate,
        "relay_cores": (cpu1 - cpu0) / window,
        "peak_rss_mib": rss,
        "written": written,
    }))
}

/// 4 writers committing `rate` events/s between them, one row per
/// transaction, until `stop`; each answers how many it wrote.
fn steady_writers(
    pool: &PgPool,
    sql: &str,
    rate: u64,
    stop: Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<u64>> {
    (0..4u64)
        .map(|w| {
            let (pool, sql, stop) = (pool.clone(), sql.to_string(), stop.clone());
            tokio::spawn(async move {
                let mut tick =
                    tokio::time::interval(Duration::from_secs_f64(4.0 / rate.max(1) as f64));
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    tick.tick().await;
                    if sqlx::query(&sql)
                        .bind((w * 1_000_000_000 + n) as i64)
                        .execute(&pool)
                        .await
                        .is_ok()
                    {
                        n += 1;
                    }
                }
                n
            })
        })
        .collect()
}
