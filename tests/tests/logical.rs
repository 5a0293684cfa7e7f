//! Log-based capture (`capture = "logical"`) against a real `wal_level =
//! logical` PostgreSQL (`scripts/pg-logical`, port 5434): the crash points,
//! kill -9 and fail-over with several relays, a failing event that holds only
//! its own aggregate (durably, across a restart) until `failed discard`,
//! rows written before the slot existed (published from the table first,
//! also after a `migrate` that died right after creating the slot), rows
//! sharing an order value, a partitioned outbox,
//! tableless capture from `pg_logical_emit_message`, and the clear refusal
//! on a server without `wal_level = logical`.
//!
//! One concern, one file: the end-to-end tests of log-based capture on its
//! own cluster; each sets up its slot and table.

use std::path::Path;
use std::time::{Duration, Instant};

use outroute_e2e::*;

const POINTS: [&str; 4] = ["after-claim", "before-ack", "after-ack", "mid-mark"];
const LOGICAL: &str = "capture = \"logical\"";

/// A log-capture config (in a test folder named after `name`) for table
/// `ev` ordered by `pos`, with `table_keys` added to its mapping, publishing
/// to a file sink through `plugin`; `lease_ttl` 2 s. Returns the config and
/// the file the sink writes.
fn file_config(
    name: &str,
    db: &TestDb,
    table_keys: &str,
    plugin: &str,
) -> anyhow::Result<(std::path::PathBuf, std::path::PathBuf)> {
    let dir = test_dir(name);
    let out = dir.join("out.jsonl");
    let body = format!(
        "{}{table_keys}\n{}",
        own_table("ev", "pos"),
        relay_body("", &[TestSink::File(&out)], plugin, "orders", FILE_ROUTE)
    );
    let config = write_config_with(&dir, &db.url, LOGICAL, "lease_ttl = \"2s\"", &body)?;
    Ok((config, out))
}

/// Table `ev` as [`file_config`] maps it, with a nullable text id.
async fn create_ev(db: &TestDb) -> anyhow::Result<()> {
    sqlx::query(
        "CREATE TABLE ev (id text, pos bigserial, aggregate_id text NOT NULL, \
         event_type text NOT NULL, payload jsonb NOT NULL, created_at timestamptz NOT NULL DEFAULT now())",
    )
    .execute(&db.pool)
    .await?;
    Ok(())
}

/// A `[store.table]` mapping of a test's own table `name`: columns `id`,
/// `aggregate_id`, `event_type`, `payload`, `created_at`, and the order
/// column `seq`.
fn own_table(name: &str, seq: &str) -> String {
    format!(
        "[store.table]\nname = \"{name}\"\nid = \"id\"\nsequence = \"{seq}\"\naggregate_type_value = \"order\"\n\
         aggregate_id = \"aggregate_id\"\nevent_type = \"event_type\"\npayload = \"payload\"\n\
         created_at = \"created_at\"\nmarking = {{ style = \"delete\" }}\n"
    )
}

fn kafka_config(
    dir: &std::path::Path,
    db: &TestDb,
    t: &str,
    relay: &str,
) -> anyhow::Result<std::path::PathBuf> {
    let route = format!(
        "config = {{ sink = \"kafka\", topic = \"t{t}.{{event_type}}\" }}\nallow = {{ kafka = [\"t{t}.*\"] }}"
    );
    write_config_with(
        dir,
        &db.url,
        LOGICAL,
        relay,
        &relay_body("", &[TestSink::Kafka], "order-router", "orders", &route),
    )
}

/// The relay id holding the capture lease, if any.
async fn capture_owner(db: &TestDb) -> Option<String> {
    sqlx::query_scalar::<_, Option<String>>(
        "SELECT owner FROM outroute_lanes WHERE lane = -1 AND lease_until > now()",
    )
    .fetch_optional(&db.pool)
    .await
    .ok()
    .flatten()
    .flatten()
}

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

