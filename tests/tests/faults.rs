//! Fault injection (seed article 000): kill the relay at exact points —
//! after claiming, after handing messages to the broker but before the ack,
//! after the ack but before marking, and between two marks — restart it,
//! and check that every committed event arrived, nothing rolled back did,
//! and per-aggregate order held. Also: three relays, one of which dies
//! right after a broker acknowledgement (the others send its unmarked batch
//! again), then random kills.
//!
//! `OUTROUTE_CRASH_ITERATIONS` sets the crashes per point (default 2; the
//! stress command `scripts/stress` uses 20).

use std::time::Duration;

use outroute_e2e::*;

const POINTS: [&str; 4] = ["after-claim", "before-ack", "after-ack", "mid-mark"];

fn kafka_config(
    dir: &std::path::Path,
    db: &TestDb,
    t: &str,
    relay: &str,
) -> anyhow::Result<std::path::PathBuf> {
    kafka_config_with(dir, db, t, relay, "")
}

/// With a `[store.table]` mapping (`""`: the canonical table).
fn kafka_config_with(
    dir: &std::path::Path,
    db: &TestDb,
    t: &str,
    relay: &str,
    mapping: &str,
) -> anyhow::Result<std::path::PathBuf> {
    let route = format!(
        "config = {{ sink = \"kafka\", topic = \"t{t}.{{event_type}}\" }}\nallow = {{ kafka = [\"t{t}.*\"] }}"
    );
    write_config(
        dir,
        &db.url,
        relay,
        &format!(
            "{mapping}{}",
            relay_body("", &[TestSink::Kafka], "order-router", "orders", &route)
        ),
    )
}

/// The canonical table's default marking, the pending queue: a crash
/// between the ack and the queue entry's delete re-publishes, never loses.
#[tokio::test(flavor = "multi_thread")]
async fn crash_at_every_point_loses_nothing_and_keeps_order() -> anyhow::Result<()> {
    crash_at_every_point(
        "",
        "SELECT count(*) FROM outroute_queue WHERE source = 'outbox'",
    )
    .await
}

/// The same crash points with rows stamped by `published_at`.
#[tokio::test(flavor = "multi_thread")]
async fn crash_at_every_point_under_published_at_loses_nothing_and_keeps_order()
-> anyhow::Result<()> {
    crash_at_every_point(
        &example_table("outbox-published-at.toml")?,
        "SELECT count(*) FROM outbox WHERE published_at IS NULL",
    )
    .await
}

