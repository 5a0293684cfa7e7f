//! The PostgreSQL store against a real server: lease fencing and takeover,
//! retention, and the two existing-table shapes from the seed articles
//! relayed end to end (to NATS JetStream) without migrating them, including
//! the operator workflow for a malformed row (`failed list` → fix → `failed
//! retry`).
//!
//! One concern, one file: the end-to-end tests of the PostgreSQL store; each
//! sets up its own database and table.

use std::path::Path;
use std::time::Duration;

use outroute::store::{Claim, Failure, FailureKind};
use outroute_e2e::*;

fn file_sink_body(dir: &Path, table: &str) -> String {
    format!(
        r#"
[http]
listen = ""
{table}
[sinks.file]
kind = "file"
path = "{out}"
[plugins.order-router]
path = "{plugin}"
[[routes]]
name = "orders"
plugin = "order-router"
config = {{ sink = "file", topic = "orders.{{event_type}}" }}
allow = {{ file = ["orders.*"] }}
"#,
        out = dir.join("out.jsonl").display(),
        plugin = plugin("order-router").display()
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn expired_lease_is_taken_over_and_the_old_owner_cannot_mark() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let dir = test_dir("fence");
    let config = write_config(
        &dir,
        &db.url,
        "lanes = 4\nlease_ttl = \"5s\"",
        &file_sink_body(&dir, ""),
    )?;
    db.migrate(&config)?;
    let work = produce(&db.pool, "agg", 10, 2, 0).await?;

    let a = open_store(&config, "relay-a").await?;
    let la = a.lease_round().await?;
    assert_eq!(la.lanes, vec![0, 1, 2, 3]);
    let claimed = a.claim(&la.lanes, 100).await?.claims;
    assert_eq!(claimed.len(), work.committed.len());
    let ids: Vec<String> = claimed.iter().map(|c| c.id().to_string()).collect();
    let mine: Vec<&Claim> = claimed.iter().collect();

    // Relay A stalls (GC pause, network cut): its lease lapses, its heartbeat stops.
    sqlx::query("UPDATE outroute_lanes SET lease_until = now() - interval '1 second'")
        .execute(&db.pool)
        .await?;
    sqlx::query("UPDATE outroute_relays SET heartbeat_at = now() - interval '1 hour' WHERE relay_id = 'relay-a'")
        .execute(&db.pool)
        .await?;
    let b = open_store(&config, "relay-b").await?;
    let lb = b.lease_round().await?;
    assert_eq!(lb.lanes, vec![0, 1, 2, 3], "B takes over every lapsed lane");
    assert_eq!(lb.acquired, 4);

    // A wakes up and tries to mark what it published: fenced out.
    assert_eq!(
        a.mark_published(&mine).await?,
        0,
        "a fenced-out relay marked rows"
    );
    assert_eq!(db.published("").await, 0);
    // A's renewal finds nothing left to renew.
    assert!(
        a.lease_round().await?.lanes.is_empty()
            || db
                .count("SELECT count(*) FROM outroute_lanes WHERE owner = 'relay-a'")
                .await
                == 0
    );

    // B claims the same events and marks them exactly once.
    let again = b.claim(&lb.lanes, 100).await?.claims;
    assert_eq!(again.len(), ids.len());
    let theirs: Vec<&Claim> = again.iter().collect();
    assert_eq!(b.mark_published(&theirs).await?, ids.len() as u64);
    assert_eq!(
        b.mark_published(&theirs).await?,
        0,
        "a second mark changed rows"
    );
    assert_eq!(a.mark_published(&mine).await?, 0);
    assert_eq!(db.published("").await, ids.len() as i64);
    db.drop_db().await;
    Ok(())
}

/// ABA: relay A claims, stalls, B takes the lanes over and lets them go, A
/// gets them back. A is the owner again with a valid lease, but the lanes
/// changed hands in between (B may have published the same rows, and later
/// ones): A's old batch must not be marked. The lane epoch says so.
#[tokio::test(flavor = "multi_thread")]
async fn a_batch_from_before_a_lane_changed_hands_and_came_back_is_not_marked() -> anyhow::Result<()>
{
    let db = TestDb::new().await?;
    let dir = test_dir("epoch");
    let config = write_config(
        &dir,
        &db.url,
        "lanes = 2\nlease_ttl = \"5s\"",
        &file_sink_body(&dir, ""),
    )?;
    db.migrate(&config)?;
    produce(&db.pool, "agg", 10, 1, 0).await?;
    let stamp = |claims: &mut Vec<Claim>, lanes: &[i32], epochs: &[i64]| {
        for c in claims.iter_mut() {
            c.epoch = lanes.iter().position(|l| *l == c.lane).map(|i| epochs[i]);
        }
    };

    let a = open_store(&config, "relay-a").await?;
    let before = a.lease_round().await?;
    let mut old = a.claim(&before.lanes, 100).await?.claims;
    assert_eq!(old.len(), 10);
    stamp(&mut old, &before.lanes, &before.epochs);

    // A stalls; B takes both lanes, then shuts down and gives them back.
    sqlx::query("UPDATE outroute_lanes SET lease_until = now() - interval '1 second'")
        .execute(&db.pool)
        .await?;
    sqlx::query("UPDATE outroute_relays SET heartbeat_at = now() - interval '1 hour' WHERE relay_id = 'relay-a'")
        .execute(&db.pool)
        .await?;
    let b = open_store(&config, "relay-b").await?;
    assert_eq!(b.lease_round().await?.acquired, 2);
    b.release_all().await?;

    // A wakes up and takes its lanes again: owner and lease are fine.
    let after = a.lease_round().await?;
    assert_eq!(after.lanes, before.lanes);
    assert!(
        after.epochs.iter().zip(&before.epochs).all(|(n, o)| n > o),
        "epochs did not move: {:?} → {:?}",
        before.epochs,
        after.epochs
    );
    let refs: Vec<&Claim> = old.iter().collect();
    assert_eq!(
        a.mark_published(&refs).await?,
        0,
        "a batch claimed under an earlier epoch was marked"
    );
    // Nor does its failure record hold the aggregate back.
    assert_eq!(
        a.record_failures(&[failure_of(
            &old[0],
            FailureKind::Retry {
                delay: Duration::from_secs(60)
            },
            "broker down"
        )?])
        .await?,
        0,
        "a failure of a batch claimed under an earlier epoch was recorded"
    );
    // Claimed again under the current epochs, it is marked.
    let mut fresh = a.claim(&after.lanes, 100).await?.claims;
    stamp(&mut fresh, &after.lanes, &after.epochs);
    let refs: Vec<&Claim> = fresh.iter().collect();
    assert_eq!(a.mark_published(&refs).await?, 10);
    db.drop_db().await;
    Ok(())
}

/// A failure record also takes the event off the pending queue and sets
/// the row's own attempts, last_error and failed_at (one statement per
/// failure, where there were three, and a crash between them left a row
/// that looked published).
#[tokio::test(flavor = "multi_thread")]
async fn a_failure_record_sets_the_rows_own_columns_and_leaves_the_queue() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let dir = test_dir("failure-one-statement");
    let config = write_config(&dir, &db.url, "lanes = 2", &file_sink_body(&dir, ""))?;
    db.migrate(&config)?;
    produce(&db.pool, "agg", 10, 1, 0).await?;
    let store = open_store(&config, "recorder").await?;
    let leases = store.lease_round().await?;
    let claims = store.claim(&leases.lanes, 100).await?.claims;
    assert_eq!(claims.len(), 10);
    let failures = claims
        .iter()
        .map(|c| {
            let f = failure_of(
                c,
                FailureKind::Failed { hold: false },
                "broker refused: too large",
            )?;
            let epoch = leases.lanes.iter().position(|l| *l == c.lane);
            Ok(Failure {
                epoch: epoch.map(|i| leases.epochs[i]),
                ..f
            })
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    assert_eq!(store.record_failures(&failures).await?, 10);
    assert_eq!(db.count("SELECT count(*) FROM outroute_queue").await, 0);
    assert_eq!(
        db.count(
            "SELECT count(*) FROM outbox WHERE failed_at IS NOT NULL AND attempts = 1 \
             AND last_error = 'broker refused: too large'"
        )
        .await,
        10
    );
    assert_eq!(db.published("").await, 0);
    db.drop_db().await;
    Ok(())
}

/// A failure record that began while its relay held the lane and could
/// commit only after the lease expired (it waited on a lock): the hand-over
/// waits for it, so the new owner sees the record and never publishes the
/// event under a hold that would then block its aggregate for good.
#[tokio::test(flavor = "multi_thread")]
async fn a_failure_record_that_commits_after_a_hand_over_never_blocks_a_published_event()
-> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let dir = test_dir("fence-failure");
    let config = write_config(
        &dir,
        &db.url,
        "lanes = 1\nlease_ttl = \"5s\"",
        &file_sink_body(&dir, ""),
    )?;
    db.migrate(&config)?;
    produce(&db.pool, "agg", 1, 2, 0).await?;
    let a = open_store(&config, "relay-a").await?;
    let la = a.lease_round().await?;
    let mut claims = a.claim(&la.lanes, 100).await?.claims;
    assert_eq!(claims.len(), 2);
    for c in claims.iter_mut() {
        c.epoch = la.epochs.first().copied();
    }
    let first = claims[0]
        .row
        .as_ref()
        .map_err(|m| anyhow::anyhow!("{}", m.reason))?
        .clone();
    let source: String = sqlx::query_scalar("SELECT source FROM outroute_lanes LIMIT 1")
        .fetch_one(&db.pool)
        .await?;
    // Another session holds the event's state key: A's record, once past
    // its lease check, waits on it.
    let mut blocker = db.pool.begin().await?;
    sqlx::query(
        "INSERT INTO outroute_event_state (source, event_id, aggregate_type, aggregate_id, seq) \
         VALUES ($1, $2, 'x', 'x', 0)",
    )
    .bind(&source)
    .bind(&first.id)
    .execute(&mut *blocker)
    .await?;
    let failure = failure_of(
        &claims[0],
        FailureKind::Failed { hold: true },
        "plugin refused",
    )?;
    let recording = tokio::spawn(async move { a.record_failures(&[failure]).await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Meanwhile A's lease lapses and B takes the lane, claims and marks.
    let (url, cfg) = (db.url.clone(), config.clone());
    let b_side = tokio::spawn(async move {
        let pool = sqlx::PgPool::connect(&url).await?;
        sqlx::query("UPDATE outroute_lanes SET lease_until = now() - interval '1 second'")
            .execute(&pool)
            .await?;
        sqlx::query("UPDATE outroute_relays SET heartbeat_at = now() - interval '1 hour' WHERE relay_id = 'relay-a'")
            .execute(&pool)
            .await?;
        let b = open_store(&cfg, "relay-b").await?;
        let lb = b.lease_round().await?;
        let mut got = b.claim(&lb.lanes, 100).await?.claims;
        for c in got.iter_mut() {
            c.epoch = lb.epochs.first().copied();
        }
        let refs: Vec<&Claim> = got.iter().collect();
        let marked = b.mark_published(&refs).await?;
        let ids: Vec<String> = got.iter().map(|c| c.id().to_string()).collect();
        anyhow::Ok((ids, marked))
    });
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    blocker.rollback().await?;
    let recorded = recording.await??;
    let (b_claimed, marked) = b_side.await??;
    let published = i64::from(b_claimed.contains(&first.id) && marked > 0);
    let held = db
        .count(&format!(
            "SELECT count(*) FROM outroute_event_state WHERE event_id = '{}' AND blocks_until = 'infinity'",
            first.id
        ))
        .await;
    assert!(
        !(published == 1 && held == 1),
        "event {} was published by B and then held by A's late record (recorded {recorded}, B marked {marked}): \
         its aggregate is blocked for good",
        first.id
    );
    assert!(
        recorded == 1 || published == 1,
        "neither recorded nor published"
    );
    db.drop_db().await;
    Ok(())
}

/// Retention rounds of 3 rows with a one-day window: the rows deleted.
async fn purge_a_day_old(config: &Path) -> anyhow::Result<u64> {
    let s = open_store(config, "purger").await?;
    purge_rounds(&s, Duration::from_secs(86_400), 3).await
}

/// A migrated database whose outbox is marked by `published_at`
/// (`examples/outbox-published-at.toml`), in test folder `name`.
async fn stamped_outbox(name: &str) -> anyhow::Result<(TestDb, std::path::PathBuf)> {
    let db = TestDb::new().await?;
    let dir = test_dir(name);
    let config = write_config(
        &dir,
        &db.url,
        "",
        &file_sink_body(&dir, &example_table("outbox-published-at.toml")?),
    )?;
    db.migrate(&config)?;
    Ok((db, config))
}

/// Retention runs on one relay at a time: while another relay's round
/// holds the table's purge lock (an advisory lock per source), a round
/// deletes nothing and leaves the rows for the holder; once it is released
/// the next round deletes them.
#[tokio::test(flavor = "multi_thread")]
async fn retention_rounds_skip_while_another_relay_holds_the_purge_lock() -> anyhow::Result<()> {
    let (db, config) = stamped_outbox("retention-lock").await?;
    produce(&db.pool, "agg", 10, 1, 0).await?;
    sqlx::query("UPDATE outbox SET published_at = now() - interval '3 days'")
        .execute(&db.pool)
        .await?;
    // Another relay's round on this table, mid-transaction.
    let mut other = db.pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('outroute purge'), hashtext('outbox'))")
        .execute(&mut *other)
        .await?;
    assert_eq!(purge_a_day_old(&config).await?, 0);
    assert_eq!(db.count("SELECT count(*) FROM outbox").await, 10);
    other.commit().await?;
    assert_eq!(purge_a_day_old(&config).await?, 10);
    assert_eq!(db.count("SELECT count(*) FROM outbox").await, 0);
    db.drop_db().await;
    Ok(())
}

/// Under `published_at` marking retention ages rows by their stamp.
#[tokio::test(flavor = "multi_thread")]
async fn retention_deletes_only_published_rows_past_the_window() -> anyhow::Result<()> {
    let (db, config) = stamped_outbox("retention").await?;
    produce(&db.pool, "agg", 10, 3, 0).await?; // 30 rows
    sqlx::query("UPDATE outbox SET published_at = now() - interval '3 days' WHERE seq <= 10")
        .execute(&db.pool)
        .await?;
    sqlx::query(
        "UPDATE outbox SET published_at = now() - interval '1 hour' WHERE seq > 10 AND seq <= 20",
    )
    .execute(&db.pool)
    .await?;
    let deleted = purge_a_day_old(&config).await?;
    assert_eq!(deleted, 10);
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE seq <= 10")
            .await,
        0
    );
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE published_at IS NOT NULL")
            .await,
        10
    );
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE published_at IS NULL")
            .await,
        10
    );
    db.drop_db().await;
    Ok(())
}

