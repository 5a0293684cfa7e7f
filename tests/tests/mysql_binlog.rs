//! Binlog capture on MariaDB (`capture = "binlog"`, issue 44), against the
//! own server of `scripts/mariadb-own` (binlog on, ROW, full images): the
//! same workload and invariant checker as the lease-mode suites
//! (`mysql.rs`). Rows written before the first start, restarts from the
//! recorded GTID position (and `status` and the lag gauge showing it), a
//! purged binlog, the four crash points, three
//! relays (one streams, two wait) with kills, a failing event that holds
//! back only its aggregate, a kill in the middle of a 50,000-row producer
//! transaction, a streaming relay frozen past its lease, a late-committing
//! AUTO_INCREMENT row, the seed's `t_outbox`, and a server without a
//! row-based binlog refused by name.
//!
//! One concern, one file: the end-to-end tests of binlog capture on its
//! own server, which share its binlog files (the purge test runs alone);
//! faults with the network or the server in the way are in
//! `mysql_faults.rs`, with the lease-mode ones.

use std::time::Duration;

use outroute_e2e::*;
use sqlx::Executor;

const POINTS: [&str; 4] = ["after-claim", "before-ack", "after-ack", "mid-mark"];

const PENDING: &str = "SELECT count(*) FROM outbox WHERE published_at = '1000-01-01 00:00:00'";

/// Purging the server's binary logs would pull the rug from under the
/// other tests' streams: that test runs alone (write), the others beside
/// each other (read).
static BINLOG_FILES: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

/// A binlog-capture relay config on `db` publishing to Kafka topic
/// `t<t>.order-updated`.
fn binlog_config(
    db: &MyDb,
    dir: &std::path::Path,
    t: &str,
    relay: &str,
) -> anyhow::Result<std::path::PathBuf> {
    kafka_topic_config(dir, &db.url, "capture = \"binlog\"", t, relay)
}

async fn own_db() -> anyhow::Result<MyDb> {
    MyDb::new_at(&mariadb_own_admin_url()?).await
}

async fn drained(db: &MyDb, relay: &Relay, within: Duration) {
    let done = eventually(within, || async { db.count(PENDING).await == 0 }).await;
    assert!(
        done,
        "{} events left pending\n{}",
        db.count(PENDING).await,
        relay.log_text()
    );
}

/// Wait until `relay` streams from the binlog.
async fn streaming(relay: &Relay) {
    let streaming = eventually(Duration::from_secs(30), || async {
        relay.log_text().contains("streaming from the binary log")
    })
    .await;
    assert!(streaming, "not streaming\n{}", relay.log_text());
}

