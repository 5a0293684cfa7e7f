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
pub(crate) async fn peers(n: usize, rounds: usize, concurrency: u32) -> Result<Value> {
    let python = mq_bridge_python()?;
    let mut runs: HashMap<&str, Vec<Value>> = HashMap::new();
    PARTITIONS.store(1, Ordering::Relaxed);
    let result = async {
        for round in 1..=rounds {
            for (label, kind) in RUNS {
                eprintln!("== peers round {round}/{rounds}: {label}");
                let d = match kind {
                    "logical" | "lease" => {
                        MODE.store(if kind == "logical" { 2 } else { 1 }, Ordering::Relaxed);
                        let d = drain(n, "kafka", concurrency).await;
                        MODE.store(0, Ordering::Relaxed);
                        d?
                    }
                    _ => mq_bridge_drain(&python, kind, n).await?,
                };
                let io = |k: &str| d["broker_io_per_event"][k].as_f64().unwrap_or(0.0);
                eprintln!(
                    "   {:.0} events/s; {}; peak RSS {:.0} MiB; broker took in {:.0} B and {:.3} reads per event, sent {:.0} B",
                    d["events_per_s"].as_f64().unwrap_or(0.0),
                    cpu_line(&d),
                    d["peak_rss_mib"].as_f64().unwrap_or(0.0),
                    io("bytes_in"),
                    io("reads"),
                    io("bytes_out"),
                );
                runs.entry(kind).or_default().push(d);
            }
        }
        anyhow::Ok(())
    }
    .await;
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
    for (_, kind) in RUNS {
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
    out.insert(
        "logical_over_cdc".into(),
        json!(median("logical", "events_per_s") / median("cdc", "events_per_s").max(1e-9)),
    );
    out.insert(
        "lease_over_polling".into(),
        json!(median("lease", "events_per_s") / median("polling", "events_per_s").max(1e-9)),
    );
    out.insert("rounds".into(), json!(rounds));
    out.insert("events".into(), json!(n));
    Ok(Value::Object(out))
}

/// The table rows of [`peers`]' result.
pub(crate) fn peers_rows(p: &Value) -> Vec<(String, String)> {
    let mut rows = Vec::new();
    for (label, kind) in RUNS {
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
    let r = |k: &str| p[k].as_f64().unwrap_or(0.0);
    rows.push((
        "peers: outroute ÷ mq-bridge drain rate".into(),
        format!(
            "logical ÷ CDC {:.2}×, lease ÷ polling {:.2}× (goal ≥ 1.2× each)",
            r("logical_over_cdc"),
            r("lease_over_polling")
        ),
    ));
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

/// mq-bridge draining `n` pre-inserted events of the canonical table's
/// shape: `cdc` from a publication and slot made before the rows were
/// written, `polling` deleting what it published. Timed and charged as
/// [`drain_table`] times and charges outroute.
async fn mq_bridge_drain(python: &Path, kind: &str, n: usize) -> Result<Value> {
    let db = TestDb::new_logical().await?;
    let t = tag();
    let topic = format!("b{t}.order-created");
    create_topic(&topic, 1).await?;
    let slot = format!("mqb_{t}");
    if kind == "cdc" {
        // The canonical table's columns, without outroute's migrations (no
        // queue trigger): the peer streams its inserts as they are.
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
        fill(&db.pool, n).await?;
    } else {
        // The polling input reads only its own queue table (`id`,
        // `payload`, `locked_until`; the shape it creates itself): each
        // row's payload is the canonical row as JSON (~1.1 KB), what its
        // CDC input sends for a row of the other table.
        for sql in [
            "CREATE TABLE outbox (id BIGSERIAL PRIMARY KEY, payload BYTEA NOT NULL, \
             locked_until TIMESTAMPTZ, created_at TIMESTAMPTZ DEFAULT NOW())",
            "CREATE INDEX outbox_locked_until ON outbox (locked_until)",
        ] {
            sqlx::query(sql).execute(&db.pool).await?;
        }
        let mut done = 0;
        while done < n {
            let end = (done + 50_000).min(n);
            sqlx::query(
                "INSERT INTO outbox (payload) SELECT convert_to(json_build_object(\
                   'id', gen_random_uuid(), 'aggregate_type', 'order', 'aggregate_id', 'o-' || g, \
                   'event_type', 'order-created', 'event_version', 1, 'payload', \
                   json_build_object('order_id', 'o-' || g, 'customer', 'c-' || (g % 977), \
                     'total', (g % 1000) + 0.5, 'note', repeat('x', $3)), \
                   'headers', '{}'::json, 'created_at', now())::text, 'UTF8') \
                 FROM generate_series($1::bigint, $2::bigint) g",
            )
            .bind(done as i64)
            .bind(end as i64 - 1)
            .bind(PAYLOAD_BYTES as i32 - 120)
            .execute(&db.pool)
            .await?;
            done = end;
        }
    }
    let deadline = Instant::now() + Duration::from_secs(600);
    let consumer = tokio::task::spawn_blocking({
        let topic = topic.clone();
        move || consumer::kafka_last_arrival(&topic, 1, "mq_bridge.message_id", n, deadline)
    });
    let group0 = group_cpu("tansu broker");
    let io0 = group_io("tansu broker");
    let pg0 = pg_cpu(&db.pool).await;
    let script = outroute_e2e::workspace().join("benches/peers/mq_bridge_run.py");
    let mut cmd = std::process::Command::new(python);
    cmd.arg(&script).arg(kind).arg(&db.url);
    if kind == "cdc" {
        cmd.args(["mqb_pub", &slot]);
    } else {
        cmd.arg("outbox");
    }
    let spawned = Instant::now();
    let mut child = cmd
        .args([KAFKA, &topic])
        .env("RUST_LOG", "warn")
        .stdin(std::process::Stdio::null())
        .spawn()
        .with_context(|| format!("starting {}", script.display()))?;
    let pid = child.id();
    let received = consumer.await;
    // Polling deletes what it published: its "confirmation" is an empty
    // table (CDC leaves the rows; nothing more to wait for).
    let confirmed = if kind == "polling" {
        let until = Instant::now() + Duration::from_secs(60);
        while db.count("SELECT count(*) FROM outbox").await > 0 && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Instant::now()
    } else {
        Instant::now()
    };
    let (cpu, rss) = proc_stats(pid);
    let pg = pg_cpu(&db.pool).await - pg0;
    let broker = group_cpu("tansu broker") - group0;
    let broker_io = io_per_event(io0, group_io("tansu broker"), n);
    // SIGTERM stops the route; a peer that does not stop is killed.
    let _ = std::process::Command::new("kill")
        .arg(pid.to_string())
        .status();
    let stopping = Instant::now();
    while child.try_wait().ok().flatten().is_none() && stopping.elapsed() < Duration::from_secs(10)
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = child.kill();
    let _ = child.wait();
    db.drop_db().await;
    let received = match received {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => anyhow::bail!("mq-bridge {kind}: {e:#}"),
        Err(e) => anyhow::bail!("mq-bridge {kind}: the consumer task failed: {e}"),
    };
    let secs = (received - spawned).as_secs_f64().max(1e-3);
    let window = secs.max((confirmed - spawned).as_secs_f64());
    Ok(json!({
        "events": n,
        "clock": "peer start → last event at an independent consumer",
        "seconds": secs,
        "events_per_s": n as f64 / secs,
        "cores": cpu / window,
        "postgres_cores": pg / window,
        "relay_us_per_event": cpu * 1e6 / n.max(1) as f64,
        "postgres_us_per_event": pg * 1e6 / n.max(1) as f64,
        "broker_us_per_event": broker * 1e6 / n.max(1) as f64,
        "broker_io_per_event": broker_io,
        "peak_rss_mib": rss,
    }))
}