/// Under the pending queue (the default) retention ages rows by
/// `created_at` and never deletes a row still queued or failed.
#[tokio::test(flavor = "multi_thread")]
async fn retention_under_the_queue_deletes_only_published_rows_past_the_window()
-> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let dir = test_dir("retention-queue");
    let config = write_config(&dir, &db.url, "", &file_sink_body(&dir, ""))?;
    db.migrate(&config)?;
    produce(&db.pool, "agg", 10, 3, 0).await?; // 30 rows
    // Old: 1-15, of which 11-13 are still queued and 14 failed; the rest
    // is published.
    sqlx::query("UPDATE outbox SET created_at = now() - interval '3 days' WHERE seq <= 15")
        .execute(&db.pool)
        .await?;
    sqlx::query("UPDATE outbox SET failed_at = now() WHERE seq = 14")
        .execute(&db.pool)
        .await?;
    sqlx::query("DELETE FROM outroute_queue WHERE source = 'outbox' AND seq NOT BETWEEN 11 AND 13")
        .execute(&db.pool)
        .await?;
    let deleted = purge_a_day_old(&config).await?;
    assert_eq!(deleted, 11, "1-10 and 15, stepping over 11-14");
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE seq <= 10 OR seq = 15")
            .await,
        0
    );
    assert_eq!(db.published("").await, 15, "16-30 are recent");
    assert_eq!(db.unpublished("").await, 4, "11-13 queued, 14 failed");
    db.drop_db().await;
    Ok(())
}