#[tokio::test(flavor = "multi_thread")]
async fn binlog_capture_publishes_in_order_through_restarts_and_a_purged_binlog()
-> anyhow::Result<()> {
    let _alone = BINLOG_FILES.write().await;
    let db = own_db().await?;
    let t = tag();
    let topic = format!("t{t}.order-updated");
    create_topic(&topic, 3).await?;
    let dir = test_dir("binlog-e2e");
    let config = binlog_config(&db, &dir, &t, "lanes = 8\nbatch_size = 100")?;
    let http = free_addr();
    std::fs::write(
        &config,
        std::fs::read_to_string(&config)?.replace("listen = \"\"", &format!("listen = \"{http}\"")),
    )?;
    let cfg = config.display().to_string();
    db.migrate(&config)?;
    let mut all = Workload::default();
    let mut add = |w: Workload| {
        all.committed.extend(w.committed);
        all.rolled_back.extend(w.rolled_back);
    };
    // Written before the relay ever ran: the stream will never bring them.
    add(produce_mysql(&db.pool, "before", 40, 5, 7).await?);
    let mut relay = Relay::start(&config, &[])?;
    add(produce_mysql(&db.pool, "streamed", 60, 10, 7).await?);
    drained(&db, &relay, Duration::from_secs(60)).await;
    let recorded = eventually(Duration::from_secs(10), || async {
        db.count("SELECT count(*) FROM outroute_binlog WHERE backfilled = 1 AND position <> ''")
            .await
            == 1
    })
    .await;
    assert!(recorded, "no position recorded\n{}", relay.log_text());
    let log = relay.log_text();
    assert!(
        log.contains("streaming from the binary log"),
        "not streaming\n{log}"
    );

    // Stopped, events written meanwhile, started again: from the position.
    relay.terminate(Duration::from_secs(15));
    // `status` counts the transactions the server logged past the recorded
    // position: nothing else writes to this server while this test runs.
    let behind = || async {
        let (code, out, err) = cli(&["status", "--json", "-c", &cfg])?;
        anyhow::ensure!(code == 0, "status: {out}{err}");
        let v: serde_json::Value = serde_json::from_str(&out)?;
        Ok::<_, anyhow::Error>(v["binlog"].clone())
    };
    let before = behind().await?;
    assert_eq!(before["purged"], false, "{before}");
    assert_eq!(before["backfilled"], true, "{before}");
    db.pool
        .execute("CREATE TABLE noise (n INT PRIMARY KEY)")
        .await?;
    for n in 0..5 {
        sqlx::query("INSERT INTO noise VALUES (?)")
            .bind(n)
            .execute(&db.pool)
            .await?;
    }
    let after = behind().await?;
    let count = |v: &serde_json::Value| v["behind_transactions"].as_u64();
    assert_eq!(
        count(&after),
        count(&before).map(|n| n + 6),
        "a table and five inserts later\n{before}\n{after}"
    );
    assert_eq!(after["position"], before["position"], "{after}");
    add(produce_mysql(&db.pool, "while-stopped", 30, 4, 5).await?);
    let mut relay = Relay::start(&config, &[])?;
    drained(&db, &relay, Duration::from_secs(60)).await;
    assert!(
        !relay
            .log_text()
            .contains("no longer has the recorded position"),
        "{}",
        relay.log_text()
    );
    // How far behind the producers' commits capture is: exported once the
    // stream brought events (these came after the recorded position; the
    // first run's may all have been read from the table before it streamed).
    let lag = eventually(Duration::from_secs(10), || async {
        http_get(&http, "/metrics").await.is_ok_and(|(_, m)| {
            metric(&m, "outroute_capture_lag_seconds{source=\"default\"}")
                .is_some_and(|s| (0.0..60.0).contains(&s))
        })
    })
    .await;
    assert!(lag, "{:?}", http_get(&http, "/metrics").await);

    // Stopped again; the binlog that holds the position is purged.
    relay.terminate(Duration::from_secs(15));
    add(produce_mysql(&db.pool, "purged", 30, 4, 5).await?);
    // (Text protocol: these statements are not preparable.)
    // A file InnoDB may still need for crash recovery is kept until its
    // binlog checkpoint is written: purge until only the new file is left.
    db.pool.execute("FLUSH BINARY LOGS").await?;
    let file = current_binlog(&db).await?;
    let purged = eventually(Duration::from_secs(30), || async {
        let _ = db
            .pool
            .execute(format!("PURGE BINARY LOGS TO '{file}'").as_str())
            .await;
        oldest_binlog(&db).await.is_ok_and(|f| f == file)
    })
    .await;
    assert!(purged, "the older binlog files stayed");
    let gone = behind().await?;
    assert_eq!(gone["purged"], true, "{gone}");
    let (_, text, _) = cli(&["status", "-c", &cfg])?;
    assert!(
        text.contains("PURGED: the server no longer has what follows the recorded position"),
        "{text}"
    );
    let mut relay = Relay::start(&config, &[])?;
    drained(&db, &relay, Duration::from_secs(60)).await;
    let told = eventually(Duration::from_secs(10), || async {
        relay
            .log_text()
            .contains("no longer has the recorded position")
    })
    .await;
    assert!(told, "the purge went unnoticed\n{}", relay.log_text());

    // kill -9 while producers write: the next run starts at the position.
    let pool = db.pool.clone();
    let producer = tokio::spawn(async move { produce_mysql(&pool, "killed", 100, 10, 9).await });
    tokio::time::sleep(Duration::from_millis(700)).await;
    relay.kill();
    let mut relay = Relay::start(&config, &[])?;
    add(producer.await??);
    drained(&db, &relay, Duration::from_secs(60)).await;

    all.committed.sort_by_key(|e| e.seq);
    let delivered = consume_kafka(&topic, 3, all.committed.len(), Duration::from_secs(90))?;
    let report = check(&all, &delivered);
    println!("binlog, restarts and a purge: {report}");
    report.assert_clean();
    assert_eq!(
        db.count("SELECT count(*) FROM outbox").await,
        all.committed.len() as i64,
        "rolled-back rows never existed"
    );
    relay.terminate(Duration::from_secs(15));
    db.drop_db().await;
    Ok(())
}

