//! `--only mysql`: a MySQL/MariaDB outbox (issue 44). outroute draining
//! the same pre-filled 1 KB events as the PostgreSQL drain, from the
//! machine's MariaDB canonical table, timed from the relay's start to the
//! last event an independent consumer read and to the last row marked;
//! the relay's and `mariadbd`'s CPU per event beside it.

use super::*;
use outroute_e2e::MyDb;
use sqlx::mysql::MySqlPool;

/// Insert `n` 1 KB events (multi-row INSERTs from 4 connections), one
/// aggregate per event.
async fn fill_mysql(pool: &MySqlPool, n: usize) -> Result<()> {
    let per = n.div_ceil(4);
    let mut tasks = Vec::new();
    for w in 0..4 {
        let pool = pool.clone();
        tasks.push(tokio::spawn(async move {
            let (lo, hi) = (w * per, ((w + 1) * per).min(n));
            let mut i = lo;
            while i < hi {
                let end = (i + 500).min(hi);
                let mut qb = sqlx::QueryBuilder::new(
                    "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) ",
                );
                qb.push_values(i..end, |mut b, k| {
                    b.push_bind(uuid::Uuid::new_v4().to_string())
                        .push_bind("order")
                        .push_bind(format!("o-{k}"))
                        .push_bind("order-created")
                        .push_bind(payload(k).to_string());
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
    Ok(())
}

pub(crate) async fn mysql_drain(n: usize, sink: &str, concurrency: u32) -> Result<Value> {
    let db = MyDb::new().await?;
    let t = tag();
    if sink == "kafka" {
        create_topics(&t).await?;
    } else {
        nats_stream(&format!("B{t}"), vec![format!("b{t}.>")]).await?;
    }
    let dir = test_dir("mysql-drain");
    let http = outroute_e2e::free_addr();
    let config = write_config(
        &dir,
        &db.url,
        &format!("batch_size = 1000\nconcurrency = {concurrency}\nlanes = 64"),
        &relay_body(sink, &t, &http),
    )?;
    db.migrate(&config)?;
    fill_mysql(&db.pool, n).await?;
    let pending = "SELECT count(*) FROM outbox WHERE published_at = '1000-01-01 00:00:00'";
    let deadline = Instant::now() + Duration::from_secs(600);
    let consumer = consumer::start(sink, &t, n, deadline);
    let db_cpu0 = group_cpu("mariadbd");
    let spawned = Instant::now();
    let mut relay = Relay::start(&config, &[("RUST_LOG", "warn")])?;
    let pid = relay.child.id();
    let confirmed = loop {
        let (_, m) = outroute_e2e::http_get(&http, "/metrics")
            .await
            .unwrap_or_default();
        let published =
            outroute_e2e::metric(&m, "outroute_events_published_total{route=\"orders\"}")
                .unwrap_or(0.0) as usize;
        if published >= n && db.count(pending).await == 0 {
            break Some(Instant::now());
        }
        if Instant::now() > deadline {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let received = consumer.await;
    let (cpu, rss) = proc_stats(pid);
    let db_cpu = group_cpu("mariadbd") - db_cpu0;
    relay.terminate(Duration::from_secs(15));
    let log = relay.log_text();
    db.drop_db().await;
    if sink == "nats" {
        outroute_e2e::drop_nats_stream(&format!("B{t}")).await;
    }
    let (confirmed, received) = match (confirmed, received) {
        (Some(c), Ok(Ok(r))) => (c, r),
        (None, _) => anyhow::bail!("mysql drain: not every event was marked within 600 s\n{log}"),
        (_, Ok(Err(e))) => anyhow::bail!("mysql drain: {e:#}"),
        (_, Err(e)) => anyhow::bail!("mysql drain: the consumer task failed: {e}"),
    };
    let secs = (received - spawned).as_secs_f64().max(1e-3);
    let secs_confirmed = (confirmed - spawned).as_secs_f64().max(1e-3);
    let window = secs.max(secs_confirmed);
    Ok(json!({
        "events": n,
        "clock": "relay start → last event at an independent consumer (events_per_s); → the last row marked (events_per_s_confirmed)",
        "seconds": secs,
        "events_per_s": n as f64 / secs,
        "seconds_confirmed": secs_confirmed,
        "events_per_s_confirmed": n as f64 / secs_confirmed,
        "cores": cpu / window,
        "mariadb_cores": db_cpu / window,
        "relay_us_per_event": cpu * 1e6 / n.max(1) as f64,
        "mariadb_us_per_event": db_cpu * 1e6 / n.max(1) as f64,
        "peak_rss_mib": rss,
    }))
}
