//! Log-based capture (`capture = "logical"`) against a real `wal_level =
//! logical` PostgreSQL (`scripts/pg-logical`, port 5434): the crash points,
//! kill -9 and fail-over with several relays, a frozen capture owner, a
//! failing event that holds only its own aggregate (durably, across a
//! restart) until `failed discard`, an unreadable parked record, rows
//! sharing an order value, a partitioned outbox, a same-named table of
//! another schema, reused, NULL and malformed ids and rows, huge
//! transactions (cleaned up in chunks, read within the capture budget), and
//! tableless capture from `pg_logical_emit_message`.
//!
//! One concern, one file: what the stream guarantees, each test on its own
//! slot and table; the slot's life (rows from before it, the switch from
//! lease mode, a promotion that loses it, dropping it, a server without
//! `wal_level = logical`) is `logical_slot.rs`.

use std::path::Path;
use std::time::{Duration, Instant};

use outroute_e2e::logical::*;
use outroute_e2e::*;

const POINTS: [&str; 4] = ["after-claim", "before-ack", "after-ack", "mid-mark"];

#[tokio::test(flavor = "multi_thread")]
async fn crash_at_every_point_loses_nothing_in_logical_mode() -> anyhow::Result<()> {
    let iterations: usize = std::env::var("OUTROUTE_CRASH_ITERATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    let db = TestDb::new_logical().await?;
    let t = tag();
    let topic = format!("t{t}.order-updated");
    create_topic(&topic, 3).await?;
    let dir = test_dir("logical-crash");
    let config = kafka_config(&dir, &db, &t, "lease_ttl = \"1s\"\nbatch_size = 40")?;
    db.migrate(&config)?;

    let (all, crashes) = crash_at_points(&db.pool, &config, &POINTS, iterations).await?;
    let mut relay = Relay::start(&config, &[])?;
    let delivered = consume_kafka(&topic, 3, all.committed.len(), Duration::from_secs(120))?;
    let report = check(&all, &delivered);
    println!("logical crash points: {iterations} crashes per point ({crashes} total): {report}");
    report.assert_clean();
    // Handled rows are cleaned up in bulk; the slot is confirmed up to them.
    assert!(
        eventually(Duration::from_secs(20), || async {
            db.count("SELECT count(*) FROM outbox").await == 0
        })
        .await,
        "captured rows left in the table: {}",
        db.count("SELECT count(*) FROM outbox").await
    );
    assert_eq!(
        db.count("SELECT count(*) FROM outroute_event_state").await,
        0,
        "nothing should be parked"
    );
    relay.terminate(Duration::from_secs(15));
    db.drop_db().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn kill_nine_and_failover_with_three_relays() -> anyhow::Result<()> {
    let db = TestDb::new_logical().await?;
    let t = tag();
    let topic = format!("t{t}.order-updated");
    create_topic(&topic, 4).await?;
    let dir = test_dir("logical-failover");
    let config = kafka_config(&dir, &db, &t, "lease_ttl = \"2s\"\nbatch_size = 200")?;
    db.migrate(&config)?;

    let mut relays: Vec<Option<Relay>> = (0..3)
        .map(|_| Relay::start(&config, &[]).map(Some))
        .collect::<Result<_, _>>()?;
    let pool = db.pool.clone();
    let producer = tokio::spawn(async move { produce(&pool, "agg", 400, 20, 13).await });
    // Kill the streaming relay (kill -9) three times while events flow; the
    // killed one is not restarted until the end, so a standby must take over.
    let mut failovers = Vec::new();
    for round in 0..2usize {
        tokio::time::sleep(Duration::from_millis(800 + 400 * round as u64)).await;
        let Some(owner) = capture_owner(&db).await else {
            continue;
        };
        let Some(victim) = relays.iter().position(|r| {
            r.as_ref()
                .is_some_and(|r| owner.contains(&format!("-{}-", r.child.id())))
        }) else {
            continue;
        };
        if let Some(mut r) = relays[victim].take() {
            r.kill();
        }
        let killed = Instant::now();
        let took = eventually(Duration::from_secs(30), || async {
            capture_owner(&db).await.is_some_and(|o| o != owner)
                && db
                    .count("SELECT count(*) FROM pg_replication_slots WHERE active")
                    .await
                    == 1
        })
        .await;
        assert!(
            took,
            "no standby took over the slot after {owner} was killed"
        );
        failovers.push(killed.elapsed());
    }
    let work = producer.await??;
    let delivered = consume_kafka(&topic, 4, work.committed.len(), Duration::from_secs(180))?;
    let report = check(&work, &delivered);
    println!(
        "logical, three relays, {} kill -9 fail-overs (kill → slot streaming again: {:?}, lease_ttl 2s): {report}",
        failovers.len(),
        failovers
    );
    assert_eq!(
        failovers.len(),
        2,
        "both kills should have hit the streaming relay"
    );
    report.assert_clean();
    for mut r in relays.into_iter().flatten() {
        r.terminate(Duration::from_secs(15));
    }
    db.drop_db().await;
    Ok(())
}

/// A migrated database on the logical cluster and a config that routes
/// through the hostile plugin to a file sink: (database, file, config).
async fn hostile_to_file(
    name: &str,
) -> anyhow::Result<(TestDb, std::path::PathBuf, std::path::PathBuf)> {
    let db = TestDb::new_logical().await?;
    let dir = test_dir(name);
    let out = dir.join("out.jsonl");
    let route = FILE_ROUTE;
    let config = write_config_with(
        &dir,
        &db.url,
        LOGICAL,
        "lease_ttl = \"2s\"",
        &relay_body("", &[TestSink::File(&out)], "hostile", "orders", route),
    )?;
    db.migrate(&config)?;
    Ok((db, out, config))
}

#[tokio::test(flavor = "multi_thread")]
async fn failed_event_holds_only_its_aggregate_durably_until_discarded() -> anyhow::Result<()> {
    let (db, out, config) = hostile_to_file("logical-hold").await?;
    let mut relay = Relay::start(&config, &[])?;

    let a1 = insert_order_event(&db, "A", serde_json::json!({"n": 1})).await?;
    let a2 = insert_order_event(&db, "A", serde_json::json!({"n": 2, "hostile": "reject"})).await?;
    let a3 = insert_order_event(&db, "A", serde_json::json!({"n": 3})).await?;
    let b1 = insert_order_event(&db, "B", serde_json::json!({"n": 1})).await?;
    assert!(file_sink_reaches(&out, 2, Duration::from_secs(20)).await);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        sorted(delivered_ids(&out)),
        sorted(vec![a1.clone(), b1.clone()])
    );

    // The relay dies; A's queue survives it; B keeps flowing after restart.
    relay.kill();
    let a4 = insert_order_event(&db, "A", serde_json::json!({"n": 4})).await?;
    let b2 = insert_order_event(&db, "B", serde_json::json!({"n": 2})).await?;
    let mut relay = Relay::start(&config, &[])?;
    assert!(
        eventually(Duration::from_secs(20), || async {
            delivered_ids(&out).len() >= 3
        })
        .await
    );
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(
        sorted(delivered_ids(&out)),
        sorted(vec![a1.clone(), b1.clone(), b2.clone()])
    );

    let cfg = config.to_str().unwrap_or_default().to_string();
    let (code, list, err) = cli(&["failed", "list", "-c", &cfg])?;
    assert_eq!(code, 0, "{err}");
    assert!(
        list.contains(&a2) && list.contains("hostile plugin rejects this event"),
        "{list}"
    );
    let (_, status, _) = cli(&["status", "-c", &cfg])?;
    assert!(status.contains("backlog          2 events"), "{status}");
    assert!(status.contains("(streaming, backend"), "{status}");
    // Every captured row left the table, the parked ones included: they wait
    // with the event itself in the state table.
    assert_eq!(db.count("SELECT count(*) FROM outbox").await, 0);

    let (code, _, err) = cli(&["failed", "discard", "--id", &a2, "-c", &cfg])?;
    assert_eq!(code, 0, "{err}");
    assert!(
        eventually(Duration::from_secs(20), || async {
            delivered_ids(&out).len() >= 5
        })
        .await
    );
    let a5 = insert_order_event(&db, "A", serde_json::json!({"n": 5})).await?;
    assert!(
        eventually(Duration::from_secs(20), || async {
            delivered_ids(&out).len() >= 6
        })
        .await
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    // In order per aggregate (A's queue drained before a5, B unaffected).
    let got = delivered_ids(&out);
    let of = |ids: &[&String]| {
        got.iter()
            .filter(|g| ids.contains(g))
            .cloned()
            .collect::<Vec<_>>()
    };
    assert_eq!(of(&[&a1, &a3, &a4, &a5]), vec![a1.clone(), a3, a4, a5]);
    assert_eq!(of(&[&b1, &b2]), vec![b1, b2]);
    assert_eq!(got.len(), 6);
    assert!(
        eventually(Duration::from_secs(10), || async {
            db.count("SELECT count(*) FROM outroute_event_state WHERE discarded_at IS NULL")
                .await
                == 0
        })
        .await
    );
    relay.terminate(Duration::from_secs(15));
    db.drop_db().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unreadable_parked_record_fails_that_event_alone() -> anyhow::Result<()> {
    let (db, out, config) = hostile_to_file("logical-unreadable").await?;
    let relay = Relay::start(&config, &[])?;
    let c1 = insert_order_event(&db, "C", serde_json::json!({"n": 1, "hostile": "reject"})).await?;
    let c2 = insert_order_event(&db, "C", serde_json::json!({"n": 2})).await?;
    let c3 = insert_order_event(&db, "C", serde_json::json!({"n": 3})).await?;
    let d1 = insert_order_event(&db, "D", serde_json::json!({"n": 1})).await?;
    assert!(file_sink_reaches(&out, 1, Duration::from_secs(20)).await);
    // c2 and c3 wait behind c1 with the event itself; c2's record is damaged.
    assert!(
        eventually(Duration::from_secs(20), || async {
            db.count("SELECT count(*) FROM outroute_event_state WHERE event IS NOT NULL")
                .await
                == 3
        })
        .await
    );
    sqlx::query(
        "UPDATE outroute_event_state SET event = '{\"not\": \"an event\"}' WHERE event_id = $1",
    )
    .bind(&c2)
    .execute(&db.pool)
    .await?;
    let cfg = config.to_str().unwrap_or_default().to_string();
    let (code, _, err) = cli(&["failed", "discard", "--id", &c1, "-c", &cfg])?;
    assert_eq!(code, 0, "{err}");
    // c2 fails with the reason and holds C (policy block); capture goes on.
    assert!(
        eventually(Duration::from_secs(20), || async {
            cli(&["failed", "list", "-c", &cfg])
                .map(|(_, list, _)| {
                    list.contains(&c2) && list.contains("parked record cannot be read")
                })
                .unwrap_or(false)
        })
        .await,
        "{}",
        relay.log_text()
    );
    let d2 = insert_order_event(&db, "D", serde_json::json!({"n": 2})).await?;
    assert!(file_sink_reaches(&out, 2, Duration::from_secs(20)).await);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(sorted(delivered_ids(&out)), sorted(vec![d1, d2]));
    let (code, _, err) = cli(&["failed", "discard", "--id", &c2, "-c", &cfg])?;
    assert_eq!(code, 0, "{err}");
    assert!(file_sink_reaches(&out, 3, Duration::from_secs(20)).await);
    assert!(delivered_ids(&out).contains(&c3));
    drop(relay);
    db.drop_db().await;
    Ok(())
}

/// An existing table whose order column is not unique: rows sharing a
/// number are cleaned up by id, so a tie that the backfill has not read yet
/// (pages of one row) is not deleted with the one it read.
#[tokio::test(flavor = "multi_thread")]
async fn rows_sharing_an_order_value_are_each_published() -> anyhow::Result<()> {
    let db = TestDb::new_logical().await?;
    sqlx::query(
        "CREATE TABLE ev (id uuid PRIMARY KEY, pos bigint NOT NULL, aggregate_id text NOT NULL, \
         event_type text NOT NULL, payload jsonb NOT NULL, created_at timestamptz NOT NULL DEFAULT now())",
    )
    .execute(&db.pool)
    .await?;
    let add = |pos: i64, agg: &'static str| {
        let pool = db.pool.clone();
        async move {
            let id = uuid::Uuid::new_v4().to_string();
            sqlx::query(
                "INSERT INTO ev (id, pos, aggregate_id, event_type, payload) VALUES ($1::uuid, $2, $3, 'created', '{}')",
            )
            .bind(&id)
            .bind(pos)
            .bind(agg)
            .execute(&pool)
            .await
            .map(|_| id)
        }
    };
    let mut want = vec![add(1, "X").await?, add(1, "Y").await?, add(2, "Z").await?];
    let dir = test_dir("logical-ties");
    let out = dir.join("out.jsonl");
    let route = FILE_ROUTE;
    let mapping = own_table("ev", "pos");
    let body = format!(
        "{mapping}\n{}",
        relay_body("", &[TestSink::File(&out)], "order-router", "orders", route)
    );
    let config = write_config_with(
        &dir,
        &db.url,
        LOGICAL,
        "lease_ttl = \"2s\"\nbatch_size = 1",
        &body,
    )?;
    db.migrate(&config)?;
    let relay = Relay::start(&config, &[])?;
    want.push(add(1, "W").await?);
    assert!(
        file_sink_reaches(&out, 4, Duration::from_secs(30)).await,
        "{}",
        relay.log_text()
    );
    assert_eq!(sorted(delivered_ids(&out)), sorted(want));
    assert!(
        eventually(Duration::from_secs(10), || async {
            db.count("SELECT count(*) FROM ev").await == 0
        })
        .await,
        "captured rows were not cleaned up"
    );
    drop(relay);
    db.drop_db().await;
    Ok(())
}

/// A partitioned outbox: `migrate` publishes its inserts under the
/// table's own name (not each partition's), so they are recognised and go
/// out; a publication made without that is refused, naming the fix.
#[tokio::test(flavor = "multi_thread")]
async fn a_partitioned_outbox_is_captured_under_its_own_name() -> anyhow::Result<()> {
    let db = TestDb::new_logical().await?;
    for ddl in [
        "CREATE TABLE pev (seq bigint GENERATED ALWAYS AS IDENTITY, id uuid NOT NULL, \
         aggregate_id text NOT NULL, event_type text NOT NULL, payload jsonb NOT NULL, \
         created_at timestamptz NOT NULL DEFAULT now()) PARTITION BY RANGE (created_at)",
        "CREATE TABLE pev_old PARTITION OF pev FOR VALUES FROM ('2000-01-01') TO ('2020-01-01')",
        "CREATE TABLE pev_now PARTITION OF pev DEFAULT",
    ] {
        sqlx::query(ddl).execute(&db.pool).await?;
    }
    let dir = test_dir("logical-partitioned");
    let out = dir.join("out.jsonl");
    let route = FILE_ROUTE;
    let mapping = own_table("pev", "seq");
    let body = format!(
        "{mapping}\n{}",
        relay_body("", &[TestSink::File(&out)], "order-router", "orders", route)
    );
    // First a publication made by hand the plain way: refused, with the fix.
    sqlx::query("CREATE PUBLICATION outroute_pev FOR TABLE pev WITH (publish = 'insert')")
        .execute(&db.pool)
        .await?;
    let config = write_config_with(
        &dir,
        &db.url,
        &format!("{LOGICAL}\nlogical = {{ publication = \"outroute_pev\" }}"),
        "lease_ttl = \"2s\"",
        &body,
    )?;
    db.migrate(&config)?;
    let cfg = config.to_str().unwrap_or_default().to_string();
    let (code, _, err) = cli(&["config", "check", "--store", "-c", &cfg])?;
    assert_ne!(code, 0);
    assert!(err.contains("publish_via_partition_root = true"), "{err}");
    // Without the hand-made one, migrate makes it right.
    sqlx::query("DROP PUBLICATION outroute_pev")
        .execute(&db.pool)
        .await?;
    db.migrate(&config)?;
    let relay = Relay::start(&config, &[])?;
    let mut want = Vec::new();
    for (n, at) in [(1, "2010-06-01"), (2, "2026-12-02")] {
        let id = uuid::Uuid::new_v4().to_string();
        sqlx::query(
            "INSERT INTO pev (id, aggregate_id, event_type, payload, created_at) \
             VALUES ($1::uuid, 'P', 'created', jsonb_build_object('n', $2::int), $3::timestamptz)",
        )
        .bind(&id)
        .bind(n)
        .bind(at)
        .execute(&db.pool)
        .await?;
        want.push(id);
    }
    assert!(
        file_sink_reaches(&out, 2, Duration::from_secs(30)).await,
        "{}",
        relay.log_text()
    );
    assert_eq!(delivered_ids(&out), want);
    drop(relay);
    db.drop_db().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn tableless_capture_reads_logical_messages() -> anyhow::Result<()> {
    let db = TestDb::new_logical().await?;
    let dir = test_dir("logical-messages");
    let out = dir.join("out.jsonl");
    let route = FILE_ROUTE;
    let config = write_config_with(
        &dir,
        &db.url,
        "capture = \"logical\"\nlogical = { input = \"messages\", message_prefix = \"outroute\" }",
        "",
        &relay_body("", &[TestSink::File(&out)], "order-router", "orders", route),
    )?;
    db.migrate(&config)?;
    let mut relay = Relay::start(&config, &[])?;
    let emit = |id: &str, agg: &str, n: i32| {
        serde_json::json!({
            "id": id, "aggregate_type": "order", "aggregate_id": agg,
            "event_type": "order-paid", "payload": {"n": n},
            "headers": {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
        })
        .to_string()
    };
    let mut ids = Vec::new();
    let mut committed = Workload::default();
    for n in 0..20 {
        let id = uuid::Uuid::new_v4().to_string();
        let mut tx = db.pool.begin().await?;
        sqlx::query("INSERT INTO orders (id, version) VALUES ($1, $2) ON CONFLICT (id) DO UPDATE SET version = $2")
            .bind(format!("o{}", n % 3))
            .bind(n)
            .execute(&mut *tx)
            .await?;
        sqlx::query("SELECT pg_logical_emit_message(true, 'outroute', $1)")
            .bind(emit(&id, &format!("o{}", n % 3), n))
            .execute(&mut *tx)
            .await?;
        if n % 7 == 6 {
            tx.rollback().await?;
            committed.rolled_back.push(id);
        } else {
            tx.commit().await?;
            committed.committed.push(Expected {
                id: id.clone(),
                aggregate_id: format!("o{}", n % 3),
                seq: n as i64,
            });
            ids.push(id);
        }
    }
    // Another prefix is not ours; a broken envelope fails with its reason.
    sqlx::query("SELECT pg_logical_emit_message(true, 'someone-else', 'x')")
        .execute(&db.pool)
        .await?;
    sqlx::query("SELECT pg_logical_emit_message(true, 'outroute', '{not json')")
        .execute(&db.pool)
        .await?;
    assert!(file_sink_reaches(&out, ids.len(), Duration::from_secs(20)).await);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let got = file_sink_deliveries(&out);
    // Per aggregate in commit order (aggregates go through the relay's
    // partitions side by side), nothing rolled back, nothing twice.
    check(&committed, &got).assert_clean();
    assert_eq!(got.len(), ids.len());
    assert_eq!(
        got[0].headers.get("traceparent").map(String::as_str),
        Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    );
    let cfg = config.to_str().unwrap_or_default().to_string();
    let (_, list, _) = cli(&["failed", "list", "-c", &cfg])?;
    assert!(list.contains("not an outroute envelope"), "{list}");
    relay.terminate(Duration::from_secs(15));
    db.drop_db().await;
    Ok(())
}

/// One producer transaction of 300,000 rows, with the relay's statement
/// timeout at 200 ms (deleting them in one statement takes ~0.7 s here): the captured rows are deleted a chunk at a time, each
/// within the timeout. As one statement (before) the delete never finished:
/// the cleaner stopped, the stream restarted at the transaction and sent
/// all of it again, over and over, while the WAL piled up.
#[tokio::test(flavor = "multi_thread")]
async fn a_huge_transaction_is_cleaned_up_in_chunks() -> anyhow::Result<()> {
    const ROWS: i64 = 300_000;
    let db = TestDb::new_logical().await?;
    let dir = test_dir("logical-huge-tx");
    let out = dir.join("out.jsonl");
    let config = write_config_with(
        &dir,
        &db.url,
        &format!("{LOGICAL}\nstatement_timeout = \"200ms\""),
        "batch_size = 1000",
        &file_route_body(&out),
    )?;
    db.migrate(&config)?;
    let relay = Relay::start(&config, &[])?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    sqlx::query(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), 'order', 'a' || (g % 1000), 'order-created', jsonb_build_object('n', g) \
         FROM generate_series(1, $1::int8) g",
    )
    .bind(ROWS)
    .execute(&db.pool)
    .await?;
    let cleaned = eventually(Duration::from_secs(240), || async {
        db.count("SELECT count(*) FROM outbox").await == 0
    })
    .await;
    let sent = file_sink_deliveries(&out);
    let unique: std::collections::HashSet<&str> = sent.iter().map(|d| d.id()).collect();
    assert!(
        cleaned,
        "{} rows left, {} sent ({} distinct)\n{}",
        db.count("SELECT count(*) FROM outbox").await,
        sent.len(),
        unique.len(),
        relay.log_text()
    );
    assert_eq!(unique.len() as i64, ROWS);
    // The cleaner never gave up on a delete (each statement well within the
    // timeout). Given up, a delete may still finish on the server, but the
    // cleaner stops, the slot is not confirmed and the stream restarts.
    let log = relay.log_text();
    assert!(
        !log.contains("deleting captured rows failed"),
        "a cleanup statement timed out:\n{log}"
    );
    // Sent once (a restart would have sent the transaction again).
    assert_eq!(sent.len() as i64, ROWS, "{}", relay.log_text());
    drop(relay);
    db.drop_db().await;
    Ok(())
}

/// One huge producer transaction of large rows while the sink fails
/// (issue 41, item 12): the relay holds at most its capture budget of
/// captured events, `(concurrency × 2 + 1) × max_batch_bytes` (here
/// 12 MiB), plus the 16 messages the replication client reads ahead (here
/// 64 MiB), not the transaction (600 MiB): its peak RSS grows by less
/// than 300 MiB. Before, the reader went on into queues of thousands of
/// events and the client's 8,192 messages of read-ahead: the whole
/// transaction in memory (with 20 MB rows, gigabytes). Then, the sink
/// back, every event goes out.
#[tokio::test(flavor = "multi_thread")]
async fn a_huge_transaction_of_large_rows_is_read_within_the_capture_budget() -> anyhow::Result<()>
{
    const ROWS: i64 = 150;
    const ROW_BYTES: i64 = 4 << 20;
    let db = TestDb::new_logical().await?;
    let dir = test_dir("logical-huge-rows");
    let out = dir.join("out.jsonl");
    let config_to = |path: &Path| {
        write_config_with(
            &dir,
            &db.url,
            LOGICAL,
            "concurrency = 1\nmax_batch_bytes = 4194304",
            &relay_body(
                "",
                &[TestSink::File(path)],
                "order-router",
                "orders",
                FILE_ROUTE,
            )
            .replace(
                "kind = \"file\"\n",
                "kind = \"file\"\nmax_message_bytes = 8388608\n",
            ),
        )
    };
    // Every write fails (ENOSPC): each batch backs off and keeps its events.
    let failing = config_to(Path::new("/dev/full"))?;
    db.migrate(&failing)?;
    let relay = Relay::start(&failing, &[])?;
    let streaming = eventually(Duration::from_secs(30), || async {
        relay
            .log_text()
            .contains("streaming from the replication slot")
    })
    .await;
    assert!(streaming, "{}", relay.log_text());
    let pid = relay.child.id();
    let before = proc_memory_kib(pid, "VmHWM");
    // Highly compressible: cheap for the database, full size on the stream.
    sqlx::query(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), 'order', 'o-' || g, 'order-created', \
                json_build_object('pad', repeat(md5(g::text), ($2 / 32)::int)) \
         FROM generate_series(1, $1::int8) g",
    )
    .bind(ROWS)
    .bind(ROW_BYTES)
    .execute(&db.pool)
    .await?;
    let backing_off = eventually(Duration::from_secs(60), || async {
        relay.log_text().contains("every publish failed")
    })
    .await;
    assert!(backing_off, "{}", relay.log_text());
    // Time for the reader to take in all it may (the transaction reaches
    // the relay in a few seconds when nothing stops it).
    tokio::time::sleep(Duration::from_secs(20)).await;
    let grown_mib = (proc_memory_kib(pid, "VmHWM") - before) / 1024;
    eprintln!("peak RSS grew {grown_mib} MiB while the sink failed");
    assert!(
        grown_mib < 300,
        "the relay's peak RSS grew {grown_mib} MiB while the sink failed (the transaction is {} MiB)",
        (ROWS * ROW_BYTES) >> 20
    );
    drop(relay);
    let relay = Relay::start(&config_to(&out)?, &[])?;
    let cleaned = eventually(Duration::from_secs(240), || async {
        db.count("SELECT count(*) FROM outbox").await == 0
    })
    .await;
    assert!(cleaned, "{}", relay.log_text());
    let sent = file_sink_deliveries(&out);
    let unique: std::collections::HashSet<&str> = sent.iter().map(|d| d.id()).collect();
    assert_eq!(unique.len() as i64, ROWS);
    drop(relay);
    let _ = std::fs::remove_file(&out);
    db.drop_db().await;
    Ok(())
}

/// Ids reused within a table without a unique id, and NULL ids: the second
/// event under a taken id fails alone, recorded under an id of its own
/// (`<id>@<commit lsn>/<seq>`, with the reason), and the stream moves on.
/// Before, its record found the id taken, recorded nothing, the batch was
/// never confirmed and the stream restarted at it for ever.
#[tokio::test(flavor = "multi_thread")]
async fn a_reused_or_null_id_fails_that_event_alone() -> anyhow::Result<()> {
    let db = TestDb::new_logical().await?;
    create_ev(&db).await?;
    let (config, out) = file_config("logical-taken-ids", &db, "", "hostile")?;
    db.migrate(&config)?;
    let relay = Relay::start(&config, &[])?;
    let add = |id: Option<&'static str>, agg: &'static str, payload: serde_json::Value| {
        let pool = db.pool.clone();
        async move {
            sqlx::query(
                "INSERT INTO ev (id, aggregate_id, event_type, payload) VALUES ($1, $2, 'created', $3)",
            )
            .bind(id)
            .bind(agg)
            .bind(payload)
            .execute(&pool)
            .await
        }
    };
    // `dup` fails (and holds X); the next X event, under the same id,
    // waits behind it and needs a record of its own.
    add(Some("dup"), "X", serde_json::json!({"hostile": "reject"})).await?;
    add(Some("dup"), "X", serde_json::json!({})).await?;
    // Two rows without an id: each fails (malformed), the second under a
    // taken (empty) id.
    add(None, "N", serde_json::json!({})).await?;
    add(None, "M", serde_json::json!({})).await?;
    add(Some("after"), "Z", serde_json::json!({})).await?;
    let written: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(&db.pool)
        .await?;
    assert!(
        file_sink_reaches(&out, 1, Duration::from_secs(30)).await,
        "the stream did not move on past the taken ids\n{}",
        relay.log_text()
    );
    // The slot is confirmed past them (before, it never was: the WAL piled
    // up until the slot was invalidated).
    let confirmed = eventually(Duration::from_secs(30), || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT bool_or(confirmed_flush_lsn >= $1::pg_lsn) FROM pg_replication_slots \
             WHERE database = current_database()",
        )
        .bind(&written)
        .fetch_one(&db.pool)
        .await
        .unwrap_or(false)
    })
    .await;
    assert!(
        confirmed,
        "the slot was not confirmed past the taken ids\n{}",
        relay.log_text()
    );
    assert_eq!(delivered_ids(&out), vec!["after".to_string()]);
    let failed: Vec<(String, String)> = sqlx::query_as(
        "SELECT event_id, last_error FROM outroute_event_state WHERE failed_at IS NOT NULL ORDER BY seq",
    )
    .fetch_all(&db.pool)
    .await?;
    assert_eq!(failed.len(), 4, "{failed:?}");
    assert_eq!(failed[0].0, "dup");
    assert!(
        failed[1].0.starts_with("dup@")
            && failed[1].1.contains("id `dup` is taken by another event"),
        "{failed:?}"
    );
    assert!(
        failed[2].0.is_empty() && failed[2].1.contains("id is NULL or empty"),
        "{failed:?}"
    );
    assert!(
        failed[3].0.starts_with('@') && failed[3].1.contains("is taken"),
        "{failed:?}"
    );
    assert!(
        !relay
            .log_text()
            .contains("capture lease lost while recording"),
        "{}",
        relay.log_text()
    );
    drop(relay);
    db.drop_db().await;
    Ok(())
}