async fn binlog_files(db: &MyDb) -> anyhow::Result<Vec<String>> {
    use sqlx::Row;
    let rows = db.pool.fetch_all("SHOW BINARY LOGS").await?;
    Ok(rows
        .iter()
        .filter_map(|r| r.try_get::<String, _>(0).ok())
        .collect())
}

async fn current_binlog(db: &MyDb) -> anyhow::Result<String> {
    binlog_files(db)
        .await?
        .pop()
        .ok_or_else(|| anyhow::anyhow!("SHOW BINARY LOGS listed nothing"))
}

async fn oldest_binlog(db: &MyDb) -> anyhow::Result<String> {
    binlog_files(db)
        .await?
        .into_iter()
        .next()
        .ok_or_else(|| anyhow::anyhow!("SHOW BINARY LOGS listed nothing"))
}

#[tokio::test(flavor = "multi_thread")]
async fn crash_at_every_point_in_binlog_mode_loses_nothing_and_keeps_order() -> anyhow::Result<()> {
    let _beside = BINLOG_FILES.read().await;
    let db = own_db().await?;
    let t = tag();
    let topic = format!("t{t}.order-updated");
    create_topic(&topic, 3).await?;
    let dir = test_dir("binlog-crash");
    let config = binlog_config(
        &db,
        &dir,
        &t,
        "lease_ttl = \"1s\"\nlanes = 8\nbatch_size = 40\nconcurrency = 2",
    )?;
    db.migrate(&config)?;
    // A first run records a position; each crash run then starts from it
    // with a backlog in the binlog (full batches: every point is reached).
    record_a_position(&db, &config).await?;
    let mut all = Workload::default();
    let mut duplicates = 0;
    for point in POINTS {
        let w = produce_mysql(&db.pool, point, 20, 6, 9).await?;
        all.committed.extend(w.committed);
        all.rolled_back.extend(w.rolled_back);
        let mut relay = Relay::start(
            &config,
            &[
                ("OUTROUTE_FAILPOINT", point),
                ("OUTROUTE_FAILPOINT_HIT", "2"),
            ],
        )?;
        let status = relay.wait_exit(Duration::from_secs(60));
        let log = relay.log_text();
        assert!(
            status.is_some_and(|s| !s.success())
                && log.contains(&format!("failpoint `{point}` reached")),
            "relay did not crash at {point} (built with --features failpoints? scripts/test does that): {status:?}\n{log}"
        );
        let mut relay = Relay::start(&config, &[])?;
        drained(&db, &relay, Duration::from_secs(60)).await;
        all.committed.sort_by_key(|e| e.seq);
        let delivered = consume_kafka(&topic, 3, all.committed.len(), Duration::from_secs(60))?;
        let report = check(&all, &delivered);
        println!("binlog, crash at {point}: {report}");
        report.assert_clean();
        duplicates = report.duplicates;
        relay.terminate(Duration::from_secs(15));
    }
    assert!(
        duplicates >= 1,
        "no crash point made anything go out twice: the crashes did not bite"
    );
    db.drop_db().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn three_binlog_relays_with_kills_keep_per_aggregate_order() -> anyhow::Result<()> {
    let _beside = BINLOG_FILES.read().await;
    let db = own_db().await?;
    let t = tag();
    let topic = format!("t{t}.order-updated");
    create_topic(&topic, 4).await?;
    let dir = test_dir("binlog-three");
    let config = binlog_config(&db, &dir, &t, "lease_ttl = \"2s\"\nbatch_size = 200")?;
    db.migrate(&config)?;
    let mut relays: Vec<Relay> = Vec::new();
    for _ in 0..3 {
        relays.push(Relay::start(&config, &[])?);
    }
    let pool = db.pool.clone();
    let producer = tokio::spawn(async move { produce_mysql(&pool, "agg", 300, 10, 0).await });
    for round in 0..4usize {
        tokio::time::sleep(Duration::from_millis(700 + 300 * round as u64)).await;
        // The streaming relay is the one that says so last; kill it, or
        // another, in turn.
        let victim = relays
            .iter()
            .position(|r| {
                let log = r.log_text();
                log.rfind("streaming from the binary log") > log.rfind("standby")
            })
            .unwrap_or(round % 3);
        relays[victim].kill();
        tokio::time::sleep(Duration::from_millis(300)).await;
        relays[victim] = Relay::start(&config, &[])?;
    }
    let work = producer.await??;
    assert_eq!(work.committed.len(), 3_000);
    let delivered = consume_kafka(&topic, 4, work.committed.len(), Duration::from_secs(180))?;
    let report = check(&work, &delivered);
    println!("binlog, three relays with kills: {report}");
    report.assert_clean();
    // One relay streams at a time: the others say they wait.
    let standbys = relays
        .iter()
        .filter(|r| {
            r.log_text()
                .contains("standby: waiting for the capture lease")
        })
        .count();
    assert!(standbys >= 1, "no relay waited as a standby");
    for mut r in relays {
        r.terminate(Duration::from_secs(15));
    }
    db.drop_db().await;
    Ok(())
}

/// A failing event goes to the failed state with its reason and holds back
/// the later events of its aggregate only, though the stream has moved on:
/// they wait in the table and go, in order, once it is discarded.
#[tokio::test(flavor = "multi_thread")]
async fn a_failing_event_in_binlog_mode_holds_back_only_its_aggregate() -> anyhow::Result<()> {
    let _beside = BINLOG_FILES.read().await;
    let db = own_db().await?;
    let dir = test_dir("binlog-fail");
    let out = dir.join("out.jsonl");
    let route = "config = { sink = \"file\", topic = \"orders.{event_type}\" }\nallow = { file = [\"orders.order-*\"] }";
    let config = write_config_with(
        &dir,
        &db.url,
        "capture = \"binlog\"",
        "lanes = 2",
        &relay_body("", &[TestSink::File(&out)], "order-router", "orders", route),
    )?;
    db.migrate(&config)?;
    let mut relay = Relay::start(&config, &[])?;
    streaming(&relay).await;
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
    insert("held-3", "held", "order-shipped")
        .execute(&db.pool)
        .await?;
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
        "the reason names the topic: {list}"
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
    tokio::time::sleep(Duration::from_millis(800)).await;
    let ids = |out: &std::path::Path| -> Vec<String> {
        file_sink_deliveries(out)
            .iter()
            .map(|d| d.id().to_string())
            .collect()
    };
    assert!(
        !ids(&out).iter().any(|id| id.starts_with("held-")),
        "an event went out before the failed event of its aggregate: {:?}",
        ids(&out)
    );
    // They wait in the table, pending, with a record saying why.
    assert_eq!(
        db.count(&format!("{PENDING} AND aggregate_id = 'held'"))
            .await,
        3
    );
    // A restart meanwhile changes nothing: the records hold them.
    relay.terminate(Duration::from_secs(15));
    let mut relay = Relay::start(&config, &[])?;
    let (code, o, e) = cli(&["failed", "discard", "--id", "bad-1", "-c", &c])?;
    assert_eq!(code, 0, "{o}{e}");
    let released = eventually(Duration::from_secs(20), || async {
        ids(&out).iter().any(|id| id == "held-3")
    })
    .await;
    assert!(
        released,
        "discarding the failed event did not release its aggregate\n{}",
        relay.log_text()
    );
    let held: Vec<String> = ids(&out)
        .into_iter()
        .filter(|id| id.starts_with("held-"))
        .collect();
    assert_eq!(held, ["held-2", "held-3"], "in order, once each");
    relay.terminate(Duration::from_secs(15));
    db.drop_db().await;
    Ok(())
}

/// One producer transaction of 50,000 rows, the relay killed while it is
/// publishing them (the reader holds only its memory budget of them), and
/// started again: every row goes out, in order, none is lost.
#[tokio::test(flavor = "multi_thread")]
async fn a_kill_in_the_middle_of_a_50000_row_transaction_loses_nothing() -> anyhow::Result<()> {
    let _beside = BINLOG_FILES.read().await;
    let db = own_db().await?;
    let t = tag();
    let topic = format!("t{t}.order-updated");
    create_topic(&topic, 3).await?;
    let dir = test_dir("binlog-huge");
    let config = binlog_config(&db, &dir, &t, "batch_size = 500")?;
    db.migrate(&config)?;
    let mut relay = Relay::start(&config, &[])?;
    streaming(&relay).await;
    let n = 50_000usize;
    let mut work = Workload::default();
    let mut tx = db.pool.begin().await?;
    for chunk in 0..(n / 1000) {
        let mut qb = sqlx::QueryBuilder::<sqlx::MySql>::new(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) ",
        );
        let rows: Vec<(String, String, usize)> = (0..1000)
            .map(|i| {
                let k = chunk * 1000 + i;
                (
                    uuid::Uuid::new_v4().to_string(),
                    format!("big-{}", k % 500),
                    k,
                )
            })
            .collect();
        qb.push_values(&rows, |mut b, (id, agg, k)| {
            b.push_bind(id)
                .push_bind("order")
                .push_bind(agg)
                .push_bind("order-updated")
                .push_bind(format!("{{\"n\":{k}}}"));
        });
        qb.build().execute(&mut *tx).await?;
        for (id, agg, _) in rows {
            work.committed.push(Expected {
                id,
                aggregate_id: agg,
                seq: 0,
            });
        }
    }
    tx.commit().await?;
    // Sequence numbers as the table has them: the order within the aggregate.
    let seqs: Vec<(String, i64)> = sqlx::query_as("SELECT CAST(id AS CHAR), seq FROM outbox")
        .fetch_all(&db.pool)
        .await?;
    let seq: std::collections::HashMap<String, i64> = seqs.into_iter().collect();
    for e in &mut work.committed {
        e.seq = seq.get(&e.id).copied().unwrap_or(0);
    }
    work.committed.sort_by_key(|e| e.seq);
    let midway = eventually(Duration::from_secs(60), || async {
        let left = db.count(PENDING).await;
        left > 0 && left < (n as i64) * 3 / 4
    })
    .await;
    assert!(midway, "never saw it midway\n{}", relay.log_text());
    relay.kill();
    let left = db.count(PENDING).await;
    assert!(left > 0, "nothing left to publish after the kill");
    let mut relay = Relay::start(&config, &[])?;
    drained(&db, &relay, Duration::from_secs(120)).await;
    let delivered = consume_kafka(&topic, 3, n, Duration::from_secs(120))?;
    let report = check(&work, &delivered);
    println!("binlog, kill inside a {n}-row transaction ({left} left at the kill): {report}");
    report.assert_clean();
    relay.terminate(Duration::from_secs(15));
    db.drop_db().await;
    Ok(())
}