fn nats_body(t: &str, table: &str) -> String {
    format!(
        r#"
[http]
listen = ""
{table}
[sinks.nats]
kind = "nats"
url = "{NATS}"
[plugins.order-router]
path = "{plugin}"
[[routes]]
name = "orders"
plugin = "order-router"
config = {{ sink = "nats", topic = "l{t}.{{event_type}}" }}
allow = {{ nats = ["l{t}.*"] }}
max_attempts = 1
on_failure = "skip"
"#,
        plugin = plugin("order-router").display()
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn existing_tables_relay_without_migration() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let t = tag();
    let js = nats_stream(&format!("L{t}"), vec![format!("l{t}.>")]).await?;
    // The two shapes, exactly as the seed articles define them.
    sqlx::query(seed::OUTBOX_EVENTS_DDL)
        .execute(&db.pool)
        .await?;
    sqlx::query(seed::T_OUTBOX_DDL).execute(&db.pool).await?;
    let agg = uuid::Uuid::new_v4();
    let mut ids1 = Vec::new();
    for i in 0..20 {
        let id = uuid::Uuid::new_v4();
        sqlx::query("INSERT INTO outbox_events (id, event_type, aggregate_id, payload) VALUES ($1, 'order-created', $2, $3)")
            .bind(id)
            .bind(agg)
            .bind(serde_json::json!({"n": i}))
            .execute(&db.pool)
            .await?;
        ids1.push(id.to_string());
    }
    let mut ids2 = Vec::new();
    for i in 0..20 {
        let id = format!("evt-{i}");
        sqlx::query("INSERT INTO t_outbox (event_id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1, 'order', $2, 'order-paid', $3)")
            .bind(&id)
            .bind(format!("o-{}", i % 4))
            .bind(format!("{{\"n\": {i}}}"))
            .execute(&db.pool)
            .await?;
        ids2.push(id);
    }
    // Producer bugs: a payload that is not JSON, a NULL aggregate id.
    sqlx::query("INSERT INTO t_outbox (event_id, aggregate_type, aggregate_id, event_type, payload) VALUES ('bad-json', 'order', 'o-x', 'order-paid', '{oops')")
        .execute(&db.pool)
        .await?;
    sqlx::query("INSERT INTO t_outbox (event_id, aggregate_type, aggregate_id, event_type, payload) VALUES ('null-agg', 'order', NULL, 'order-paid', '{}')")
        .execute(&db.pool)
        .await?;

    let dir1 = test_dir("legacy1");
    let c1 = write_config(
        &dir1,
        &db.url,
        "lease_ttl = \"2s\"",
        &nats_body(&t, seed::OUTBOX_EVENTS_MAPPING),
    )?;
    let dir2 = test_dir("legacy2");
    let c2 = write_config(
        &dir2,
        &db.url,
        "lease_ttl = \"2s\"",
        &nats_body(&t, seed::T_OUTBOX_MAPPING),
    )?;
    let mut r1 = Relay::start(&c1, &[])?;
    let mut r2 = Relay::start(&c2, &[])?;
    let delivered = consume_nats(&js, &format!("L{t}"), 40, Duration::from_secs(60)).await?;
    let got: std::collections::HashSet<String> =
        delivered.iter().map(|d| d.id().to_string()).collect();
    for id in ids1.iter().chain(&ids2) {
        assert!(got.contains(id), "event {id} not delivered");
    }
    assert!(!got.contains("bad-json") && !got.contains("null-agg"));
    // outbox_events: the 20 events of one aggregate arrive in created_at order.
    let order: Vec<i64> = delivered
        .iter()
        .filter(|d| {
            d.headers.get("ce_aggregatetype").map(String::as_str) == Some("order")
                && ids1.contains(&d.id().to_string())
        })
        .map(Delivered::number)
        .collect();
    assert_eq!(order, (0..20).collect::<Vec<_>>());
    // Marked in the table's own style.
    assert!(
        eventually(Duration::from_secs(10), || async {
            db.count("SELECT count(*) FROM outbox_events WHERE published_at IS NULL")
                .await
                == 0
                && db
                    .count("SELECT count(*) FROM t_outbox WHERE status = 'SENT'")
                    .await
                    == 20
        })
        .await
    );
    // The bad rows failed with their reasons, recorded beside the table; the
    // relay did not loop on them (attempts mirrored into retry_count).
    let c2s = c2.to_str().unwrap_or_default().to_string();
    let listed = eventually(Duration::from_secs(10), || async {
        cli(&["failed", "list", "--json", "-c", &c2s])
            .is_ok_and(|(_, out, _)| out.matches("\"id\"").count() == 2)
    })
    .await;
    let (code, out, err) = cli(&["failed", "list", "--json", "-c", &c2s])?;
    assert!(listed && code == 0, "{out}{err}\n{}", r2.log_text());
    let failed: serde_json::Value = serde_json::from_str(&out)?;
    let reasons: Vec<(String, String)> = failed
        .as_array()
        .map(|a| {
            a.iter()
                .map(|f| {
                    (
                        f["id"].as_str().unwrap_or("").to_string(),
                        f["reason"].as_str().unwrap_or("").to_string(),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(reasons.len(), 2, "{out}");
    assert!(
        reasons
            .iter()
            .any(|(id, r)| id == "bad-json" && r.contains("payload is not valid JSON")),
        "{out}"
    );
    assert!(
        reasons
            .iter()
            .any(|(id, r)| id == "null-agg" && r.contains("aggregate_id is NULL")),
        "{out}"
    );
    assert_eq!(
        db.count("SELECT retry_count::bigint FROM t_outbox WHERE event_id = 'bad-json'")
            .await,
        1
    );
    let (_, status, _) = cli(&["status", "--json", "-c", c2.to_str().unwrap_or_default()])?;
    let status: serde_json::Value = serde_json::from_str(&status)?;
    assert_eq!(status["backlog"], 0, "{status}");
    assert_eq!(status["failed"], 2, "{status}");
    // The per-type breakdown agrees with the total (failed rows that stay
    // PENDING in a table without `marking.failed` are not backlog).
    assert_eq!(
        status["backlog_by_aggregate_type"],
        serde_json::json!([]),
        "{status}"
    );
    // A malformed row keeps the columns that could be read: its event type
    // is listed and filterable.
    let (_, out, _) = cli(&[
        "failed",
        "list",
        "--json",
        "--event-type",
        "order-paid",
        "-c",
        &c2s,
    ])?;
    let listed: serde_json::Value = serde_json::from_str(&out)?;
    assert_eq!(listed.as_array().map(Vec::len), Some(2), "{out}");
    assert!(
        listed
            .as_array()
            .is_some_and(|a| a.iter().all(|f| f["event_type"] == "order-paid")),
        "{out}"
    );

    // The operator fixes the payload and retries: it is published.
    sqlx::query("UPDATE t_outbox SET payload = '{\"fixed\": true}' WHERE event_id = 'bad-json'")
        .execute(&db.pool)
        .await?;
    let (code, out, err) = cli(&[
        "failed",
        "retry",
        "--id",
        "bad-json",
        "-c",
        c2.to_str().unwrap_or_default(),
    ])?;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("1 event(s) put back"), "{out}");
    assert!(
        eventually(Duration::from_secs(20), || async {
            db.count(
                "SELECT count(*) FROM t_outbox WHERE event_id = 'bad-json' AND status = 'SENT'",
            )
            .await
                == 1
        })
        .await,
        "retried event not published"
    );
    // And the NULL-aggregate row is discarded for good.
    let (code, out, _) = cli(&[
        "failed",
        "discard",
        "--id",
        "null-agg",
        "-c",
        c2.to_str().unwrap_or_default(),
    ])?;
    assert_eq!(code, 0);
    assert!(out.contains("1 event(s) discarded"), "{out}");
    let (_, out, _) = cli(&[
        "failed",
        "list",
        "--json",
        "-c",
        c2.to_str().unwrap_or_default(),
    ])?;
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&out)?
            .as_array()
            .map(Vec::len),
        Some(0),
        "{out}"
    );
    let (_, out, _) = cli(&[
        "failed",
        "show",
        "null-agg",
        "-c",
        c2.to_str().unwrap_or_default(),
    ])?;
    assert!(out.contains("\"discarded_at\""), "{out}");

    r1.terminate(Duration::from_secs(15));
    r2.terminate(Duration::from_secs(15));
    db.drop_db().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn fixed_width_char_ids_are_marked() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    sqlx::query(
        "CREATE TABLE legacy_char (id char(36) PRIMARY KEY, seq bigserial, aggregate_id text NOT NULL, \
         event_type text NOT NULL, payload jsonb NOT NULL, created_at timestamptz NOT NULL DEFAULT now(), published_at timestamptz)",
    )
    .execute(&db.pool)
    .await?;
    for i in 0..25 {
        sqlx::query("INSERT INTO legacy_char (id, aggregate_id, event_type, payload) VALUES ($1, $2, 'created', '{}')")
            .bind(uuid::Uuid::new_v4().to_string())
            .bind(format!("a{}", i % 5))
            .execute(&db.pool)
            .await?;
    }
    let dir = test_dir("charid");
    let table = "[store.table]\nname = \"legacy_char\"\nid = \"id\"\nsequence = \"seq\"\naggregate_type_value = \"order\"\n\
                 aggregate_id = \"aggregate_id\"\nevent_type = \"event_type\"\npayload = \"payload\"\ncreated_at = \"created_at\"\n";
    let config = write_config(
        &dir,
        &db.url,
        "lease_ttl = \"2s\"",
        &file_sink_body(&dir, table),
    )?;
    let mut relay = Relay::start(&config, &[])?;
    let marked = eventually(Duration::from_secs(20), || async {
        db.count("SELECT count(*) FROM legacy_char WHERE published_at IS NOT NULL")
            .await
            == 25
    })
    .await;
    assert!(
        marked,
        "char(36) ids were not marked:\n{}",
        relay.log_text()
    );
    let lines = std::fs::read_to_string(dir.join("out.jsonl"))?;
    assert_eq!(lines.lines().count(), 25, "published more than once");
    relay.terminate(Duration::from_secs(15));
    db.drop_db().await;
    Ok(())
}

/// A database with the canonical table mapped as `examples/<example>`
/// (marking `style`), set up by `migrate` and `migrate --table`, routed by
/// the hostile plugin to a file sink. Returns the database, the test's
/// directory and its config.
async fn example_marking(
    example: &str,
    style: &str,
) -> anyhow::Result<(TestDb, std::path::PathBuf, std::path::PathBuf)> {
    let mapping = example_table(example)?;
    assert!(
        mapping.contains(&format!("style = \"{style}\"")),
        "{mapping}"
    );
    let db = TestDb::new().await?;
    let dir = test_dir(&format!("{style}-marking"));
    let body = file_sink_body(&dir, &mapping).replace(
        &plugin("order-router").display().to_string(),
        &plugin("hostile").display().to_string(),
    );
    let config = write_config(&dir, &db.url, "", &body)?;
    db.migrate(&config)?;
    let c = config.to_string_lossy().to_string();
    let (code, out, err) = cli(&["migrate", "--table", "-c", &c])?;
    assert_eq!(code, 0, "{out}{err}");
    Ok((db, dir, config))
}

/// The canonical table marked by `delete` (examples/outbox-delete.toml's
/// mapping): published rows are gone, a failed one stays, marked by
/// `failed_at` and listed by `outroute failed list`.
#[tokio::test(flavor = "multi_thread")]
async fn the_canonical_table_marked_by_delete_keeps_only_failed_rows() -> anyhow::Result<()> {
    let (db, dir, config) = example_marking("outbox-delete.toml", "delete").await?;
    let c = config.to_string_lossy().to_string();
    let insert = |agg: String, payload: serde_json::Value| {
        let pool = db.pool.clone();
        async move {
            sqlx::query("INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1::uuid, 'order', $2, 'order-updated', $3)")
                .bind(uuid::Uuid::new_v4().to_string())
                .bind(agg)
                .bind(payload)
                .execute(&pool)
                .await
        }
    };
    for i in 0..20 {
        insert(format!("o-{}", i % 4), serde_json::json!({"n": i})).await?;
    }
    insert("bad".into(), serde_json::json!({"hostile": "reject"})).await?;

    let relay = Relay::start(&config, &[])?;
    let out = dir.join("out.jsonl");
    let drained = eventually(Duration::from_secs(60), || async {
        let delivered = std::fs::read_to_string(&out)
            .map(|t| t.lines().count())
            .unwrap_or(0);
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox")
            .fetch_one(&db.pool)
            .await
            .unwrap_or(-1);
        let marked: i64 =
            sqlx::query_scalar("SELECT count(*) FROM outbox WHERE failed_at IS NOT NULL")
                .fetch_one(&db.pool)
                .await
                .unwrap_or(-1);
        // The failed row's marker is written after its failure record:
        // wait for both, not just for the others to be gone.
        delivered >= 20 && left == 1 && marked == 1
    })
    .await;
    assert!(
        drained,
        "published rows deleted, the failed one marked: {}",
        relay.log_text()
    );
    let (agg, failed): (String, bool) =
        sqlx::query_as("SELECT aggregate_id, failed_at IS NOT NULL FROM outbox")
            .fetch_one(&db.pool)
            .await?;
    assert_eq!(agg, "bad");
    assert!(failed, "the failed row is marked by failed_at");
    let (code, out, err) = cli(&["failed", "list", "-c", &c])?;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("hostile plugin rejects this event"), "{out}");
    drop(relay);
    db.drop_db().await;
    Ok(())
}

/// The canonical table as `outroute migrate` alone sets it up: its pending
/// rows listed in the queue by the insert trigger, which a producer role
/// with rights on the outbox only can fire. Published events leave their
/// outbox rows untouched and the queue, in per-aggregate order; a failing
/// event is recorded as failed; published events can be replayed.
#[tokio::test(flavor = "multi_thread")]
async fn the_canonical_table_marked_by_the_queue_keeps_rows_and_replays() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let dir = test_dir("queue-marking");
    let body = file_sink_body(&dir, "").replace(
        &plugin("order-router").display().to_string(),
        &plugin("hostile").display().to_string(),
    );
    let config = write_config(&dir, &db.url, "", &body)?;
    let c = config.to_string_lossy().to_string();
    let (code, out, err) = cli(&["migrate", "-c", &c])?;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("pending queue of `outbox` set up"), "{out}");
    // A producer's role may insert into its outbox and nothing of outroute's.
    let role = format!("producer_{}", tag().to_lowercase());
    for ddl in [
        format!("CREATE ROLE {role}"),
        format!("GRANT INSERT ON outbox TO {role}"),
    ] {
        sqlx::query(&ddl).execute(&db.pool).await?;
    }
    let mut tx = db.pool.begin().await?;
    sqlx::query(&format!("SET LOCAL ROLE {role}"))
        .execute(&mut *tx)
        .await?;
    sqlx::query("INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES (gen_random_uuid(), 'order', 'o-0', 'order-updated', '{\"n\": -1}')")
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    sqlx::query(&format!("DROP OWNED BY {role}"))
        .execute(&db.pool)
        .await?;
    sqlx::query(&format!("DROP ROLE {role}"))
        .execute(&db.pool)
        .await?;
    for i in 0..20 {
        sqlx::query("INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1::uuid, 'order', $2, 'order-updated', $3)")
            .bind(uuid::Uuid::new_v4().to_string())
            .bind(format!("o-{}", i % 4))
            .bind(serde_json::json!({"n": i}))
            .execute(&db.pool)
            .await?;
    }
    sqlx::query("INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1::uuid, 'order', 'bad', 'order-updated', $2)")
        .bind(uuid::Uuid::new_v4().to_string())
        .bind(serde_json::json!({"hostile": "reject"}))
        .execute(&db.pool)
        .await?;

    let relay = Relay::start(&config, &[])?;
    let out = dir.join("out.jsonl");
    let drained = eventually(Duration::from_secs(60), || async {
        let queued = db
            .count("SELECT count(*) FROM outroute_queue WHERE source = 'outbox'")
            .await;
        let failed = db
            .count("SELECT count(*) FROM outbox WHERE failed_at IS NOT NULL")
            .await;
        file_sink_deliveries(&out).len() >= 21 && queued == 0 && failed == 1
    })
    .await;
    assert!(drained, "queue empty, one failed row: {}", relay.log_text());
    assert_eq!(
        db.count("SELECT count(*) FROM outbox").await,
        22,
        "rows are kept"
    );
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE published_at IS NOT NULL")
            .await,
        0,
        "no row was rewritten"
    );
    // Per aggregate, the file holds the events in outbox order.
    let delivered = file_sink_deliveries(&out);
    assert_eq!(delivered.len(), 21);
    let mut last: std::collections::HashMap<String, i64> = Default::default();
    for d in &delivered {
        if let Some(prev) = last.insert(d.aggregate().to_string(), d.seq()) {
            assert!(
                prev < d.seq(),
                "{}: {} after {prev}",
                d.aggregate(),
                d.seq()
            );
        }
    }
    assert_eq!(last.len(), 4);
    let (code, out, err) = cli(&["status", "-c", &c])?;
    assert_eq!(code, 0, "{out}{err}");
    let (code, out, err) = cli(&["replay", "--aggregate-id", "o-1", "--dry-run", "-c", &c])?;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.starts_with("5 published event(s) match"), "{out}");
    let (code, out, err) = cli(&["replay", "--aggregate-id", "o-0", "--dry-run", "-c", &c])?;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.starts_with("6 published event(s) match"), "{out}");
    // The failed row is purged by hand: `failed retry` cannot queue it
    // again and says so, naming it; it never reports it put back.
    let bad: String = sqlx::query_scalar("SELECT id::text FROM outbox WHERE aggregate_id = 'bad'")
        .fetch_one(&db.pool)
        .await?;
    sqlx::query("DELETE FROM outbox WHERE aggregate_id = 'bad'")
        .execute(&db.pool)
        .await?;
    let (code, out, err) = cli(&["failed", "retry", "--id", &bad, "-c", &c])?;
    assert_ne!(code, 0, "{out}{err}");
    assert!(
        format!("{out}{err}").contains("0 event(s) put back"),
        "{out}{err}"
    );
    assert!(
        err.contains("could not be") && err.contains(&bad),
        "{out}{err}"
    );
    let (_, out, _) = cli(&["failed", "list", "--json", "-c", &c])?;
    assert!(out.contains(&bad), "still failed: {out}");
    drop(relay);
    db.drop_db().await;
    Ok(())
}

