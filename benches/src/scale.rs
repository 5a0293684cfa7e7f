//! Platform scale (issue 43): one relay serving many idle sources — what it
//! costs while nothing happens (relay CPU and RSS, connections, statements
//! per second on each producer database) and how fast it picks up the first
//! event after a quiet spell. Runs on a cluster of its own
//! (`scripts/pg-logical`, named `outroute_scale`, port 5450, max_connections
//! 1200; 5432–5438 are the tests' clusters), one database per source, each
//! with the canonical outbox.

use super::*;

const PORT: &str = "5450";

/// The scale cluster's URL for database `db`.
pub(crate) fn url(db: &str) -> String {
    format!("postgres://root@127.0.0.1:{PORT}/{db}")
}

/// Start (or find) the scale cluster.
pub(crate) fn cluster() -> Result<()> {
    let status = std::process::Command::new(outroute_e2e::workspace().join("scripts/pg-logical"))
        .env("OUTROUTE_PG_LOGICAL_NAME", "outroute_scale")
        .env("OUTROUTE_PG_LOGICAL_PORT", PORT)
        .env("OUTROUTE_PG_MAX_CONNECTIONS", "1200")
        .env("OUTROUTE_PG_PRELOAD", "pg_stat_statements")
        .stdout(std::process::Stdio::null())
        .status()
        .context("running scripts/pg-logical")?;
    anyhow::ensure!(
        status.success(),
        "scripts/pg-logical failed for the scale cluster"
    );
    Ok(())
}

/// Statements the relay ran in each of `dbs` (`pg_stat_statements`, which
/// counts BEGIN, COMMIT and LISTEN too), summed.
async fn statements(admin: &PgPool, dbs: &[String]) -> Result<f64> {
    Ok(sqlx::query_scalar::<_, f64>(
        "SELECT coalesce(sum(s.calls), 0)::float8 FROM pg_stat_statements s \
         JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = ANY($1)",
    )
    .bind(dbs)
    .fetch_one(admin)
    .await?)
}

/// What the relay ran most in `dbs` since the reset (the first words of
/// each statement with its calls), to tell where the idle cost comes from.
async fn top_statements(admin: &PgPool, dbs: &[String]) -> Result<Vec<(String, i64)>> {
    Ok(sqlx::query_as::<_, (String, i64)>(
        "SELECT left(regexp_replace(s.query, '\\s+', ' ', 'g'), 60), sum(s.calls)::bigint \
         FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid \
         WHERE d.datname = ANY($1) GROUP BY 1 ORDER BY 2 DESC LIMIT 8",
    )
    .bind(dbs)
    .fetch_all(admin)
    .await?)
}

async fn relay_connections(admin: &PgPool) -> Result<f64> {
    Ok(sqlx::query_scalar::<_, i64>(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'outroute'",
    )
    .fetch_one(admin)
    .await? as f64)
}

/// `n` idle sources in one relay: idle cost over `idle_secs`, then the
/// pickup of a first event after that quiet spell in up to 20 sources.
pub(crate) async fn scale_one(n: usize, idle_secs: u64) -> Result<Value> {
    cluster()?;
    let admin = PgPool::connect(&url("postgres")).await?;
    sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        .execute(&admin)
        .await
        .context("pg_stat_statements (the scale cluster preloads it; one made before may not: drop it with `pg_dropcluster 15 outroute_scale --stop`)")?;
    let t = tag();
    let dbs: Vec<String> = (0..n).map(|i| format!("scale_{t}_{i}")).collect();
    for db in &dbs {
        sqlx::query(&format!("CREATE DATABASE {db}"))
            .execute(&admin)
            .await?;
    }
    let result = measure(&admin, &dbs, idle_secs).await;
    for db in &dbs {
        let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
            .execute(&admin)
            .await;
    }
    result
}