/// The machine's shared MariaDB has no binary log: a binlog source there
/// does not start, and says which setting is missing.
#[tokio::test(flavor = "multi_thread")]
async fn binlog_capture_on_a_server_without_a_row_binlog_names_the_setting() -> anyhow::Result<()> {
    let db = MyDb::new().await?;
    let t = tag();
    let dir = test_dir("binlog-off");
    let config = binlog_config(&db, &dir, &t, "")?;
    let refused = db
        .migrate(&config)
        .expect_err("migrate accepted a server without a binlog");
    assert!(
        format!("{refused:#}")
            .contains("`binlog` needs the server's row-based binary log: the binary log is off"),
        "{refused:#}"
    );
    let mut relay = Relay::start(&config, &[])?;
    let told = eventually(Duration::from_secs(30), || async {
        relay
            .log_text()
            .contains("`binlog` needs the server's row-based binary log: the binary log is off")
    })
    .await;
    assert!(told, "{}", relay.log_text());
    relay.terminate(Duration::from_secs(15));
    db.drop_db().await;
    Ok(())
}

/// The seed's Spring `t_outbox` as it is, in binlog mode: rows written
/// before the first start and while streaming go out once each in
/// per-aggregate order and turn `SENT`; a streamed row that is not JSON
/// fails with its reason and stays `PENDING`, like one read from the table.
#[tokio::test(flavor = "multi_thread")]
async fn the_seed_t_outbox_is_relayed_from_the_binlog_as_it_is() -> anyhow::Result<()> {
    let _beside = BINLOG_FILES.read().await;
    let db = own_db().await?;
    sqlx::query(T_OUTBOX).execute(&db.pool).await?;
    let dir = test_dir("binlog-t-outbox");
    let out = dir.join("out.jsonl");
    let config = write_config_with(
        &dir,
        &db.url,
        &format!("capture = \"binlog\"\n{T_OUTBOX_MAPPING}"),
        "lanes = 4",
        &file_route_body(&out),
    )?;
    let c = config.to_string_lossy().to_string();
    let (code, o, e) = cli(&["migrate", "--table", "-c", &c])?;
    assert_eq!(code, 0, "{o}{e}");
    let bad = |id: &'static str| {
        sqlx::query(
            "INSERT INTO t_outbox (event_id, aggregate_type, aggregate_id, event_type, payload, status, retry_count, \
             create_time) VALUES (?, 'order', ?, 'order-created', 'not json', 'PENDING', 0, NOW())",
        )
        .bind(id)
        .bind(id)
    };
    bad("bad-before").execute(&db.pool).await?;
    let mut work = produce_t_outbox(&db.pool, "before", 10, 4, 7).await?;
    let mut relay = Relay::start(&config, &[])?;
    streaming(&relay).await;
    let w = produce_t_outbox(&db.pool, "streamed", 20, 6, 7).await?;
    work.committed.extend(w.committed);
    work.rolled_back.extend(w.rolled_back);
    bad("bad-streamed").execute(&db.pool).await?;
    let pending = "SELECT count(*) FROM t_outbox WHERE status = 'PENDING'";
    let drained = eventually(Duration::from_secs(60), || async {
        db.count(pending).await == 2 && file_sink_deliveries(&out).len() >= work.committed.len()
    })
    .await;
    assert!(
        drained,
        "{} pending, {} delivered of {}\n{}",
        db.count(pending).await,
        file_sink_deliveries(&out).len(),
        work.committed.len(),
        relay.log_text()
    );
    let report = check(&work, &file_sink_deliveries(&out));
    println!("t_outbox from the binlog: {report}");
    report.assert_clean();
    assert_eq!(
        db.count("SELECT count(*) FROM t_outbox WHERE status = 'SENT'")
            .await,
        work.committed.len() as i64
    );
    let failed = eventually(Duration::from_secs(10), || async {
        cli(&["failed", "list", "--json", "-c", &c]).is_ok_and(|(code, list, _)| {
            code == 0
                && list.contains("bad-before")
                && list.contains("bad-streamed")
                && list.contains("not valid JSON")
        })
    })
    .await;
    assert!(failed, "{:?}", cli(&["failed", "list", "--json", "-c", &c]));
    relay.terminate(Duration::from_secs(15));
    db.drop_db().await;
    Ok(())
}