async fn crash_at_every_point(mapping: &str, unmarked: &str) -> anyhow::Result<()> {
    let iterations: usize = std::env::var("OUTROUTE_CRASH_ITERATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    let db = TestDb::new().await?;
    let t = tag();
    let topic = format!("t{t}.order-updated");
    create_topic(&topic, 3).await?;
    let dir = test_dir("crash");
    let config = kafka_config_with(
        &dir,
        &db,
        &t,
        "lease_ttl = \"1s\"\nlanes = 8\nbatch_size = 40\nconcurrency = 2",
        mapping,
    )?;
    db.migrate(&config)?;
    if !mapping.is_empty() {
        let c = config.to_string_lossy().to_string();
        let (code, out, err) = cli(&["migrate", "--table", "-c", &c])?;
        anyhow::ensure!(code == 0, "migrate --table: {out}{err}");
    }

    // Point by point: the crashes, then a relay that does not crash
    // finishes what they left. A crash after the broker acknowledged and
    // before the mark (`after-ack`, `mid-mark`) must show as duplicates:
    // the next relay sends the acknowledged events again. None would mean
    // the point no longer sits between the two (moved after the mark, a
    // crash there proves nothing about ack-before-mark).
    let mut all = Workload::default();
    let mut crashes = 0;
    let mut duplicates = 0;
    for point in POINTS {
        let (w, n) = crash_at_points(&db.pool, &config, &[point], iterations).await?;
        all.committed.extend(w.committed);
        all.rolled_back.extend(w.rolled_back);
        all.committed.sort_by_key(|e| e.seq);
        crashes += n;
        let mut relay = Relay::start(&config, &[])?;
        assert!(
            eventually(Duration::from_secs(60), || async {
                db.count(unmarked).await == 0
            })
            .await,
            "rows left unmarked after the crashes at {point}\n{}",
            relay.log_text()
        );
        relay.terminate(Duration::from_secs(15));
        let delivered = consume_kafka(&topic, 3, all.committed.len(), Duration::from_secs(120))?;
        let report = check(&all, &delivered);
        println!("after {iterations} crashes at {point}: {report}");
        report.assert_clean();
        if point == "after-ack" || point == "mid-mark" {
            assert!(
                report.duplicates > duplicates,
                "{iterations} crashes at {point} sent nothing twice: {report}"
            );
        }
        duplicates = report.duplicates;
    }
    println!("crash points: {iterations} crashes per point ({crashes} total)");
    let mut relay = Relay::start(&config, &[])?;
    // Business data and event intent agree: one published event per committed transaction.
    assert_eq!(
        db.count("SELECT count(*) FROM outbox").await,
        all.committed.len() as i64
    );
    relay.terminate(Duration::from_secs(15));
    db.drop_db().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn three_relays_with_kills_keep_per_aggregate_order() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let t = tag();
    let topic = format!("t{t}.order-updated");
    create_topic(&topic, 4).await?;
    let dir = test_dir("three");
    let config = kafka_config(
        &dir,
        &db,
        &t,
        "lease_ttl = \"2s\"\nlanes = 32\nbatch_size = 200",
    )?;
    db.migrate(&config)?;

    // Relay 0 dies (abort, as kill -9) right after the broker acknowledged
    // its third batch, before marking it: a kill that certainly hits work
    // in flight. The others take its lanes and send that batch again.
    let mut relays: Vec<Relay> = vec![Relay::start(
        &config,
        &[
            ("OUTROUTE_FAILPOINT", "after-ack"),
            ("OUTROUTE_FAILPOINT_HIT", "3"),
        ],
    )?];
    for _ in 1..3 {
        relays.push(Relay::start(&config, &[])?);
    }
    let pool = db.pool.clone();
    let producer = tokio::spawn(async move { produce(&pool, "agg", 500, 20, 0).await });
    let died = relays[0].wait_exit(Duration::from_secs(60));
    assert!(
        died.is_some_and(|s| !s.success())
            && relays[0]
                .log_text()
                .contains("failpoint `after-ack` reached"),
        "relay 0 did not die after an acknowledgement: {died:?}\n{}",
        relays[0].log_text()
    );
    relays[0] = Relay::start(&config, &[])?;
    // Then kill relays at random moments while events flow, restart them.
    let mut kills = 1;
    for round in 0..3usize {
        tokio::time::sleep(Duration::from_millis(700 + 300 * round as u64)).await;
        let victim = (round * 7 + uuid::Uuid::new_v4().as_u128() as usize) % 3;
        relays[victim].kill();
        kills += 1;
        tokio::time::sleep(Duration::from_millis(500)).await;
        relays[victim] = Relay::start(&config, &[])?;
    }
    let work = producer.await??;
    assert_eq!(work.committed.len(), 10_000);
    let delivered = consume_kafka(&topic, 4, work.committed.len(), Duration::from_secs(180))?;
    let report = check(&work, &delivered);
    println!("three relays, {kills} kills: {report}");
    report.assert_clean();
    assert!(
        report.duplicates >= 1,
        "the batch relay 0 had acknowledged but not marked was not sent again: {report}"
    );
    // Work was shared: the status command sees three live relays (a killed
    // relay's heartbeat ages out after lease_ttl).
    let cfg = config.to_str().unwrap_or_default().to_string();
    let live = |out: &str| {
        serde_json::from_str::<serde_json::Value>(out)
            .ok()
            .and_then(|v| v["relays"].as_array().map(Vec::len))
    };
    let three = eventually(Duration::from_secs(15), || async {
        cli(&["status", "--json", "-c", &cfg])
            .is_ok_and(|(code, out, _)| code == 0 && live(&out) == Some(3))
    })
    .await;
    let (_, out, err) = cli(&["status", "--json", "-c", &cfg])?;
    assert!(three, "{out}{err}");
    for mut r in relays {
        r.terminate(Duration::from_secs(15));
    }
    db.drop_db().await;
    Ok(())
}