/// The first deliveries the file sink got, in order (a crash may repeat an
/// event already delivered: at-least-once; the repeat is not a first).
fn delivered_ids(path: &std::path::Path) -> Vec<String> {
    let mut seen = std::collections::HashSet::new();
    file_sink_deliveries(path)
        .iter()
        .map(|d| d.id().to_string())
        .filter(|id| seen.insert(id.clone()))
        .collect()
}

fn sorted(mut v: Vec<String>) -> Vec<String> {
    v.sort();
    v
}

async fn insert(
    db: &TestDb,
    aggregate: &str,
    payload: serde_json::Value,
) -> anyhow::Result<String> {
    let id = uuid::Uuid::new_v4().to_string();
    sqlx::query(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         VALUES ($1::uuid, 'order', $2, 'order-updated', $3)",
    )
    .bind(&id)
    .bind(aggregate)
    .bind(payload)
    .execute(&db.pool)
    .await?;
    Ok(id)
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

    let a1 = insert(&db, "A", serde_json::json!({"n": 1})).await?;
    let a2 = insert(&db, "A", serde_json::json!({"n": 2, "hostile": "reject"})).await?;
    let a3 = insert(&db, "A", serde_json::json!({"n": 3})).await?;
    let b1 = insert(&db, "B", serde_json::json!({"n": 1})).await?;
    assert!(file_sink_reaches(&out, 2, Duration::from_secs(20)).await);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        sorted(delivered_ids(&out)),
        sorted(vec![a1.clone(), b1.clone()])
    );

    // The relay dies; A's queue survives it; B keeps flowing after restart.
    relay.kill();
    let a4 = insert(&db, "A", serde_json::json!({"n": 4})).await?;
    let b2 = insert(&db, "B", serde_json::json!({"n": 2})).await?;
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
    let a5 = insert(&db, "A", serde_json::json!({"n": 5})).await?;
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
    let c1 = insert(&db, "C", serde_json::json!({"n": 1, "hostile": "reject"})).await?;
    let c2 = insert(&db, "C", serde_json::json!({"n": 2})).await?;
    let c3 = insert(&db, "C", serde_json::json!({"n": 3})).await?;
    let d1 = insert(&db, "D", serde_json::json!({"n": 1})).await?;
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
    let d2 = insert(&db, "D", serde_json::json!({"n": 2})).await?;
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

/// A source in use in lease mode before the switch to log capture: the
/// canonical table stamped by `published_at`, publishing to a file sink
/// through the `hostile` plugin, migrated. Returns the config body (for the
/// logical config), the lease-mode config and the file the sink writes.
fn lease_mode_first(
    name: &str,
    db: &TestDb,
) -> anyhow::Result<(String, std::path::PathBuf, std::path::PathBuf)> {
    let dir = test_dir(name);
    let out = dir.join("out.jsonl");
    let stamped = example_table("outbox-published-at.toml")?;
    let body = format!(
        "{stamped}{}",
        relay_body("", &[TestSink::File(&out)], "hostile", "orders", FILE_ROUTE)
    );
    let lease = write_config_with(&dir.join("lease"), &db.url, "", "lease_ttl = \"2s\"", &body)?;
    db.migrate(&lease)?;
    Ok((body, lease, out))
}

/// Switch that source to log capture (`relay` settings added): its config
/// next to the lease one, and `outroute migrate` run (it must succeed).
/// Returns the config, its path as text and what migrate printed.
fn switch_to_logical(
    lease: &std::path::Path,
    db: &TestDb,
    relay: &str,
    body: &str,
) -> anyhow::Result<(std::path::PathBuf, String, String)> {
    let dir = lease
        .parent()
        .and_then(|d| d.parent())
        .map(|d| d.join("logical"))
        .unwrap_or_default();
    let config = write_config_with(&dir, &db.url, LOGICAL, relay, body)?;
    let cfg = config.to_str().unwrap_or_default().to_string();
    let (code, said, err) = cli(&["migrate", "-c", &cfg])?;
    anyhow::ensure!(code == 0, "migrate: {err}");
    Ok((config, cfg, said))
}