/// Lease loss mid-batch in binlog mode: the streaming relay frozen
/// (SIGSTOP at a failpoint) after taking a batch, while publishing, or
/// after the broker's ack loses the capture lease to a standby, which
/// streams from the recorded position and publishes everything; thawed,
/// the first publishes nothing more (at most the message each batch out
/// was sending),
/// marks and records nothing (`outroute_mark_fenced_total`), and keeps
/// running as a standby.
#[tokio::test(flavor = "multi_thread")]
async fn a_streaming_relay_frozen_past_its_lease_publishes_nothing_more() -> anyhow::Result<()> {
    let _beside = BINLOG_FILES.read().await;
    // Thawed, the batch in flight notices the lapsed lease itself, or the
    // partition worker does first and drops the batch: either is fine.
    let dropped = "capture lease lost: stopping the stream";
    let settings = "lease_ttl = \"2s\"\nbatch_size = 400\nconcurrency = 1";
    // A partition worker keeps up to two batches out: each may have had
    // its message in flight at the freeze.
    for (point, may_duplicate, noticed) in [
        ("after-claim", 0usize, "lease expired before publishing"),
        ("mid-publish", 2, "lease lapsed while publishing"),
        (
            "after-ack",
            usize::MAX,
            "lease lost: rows were published but not marked",
        ),
    ] {
        let db = own_db().await?;
        frozen_past_its_lease(
            &db,
            point,
            ("capture = \"binlog\"", settings),
            may_duplicate,
            &[noticed, dropped],
        )
        .await?;
        db.drop_db().await;
    }
    Ok(())
}