/// A source that streamed the log before (its capture lease is a lane row
/// numbered -1) switched to lease mode with one lane: lane 0 is created and
/// its events flow (the capture row was counted as the one lane before).
#[tokio::test(flavor = "multi_thread")]
async fn a_switch_from_log_capture_to_one_lane_creates_that_lane() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let dir = test_dir("capture-to-lease");
    let config = write_config(&dir, &db.url, "lanes = 1", &file_sink_body(&dir, ""))?;
    db.migrate(&config)?;
    sqlx::query("INSERT INTO outroute_lanes (source, lane) VALUES ('outbox', -1)")
        .execute(&db.pool)
        .await?;
    produce(&db.pool, "agg", 2, 3, 0).await?;
    let relay = Relay::start(&config, &[])?;
    let out = dir.join("out.jsonl");
    assert!(
        file_sink_reaches(&out, 6, Duration::from_secs(30)).await,
        "{}",
        relay.log_text()
    );
    assert_eq!(
        db.count("SELECT count(*) FROM outroute_lanes WHERE source = 'outbox' AND lane = 0")
            .await,
        1
    );
    drop(relay);
    db.drop_db().await;
    Ok(())
}

/// Under the pending queue, a producer that updates a pending row's
/// aggregate or sequence number moves its queue entry with it: the event
/// goes out once, under its new aggregate (before: an entry pointing at no
/// row, and the event never published).
#[tokio::test(flavor = "multi_thread")]
async fn a_producer_update_of_a_pending_rows_aggregate_or_sequence_is_followed()
-> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let dir = test_dir("queue-update");
    let config = write_config(&dir, &db.url, "", &file_sink_body(&dir, ""))?;
    let c = config.to_string_lossy().to_string();
    let (code, out, err) = cli(&["migrate", "-c", &c])?;
    assert_eq!(code, 0, "{out}{err}");
    let mut ids = Vec::new();
    for i in 0..4 {
        let id: String = sqlx::query_scalar(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
             VALUES (gen_random_uuid(), 'order', 'a', 'order-updated', $1) RETURNING id::text",
        )
        .bind(serde_json::json!({ "n": i }))
        .fetch_one(&db.pool)
        .await?;
        ids.push(id);
    }
    // Moved to another aggregate, renumbered to the end, both at once.
    sqlx::query("UPDATE outbox SET aggregate_id = 'b' WHERE id::text = $1")
        .bind(&ids[0])
        .execute(&db.pool)
        .await?;
    sqlx::query("UPDATE outbox SET seq = DEFAULT WHERE id::text = $1")
        .bind(&ids[1])
        .execute(&db.pool)
        .await?;
    sqlx::query("UPDATE outbox SET seq = DEFAULT, aggregate_id = 'c' WHERE id::text = $1")
        .bind(&ids[2])
        .execute(&db.pool)
        .await?;
    let relay = Relay::start(&config, &[])?;
    let out = dir.join("out.jsonl");
    let drained = eventually(Duration::from_secs(30), || async {
        file_sink_deliveries(&out).len() >= 4
            && db.count("SELECT count(*) FROM outroute_queue").await == 0
    })
    .await;
    let delivered = file_sink_deliveries(&out);
    assert!(
        drained,
        "delivered {} of 4, queue {:?}: {}",
        delivered.len(),
        db.count("SELECT count(*) FROM outroute_queue").await,
        relay.log_text()
    );
    assert_eq!(delivered.len(), 4);
    let agg = |id: &str| {
        delivered
            .iter()
            .find(|d| d.id() == id)
            .map(|d| d.aggregate().to_string())
    };
    assert_eq!(agg(&ids[0]).as_deref(), Some("b"));
    assert_eq!(agg(&ids[1]).as_deref(), Some("a"));
    assert_eq!(agg(&ids[2]).as_deref(), Some("c"));
    assert_eq!(agg(&ids[3]).as_deref(), Some("a"));
    // Aggregate `a`: the renumbered event now comes after the last one.
    let order: Vec<&str> = delivered
        .iter()
        .filter(|d| d.aggregate() == "a")
        .map(|d| d.id())
        .collect();
    assert_eq!(order, vec![ids[3].as_str(), ids[1].as_str()]);
    assert_eq!(db.published("").await, 4);
    drop(relay);
    // The trigger numbers lanes itself: a relay with another lane count
    // (its lane rows gone, so that check passes) is refused, not left to
    // read some lanes only.
    sqlx::query("DELETE FROM outroute_lanes")
        .execute(&db.pool)
        .await?;
    let other = write_config(
        &dir.join("sixteen"),
        &db.url,
        "lanes = 16",
        &file_sink_body(&dir, ""),
    )?;
    let (code, out, err) = cli(&["migrate", "--table", "-c", &other.to_string_lossy()])?;
    assert_ne!(code, 0, "{out}{err}");
    assert!(
        err.contains("relay.lanes") && err.contains("trigger"),
        "{out}{err}"
    );
    db.drop_db().await;
    Ok(())
}