/// A table of the same name in another schema, in the same publication (a
/// shared one): its inserts are not this source's events (before, an
/// unqualified table name matched any schema: another team's rows went out
/// as ours, and their sequence numbers deleted our rows).
#[tokio::test(flavor = "multi_thread")]
async fn a_same_named_table_of_another_schema_is_not_captured() -> anyhow::Result<()> {
    let db = TestDb::new_logical().await?;
    for ddl in [
        "CREATE TABLE ev (id text PRIMARY KEY, pos bigserial, aggregate_id text NOT NULL, event_type text NOT NULL, \
         payload jsonb NOT NULL, created_at timestamptz NOT NULL DEFAULT now())",
        "CREATE SCHEMA other",
        "CREATE TABLE other.ev (LIKE ev INCLUDING ALL)",
    ] {
        sqlx::query(ddl).execute(&db.pool).await?;
    }
    let (config, out) = file_config("logical-schema", &db, "", "order-router")?;
    db.migrate(&config)?;
    let publication: String =
        sqlx::query_scalar("SELECT pubname::text FROM pg_publication LIMIT 1")
            .fetch_one(&db.pool)
            .await?;
    sqlx::query(&format!(
        "ALTER PUBLICATION \"{publication}\" ADD TABLE other.ev"
    ))
    .execute(&db.pool)
    .await?;
    let relay = Relay::start(&config, &[])?;
    sqlx::query(
        "INSERT INTO other.ev (id, aggregate_id, event_type, payload) VALUES ('theirs', 'T', 'created', '{}')",
    )
    .execute(&db.pool)
    .await?;
    sqlx::query("INSERT INTO ev (id, aggregate_id, event_type, payload) VALUES ('ours', 'O', 'created', '{}')")
        .execute(&db.pool)
        .await?;
    assert!(
        eventually(Duration::from_secs(30), || async {
            delivered_ids(&out).contains(&"ours".to_string())
                && db.count("SELECT count(*) FROM ev").await == 0
        })
        .await,
        "{}",
        relay.log_text()
    );
    assert_eq!(delivered_ids(&out), vec!["ours".to_string()]);
    assert_eq!(db.count("SELECT count(*) FROM other.ev").await, 1);
    drop(relay);
    db.drop_db().await;
    Ok(())
}