/// A producer transaction that took its AUTO_INCREMENT number first and
/// commits after a later one: the binlog holds transactions in commit
/// order, so it is simply streamed after the other (lease mode finds it
/// by walking each lane from its oldest pending row).
#[tokio::test(flavor = "multi_thread")]
async fn a_late_committing_auto_increment_row_is_streamed() -> anyhow::Result<()> {
    let _beside = BINLOG_FILES.read().await;
    let db = own_db().await?;
    let dir = test_dir("binlog-late");
    let out = dir.join("out.jsonl");
    let config = write_config_with(
        &dir,
        &db.url,
        "capture = \"binlog\"",
        "",
        &file_route_body(&out),
    )?;
    db.migrate(&config)?;
    let mut relay = Relay::start(&config, &[])?;
    streaming(&relay).await;
    let insert = |id: &'static str, agg: &'static str| {
        sqlx::query(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES (?, 'order', ?, 'order-created', '{}')",
        )
        .bind(id)
        .bind(agg)
    };
    let mut late = db.pool.begin().await?;
    insert("late", "a").execute(&mut *late).await?;
    insert("early", "b").execute(&db.pool).await?;
    let early = eventually(Duration::from_secs(20), || async {
        file_sink_deliveries(&out).iter().any(|d| d.id() == "early")
    })
    .await;
    assert!(early, "{}", relay.log_text());
    late.commit().await?;
    let both = eventually(Duration::from_secs(20), || async {
        file_sink_deliveries(&out).iter().any(|d| d.id() == "late")
    })
    .await;
    assert!(
        both,
        "the late committer was never published\n{}",
        relay.log_text()
    );
    let seqs: Vec<(String, i64)> =
        sqlx::query_as("SELECT CAST(id AS CHAR), seq FROM outbox ORDER BY seq")
            .fetch_all(&db.pool)
            .await?;
    assert_eq!(
        seqs.iter().map(|(id, _)| id.as_str()).collect::<Vec<_>>(),
        ["late", "early"],
        "the late row holds the lower number"
    );
    relay.terminate(Duration::from_secs(15));
    db.drop_db().await;
    Ok(())
}