/// A partitioned outbox (how large outboxes are pruned) under the pending
/// queue: producers' inserts into any partition are listed (the trigger
/// fires on the partition), relayed, and a failed row is flagged; a marking
/// that needs a lane index is refused at `migrate --table` with the way out.
#[tokio::test(flavor = "multi_thread")]
async fn a_partitioned_outbox_relays_under_the_queue() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let dir = test_dir("partitioned");
    for ddl in [
        "CREATE TABLE pout (seq bigint GENERATED ALWAYS AS IDENTITY, id uuid NOT NULL, aggregate_type text NOT NULL, \
         aggregate_id text NOT NULL, event_type text NOT NULL, payload jsonb NOT NULL, \
         created_at timestamptz NOT NULL DEFAULT now(), failed_at timestamptz, PRIMARY KEY (seq)) \
         PARTITION BY RANGE (seq)",
        "CREATE TABLE pout_low PARTITION OF pout FOR VALUES FROM (MINVALUE) TO (1000)",
        "CREATE TABLE pout_high PARTITION OF pout FOR VALUES FROM (1000) TO (MAXVALUE)",
    ] {
        sqlx::query(ddl).execute(&db.pool).await?;
    }
    let table = |marking: &str| {
        format!(
            "[store.table]\nname = \"pout\"\nid = \"id\"\nsequence = \"seq\"\naggregate_type = \"aggregate_type\"\n\
             aggregate_id = \"aggregate_id\"\nevent_type = \"event_type\"\npayload = \"payload\"\n\
             created_at = \"created_at\"\nfailed_at = \"failed_at\"\nmarking = {marking}\n"
        )
    };
    let body = file_sink_body(&dir, &table("{ style = \"queue\" }")).replace(
        &plugin("order-router").display().to_string(),
        &plugin("hostile").display().to_string(),
    );
    let config = write_config(&dir, &db.url, "", &body)?;
    let c = config.to_string_lossy().to_string();
    let (code, out, err) = cli(&["migrate", "--table", "-c", &c])?;
    assert_eq!(code, 0, "{out}{err}");
    // Into both partitions, by the identity and by explicit numbers.
    let insert = |seq: Option<i64>, agg: &str, payload: serde_json::Value| {
        let pool = db.pool.clone();
        let agg = agg.to_string();
        async move {
            sqlx::query(
                "INSERT INTO pout (seq, id, aggregate_type, aggregate_id, event_type, payload) OVERRIDING SYSTEM VALUE \
                 VALUES (COALESCE($1, nextval(pg_get_serial_sequence('pout', 'seq'))), gen_random_uuid(), 'order', $2, \
                 'order-created', $3)",
            )
            .bind(seq)
            .bind(agg)
            .bind(payload)
            .execute(&pool)
            .await
        }
    };
    for i in 0..5 {
        insert(None, &format!("o-{i}"), serde_json::json!({"n": i})).await?;
        insert(
            Some(2000 + i),
            &format!("o-{i}"),
            serde_json::json!({"n": 10 + i}),
        )
        .await?;
    }
    insert(Some(3000), "bad", serde_json::json!({"hostile": "reject"})).await?;
    let relay = Relay::start(&config, &[])?;
    let out = dir.join("out.jsonl");
    let drained = eventually(Duration::from_secs(60), || async {
        file_sink_deliveries(&out).len() >= 10
            && db.count("SELECT count(*) FROM outroute_queue").await == 0
            && db
                .count("SELECT count(*) FROM pout WHERE failed_at IS NOT NULL")
                .await
                == 1
    })
    .await;
    assert!(drained, "{}", relay.log_text());
    assert_eq!(file_sink_deliveries(&out).len(), 10);
    assert_eq!(
        db.count(
            "SELECT count(*) FROM pout_high WHERE failed_at IS NOT NULL AND aggregate_id = 'bad'"
        )
        .await,
        1
    );
    drop(relay);
    // Stamping needs a lane index, which PostgreSQL cannot build on a
    // partitioned table without blocking writes: refused, with the way out.
    for ddl in [
        "DROP TRIGGER outroute_enqueue ON pout",
        "DROP TRIGGER outroute_requeue ON pout",
    ] {
        sqlx::query(ddl).execute(&db.pool).await?;
    }
    sqlx::query("ALTER TABLE pout ADD COLUMN published_at timestamptz")
        .execute(&db.pool)
        .await?;
    sqlx::query("UPDATE pout SET published_at = now() WHERE failed_at IS NULL")
        .execute(&db.pool)
        .await?;
    sqlx::query("DELETE FROM outroute_queue")
        .execute(&db.pool)
        .await?;
    sqlx::query("DROP FUNCTION pout_outroute_enqueue()")
        .execute(&db.pool)
        .await?;
    let stamped = write_config(
        &dir.join("stamped"),
        &db.url,
        "",
        &file_sink_body(
            &dir,
            &table("{ style = \"published_at\", column = \"published_at\" }"),
        ),
    )?;
    let (code, out, err) = cli(&["migrate", "--table", "-c", &stamped.to_string_lossy()])?;
    assert_ne!(code, 0, "{out}{err}");
    assert!(
        err.contains("is partitioned") && err.contains("style = \"queue\""),
        "{out}{err}"
    );
    db.drop_db().await;
    Ok(())
}