#[tokio::test(flavor = "multi_thread")]
async fn rows_written_before_the_slot_go_out_first_in_order() -> anyhow::Result<()> {
    // The table is in use (lease mode, rows stamped by `published_at`)
    // before anyone creates the slot.
    let db = TestDb::new_logical().await?;
    let (body, lease, out) = lease_mode_first("logical-backfill", &db)?;
    let done = insert(&db, "P", serde_json::json!({"n": 1})).await?;
    sqlx::query("UPDATE outbox SET published_at = now() WHERE id = $1::uuid")
        .bind(&done)
        .execute(&db.pool)
        .await?;
    let a1 = insert(&db, "A", serde_json::json!({"n": 1})).await?;
    let a2 = insert(&db, "A", serde_json::json!({"n": 2, "hostile": "reject"})).await?;
    let a3 = insert(&db, "A", serde_json::json!({"n": 3})).await?;
    let b1 = insert(&db, "B", serde_json::json!({"n": 1})).await?;
    let b2 = insert(&db, "B", serde_json::json!({"n": 2})).await?;

    // Switching to logical capture: the slot never streams those five.
    // Small batches: the table is read page after page.
    let (config, cfg, said) =
        switch_to_logical(&lease, &db, "lease_ttl = \"2s\"\nbatch_size = 2", &body)?;
    assert!(
        said.contains("5 pending rows of `outbox` were written before the slot"),
        "{said}"
    );
    let a4 = insert(&db, "A", serde_json::json!({"n": 4})).await?;
    let b3 = insert(&db, "B", serde_json::json!({"n": 3})).await?;
    let c1 = insert(&db, "C", serde_json::json!({"n": 1})).await?;

    let relay = Relay::start(&config, &[])?;
    assert!(
        file_sink_reaches(&out, 5, Duration::from_secs(30)).await,
        "{}",
        relay.log_text()
    );
    tokio::time::sleep(Duration::from_millis(700)).await;
    let got = delivered_ids(&out);
    // a2 failed and holds A (a3 from the table, a4 from the stream wait
    // behind it); the row published in lease mode never goes out again.
    assert_eq!(
        sorted(got.clone()),
        sorted(vec![
            a1.clone(),
            b1.clone(),
            b2.clone(),
            b3.clone(),
            c1.clone()
        ])
    );
    let pos = |id: &String| got.iter().position(|g| g == id);
    assert!(pos(&b1) < pos(&b2) && pos(&b2) < pos(&b3), "{got:?}");
    assert_eq!(
        db.count("SELECT count(*) FROM outroute_capture_backfill WHERE finished_at IS NOT NULL")
            .await,
        1
    );
    let (code, _, err) = cli(&["failed", "discard", "--id", &a2, "-c", &cfg])?;
    assert_eq!(code, 0, "{err}");
    assert!(file_sink_reaches(&out, 7, Duration::from_secs(20)).await);
    let got = delivered_ids(&out);
    let of_a: Vec<&String> = got.iter().filter(|g| [&a1, &a3, &a4].contains(g)).collect();
    assert_eq!(of_a, vec![&a1, &a3, &a4]);
    assert!(!got.contains(&done) && !got.contains(&a2));
    // Captured rows were cleaned up, the backfilled ones too; the row
    // published before the switch stays.
    assert!(
        eventually(Duration::from_secs(10), || async {
            db.count("SELECT count(*) FROM outbox").await == 1
        })
        .await
    );
    drop(relay);
    db.drop_db().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_migrate_stopped_right_after_creating_the_slot_loses_nothing() -> anyhow::Result<()> {
    let db = TestDb::new_logical().await?;
    let dir = test_dir("logical-migrate-crash");
    let out = dir.join("out.jsonl");
    let route = FILE_ROUTE;
    // Lease mode stamping `published_at` first, then the switch.
    let body = format!(
        "{}{}",
        example_table("outbox-published-at.toml")?,
        relay_body("", &[TestSink::File(&out)], "order-router", "orders", route)
    );
    let lease = write_config_with(&dir.join("lease"), &db.url, "", "lease_ttl = \"2s\"", &body)?;
    db.migrate(&lease)?;
    let mut before = Vec::new();
    for n in 0..3 {
        before.push(insert(&db, "A", serde_json::json!({ "n": n })).await?);
    }
    let config = write_config_with(
        &dir.join("logical"),
        &db.url,
        LOGICAL,
        "lease_ttl = \"2s\"",
        &body,
    )?;
    let cfg = config.to_str().unwrap_or_default().to_string();
    // The process dies between creating the slot and recording the rows
    // written before it.
    let (code, _, err) = cli_env(
        &["migrate", "-c", &cfg],
        &[("OUTROUTE_FAILPOINT", "slot-created")],
    )?;
    assert_ne!(code, 0, "the failpoint was not reached: {err}");
    assert_eq!(
        db.count("SELECT count(*) FROM pg_replication_slots WHERE database = current_database()")
            .await,
        1,
        "the slot was created"
    );
    // A relay refuses to stream past rows nobody recorded, naming the fix.
    let (code, _, err) = cli(&["config", "check", "--store", "-c", &cfg])?;
    assert_ne!(code, 0);
    assert!(err.contains("run `outroute migrate` again"), "{err}");
    let after = insert(&db, "A", serde_json::json!({ "n": 3 })).await?;

    // The next migrate finishes the job.
    let (code, said, err) = cli(&["migrate", "-c", &cfg])?;
    assert_eq!(code, 0, "{err}");
    assert!(said.contains("stopped right after creating slot"), "{said}");
    let relay = Relay::start(&config, &[])?;
    assert!(
        file_sink_reaches(&out, 4, Duration::from_secs(30)).await,
        "{}",
        relay.log_text()
    );
    let got = delivered_ids(&out);
    // Nothing lost, and aggregate A in order; `after` was committed after
    // the slot and is also in the table's record: it may come twice.
    let mut want = before.clone();
    want.push(after.clone());
    let mut firsts: Vec<String> = Vec::new();
    for g in &got {
        if !firsts.contains(g) {
            firsts.push(g.clone());
        }
    }
    assert_eq!(firsts, want, "{got:?}");
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

#[tokio::test(flavor = "multi_thread")]
async fn without_wal_level_logical_the_source_waits_naming_the_setting() -> anyhow::Result<()> {
    // The shared cluster runs with wal_level = replica.
    let db = TestDb::new().await?;
    let dir = test_dir("logical-refused");
    let route = FILE_ROUTE;
    let config = write_config_with(
        &dir,
        &db.url,
        LOGICAL,
        "",
        &relay_body(
            "",
            &[TestSink::File(&dir.join("o.jsonl"))],
            "order-router",
            "orders",
            route,
        ),
    )?;
    let cfg = config.to_str().unwrap_or_default().to_string();
    let (code, _, err) = cli(&["migrate", "-c", &cfg])?;
    assert_ne!(code, 0);
    assert!(
        err.contains("store.capture") && err.contains("wal_level = logical"),
        "{err}"
    );
    // `run` does not exit (one source's database never stops a shared
    // relay): the source waits, its log line naming the setting.
    let mut relay = Relay::start(&config, &[])?;
    let named = eventually(Duration::from_secs(30), || async {
        relay.log_text().contains("wal_level = logical")
    })
    .await;
    assert!(named, "{}", relay.log_text());
    assert!(
        relay.log_text().contains("source not started"),
        "{}",
        relay.log_text()
    );
    assert!(relay.child.try_wait()?.is_none(), "the relay exited");
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

/// `scripts/pg-failover <action>` (a primary and its streaming standby):
/// `up` makes a fresh pair, `promote` crashes the primary and promotes the
/// standby on the primary's port, `down` removes both. Returns the port.
fn failover_pair(action: &str) -> anyhow::Result<u16> {
    let out = std::process::Command::new(workspace().join("scripts/pg-failover"))
        .arg(action)
        .stdin(std::process::Stdio::null())
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "scripts/pg-failover {action}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .unwrap_or(0))
}

/// PostgreSQL fails over: the primary crashes and its standby is promoted
/// (before PostgreSQL 17 the slot does not survive). One relay reads two
/// sources there. Source `orders` (rows deleted once published) sees the
/// new timeline and the missing slot, says what happened, creates the slot
/// again and publishes the rows still pending in the table — those written
/// while it was away included — then streams on. Source `kept` keeps its
/// published rows (`cleanup = "keep"`), so the relay cannot tell which were
/// missed: that source stops, naming the position after which events may
/// be missing and the command that brings it back, and `orders` is not
/// held up by it. (Before, the source refused to start: "replication slot
/// does not exist".)
#[tokio::test(flavor = "multi_thread")]
async fn a_promotion_that_loses_the_slot_re_reads_the_pending_rows() -> anyhow::Result<()> {
    let port = failover_pair("up")?;
    let result = promotion(port).await;
    failover_pair("down")?;
    result
}

async fn promotion(port: u16) -> anyhow::Result<()> {
    let db = TestDb::new_at(&format!("postgres://root@127.0.0.1:{port}/postgres")).await?;
    create_ev(&db).await?;
    sqlx::query("CREATE TABLE ev_kept (LIKE ev INCLUDING ALL)")
        .execute(&db.pool)
        .await?;
    let dir = test_dir("logical-promotion");
    let out = dir.join("out.jsonl");
    let source = |name: &str, table: &str, logical: &str| {
        format!(
            "[sources.{name}]\nurl = \"{}\"\n{LOGICAL}\n{logical}\n{}",
            db.url,
            own_table(table, "pos").replace("[store.table]", &format!("[sources.{name}.table]"))
        )
    };
    let config = dir.join("outroute.toml");
    std::fs::write(
        &config,
        format!(
            "[relay]\ncache_dir = \"{}\"\nlease_ttl = \"2s\"\n{}\n{}\n{}",
            std::env::temp_dir().join("outroute-test-cache").display(),
            source("orders", "ev", ""),
            source(
                "kept",
                "ev_kept",
                "logical = { slot = \"outroute_kept\", publication = \"outroute_kept\", cleanup = \"keep\" }"
            ),
            relay_body(
                "",
                &[TestSink::File(&out)],
                "order-router",
                "orders",
                &format!("{FILE_ROUTE}\nsources = [\"orders\", \"kept\"]"),
            ),
        ),
    )?;
    db.migrate(&config)?;
    let add = |pool: sqlx::PgPool, table: &'static str, id: &'static str| async move {
        sqlx::query(&format!(
            "INSERT INTO {table} (id, aggregate_id, event_type, payload) VALUES ($1, $1, 'created', '{{}}')"
        ))
        .bind(id)
        .execute(&pool)
        .await
    };
    let relay = Relay::start(&config, &[])?;
    for id in ["a1", "a2", "a3"] {
        add(db.pool.clone(), "ev", id).await?;
    }
    add(db.pool.clone(), "ev_kept", "k1").await?;
    assert!(
        file_sink_reaches(&out, 4, Duration::from_secs(30)).await,
        "{}",
        relay.log_text()
    );
    // Give the relay time to record its confirmed positions, then stop it
    // and write what it has not seen; the standby has it all.
    tokio::time::sleep(Duration::from_secs(1)).await;
    drop(relay);
    for id in ["b1", "b2", "b3"] {
        add(db.pool.clone(), "ev", id).await?;
    }
    add(db.pool.clone(), "ev_kept", "k2").await?;
    db.pool.close().await;
    failover_pair("promote")?;
    let pool = sqlx::PgPool::connect(&db.url).await?;
    let slots: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_replication_slots")
        .fetch_one(&pool)
        .await?;
    assert_eq!(
        slots, 0,
        "the slots survived the promotion: this checks nothing"
    );
    let relay = Relay::start(&config, &[])?;
    assert!(
        file_sink_reaches(&out, 7, Duration::from_secs(30)).await,
        "the rows written before the promotion were not published\n{}",
        relay.log_text()
    );
    add(pool.clone(), "ev", "c1").await?;
    assert!(
        file_sink_reaches(&out, 8, Duration::from_secs(30)).await,
        "the relay did not stream on after the promotion\n{}",
        relay.log_text()
    );
    let got = delivered_ids(&out);
    assert_eq!(
        sorted(got.clone()),
        sorted(
            ["a1", "a2", "a3", "k1", "b1", "b2", "b3", "c1"]
                .map(String::from)
                .to_vec()
        ),
        "`kept` publishes nothing it cannot vouch for: {got:?}"
    );
    let log = relay.log_text();
    assert!(
        log.contains("orders.logical.slot: PostgreSQL was promoted (timeline 1 -> 2)")
            && log.contains("re-read from the table"),
        "{log}"
    );
    assert!(
        log.contains("kept.logical.slot: PostgreSQL was promoted (timeline 1 -> 2)")
            && log.contains("with cleanup = \"keep\" the published rows of `ev_kept` stay in it, so outroute cannot tell which rows written after 0/")
            && log.contains("then run `outroute migrate` to create the slot again"),
        "{log}"
    );
    drop(relay);
    pool.close().await;
    Ok(())
}

/// An event that failed in lease mode, before the source switched to log
/// capture, still holds its aggregate after the switch (the aggregate's
/// rows from the table and from the stream wait behind it), `failed retry`
/// tries it again, and `failed discard` lets the rest go, in order (issue
/// 41, item 13). Before, log capture only knew its own parked records: the
/// aggregate's later events went out past the failed one, and a retry did
/// nothing.
#[tokio::test(flavor = "multi_thread")]
async fn an_event_failed_in_lease_mode_still_holds_and_retries_after_the_switch()
-> anyhow::Result<()> {
    let db = TestDb::new_logical().await?;
    let (body, lease, out) = lease_mode_first("logical-adopt", &db)?;
    let a1 = insert(&db, "A", serde_json::json!({"n": 1})).await?;
    let a2 = insert(&db, "A", serde_json::json!({"n": 2, "hostile": "reject"})).await?;
    let b1 = insert(&db, "B", serde_json::json!({"n": 1})).await?;
    let relay = Relay::start(&lease, &[])?;
    assert!(
        file_sink_reaches(&out, 2, Duration::from_secs(30)).await,
        "{}",
        relay.log_text()
    );
    let failed = || async {
        db.count(&format!(
            "SELECT count(*) FROM outroute_event_state WHERE event_id = '{a2}' AND failed_at IS NOT NULL"
        ))
        .await
    };
    assert!(eventually(Duration::from_secs(10), || async { failed().await == 1 }).await);
    drop(relay);
    let a3 = insert(&db, "A", serde_json::json!({"n": 3})).await?;

    let (config, cfg, _) = switch_to_logical(&lease, &db, "lease_ttl = \"2s\"", &body)?;
    let a4 = insert(&db, "A", serde_json::json!({"n": 4})).await?;
    let b2 = insert(&db, "B", serde_json::json!({"n": 2})).await?;
    let relay = Relay::start(&config, &[])?;
    assert!(
        file_sink_reaches(&out, 3, Duration::from_secs(30)).await,
        "{}",
        relay.log_text()
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    let got = delivered_ids(&out);
    assert_eq!(
        sorted(got.clone()),
        sorted(vec![a1.clone(), b1.clone(), b2.clone()]),
        "A's later events went out past the event that failed in lease mode\n{}",
        relay.log_text()
    );
    // A retry tries it again: the plugin refuses it again, so it fails
    // anew (before, `failed retry` cleared it and nothing ever tried it).
    let failed_at = || async {
        sqlx::query_scalar::<_, Option<String>>(
            "SELECT failed_at::text FROM outroute_event_state WHERE event_id = $1",
        )
        .bind(&a2)
        .fetch_one(&db.pool)
        .await
        .ok()
        .flatten()
    };
    let first = failed_at().await;
    assert!(first.is_some());
    let (code, _, err) = cli(&["failed", "retry", "--id", &a2, "-c", &cfg])?;
    assert_eq!(code, 0, "{err}");
    assert!(
        eventually(Duration::from_secs(15), || async {
            failed_at()
                .await
                .is_some_and(|t| Some(&t) != first.as_ref())
        })
        .await,
        "the retried event was not tried again\n{}",
        relay.log_text()
    );
    assert_eq!(delivered_ids(&out).len(), 3, "A went on after the retry");
    let (code, _, err) = cli(&["failed", "discard", "--id", &a2, "-c", &cfg])?;
    assert_eq!(code, 0, "{err}");
    assert!(
        file_sink_reaches(&out, 5, Duration::from_secs(20)).await,
        "{}",
        relay.log_text()
    );
    let got = delivered_ids(&out);
    let of_a: Vec<&String> = got.iter().filter(|g| [&a1, &a3, &a4].contains(g)).collect();
    assert_eq!(of_a, vec![&a1, &a3, &a4]);
    assert!(!got.contains(&a2));
    drop(relay);
    db.drop_db().await;
    Ok(())
}

/// `outroute slot drop` is refused while a relay streams from the slot
/// (naming the backend), the slot's lag is exported and shown by
/// `status`; once the relay is stopped the drop goes through, a relay
/// started without the slot waits naming the fix, and after `outroute
/// migrate` it streams again by itself.
#[tokio::test(flavor = "multi_thread")]
async fn slot_drop_is_refused_while_a_relay_streams() -> anyhow::Result<()> {
    let db = TestDb::new_logical().await?;
    create_ev(&db).await?;
    let (config, out) = file_config("slot-drop", &db, "", "order-router")?;
    let http = free_addr();
    std::fs::write(
        &config,
        std::fs::read_to_string(&config)?.replace("listen = \"\"", &format!("listen = \"{http}\"")),
    )?;
    db.migrate(&config)?;
    let add = |id: &'static str| {
        let pool = db.pool.clone();
        async move {
            sqlx::query("INSERT INTO ev (id, aggregate_id, event_type, payload) VALUES ($1, $1, 'created', '{}')")
                .bind(id)
                .execute(&pool)
                .await
        }
    };
    let cfg = config.display().to_string();
    let mut relay = Relay::start(&config, &[])?;
    add("a1").await?;
    assert!(
        file_sink_reaches(&out, 1, Duration::from_secs(30)).await,
        "{}",
        relay.log_text()
    );
    let (code, o, e) = cli(&["slot", "drop", "-c", &cfg])?;
    assert_ne!(code, 0, "{o}{e}");
    assert!(
        e.contains("is in use by backend")
            && e.contains("(a relay is streaming): stop the relays first"),
        "{e}"
    );
    let slots = || {
        db.count("SELECT count(*) FROM pg_replication_slots WHERE database = current_database()")
    };
    assert_eq!(slots().await, 1, "the slot is still there");
    let lag = eventually(Duration::from_secs(10), || async {
        http_get(&http, "/metrics")
            .await
            .is_ok_and(|(_, m)| metric(&m, "outroute_slot_lag_bytes{source=\"default\"}").is_some())
    })
    .await;
    assert!(lag, "{:?}", http_get(&http, "/metrics").await);
    let (_, status, _) = cli(&["status", "-c", &cfg])?;
    assert!(
        status.lines().any(|l| l.starts_with("slot")
            && l.contains("streaming, backend")
            && l.contains("bytes of WAL kept behind it")),
        "{status}"
    );

    relay.terminate(Duration::from_secs(15));
    let dropped = eventually(Duration::from_secs(10), || async {
        cli(&["slot", "drop", "-c", &cfg]).is_ok_and(|(code, _, _)| code == 0)
    })
    .await;
    assert!(dropped, "{:?}", cli(&["slot", "drop", "-c", &cfg]));
    assert_eq!(slots().await, 0);
    let relay = Relay::start(&config, &[])?;
    let waits = eventually(Duration::from_secs(20), || async {
        relay
            .log_text()
            .contains("does not exist (run `outroute migrate`)")
    })
    .await;
    assert!(waits, "{}", relay.log_text());
    db.migrate(&config)?;
    add("a2").await?;
    assert!(
        file_sink_reaches(&out, 2, Duration::from_secs(60)).await,
        "streams again once the slot is back: {}",
        relay.log_text()
    );
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
