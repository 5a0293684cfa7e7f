//! MySQL/MariaDB outboxes (issue 44), against the machine's MariaDB: the
//! same workload, the same invariant checker and the same faults as the
//! PostgreSQL suites — rolled-back transactions never published, every
//! committed event delivered in per-aggregate order through the four crash
//! points, three relays with kills, a relay that lost its lanes marking
//! nothing, a late-committing AUTO_INCREMENT row (also under a deep drain,
//! past the claim floors), a failing event that
//! holds back only its own aggregate. (Mapped tables and one plugin across
//! databases: `mysql_tables.rs`; network faults and a server crash:
//! `mysql_faults.rs`.)

use std::time::Duration;

use outroute::store::FailureKind;
use outroute_e2e::*;

const POINTS: [&str; 4] = ["after-claim", "before-ack", "after-ack", "mid-mark"];

/// A relay config on `db` publishing to Kafka topic `t<t>.order-updated`.
fn kafka_config(
    db: &MyDb,
    dir: &std::path::Path,
    t: &str,
    relay: &str,
) -> anyhow::Result<std::path::PathBuf> {
    let route = format!(
        "config = {{ sink = \"kafka\", topic = \"t{t}.{{event_type}}\" }}\nallow = {{ kafka = [\"t{t}.*\"] }}"
    );
    write_config(
        dir,
        &db.url,
        relay,
        &relay_body("", &[TestSink::Kafka], "order-router", "orders", &route),
    )
}

const PENDING: &str = "SELECT count(*) FROM outbox WHERE published_at = '1000-01-01 00:00:00'";