/// A captured row that cannot become an event, under `cleanup = delete`:
/// its table row goes, but its parked record keeps the row as read, so it
/// is shown (`failed show`), repaired (`failed edit`) and published once
/// retried, its payload intact.
#[tokio::test(flavor = "multi_thread")]
async fn a_malformed_captured_row_is_kept_repaired_and_retried() -> anyhow::Result<()> {
    let db = TestDb::new_logical().await?;
    sqlx::query(
        "CREATE TABLE ev (id text PRIMARY KEY, pos bigserial, aggregate_id text NOT NULL, event_type text NOT NULL, \
         event_version text, payload jsonb NOT NULL, created_at timestamptz NOT NULL DEFAULT now())",
    )
    .execute(&db.pool)
    .await?;
    let (config, out) = file_config(
        "logical-repair",
        &db,
        "event_version = \"event_version\"\n",
        "order-router",
    )?;
    let c = config.to_string_lossy().to_string();
    db.migrate(&config)?;
    let relay = Relay::start(&config, &[])?;
    sqlx::query(
        "INSERT INTO ev (id, aggregate_id, event_type, event_version, payload) \
         VALUES ('bad-version', 'A', 'created', 'v2', '{\"n\": 7}'), ('fine', 'B', 'created', '1', '{}')",
    )
    .execute(&db.pool)
    .await?;
    assert!(
        file_sink_reaches(&out, 1, Duration::from_secs(30)).await,
        "{}",
        relay.log_text()
    );
    // Cleaned up: the table row is gone; the record keeps it.
    assert!(
        eventually(Duration::from_secs(20), || async {
            db.count("SELECT count(*) FROM ev").await == 0
        })
        .await,
        "{}",
        relay.log_text()
    );
    let (code, shown, err) = cli(&["failed", "show", "bad-version", "-c", &c])?;
    assert_eq!(code, 0, "{shown}{err}");
    let shown: serde_json::Value = serde_json::from_str(
        shown
            .split_once('{')
            .map(|(_, rest)| format!("{{{rest}"))
            .as_deref()
            .unwrap_or("{}"),
    )?;
    assert_eq!(shown["row"]["event_version"], "v2", "{shown}");
    assert_eq!(shown["row"]["aggregate_id"], "A", "{shown}");
    assert!(
        shown["row"]["payload"]
            .as_str()
            .is_some_and(|p| p.contains("\"n\": 7")),
        "{shown}"
    );
    // A field that is not the row's is refused, naming the ones that are.
    let (code, said, err) = cli(&["failed", "edit", "bad-version", "--set", "id=x", "-c", &c])?;
    assert_ne!(code, 0, "{said}{err}");
    assert!(err.contains("event_version"), "{err}");
    let (code, said, err) = cli(&[
        "failed",
        "edit",
        "bad-version",
        "--set",
        "event_version=2",
        "-c",
        &c,
    ])?;
    assert_eq!(code, 0, "{said}{err}");
    let (code, said, err) = cli(&["failed", "retry", "--id", "bad-version", "-c", &c])?;
    assert_eq!(code, 0, "{said}{err}");
    assert!(
        file_sink_reaches(&out, 2, Duration::from_secs(30)).await,
        "{}",
        relay.log_text()
    );
    let repaired = file_sink_deliveries(&out)
        .into_iter()
        .find(|d| d.id() == "bad-version")
        .ok_or_else(|| anyhow::anyhow!("not delivered"))?;
    assert_eq!(
        repaired.headers.get("ce_eventversion").map(String::as_str),
        Some("2")
    );
    let payload: serde_json::Value = serde_json::from_slice(&repaired.payload)?;
    assert_eq!(payload["n"], 7);
    drop(relay);
    db.drop_db().await;
    Ok(())
}