/// A row without an id (NULL, or '' in a text column), in a table whose id
/// column allows it: that row fails alone, listed by its place in the table
/// with its aggregate, and the rows after it in its lane flow. Once the
/// producer sets its id, it is published under it.
#[tokio::test(flavor = "multi_thread")]
async fn a_row_without_an_id_fails_alone_and_the_rest_flow() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let dir = test_dir("null-id");
    sqlx::query(
        &seed::T_OUTBOX_DDL
            .replace("t_outbox", "t_outbox_n")
            .replace(" PRIMARY KEY", ""),
    )
    .execute(&db.pool)
    .await?;
    let insert = "INSERT INTO t_outbox_n (event_id, aggregate_type, aggregate_id, event_type, payload) \
                  VALUES ($1, 'order', $2, 'order-paid', '{}')";
    for i in 0..3 {
        sqlx::query(insert)
            .bind(format!("before-{i}"))
            .bind("o-1")
            .execute(&db.pool)
            .await?;
    }
    for (id, agg) in [(None, "o-null"), (Some(""), "o-empty")] {
        sqlx::query(insert)
            .bind(id)
            .bind(agg)
            .execute(&db.pool)
            .await?;
    }
    for i in 0..3 {
        sqlx::query(insert)
            .bind(format!("after-{i}"))
            .bind("o-1")
            .execute(&db.pool)
            .await?;
    }
    // One lane: the rows without an id lie in the same lane as the rest.
    let config = write_config(
        &dir,
        &db.url,
        "lanes = 1",
        &file_sink_body(
            &dir,
            &seed::T_OUTBOX_MAPPING.replace("t_outbox", "t_outbox_n"),
        ),
    )?;
    let c = config.to_string_lossy().to_string();
    let relay = Relay::start(&config, &[])?;
    let out = dir.join("out.jsonl");
    let flowed = eventually(Duration::from_secs(30), || async {
        db.count("SELECT count(*) FROM t_outbox_n WHERE status = 'SENT'")
            .await
            == 6
    })
    .await;
    assert!(
        flowed,
        "the rows with ids were held up: {}",
        relay.log_text()
    );
    let listed = eventually(Duration::from_secs(10), || async {
        cli(&["failed", "list", "--json", "-c", &c])
            .is_ok_and(|(_, out, _)| out.matches("\"id\"").count() == 2)
    })
    .await;
    let (_, listing, _) = cli(&["failed", "list", "--json", "-c", &c])?;
    assert!(listed, "{listing}\n{}", relay.log_text());
    let failed: serde_json::Value = serde_json::from_str(&listing)?;
    let rows = failed.as_array().cloned().unwrap_or_default();
    for agg in ["o-null", "o-empty"] {
        let f = rows
            .iter()
            .find(|f| f["aggregate_id"] == agg)
            .ok_or_else(|| anyhow::anyhow!("{agg} not listed: {listing}"))?;
        assert!(
            f["id"].as_str().is_some_and(|id| id.starts_with("no-id@(")),
            "{listing}"
        );
        assert!(
            f["reason"]
                .as_str()
                .is_some_and(|r| r.contains("id is NULL or empty")),
            "{listing}"
        );
    }
    assert_eq!(file_sink_deliveries(&out).len(), 6);
    // The producer repairs the row and the operator lets its aggregate go
    // (the record of the row without an id held it): it goes out under its id.
    sqlx::query("UPDATE t_outbox_n SET event_id = 'repaired' WHERE event_id IS NULL")
        .execute(&db.pool)
        .await?;
    let (code, said, err) = cli(&["failed", "discard", "--aggregate-id", "o-null", "-c", &c])?;
    assert_eq!(code, 0, "{said}{err}");
    assert!(said.contains("1 event(s) discarded"), "{said}");
    assert!(
        file_sink_reaches(&out, 7, Duration::from_secs(30)).await,
        "{}",
        relay.log_text()
    );
    assert!(
        file_sink_deliveries(&out)
            .iter()
            .any(|d| d.id() == "repaired")
    );
    drop(relay);
    db.drop_db().await;
    Ok(())
}

