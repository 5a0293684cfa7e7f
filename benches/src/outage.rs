//! Section 8: one source's database stopped mid-run; the other source's
//! commit→ack under steady load, with and without the outage.

use super::*;

/// Two sources in one relay, `a` on the shared cluster and `b` on a
/// cluster of its own; `rate` events/s into `a` for `secs` seconds with
/// `b`'s database up, then `secs` more with it stopped. `a`'s
/// commit→broker-ack quantiles (the relay's histogram, per phase) show
/// what `b`'s outage costs the other source; every event of `a` must be
/// published within 60 s of the writers stopping, or the run fails.
pub(crate) async fn source_outage(secs: u64, rate: u64) -> Result<Value> {
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