/// [`scale_one`] on its databases `dbs`.
async fn measure(admin: &PgPool, dbs: &[String], idle_secs: u64) -> Result<Value> {
    let n = dbs.len();
    let dir = test_dir("scale");
    let http = outroute_e2e::free_addr();
    let mut body = String::new();
    for (i, db) in dbs.iter().enumerate() {
        body.push_str(&format!("[sources.s{i}]\nurl = \"{}\"\n", url(db)));
    }
    body.push_str(&format!(
        "[http]\nlisten = \"{http}\"\n[sinks.file]\nkind = \"file\"\npath = \"{}\"\n\
         [plugins.p]\npath = \"{}\"\n[[routes]]\nname = \"r\"\nplugin = \"p\"\n\
         config = {{ sink = \"file\", topic = \"orders.{{event_type}}\" }}\nallow = {{ file = [\"orders.*\"] }}\n",
        dir.join("out.jsonl").display(),
        plugin("order-router").display()
    ));
    let config = dir.join("outroute.toml");
    std::fs::write(&config, body)?;
    let migrated = std::process::Command::new(outroute_e2e::bin())
        .args(["migrate", "-c"])
        .arg(&config)
        .output()?;
    anyhow::ensure!(
        migrated.status.success(),
        "migrate failed: {}",
        String::from_utf8_lossy(&migrated.stderr)
    );
    let relay = Relay::start(&config, &[("RUST_LOG", "warn")])?;
    let pid = relay.child.id();
    // Every source up and, where it can, asleep.
    let settle_until = Instant::now() + Duration::from_secs(60 + n as u64 / 2);
    let mut asleep = 0.0;
    while Instant::now() < settle_until {
        if let Ok((_, m)) = outroute_e2e::http_get(&http, "/metrics").await {
            asleep = m
                .lines()
                .filter(|l| l.starts_with("outroute_source_asleep{"))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum();
            if asleep >= n as f64 {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // A little more, so the connections opened at start have idled out.
    tokio::time::sleep(Duration::from_secs(35)).await;
    let (cpu0, _) = proc_stats(pid);
    sqlx::query("SELECT pg_stat_statements_reset()")
        .execute(admin)
        .await?;
    let st0 = statements(admin, dbs).await?;
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(idle_secs)).await;
    let secs = started.elapsed().as_secs_f64();
    let (cpu1, hwm) = proc_stats(pid);
    let st1 = statements(admin, dbs).await?;
    let top = top_statements(admin, dbs).await?;
    let connections = relay_connections(admin).await?;
    let rss = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .unwrap_or(0.0)
        / 1024.0;
    // The first event after the quiet spell, in up to 20 sources, one at a
    // time: commit returned → the file sink's line read back.
    let out = dir.join("out.jsonl");
    let mut pickups = Vec::new();
    for db in dbs.iter().take(20) {
        let pool = PgPool::connect(&url(db)).await?;
        let id = uuid::Uuid::new_v4().to_string();
        sqlx::query(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
             VALUES ($1::uuid, 'order', 'first', 'order-created', '{}')",
        )
        .bind(&id)
        .execute(&pool)
        .await?;
        // From the commit's return (autocommit): the producer's own commit
        // (a WAL flush, up to 100 ms on this machine's disk) is not the
        // relay's pickup.
        let at = Instant::now();
        let deadline = at + Duration::from_secs(60);
        loop {
            if outroute_e2e::file_sink_deliveries(&out)
                .iter()
                .any(|d| d.id() == id)
            {
                pickups.push(at.elapsed().as_secs_f64() * 1000.0);
                break;
            }
            anyhow::ensure!(Instant::now() < deadline, "event {id} never arrived");
            tokio::time::sleep(Duration::from_micros(500)).await;
        }
        pool.close().await;
        // Let the source fall asleep again before the next one.
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    pickups.sort_by(f64::total_cmp);
    let mut relay = relay;
    relay.terminate(Duration::from_secs(30));
    Ok(json!({
        "sources": n,
        "asleep": asleep,
        "idle_secs": secs,
        "relay_cores": (cpu1 - cpu0) / secs,
        "rss_mib": rss,
        "peak_rss_mib": hwm,
        "connections": connections,
        "connections_per_source": connections / n as f64,
        "statements_per_s_per_db": (st1 - st0) / secs / n as f64,
        "top_statements": top.iter().map(|(q, c)| json!({"statement": q, "per_s_per_db": *c as f64 / secs / n as f64})).collect::<Vec<_>>(),
        "first_event_pickup_ms": {
            "p50": percentile(&pickups, 0.5),
            "p99": percentile(&pickups, 0.99),
            "max": pickups.last().copied().unwrap_or(0.0),
            "samples": pickups.len(),
        },
    }))
}

/// The table rows of one [`scale_one`] run over `n` sources.
pub(crate) fn scale_rows(n: usize, s: &Value) -> Vec<(String, String)> {
    vec![
        (
            format!("{n} idle sources: relay cores, RSS, connections/source, statements/s per db"),
            format!(
                "{:.4}, {:.0} MiB, {:.2}, {:.3} ({} of {n} asleep)",
                s["relay_cores"].as_f64().unwrap_or(0.0),
                s["rss_mib"].as_f64().unwrap_or(0.0),
                s["connections_per_source"].as_f64().unwrap_or(0.0),
                s["statements_per_s_per_db"].as_f64().unwrap_or(0.0),
                s["asleep"].as_f64().unwrap_or(0.0),
            ),
        ),
        (
            format!("{n} idle sources: statements/s per db, the most run"),
            s["top_statements"]
                .as_array()
                .into_iter()
                .flatten()
                .take(4)
                .map(|t| {
                    format!(
                        "{:.3} {}",
                        t["per_s_per_db"].as_f64().unwrap_or(0.0),
                        t["statement"].as_str().unwrap_or("")
                    )
                })
                .collect::<Vec<_>>()
                .join(" | "),
        ),
        (
            format!("{n} idle sources: first event after the quiet spell, commit→file"),
            format!(
                "p50 {:.1} ms, p99 {:.1} ms ({} samples)",
                s["first_event_pickup_ms"]["p50"].as_f64().unwrap_or(0.0),
                s["first_event_pickup_ms"]["p99"].as_f64().unwrap_or(0.0),
                s["first_event_pickup_ms"]["samples"].as_u64().unwrap_or(0),
            ),
        ),
    ]
}
