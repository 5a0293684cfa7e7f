//! Log-based capture around its slot (`capture = "logical"`, the cluster of
//! `scripts/pg-logical`): rows written before the slot existed (published
//! from the table first, also after a `migrate` that died right after
//! creating the slot), the switch from lease mode with an event failed
//! there, a promotion that loses the slot, `outroute slot drop` refused
//! while a relay streams, and the clear refusal on a server without
//! `wal_level = logical`.
//!
//! One concern, one file: the slot's life; what the stream itself
//! guarantees is in `logical.rs`.

use std::time::Duration;

use outroute_e2e::logical::*;
use outroute_e2e::*;

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
    let done = insert_order_event(&db, "P", serde_json::json!({"n": 1})).await?;
    sqlx::query("UPDATE outbox SET published_at = now() WHERE id = $1::uuid")
        .bind(&done)
        .execute(&db.pool)
        .await?;
    let a1 = insert_order_event(&db, "A", serde_json::json!({"n": 1})).await?;
    let a2 = insert_order_event(&db, "A", serde_json::json!({"n": 2, "hostile": "reject"})).await?;
    let a3 = insert_order_event(&db, "A", serde_json::json!({"n": 3})).await?;
    let b1 = insert_order_event(&db, "B", serde_json::json!({"n": 1})).await?;
    let b2 = insert_order_event(&db, "B", serde_json::json!({"n": 2})).await?;

    // Switching to logical capture: the slot never streams those five.
    // Small batches: the table is read page after page.
    let (config, cfg, said) =
        switch_to_logical(&lease, &db, "lease_ttl = \"2s\"\nbatch_size = 2", &body)?;
    assert!(
        said.contains("5 pending rows of `outbox` were written before the slot"),
        "{said}"
    );
    let a4 = insert_order_event(&db, "A", serde_json::json!({"n": 4})).await?;
    let b3 = insert_order_event(&db, "B", serde_json::json!({"n": 3})).await?;
    let c1 = insert_order_event(&db, "C", serde_json::json!({"n": 1})).await?;

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
        before.push(insert_order_event(&db, "A", serde_json::json!({ "n": n })).await?);
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
    let after = insert_order_event(&db, "A", serde_json::json!({ "n": 3 })).await?;

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
    let a1 = insert_order_event(&db, "A", serde_json::json!({"n": 1})).await?;
    let a2 = insert_order_event(&db, "A", serde_json::json!({"n": 2, "hostile": "reject"})).await?;
    let b1 = insert_order_event(&db, "B", serde_json::json!({"n": 1})).await?;
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
    let a3 = insert_order_event(&db, "A", serde_json::json!({"n": 3})).await?;

    let (config, cfg, _) = switch_to_logical(&lease, &db, "lease_ttl = \"2s\"", &body)?;
    let a4 = insert_order_event(&db, "A", serde_json::json!({"n": 4})).await?;
    let b2 = insert_order_event(&db, "B", serde_json::json!({"n": 2})).await?;
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