/// The streaming relay frozen (SIGSTOP, not killed) past its capture lease
/// — holding a batch it has not sent yet, or with a batch handed to the
/// broker and not yet acknowledged — while a standby takes the slot over
/// and publishes everything. Thawed, the frozen relay sends nothing it had
/// not already handed over: nothing at all when frozen before sending, at
/// most its one batch when frozen mid-send; it notices the lease is gone
/// and keeps running as a standby. Nothing is lost or out of order.
#[tokio::test(flavor = "multi_thread")]
async fn a_frozen_capture_owner_sends_nothing_after_its_lease_lapsed() -> anyhow::Result<()> {
    for (point, may_duplicate) in [("after-claim", 0usize), ("before-ack", 40)] {
        let db = TestDb::new_logical().await?;
        let t = tag();
        let topic = format!("t{t}.order-updated");
        create_topic(&topic, 3).await?;
        let dir = test_dir(&format!("logical-frozen-{point}"));
        let settings = "lease_ttl = \"2s\"\nbatch_size = 40\nconcurrency = 1";
        let config = kafka_config(&dir, &db, &t, settings)?;
        let standby_config = kafka_config(&dir.join("standby"), &db, &t, settings)?;
        db.migrate(&config)?;
        let mut frozen = Relay::start(
            &config,
            &[
                ("OUTROUTE_FAILPOINT", point),
                ("OUTROUTE_FAILPOINT_ACTION", "stop"),
            ],
        )?;
        // Streaming first, then the events.
        let streaming = eventually(Duration::from_secs(30), || async {
            frozen
                .log_text()
                .contains("streaming from the replication slot")
        })
        .await;
        assert!(streaming, "{point}: {}", frozen.log_text());
        let w = produce(&db.pool, &format!("frozen-{point}"), 40, 5, 0).await?;
        let pid = frozen.child.id();
        assert!(
            eventually(Duration::from_secs(30), || async { stopped(pid) }).await,
            "{point}: the relay never stopped at the failpoint:\n{}",
            frozen.log_text()
        );
        let owner = capture_owner(&db).await;
        let mut standby = Relay::start(&standby_config, &[])?;
        let took = eventually(Duration::from_secs(30), || async {
            capture_owner(&db)
                .await
                .is_some_and(|o| Some(&o) != owner.as_ref())
        })
        .await;
        assert!(
            took,
            "{point}: the standby never took the slot: {}",
            standby.log_text()
        );
        let all = consume_kafka(&topic, 3, w.committed.len(), Duration::from_secs(60))?;
        assert_eq!(check(&w, &all).lost, 0, "{point}: {}", standby.log_text());
        // Thaw the frozen owner, well past its lease.
        const STANDBY: &str = "standby: waiting for the capture lease";
        let standby_before = frozen.log_text().matches(STANDBY).count();
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(pid as i32, libc::SIGCONT);
        }
        // It says so, or (when its in-flight publish failed first and the
        // stream ended on that) it is back to waiting as a standby.
        let noticed = eventually(Duration::from_secs(20), || async {
            let log = frozen.log_text();
            log.contains("capture lease lost") || log.matches(STANDBY).count() > standby_before
        })
        .await;
        tokio::time::sleep(Duration::from_secs(3)).await;
        let delivered = consume_kafka(&topic, 3, usize::MAX, Duration::from_secs(5))?;
        let report = check(&w, &delivered);
        println!("logical, frozen at {point}: {report}");
        assert_eq!(report.lost, 0, "{point}: {report}");
        assert_eq!(report.order_violations, 0, "{point}: {report}");
        assert!(
            report.duplicates <= may_duplicate,
            "{point}: the thawed owner sent after its lease lapsed: {report}\n{}",
            frozen.log_text()
        );
        assert!(
            noticed && frozen.child.try_wait()?.is_none(),
            "{point}: the thawed relay should notice its lease is gone and keep running:\n{}",
            frozen.log_text()
        );
        frozen.terminate(Duration::from_secs(15));
        standby.terminate(Duration::from_secs(15));
        db.drop_db().await;
    }
    Ok(())
}