#[tokio::test(flavor = "multi_thread")]
async fn a_mysql_outbox_reaches_the_broker_in_order_and_rolled_back_events_never()
-> anyhow::Result<()> {
    let db = MyDb::new().await?;
    let t = tag();
    let topic = format!("t{t}.order-updated");
    create_topic(&topic, 3).await?;
    let dir = test_dir("mysql-e2e");
    let config = kafka_config(&db, &dir, &t, "lanes = 8\nbatch_size = 50")?;
    db.migrate(&config)?;
    // The lane column and its index are there: claims walk it.
    assert_eq!(
        db.count(
            "SELECT count(*) FROM information_schema.statistics WHERE table_schema = DATABASE() \
             AND table_name = 'outbox' AND index_name = 'outbox_outroute_lanes8'"
        )
        .await,
        4,
        "lane index (lane, published_at, failed_at, seq)"
    );
    let mut relay = Relay::start(&config, &[])?;
    let work = produce_mysql(&db.pool, "agg", 60, 10, 7).await?;
    assert!(!work.rolled_back.is_empty());
    let drained = eventually(Duration::from_secs(60), || async {
        db.count(PENDING).await == 0
    })
    .await;
    assert!(drained, "events left pending\n{}", relay.log_text());
    let delivered = consume_kafka(&topic, 3, work.committed.len(), Duration::from_secs(60))?;
    let report = check(&work, &delivered);
    println!("mysql: {report}");
    report.assert_clean();
    assert_eq!(report.lost, 0);
    // Rolled-back rows never existed: the table holds exactly the committed events.
    assert_eq!(
        db.count("SELECT count(*) FROM outbox").await,
        work.committed.len() as i64
    );

    let c = config.to_string_lossy().to_string();
    let (code, out, err) = cli(&["status", "--json", "-c", &c])?;
    assert_eq!(code, 0, "{out}{err}");
    let v: serde_json::Value = serde_json::from_str(&out)?;
    let s = v.as_array().and_then(|a| a.first()).unwrap_or(&v);
    assert_eq!(s["backlog"], 0, "{out}");
    assert_eq!(s["relays"].as_array().map(Vec::len), Some(1), "{out}");
    relay.terminate(Duration::from_secs(15));
    db.drop_db().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn crash_at_every_point_on_mysql_loses_nothing_and_keeps_order() -> anyhow::Result<()> {
    let iterations: usize = std::env::var("OUTROUTE_CRASH_ITERATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    let db = MyDb::new().await?;
    let t = tag();
    let topic = format!("t{t}.order-updated");
    create_topic(&topic, 3).await?;
    let dir = test_dir("mysql-crash");
    let config = kafka_config(
        &db,
        &dir,
        &t,
        "lease_ttl = \"1s\"\nlanes = 8\nbatch_size = 40\nconcurrency = 2",
    )?;
    db.migrate(&config)?;
    let mut all = Workload::default();
    let mut duplicates = 0;
    for point in POINTS {
        for i in 0..iterations {
            let w = produce_mysql(&db.pool, &format!("{point}-{i}"), 20, 6, 9).await?;
            all.committed.extend(w.committed);
            all.rolled_back.extend(w.rolled_back);
            let hit = (1 + i % 3).to_string();
            let mut relay = Relay::start(
                &config,
                &[
                    ("OUTROUTE_FAILPOINT", point),
                    ("OUTROUTE_FAILPOINT_HIT", &hit),
                ],
            )?;
            let status = relay.wait_exit(Duration::from_secs(60));
            let log = relay.log_text();
            assert!(
                status.is_some_and(|s| !s.success())
                    && log.contains(&format!("failpoint `{point}` reached")),
                "relay did not crash at {point} (built with --features failpoints? scripts/test does that): {status:?}\n{log}"
            );
        }
        all.committed.sort_by_key(|e| e.seq);
        let mut relay = Relay::start(&config, &[])?;
        let drained = eventually(Duration::from_secs(60), || async {
            db.count(PENDING).await == 0
        })
        .await;
        assert!(
            drained,
            "rows left unmarked after the crashes at {point}\n{}",
            relay.log_text()
        );
        relay.terminate(Duration::from_secs(15));
        let delivered = consume_kafka(&topic, 3, all.committed.len(), Duration::from_secs(120))?;
        let report = check(&all, &delivered);
        println!("mysql, after {iterations} crashes at {point}: {report}");
        report.assert_clean();
        // Between the ack and the mark a crash must re-send, never lose.
        if point == "after-ack" || point == "mid-mark" {
            assert!(
                report.duplicates > duplicates,
                "{iterations} crashes at {point} sent nothing twice: {report}"
            );
        }
        duplicates = report.duplicates;
    }
    db.drop_db().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn three_relays_with_kills_on_mysql_keep_per_aggregate_order() -> anyhow::Result<()> {
    let db = MyDb::new().await?;
    let t = tag();
    let topic = format!("t{t}.order-updated");
    create_topic(&topic, 4).await?;
    let dir = test_dir("mysql-three");
    let config = kafka_config(
        &db,
        &dir,
        &t,
        "lease_ttl = \"2s\"\nlanes = 32\nbatch_size = 200",
    )?;
    db.migrate(&config)?;
    // Relay 0 dies right after the broker acknowledged its second batch,
    // before marking it; the others take its lanes and send it again.
    let mut relays: Vec<Relay> = vec![Relay::start(
        &config,
        &[
            ("OUTROUTE_FAILPOINT", "after-ack"),
            ("OUTROUTE_FAILPOINT_HIT", "2"),
        ],
    )?];
    for _ in 1..3 {
        relays.push(Relay::start(&config, &[])?);
    }
    let pool = db.pool.clone();
    let producer = tokio::spawn(async move { produce_mysql(&pool, "agg", 300, 10, 0).await });
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
    for round in 0..3usize {
        tokio::time::sleep(Duration::from_millis(600 + 300 * round as u64)).await;
        let victim = (round * 7 + uuid::Uuid::new_v4().as_u128() as usize) % 3;
        relays[victim].kill();
        tokio::time::sleep(Duration::from_millis(400)).await;
        relays[victim] = Relay::start(&config, &[])?;
    }
    let work = producer.await??;
    assert_eq!(work.committed.len(), 3_000);
    let delivered = consume_kafka(&topic, 4, work.committed.len(), Duration::from_secs(180))?;
    let report = check(&work, &delivered);
    println!("mysql, three relays with kills: {report}");
    report.assert_clean();
    assert!(
        report.duplicates >= 1,
        "the acknowledged, unmarked batch was not sent again: {report}"
    );
    let c = config.to_string_lossy().to_string();
    let live = |out: &str| {
        serde_json::from_str::<serde_json::Value>(out)
            .ok()
            .and_then(|v| v["relays"].as_array().map(Vec::len))
    };
    let three = eventually(Duration::from_secs(15), || async {
        cli(&["status", "--json", "-c", &c])
            .is_ok_and(|(code, out, _)| code == 0 && live(&out) == Some(3))
    })
    .await;
    assert!(
        three,
        "status does not show three live relays: {:?}",
        cli(&["status", "--json", "-c", &c])
    );
    for mut r in relays {
        r.terminate(Duration::from_secs(15));
    }
    db.drop_db().await;
    Ok(())
}

/// Fencing: a relay whose lanes were taken over (its lease lapsed: a pause,
/// a partition) marks and records nothing for them, even after it leases
/// them back (the epoch moved on); the new owner claims the same rows.
#[tokio::test(flavor = "multi_thread")]
async fn a_relay_that_lost_its_lanes_on_mysql_marks_nothing() -> anyhow::Result<()> {
    let db = MyDb::new().await?;
    let dir = test_dir("mysql-fence");
    let out = dir.join("out.jsonl");
    let config = write_config(
        &dir,
        &db.url,
        "lanes = 4\nlease_ttl = \"2s\"",
        &file_route_body(&out),
    )?;
    db.migrate(&config)?;
    let work = produce_mysql(&db.pool, "f", 8, 2, 0).await?;
    let a = open_store(&config, "relay-a").await?;
    let leases = a.lease_round().await?;
    assert_eq!(leases.lanes.len(), 4, "{leases:?}");
    let mut claimed = a.claim(&leases.lanes, 100).await?.claims;
    assert_eq!(claimed.len(), work.committed.len());
    for c in &mut claimed {
        let i = leases.lanes.iter().position(|l| *l == c.lane).unwrap_or(0);
        c.epoch = leases.epochs.get(i).copied();
    }
    // Relay A stalls past its lease (and heartbeat); relay B takes every lane.
    sqlx::query("UPDATE outroute_lanes SET lease_until = UTC_TIMESTAMP(6) - INTERVAL 1 SECOND")
        .execute(&db.pool)
        .await?;
    sqlx::query("UPDATE outroute_relays SET heartbeat_at = UTC_TIMESTAMP(6) - INTERVAL 10 SECOND")
        .execute(&db.pool)
        .await?;
    let b = open_store(&config, "relay-b").await?;
    let taken = b.lease_round().await?;
    assert_eq!(taken.lanes.len(), 4, "B took the lapsed lanes: {taken:?}");
    let refs: Vec<&outroute::store::Claim> = claimed.iter().collect();
    assert_eq!(
        a.mark_published(&refs).await?,
        0,
        "A marked rows of lanes it lost"
    );
    let failure = failure_of(&claimed[0], FailureKind::Failed { hold: true }, "late")?;
    assert_eq!(
        a.record_failures(&[failure]).await?,
        0,
        "A recorded a failure on a lane it lost"
    );
    // B lets them go, A leases them back: a new epoch, so A's old claims still mark nothing.
    b.release_all().await?;
    let back = a.lease_round().await?;
    assert_eq!(back.lanes.len(), 4);
    assert!(
        back.epochs
            .iter()
            .zip(&leases.epochs)
            .all(|(new, old)| new > old),
        "{back:?} vs {leases:?}"
    );
    assert_eq!(
        a.mark_published(&refs).await?,
        0,
        "A marked under an old epoch"
    );
    assert_eq!(db.count(PENDING).await, work.committed.len() as i64);
    // Claimed again under the new epoch, they mark.
    let mut again = a.claim(&back.lanes, 100).await?.claims;
    for c in &mut again {
        let i = back.lanes.iter().position(|l| *l == c.lane).unwrap_or(0);
        c.epoch = back.epochs.get(i).copied();
    }
    let refs: Vec<&outroute::store::Claim> = again.iter().collect();
    assert_eq!(a.mark_published(&refs).await?, work.committed.len() as u64);
    assert_eq!(db.count(PENDING).await, 0);
    db.drop_db().await;
    Ok(())
}

/// The shallow claim (every lane short: one statement over all lanes)
/// finds every pending row, claim after claim, and sorts nothing. MariaDB
/// 10.11 evaluated its `lane IN (…)` on the virtual lane column without
/// reading the column's base columns when the rows went through a filesort
/// (MDEV-28610's shape: a range on an index with a virtual column, ordered
/// by another column), so under load the claim returned some, none or all
/// of them by chance (binlog capture's first drain left rows pending for
/// good). On this quiet table the counts come out right either way; the
/// plan is what this test can see fail.
#[tokio::test(flavor = "multi_thread")]
async fn a_shallow_claim_on_mysql_finds_every_pending_row() -> anyhow::Result<()> {
    let db = MyDb::new().await?;
    let dir = test_dir("mysql-shallow");
    let out = dir.join("out.jsonl");
    let config = write_config(&dir, &db.url, "", &file_route_body(&out))?;
    db.migrate(&config)?;
    produce_mysql(&db.pool, "sh", 60, 20, 0).await?;
    // Most of them published already: their old index entries stay in
    // the pending range until purge, as under a drain.
    sqlx::query("UPDATE outbox SET published_at = UTC_TIMESTAMP(6) WHERE seq % 5 <> 0")
        .execute(&db.pool)
        .await?;
    let pending = db.count(PENDING).await as usize;
    assert!(pending > 100, "{pending}");
    let store = open_store(&config, "relay-shallow").await?;
    let leases = store.lease_round().await?;
    assert_eq!(leases.lanes.len(), 64, "{leases:?}");
    // The first claim walks each lane (deep) and finds them all short.
    let first = store.claim(&leases.lanes, 5000).await?;
    assert_eq!(first.claims.len(), pending);
    let mut counts = Vec::new();
    for _ in 0..30 {
        counts.push(store.claim(&leases.lanes, 5000).await?.claims.len());
    }
    assert!(
        counts.iter().all(|n| *n == pending),
        "{pending} pending, shallow claims found {counts:?}"
    );
    // What lost rows at random was the filesort of that range: the
    // shallow claim reads the lane index in its order, nothing sorted.
    let plan = store
        .mysql()
        .ok_or_else(|| anyhow::anyhow!("not a MySQL store"))?
        .explain_shallow(&leases.lanes, 5000)
        .await?;
    assert!(
        plan.contains("outbox_outroute_lanes64") && !plan.contains("filesort"),
        "{plan}"
    );
    db.drop_db().await;
    Ok(())
}

/// AUTO_INCREMENT numbers commit out of order: a transaction that took its
/// number first and commits last is still published (the claim walks each
/// lane from its oldest pending row, never from a high-water mark).
#[tokio::test(flavor = "multi_thread")]
async fn a_late_committing_auto_increment_row_on_mysql_is_published() -> anyhow::Result<()> {
    let db = MyDb::new().await?;
    let dir = test_dir("mysql-late");
    let out = dir.join("out.jsonl");
    let config = write_config(
        &dir,
        &db.url,
        "lanes = 1\npoll_max = \"100ms\"",
        &file_route_body(&out),
    )?;
    db.migrate(&config)?;
    let mut relay = Relay::start(&config, &[])?;
    let insert = "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
                  VALUES (?, 'order', ?, 'order-created', '{}')";
    let mut late = db.pool.begin().await?;
    let late_seq = sqlx::query(insert)
        .bind("late")
        .bind("a-1")
        .execute(&mut *late)
        .await?
        .last_insert_id();
    let early_seq = sqlx::query(insert)
        .bind("early")
        .bind("a-2")
        .execute(&db.pool)
        .await?
        .last_insert_id();
    assert!(late_seq < early_seq);
    let early = eventually(Duration::from_secs(20), || async {
        file_sink_deliveries(&out).len() == 1
    })
    .await;
    assert!(
        early,
        "the committed row was not published\n{}",
        relay.log_text()
    );
    // Well past the later row: a high-water mark would have moved beyond it.
    tokio::time::sleep(Duration::from_millis(500)).await;
    late.commit().await?;
    let both = eventually(Duration::from_secs(20), || async {
        file_sink_deliveries(&out).len() == 2
    })
    .await;
    let ids: Vec<String> = file_sink_deliveries(&out)
        .iter()
        .map(|d| d.id().to_string())
        .collect();
    assert!(
        both,
        "the late-committing row was not published: {ids:?}\n{}",
        relay.log_text()
    );
    assert_eq!(ids, ["early", "late"]);
    // Marked after the sink's ack: moments after the file has the line.
    let marked = eventually(Duration::from_secs(10), || async {
        db.count(PENDING).await == 0
    })
    .await;
    assert!(
        marked,
        "a delivered row stayed pending\n{}",
        relay.log_text()
    );
    relay.terminate(Duration::from_secs(15));
    db.drop_db().await;
    Ok(())
}

/// Claim floors (`store/mysql/floor.rs`) under a deep drain: producers
/// keep 10,000–12,000 rows pending while a transaction holds a row with an
/// early AUTO_INCREMENT number open for 3 s; the floors rise meanwhile (the
/// relay publishes tens of thousands of later rows), yet never past the
/// open row, so the next claim after its commit finds it (a floor that
/// passed it would leave it to the sweep below the floors, 30 s later).
/// Then everything drains: no loss, each aggregate in order.
#[tokio::test(flavor = "multi_thread")]
async fn a_late_committing_row_under_a_deep_drain_on_mysql_is_published_at_once()
-> anyhow::Result<()> {
    let db = MyDb::new().await?;
    let dir = test_dir("mysql-floors");
    let out = dir.join("out.jsonl");
    let config = write_config(&dir, &db.url, "lanes = 1", &file_route_body(&out))?;
    db.migrate(&config)?;
    let mut relay = Relay::start(&config, &[])?;
    // Producers: 2,000 rows per transaction while fewer than 10,000 wait
    // (the relay passes the open row within a second of its insert).
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let producer = {
        let (pool, stop) = (db.pool.clone(), stop.clone());
        tokio::spawn(async move {
            let mut batch = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let pending: i64 = sqlx::query_scalar(PENDING).fetch_one(&pool).await?;
                if pending >= 10_000 {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
                batch += 1;
                sqlx::query(
                    "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
                     SELECT CONCAT('p', ?, '-', seq), 'order', CONCAT('a-', seq % 50), 'order-updated', '{}' \
                     FROM seq_1_to_2000",
                )
                .bind(batch)
                .execute(&pool)
                .await?;
            }
            anyhow::Ok(batch)
        })
    };
    let published = "SELECT count(*) FROM outbox WHERE published_at > '1000-01-01 00:00:00'";
    let started = eventually(Duration::from_secs(60), || async {
        db.count(published).await >= 20_000
    })
    .await;
    assert!(started, "the drain did not get going\n{}", relay.log_text());
    let mut late = db.pool.begin().await?;
    sqlx::query(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         VALUES ('late', 'order', 'late-1', 'order-updated', '{}')",
    )
    .execute(&mut *late)
    .await?;
    let before = db.count(published).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let during = db.count(published).await - before;
    late.commit().await?;
    let committed = std::time::Instant::now();
    let late_published = eventually(Duration::from_secs(30), || async {
        db.count(
            "SELECT count(*) FROM outbox WHERE id = 'late' AND published_at > '1000-01-01 00:00:00'",
        )
        .await
            == 1
    })
    .await;
    let waited = committed.elapsed();
    let pending_then = db.count(PENDING).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    producer.await??;
    assert!(
        during > 5_000,
        "the relay published only {during} rows while the row was open: no floor could rise"
    );
    assert!(
        late_published && waited < Duration::from_secs(8),
        "the late row was published {waited:?} after its commit (still pending: {late_published}), \
         with {pending_then} rows pending\n{}",
        relay.log_text()
    );
    let drained = eventually(Duration::from_secs(180), || async {
        db.count(PENDING).await == 0
    })
    .await;
    assert!(drained, "the backlog did not drain\n{}", relay.log_text());
    relay.terminate(Duration::from_secs(15));
    let rows: Vec<(String, String, i64)> = sqlx::query_as(
        "SELECT CAST(id AS CHAR), CAST(aggregate_id AS CHAR), seq FROM outbox ORDER BY seq",
    )
    .fetch_all(&db.pool)
    .await?;
    let w = Workload {
        committed: rows
            .into_iter()
            .map(|(id, aggregate_id, seq)| Expected {
                id,
                aggregate_id,
                seq,
            })
            .collect(),
        rolled_back: Vec::new(),
    };
    let report = check(&w, &file_sink_deliveries(&out));
    println!("late row after {waited:?}, {during} published while it was open; {report}");
    report.assert_clean();
    db.drop_db().await;
    Ok(())
}

/// A failing event goes to the failed state with its reason, holds back
/// the later events of its aggregate only, and `failed discard` lets them go.
#[tokio::test(flavor = "multi_thread")]
async fn a_failing_event_on_mysql_holds_back_only_its_aggregate() -> anyhow::Result<()> {
    let db = MyDb::new().await?;
    let dir = test_dir("mysql-fail");
    let out = dir.join("out.jsonl");
    // Topics outside `orders.order-*` are refused by the route's allow-list.
    let route = "config = { sink = \"file\", topic = \"orders.{event_type}\" }\nallow = { file = [\"orders.order-*\"] }";
    let config = write_config(
        &dir,
        &db.url,
        "lanes = 2\npoll_max = \"100ms\"",
        &relay_body("", &[TestSink::File(&out)], "order-router", "orders", route),
    )?;
    db.migrate(&config)?;
    let insert = |id: &'static str, agg: &'static str, ty: &'static str| {
        sqlx::query(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES (?, 'order', ?, ?, '{}')",
        )
        .bind(id)
        .bind(agg)
        .bind(ty)
    };
    insert("bad-1", "held", "refund").execute(&db.pool).await?;
    insert("held-2", "held", "order-updated")
        .execute(&db.pool)
        .await?;
    insert("free-1", "free", "order-created")
        .execute(&db.pool)
        .await?;
    let mut relay = Relay::start(&config, &[])?;
    let c = config.to_string_lossy().to_string();
    let failed = eventually(Duration::from_secs(20), || async {
        cli(&["failed", "list", "--json", "-c", &c])
            .is_ok_and(|(code, out, _)| code == 0 && out.contains("bad-1"))
    })
    .await;
    let (_, list, _) = cli(&["failed", "list", "--json", "-c", &c])?;
    assert!(failed, "bad-1 not failed: {list}\n{}", relay.log_text());
    assert!(
        list.contains("orders.refund"),
        "the reason names the refused topic: {list}"
    );
    let free = eventually(Duration::from_secs(20), || async {
        file_sink_deliveries(&out)
            .iter()
            .any(|d| d.id() == "free-1")
    })
    .await;
    assert!(
        free,
        "the other aggregate was held back too\n{}",
        relay.log_text()
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !file_sink_deliveries(&out)
            .iter()
            .any(|d| d.id() == "held-2"),
        "an event went out before the failed event of its aggregate"
    );
    let (code, o, e) = cli(&["failed", "discard", "--id", "bad-1", "-c", &c])?;
    assert_eq!(code, 0, "{o}{e}");
    let released = eventually(Duration::from_secs(20), || async {
        file_sink_deliveries(&out)
            .iter()
            .any(|d| d.id() == "held-2")
    })
    .await;
    assert!(
        released,
        "discarding the failed event did not release its aggregate\n{}",
        relay.log_text()
    );
    relay.terminate(Duration::from_secs(15));
    db.drop_db().await;
    Ok(())
}

/// Lease loss mid-batch, end to end: a relay frozen (SIGSTOP at a
/// failpoint) after claiming, while publishing, or after the broker's ack
/// loses its lanes to a second relay, which publishes everything; thawed,
/// the first publishes nothing for the lanes it lost (at most the one
/// message it was sending), marks nothing (`outroute_mark_fenced_total`),
/// and keeps running.
#[tokio::test(flavor = "multi_thread")]
async fn a_relay_frozen_past_its_lease_on_mysql_publishes_nothing_for_lost_lanes()
-> anyhow::Result<()> {
    let settings = "lease_ttl = \"2s\"\nlanes = 8\nbatch_size = 400\nconcurrency = 1";
    for (point, may_duplicate, noticed) in [
        (
            "after-claim",
            0usize,
            "lane lease expired before publishing",
        ),
        ("mid-publish", 1, "lane lease lapsed while publishing"),
        (
            "after-ack",
            usize::MAX,
            "lane lease lost: rows were published but not marked",
        ),
    ] {
        let db = MyDb::new().await?;
        frozen_past_its_lease(&db, point, ("", settings), may_duplicate, &[noticed]).await?;
        db.drop_db().await;
    }
    Ok(())
}