/// Switching an outbox from `published_at` to the default queue: `migrate`
/// lists only the rows still pending and names the lane index nobody reads
/// any more; switching back is refused while the queue's trigger is there
/// (rows published through the queue were never stamped).
#[tokio::test(flavor = "multi_thread")]
async fn switching_between_published_at_and_the_queue_republishes_nothing() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let dir = test_dir("switch-marking");
    let stamp = write_config(
        &dir.join("stamp"),
        &db.url,
        "",
        &file_sink_body(&dir, &example_table("outbox-published-at.toml")?),
    )?;
    let stamp = stamp.to_string_lossy().to_string();
    let (code, out, err) = cli(&["migrate", "-c", &stamp])?;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("lane index on `outbox` created"), "{out}");
    for i in 0..5 {
        sqlx::query("INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES (gen_random_uuid(), 'order', $1, 'order-updated', '{}')")
            .bind(format!("o-{i}"))
            .execute(&db.pool)
            .await?;
    }
    sqlx::query("UPDATE outbox SET published_at = now() WHERE seq <= 2")
        .execute(&db.pool)
        .await?;

    let queue = write_config(&dir.join("queue"), &db.url, "", &file_sink_body(&dir, ""))?;
    let queue = queue.to_string_lossy().to_string();
    let (code, out, err) = cli(&["migrate", "-c", &queue])?;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("pending queue of `outbox` set up"), "{out}");
    assert!(
        out.contains("DROP INDEX CONCURRENTLY \"outbox_outroute_lanes"),
        "the unread lane index is named: {out}"
    );
    assert_eq!(
        db.count("SELECT count(*) FROM outroute_queue WHERE source = 'outbox' AND seq > 2")
            .await,
        3
    );
    assert_eq!(db.count("SELECT count(*) FROM outroute_queue").await, 3);

    let (code, out, err) = cli(&["config", "check", "--store", "-c", &stamp])?;
    assert_ne!(code, 0, "{out}{err}");
    assert!(
        err.contains("trigger `outroute_enqueue`") && err.contains("DROP TRIGGER"),
        "{err}"
    );
    db.drop_db().await;
    Ok(())
}
