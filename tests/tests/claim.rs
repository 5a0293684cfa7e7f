//! The claim path's cost on the database (issue: lease mode at the
//! database's ceiling). Every table here is filled right after creation and
//! never analysed (autovacuum is off on this machine), as a user's table is
//! right after a burst: the claim must walk the lane index anyway, touching
//! rows in proportion to the batch, not to the backlog. Costs are counted
//! by PostgreSQL itself (`EXPLAIN ANALYZE` row counts), not timed.
//!
//! One concern, one file: the end-to-end tests of what claims cost the
//! database and that they keep order; each fills its own table.

use std::path::Path;
use std::time::Duration;

use outroute::store::{Claim, Failure, FailureKind, Store};
use outroute_e2e::*;

fn file_body(dir: &Path, table: &str) -> String {
    format!(
        "[http]\nlisten = \"\"\n{table}\n[sinks.file]\nkind = \"file\"\npath = \"{}\"\n[plugins.p]\npath = \"{}\"\n\
         [[routes]]\nname = \"r\"\nplugin = \"p\"\nconfig = {{ sink = \"file\", topic = \"orders.{{event_type}}\" }}\n\
         allow = {{ file = [\"orders.*\"] }}\n",
        dir.join("out.jsonl").display(),
        plugin("order-router").display()
    )
}

/// Never analysed: no column statistics for the planner; with
/// `row_count_unknown`, not even a row count (building an index records
/// one, so a table that just got its lane index has that much).
async fn assert_never_analysed(db: &TestDb, table: &str, row_count_unknown: bool) {
    let analysed = db
        .count(&format!(
            "SELECT count(*) FROM pg_stat_user_tables WHERE relname = '{table}' \
             AND (last_analyze IS NOT NULL OR last_autoanalyze IS NOT NULL)"
        ))
        .await
        + db.count(&format!(
            "SELECT count(*) FROM pg_stats WHERE tablename = '{table}'"
        ))
        .await;
    assert_eq!(analysed, 0, "{table} was analysed");
    if row_count_unknown {
        let unknown = db
            .count(&format!(
                "SELECT count(*) FROM pg_class WHERE relname = '{table}' AND reltuples < 0"
            ))
            .await;
        assert_eq!(unknown, 1, "{table} has a planner row count");
    }
}

/// Rows the claim made PostgreSQL read from the outbox table, and whether
/// it only ever walked an index.
async fn claim_cost(store: &Store, lanes: &[i32], batch: u32) -> anyhow::Result<(f64, bool)> {
    let pg = store
        .postgres()
        .ok_or_else(|| anyhow::anyhow!("not PostgreSQL"))?;
    let scans = pg.claim_cost(lanes, batch).await?;
    let rows = scans.iter().map(|(_, r)| r).sum();
    let indexed = !scans.is_empty() && scans.iter().all(|(n, _)| n.starts_with("Index"));
    Ok((rows, indexed))
}

/// Rows the mark of these claims made PostgreSQL read (from the outbox
/// table; under queue marking, from the queue), and whether every read was
/// a TID fetch.
async fn mark_cost(store: &Store, claims: &[Claim]) -> anyhow::Result<(f64, bool)> {
    let pg = store
        .postgres()
        .ok_or_else(|| anyhow::anyhow!("not PostgreSQL"))?;
    let refs: Vec<&Claim> = claims.iter().collect();
    let scans: Vec<(String, f64)> = pg
        .mark_cost(&refs)
        .await?
        .into_iter()
        .filter(|(node, _)| node.ends_with("Scan"))
        .collect();
    let read = scans.iter().map(|(_, r)| r).sum();
    let by_tid = !scans.is_empty() && scans.iter().all(|(node, _)| node == "Tid Scan");
    Ok((read, by_tid))
}

/// The canonical table marked by `published_at` (claims walk its lane
/// index; the default queue has its own tests below).
fn stamped() -> anyhow::Result<String> {
    example_table("outbox-published-at.toml")
}

/// Claim `c` failed for good (a plugin said invalid); `hold`: it holds its
/// aggregate until an operator acts.
fn failed_for_good(c: &Claim, hold: bool) -> anyhow::Result<Failure> {
    Ok(Failure {
        route: Some("r".into()),
        ..failure_of(c, FailureKind::Failed { hold }, "plugin said invalid")?
    })
}

async fn fill(db: &TestDb, from: i64, to: i64) -> anyhow::Result<()> {
    // One aggregate per event, ~1 KB payload, one statement.
    sqlx::query(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), 'order', 'o-' || g, 'order-created', \
                jsonb_build_object('n', g, 'pad', repeat('x', 1000)) \
         FROM generate_series($1::bigint, $2::bigint) g",
    )
    .bind(from)
    .bind(to)
    .execute(&db.pool)
    .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn claim_cost_is_bounded_by_the_batch_on_a_never_analysed_table() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let dir = test_dir("claim-cost");
    let config = write_config(
        &dir,
        &db.url,
        "lanes = 64\nbatch_size = 500\nlease_ttl = \"300s\"",
        &file_body(&dir, &stamped()?),
    )?;
    db.migrate(&config)?;
    fill(&db, 1, 30_000).await?;
    assert_never_analysed(&db, "outbox", true).await;

    let store = open_store(&config, "cost").await?;
    assert_eq!(
        store.missing_index(),
        None,
        "migrate created no usable lane index"
    );
    let lanes = store.lease_round().await?.lanes;
    assert_eq!(lanes.len(), 64);
    // One worker's share, as `relay.concurrency = 2` gives it.
    let share: Vec<i32> = lanes.iter().copied().filter(|l| l % 2 == 0).collect();
    let (small, indexed) = claim_cost(&store, &share, 500).await?;
    assert!(
        indexed,
        "the claim scanned the table instead of the lane index"
    );
    assert!(
        small <= (500 + share.len()) as f64,
        "a 500-event claim read {small} rows from a 30,000-event backlog"
    );

    // Three times the backlog: the same cost.
    fill(&db, 30_001, 90_000).await?;
    assert_never_analysed(&db, "outbox", true).await;
    let (large, indexed) = claim_cost(&store, &share, 500).await?;
    assert!(
        indexed,
        "the claim scanned the table instead of the lane index"
    );
    assert!(
        large <= (500 + share.len()) as f64,
        "a 500-event claim read {large} rows from a 90,000-event backlog"
    );

    // The mark goes to each claimed row, whatever the backlog.
    store.lease_round().await?;
    let claims = store.claim(&share, 500).await?.claims;
    let (read, by_tid) = mark_cost(&store, &claims).await?;
    assert!(
        by_tid && read <= 500.0,
        "marking 500 claimed rows read {read} rows of a 90,000-event backlog (TID fetches only: {by_tid})"
    );

    // Claim and mark drain it all, each row marked exactly once, and each
    // lane's events come out in outbox order.
    let mut marked = 0u64;
    let mut last_seq = std::collections::HashMap::new();
    loop {
        let claims = store.claim(&lanes, 1000).await?.claims;
        if claims.is_empty() {
            break;
        }
        for c in &claims {
            let seq = c.row.as_ref().map(|e| e.sequence).unwrap_or(0);
            let prev = last_seq.insert(c.lane, seq).unwrap_or(0);
            assert!(
                seq > prev,
                "lane {} went from seq {prev} back to {seq}",
                c.lane
            );
            assert!(c.tid.is_some() && !c.has_state);
        }
        let refs: Vec<&Claim> = claims.iter().collect();
        let n = store.mark_published(&refs).await?;
        assert_eq!(n, claims.len() as u64, "a claimed row was not marked");
        marked += n;
    }
    assert_eq!(marked, 90_000);
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE published_at IS NULL")
            .await,
        0
    );
    let (bl, _) = store.backlog().await?;
    assert_eq!(bl, 0);
    db.drop_db().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_row_moved_since_its_claim_is_published_again_and_the_backlog_gauge_is_bounded()
-> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let dir = test_dir("claim-moved");
    let config = write_config(&dir, &db.url, "lanes = 8", &file_body(&dir, &stamped()?))?;
    db.migrate(&config)?;
    fill(&db, 1, 20).await?;
    let store = open_store(&config, "moved").await?;
    let lanes = store.lease_round().await?.lanes;
    let claims = store.claim(&lanes, 100).await?.claims;
    assert_eq!(claims.len(), 20);
    // A producer touches a pending row after the claim: it moves (new ctid).
    sqlx::query("UPDATE outbox SET headers = '{\"touched\": \"yes\"}' WHERE aggregate_id = 'o-7'")
        .execute(&db.pool)
        .await?;
    let refs: Vec<&Claim> = claims.iter().collect();
    // Marked where the claim saw them: the moved row is not, so it stays
    // pending and the next claim hands it out again (same id, a duplicate
    // at worst, never a loss).
    assert_eq!(store.mark_published(&refs).await?, 19);
    let again = store.claim(&lanes, 100).await?.claims;
    assert_eq!(again.len(), 1);
    assert_eq!(
        again[0].row.as_ref().map(|e| e.aggregate_id.as_str()).ok(),
        Some("o-7")
    );
    let refs: Vec<&Claim> = again.iter().collect();
    assert_eq!(store.mark_published(&refs).await?, 1);
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE published_at IS NULL")
            .await,
        0
    );

    // The gauge counts exactly below its bound, and estimates above it
    // from the sequence span instead of counting every row.
    fill(&db, 100, 599).await?;
    assert_eq!(store.backlog().await?.0, 500);
    fill(&db, 10_000, 39_999).await?;
    let (estimate, oldest) = store.backlog().await?;
    assert!(
        (30_000..=31_000).contains(&estimate),
        "backlog estimate {estimate} for 30,500 pending events"
    );
    assert!(oldest.is_some());
    db.drop_db().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn existing_tables_get_their_lane_index_from_migrate_table() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    sqlx::query(seed::OUTBOX_EVENTS_DDL)
        .execute(&db.pool)
        .await?;
    sqlx::query(seed::T_OUTBOX_DDL).execute(&db.pool).await?;
    sqlx::query(
        "INSERT INTO outbox_events (id, event_type, aggregate_id, payload) \
         SELECT gen_random_uuid(), 'order-created', gen_random_uuid(), json_build_object('n', g) \
         FROM generate_series(1, 20000) g",
    )
    .execute(&db.pool)
    .await?;
    sqlx::query(
        "INSERT INTO t_outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT 'evt-' || g, 'order', 'o-' || g, 'order-paid', '{\"n\": ' || g || '}' \
         FROM generate_series(1, 20000) g",
    )
    .execute(&db.pool)
    .await?;

    for (table, mapping) in [
        ("t_outbox", seed::T_OUTBOX_MAPPING),
        ("outbox_events", seed::OUTBOX_EVENTS_MAPPING),
    ] {
        let dir = test_dir(&format!("migrate-{table}"));
        let config = write_config(&dir, &db.url, "lanes = 16", &file_body(&dir, mapping))?;
        let c = config.to_string_lossy().to_string();
        db.migrate(&config)?; // coordination tables only: the canonical table is not theirs
        assert_never_analysed(&db, table, true).await;

        // Without the index: it still works (slowly), and says what to run.
        let store = open_store(&config, "before").await?;
        let ddl = store
            .missing_index()
            .ok_or_else(|| anyhow::anyhow!("{table}: an index was found before migrate --table"))?
            .to_string();
        assert!(ddl.starts_with("CREATE INDEX CONCURRENTLY"), "{ddl}");
        let (rows, indexed) = claim_cost(&store, &[0, 1, 2, 3], 100).await?;
        assert!(
            !indexed && rows >= 20_000.0,
            "{table}: slow path read {rows} rows"
        );
        let (code, out, err) = cli(&["config", "check", "--store", "-c", &c])?;
        assert_eq!(code, 0, "{err}");
        assert!(
            out.contains("no usable lane index") && out.contains(&ddl),
            "{table}: config check --store said: {out}"
        );

        // migrate --table builds it, saying what it locks.
        let (code, out, err) = cli(&["migrate", "--table", "-c", &c])?;
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("SHARE UPDATE EXCLUSIVE"), "{out}");
        assert!(out.contains("created"), "{out}");
        let (code, out, _) = cli(&["migrate", "--table", "-c", &c])?;
        assert_eq!(code, 0);
        assert!(out.contains("present"), "second migrate --table: {out}");
        let (_, out, _) = cli(&["config", "check", "--store", "-c", &c])?;
        assert!(out.contains("lane index usable"), "{out}");

        let store = open_store(&config, "after").await?;
        assert_eq!(store.missing_index(), None);
        assert_never_analysed(&db, table, false).await;
        let (rows, indexed) = claim_cost(&store, &[0, 1, 2, 3], 100).await?;
        assert!(indexed, "{table}: the claim does not walk the new index");
        assert!(rows <= 104.0, "{table}: a 100-event claim read {rows} rows");
        // And the fast path marks what it claims.
        store.lease_round().await?;
        let claims = store.claim(&[0, 1, 2, 3], 100).await?.claims;
        assert_eq!(claims.len(), 100);
        let refs: Vec<&Claim> = claims.iter().collect();
        assert_eq!(store.mark_published(&refs).await?, 100);
    }
    db.drop_db().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn floors_are_off_for_a_sequence_that_may_hand_out_lower_numbers_later() -> anyhow::Result<()>
{
    let db = TestDb::new().await?;
    let dir = test_dir("claim-floor-off");
    let config = write_config(&dir, &db.url, "lanes = 4", &file_body(&dir, &stamped()?))?;
    db.migrate(&config)?;
    let c = config.to_string_lossy().to_string();
    let (code, out, err) = cli(&["config", "check", "--store", "-c", &c])?;
    assert_eq!(code, 0, "{err}");
    assert!(!out.contains("warning"), "{out}");
    // Cached blocks: a session may insert a lower number after a higher one.
    sqlx::query("ALTER TABLE outbox ALTER COLUMN seq SET CACHE 20")
        .execute(&db.pool)
        .await?;
    let (code, out, err) = cli(&["config", "check", "--store", "-c", &c])?;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("store.table.sequence `seq` comes from a sequence with CACHE > 1"),
        "{out}"
    );
    // Claims still work, from the bottom of each lane.
    fill(&db, 1, 100).await?;
    let store = open_store(&config, "cached").await?;
    let lanes = store.lease_round().await?.lanes;
    store.raise_floors(&lanes).await;
    assert_eq!(drain(&store, &lanes).await?.len(), 100);
    db.drop_db().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn an_index_that_only_has_the_order_is_not_taken_for_a_lane_index() -> anyhow::Result<()> {
    // The canonical table marked by DELETE is not the canonical mapping, so
    // `migrate` builds no lane index for it; its primary key on `seq` has
    // the outbox order but not the lane, and walking it would read other
    // lanes' rows: the relay must see that the lane index is missing.
    let db = TestDb::new().await?;
    let dir = test_dir("claim-pk-only");
    let mapping = "[store.table]\nname = \"outbox\"\nid = \"id\"\nsequence = \"seq\"\naggregate_type = \"aggregate_type\"\n\
                   aggregate_id = \"aggregate_id\"\nevent_type = \"event_type\"\npayload = \"payload\"\n\
                   created_at = \"created_at\"\nmarking = { style = \"delete\" }\n";
    let config = write_config(&dir, &db.url, "lanes = 16", &file_body(&dir, mapping))?;
    db.migrate(&config)?;
    fill(&db, 1, 5_000).await?;
    let store = open_store(&config, "pk").await?;
    assert!(
        store.missing_index().is_some(),
        "the primary key was taken for a lane index"
    );
    let (code, out, err) = cli(&["migrate", "--table", "-c", &config.to_string_lossy()])?;
    assert_eq!(code, 0, "{out}{err}");
    let store = open_store(&config, "pk").await?;
    assert_eq!(store.missing_index(), None);
    let (rows, indexed) = claim_cost(&store, &[0, 1], 100).await?;
    assert!(indexed && rows <= 102.0, "{rows} rows read");
    db.drop_db().await;
    Ok(())
}

/// Buffers the claim touched in the outbox table (index and heap pages).
async fn claim_pages(store: &Store, lanes: &[i32], batch: u32) -> anyhow::Result<f64> {
    store
        .postgres()
        .ok_or_else(|| anyhow::anyhow!("not PostgreSQL"))?
        .claim_pages(lanes, batch)
        .await
}

/// Claim and mark until a claim comes back empty; returns the aggregate
/// ids claimed, in order.
async fn drain(store: &Store, lanes: &[i32]) -> anyhow::Result<Vec<String>> {
    let mut got = Vec::new();
    loop {
        store.lease_round().await?;
        let claims = store.claim(lanes, 1000).await?.claims;
        if claims.is_empty() {
            return Ok(got);
        }
        let refs: Vec<&Claim> = claims.iter().collect();
        assert_eq!(store.mark_published(&refs).await?, claims.len() as u64);
        got.extend(
            claims
                .iter()
                .filter_map(|c| c.row.as_ref().ok().map(|e| e.aggregate_id.clone())),
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn claims_start_past_published_rows_but_never_past_a_row_still_to_commit()
-> anyhow::Result<()> {
    floors(
        &stamped()?,
        None,
        "UPDATE outbox SET published_at = NULL WHERE aggregate_id = 'o-5'",
    )
    .await
}

/// The same under the pending queue (the default): published events'
/// entries stay dead in the queue's index until VACUUM.
#[tokio::test(flavor = "multi_thread")]
async fn queue_claims_start_past_published_entries_but_never_past_one_still_to_commit()
-> anyhow::Result<()> {
    floors(
        "",
        Some(
            "CREATE TABLE saved AS SELECT q.* FROM outroute_queue q JOIN outbox o ON o.seq = q.seq \
             WHERE o.aggregate_id = 'o-5'",
        ),
        "INSERT INTO outroute_queue SELECT * FROM saved",
    )
    .await
}

/// Claim floors of the table mapped by `mapping`: `save` runs after the
/// fill, `repend` makes the published `o-5` pending again.
async fn floors(mapping: &str, save: Option<&str>, repend: &str) -> anyhow::Result<()> {
    // Autovacuum is off here, as on a server that is behind: every row
    // published leaves a dead entry in the lane index until VACUUM.
    let db = TestDb::new().await?;
    let dir = test_dir("claim-floor");
    let config = write_config(&dir, &db.url, "lanes = 4", &file_body(&dir, mapping))?;
    db.migrate(&config)?;
    fill(&db, 1, 20_000).await?;
    if let Some(save) = save {
        sqlx::query(save).execute(&db.pool).await?;
    }
    let store = open_store(&config, "floor").await?;
    let lanes = store.lease_round().await?.lanes;
    assert_eq!(drain(&store, &lanes).await?.len(), 20_000);

    // A transaction takes its sequence number now and commits last.
    let mut late = db.pool.begin().await?;
    sqlx::query(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         VALUES (gen_random_uuid(), 'order', 'late', 'order-created', '{}')",
    )
    .execute(&mut *late)
    .await?;
    fill(&db, 20_001, 20_400).await?;
    // Floor rounds (the relay runs one every 250 ms): give them a few.
    let mut seen = Vec::new();
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        store.raise_floors(&lanes).await;
        seen.extend(drain(&store, &lanes).await?);
    }
    assert_eq!(seen.len(), 400);
    assert!(
        !seen.iter().any(|a| a == "late"),
        "an uncommitted row was claimed"
    );
    late.commit().await?;
    // The floors could not pass the open transaction's row: it is claimed
    // at once, not after the 30 s sweep.
    let mut after = Vec::new();
    for _ in 0..3 {
        store.raise_floors(&lanes).await;
        after.extend(drain(&store, &lanes).await?);
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert_eq!(after, vec!["late".to_string()]);

    // With nothing left below them, the floors rise past the 20,401
    // published rows' entries: a claim that starts from its lanes' floors
    // touches a few pages; one from the bottom (a relay that just took the
    // lanes over) steps over every dead entry.
    fill(&db, 30_001, 30_040).await?;
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        store.raise_floors(&lanes).await;
    }
    let from_floor = claim_pages(&store, &lanes, 40).await?;
    let fresh = open_store(&config, "fresh").await?;
    let from_bottom = claim_pages(&fresh, &lanes, 40).await?;
    assert!(
        from_floor * 4.0 < from_bottom && from_floor < 100.0,
        "a claim from the floors touched {from_floor} pages, one from the bottom {from_bottom}"
    );
    eprintln!(
        "claim of 40 over 20,401 published rows: {from_floor} pages from the floors, {from_bottom} from the bottom"
    );
    let rest = drain(&store, &lanes).await?;
    assert_eq!(rest.len(), 40);

    // A row that turns up below a floor anyway (here: made pending again by
    // hand) is found by the sweep, which lowers that lane's floor to it.
    let pg = store
        .postgres()
        .ok_or_else(|| anyhow::anyhow!("not PostgreSQL"))?;
    store.raise_floors(&lanes).await;
    assert!(drain(&store, &lanes).await?.is_empty());
    sqlx::query(repend).execute(&db.pool).await?;
    assert!(
        drain(&store, &lanes).await?.is_empty(),
        "the floors did not pass o-5: this checks nothing"
    );
    pg.sweep_floors_soon();
    store.raise_floors(&lanes).await;
    assert_eq!(drain(&store, &lanes).await?, vec!["o-5".to_string()]);
    db.drop_db().await;
    Ok(())
}

/// Events that failed for good and were skipped or discarded stay in the
/// state table for ever; in a table whose rows say they failed, they no
/// longer cost every later claim a state probe per row (while an event
/// still retries or holds, the probes are back).
#[tokio::test(flavor = "multi_thread")]
async fn failed_and_discarded_events_do_not_cost_later_claims_their_probes() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let dir = test_dir("claim-live-state");
    let config = write_config(&dir, &db.url, "lanes = 4", &file_body(&dir, ""))?;
    db.migrate(&config)?;
    fill(&db, 1, 20).await?;
    let store = open_store(&config, "live-state").await?;
    let leases = store.lease_round().await?;
    let lanes = leases.lanes.clone();
    let pg = store
        .postgres()
        .ok_or_else(|| anyhow::anyhow!("not PostgreSQL"))?;
    let claims = store.claim(&lanes, 2).await?.claims;
    // One failed and skipped, one failed and then discarded.
    let skipped = failure_of(&claims[0], FailureKind::Failed { hold: false }, "refused")?;
    let held = failure_of(&claims[1], FailureKind::Failed { hold: true }, "refused")?;
    assert_eq!(store.record_failures(&[skipped, held.clone()]).await?, 2);
    assert!(
        pg.claim_state_probes(&lanes, 100).await? > 0.0,
        "while an event holds its aggregate, claims probe: this checks nothing"
    );
    let filter = outroute::store::Filter {
        ids: vec![held.id.clone()],
        ..Default::default()
    };
    assert_eq!(store.failed_discard(&filter).await?, 1);
    let probes = pg.claim_state_probes(&lanes, 100).await?;
    assert_eq!(probes, 0.0, "a claim probed state rows {probes} times");
    // And the claim still skips the two failed events.
    assert_eq!(drain(&store, &lanes).await?.len(), 18);
    db.drop_db().await;
    Ok(())
}

/// One row with an explicit sequence number far above the rest (an import,
/// a `setval` backwards) lifts only its own lane's claim floor: the other
/// lanes' next rows are claimed at once, not after the 30 s sweep, and its
/// own lane is back to the ordinary numbers after one sweep.
#[tokio::test(flavor = "multi_thread")]
async fn an_imported_high_sequence_number_lifts_only_its_own_lanes_floor() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let dir = test_dir("claim-floor-import");
    let config = write_config(&dir, &db.url, "lanes = 4", &file_body(&dir, ""))?;
    db.migrate(&config)?;
    fill(&db, 1, 200).await?;
    let store = open_store(&config, "floor-import").await?;
    let lanes = store.lease_round().await?.lanes;
    assert_eq!(drain(&store, &lanes).await?.len(), 200);
    sqlx::query(
        "INSERT INTO outbox (seq, id, aggregate_type, aggregate_id, event_type, payload) OVERRIDING SYSTEM VALUE \
         VALUES (1000000000000, gen_random_uuid(), 'order', 'import', 'order-created', '{}')",
    )
    .execute(&db.pool)
    .await?;
    assert_eq!(drain(&store, &lanes).await?, vec!["import".to_string()]);
    // Floor rounds (the relay runs one every 250 ms) over the empty lanes.
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        store.raise_floors(&lanes).await;
        assert!(drain(&store, &lanes).await?.is_empty());
    }
    let lane = "((hashtext('order' || '/' || aggregate_id) & 2147483647) % 4)::bigint";
    let import_lane = db
        .count(&format!(
            "SELECT {lane} FROM outbox WHERE aggregate_id = 'import'"
        ))
        .await;
    fill(&db, 201, 260).await?;
    let mut got = Vec::new();
    for _ in 0..3 {
        store.raise_floors(&lanes).await;
        got.extend(drain(&store, &lanes).await?);
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let others: Vec<String> = sqlx::query_scalar(&format!(
        "SELECT aggregate_id FROM outbox WHERE seq BETWEEN 201 AND 260 AND {lane} <> $1 ORDER BY seq"
    ))
    .bind(import_lane)
    .fetch_all(&db.pool)
    .await?;
    assert!(
        others.len() > 20,
        "the rows fell into too few lanes: {others:?}"
    );
    for a in &others {
        assert!(
            got.contains(a),
            "{a} (not in the import's lane {import_lane}) waits below a floor the import lifted; claimed {got:?}"
        );
    }
    // The import's own lane: one sweep, then ordinary again.
    let pg = store
        .postgres()
        .ok_or_else(|| anyhow::anyhow!("not PostgreSQL"))?;
    pg.sweep_floors_soon();
    store.raise_floors(&lanes).await;
    got.extend(drain(&store, &lanes).await?);
    assert_eq!(got.len(), 60, "{got:?}");
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        store.raise_floors(&lanes).await;
        assert!(drain(&store, &lanes).await?.is_empty());
    }
    fill(&db, 261, 300).await?;
    let mut later = Vec::new();
    for _ in 0..3 {
        store.raise_floors(&lanes).await;
        later.extend(drain(&store, &lanes).await?);
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert_eq!(later.len(), 40, "without a sweep: {later:?}");
    db.drop_db().await;
    Ok(())
}

/// One aggregate holding 300k pending events (its first one failed for
/// good and holds it) costs the claims of its lane a walk past them only
/// until the floor rounds have measured the backlog: then a claim reads
/// pages in proportion to the batch, not to the backlog, and the other
/// aggregates' events go out. A row of another aggregate that commits late
/// in the middle of the backlog is claimed too, and once the hold is
/// discarded the backlog goes out, in order.
#[tokio::test(flavor = "multi_thread")]
async fn a_held_aggregates_backlog_is_skipped_not_walked_by_every_claim() -> anyhow::Result<()> {
    held_backlog(&stamped()?, "claim-held-backlog").await
}

/// [`a_held_aggregates_backlog_is_skipped_not_walked_by_every_claim`] under
/// the pending queue (the default marking).
#[tokio::test(flavor = "multi_thread")]
async fn a_held_aggregates_queued_backlog_is_skipped_not_walked_by_every_claim()
-> anyhow::Result<()> {
    held_backlog("", "claim-held-backlog-queue").await
}

async fn held_backlog(table: &str, name: &str) -> anyhow::Result<()> {
    const BACKLOG: i64 = 300_000;
    let db = TestDb::new().await?;
    let dir = test_dir(name);
    let config = write_config(&dir, &db.url, "lanes = 1", &file_body(&dir, table))?;
    db.migrate(&config)?;
    let insert = |aggregate: &str, n: i64| {
        format!(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
             SELECT gen_random_uuid(), 'order', '{aggregate}', 'order-created', jsonb_build_object('n', g) \
             FROM generate_series(1, {n}) g"
        )
    };
    sqlx::query(&insert("x", 1)).execute(&db.pool).await?;
    let store = open_store(&config, name).await?;
    let lanes = store.lease_round().await?.lanes;
    let pg = store
        .postgres()
        .ok_or_else(|| anyhow::anyhow!("not PostgreSQL"))?;
    let head = store.claim(&lanes, 10).await?.claims;
    assert_eq!(head.len(), 1);
    store
        .record_failures(&[failed_for_good(&head[0], true)?])
        .await?;
    // The backlog, with a row of another aggregate near its start whose
    // transaction commits only after the rounds have begun: the first
    // rounds' walks pass its place while it is not visible yet.
    sqlx::query(&insert("x", 5_000)).execute(&db.pool).await?;
    let mut late = db.pool.begin().await?;
    sqlx::query(&insert("late", 1)).execute(&mut *late).await?;
    sqlx::query(&insert("x", BACKLOG - 5_000))
        .execute(&db.pool)
        .await?;
    for g in 1..=50 {
        sqlx::query(&insert(&format!("o-{g}"), 1))
            .execute(&db.pool)
            .await?;
    }
    let last_x = db
        .count("SELECT max(seq) FROM outbox WHERE aggregate_id = 'x'")
        .await;
    let mut late = Some(late);
    let mut got = drain(&store, &lanes).await?;
    assert!(!got.contains(&"late".to_string()));
    for round in 0..150 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        if round == 3
            && let Some(tx) = late.take()
        {
            tx.commit().await?;
        }
        store.raise_floors(&lanes).await;
        if round == 6 {
            // The skip stops at the late row, which a claim now takes.
            got.extend(drain(&store, &lanes).await?);
        }
        if round > 6 && pg.claim_skip(lanes[0]).is_some_and(|(_, to)| to > last_x) {
            break;
        }
    }
    got.extend(drain(&store, &lanes).await?);
    let pages = claim_pages(&store, &lanes, 100).await?;
    assert!(
        !got.iter().any(|a| a == "x"),
        "an event of the held aggregate was claimed"
    );
    assert!(
        got.contains(&"late".to_string()),
        "the row that committed late inside the backlog was skipped: {got:?}"
    );
    for g in 1..=50 {
        assert!(got.contains(&format!("o-{g}")), "o-{g} was not claimed");
    }
    assert!(
        pages < 200.0,
        "a claim still reads {pages} pages past the held backlog (skip: {:?})",
        pg.claim_skip(lanes[0])
    );
    // New events of other aggregates go out at once, at the same cost.
    for g in 51..=60 {
        sqlx::query(&insert(&format!("o-{g}"), 1))
            .execute(&db.pool)
            .await?;
    }
    let more = drain(&store, &lanes).await?;
    assert_eq!(more.len(), 10, "{more:?}");
    assert!(claim_pages(&store, &lanes, 100).await? < 200.0);
    // Lift the hold: the backlog is claimable again, oldest first.
    let filter = outroute::store::Filter {
        ids: vec![head[0].id().to_string()],
        ..Default::default()
    };
    assert_eq!(store.failed_discard(&filter).await?, 1);
    let next = store.claim(&lanes, 100).await?.claims;
    assert_eq!(next.len(), 100);
    let seqs: Vec<i64> = next.iter().map(|c| c.sequence()).collect();
    assert!(
        seqs.windows(2).all(|w| w[0] < w[1]),
        "out of order: {seqs:?}"
    );
    for c in &next {
        let a = c.row.as_ref().map(|e| e.aggregate_id.clone());
        assert_eq!(a.ok().as_deref(), Some("x"));
    }
    let first_backlog: i64 = db
        .count(&format!(
            "SELECT min(seq) FROM outbox WHERE aggregate_id = 'x' AND seq > {}",
            head[0].sequence()
        ))
        .await;
    assert_eq!(seqs[0], first_backlog);
    db.drop_db().await;
    Ok(())
}

/// Claims are bounded in bytes as well as rows: with 1 MB payloads and
/// `relay.max_batch_bytes` of 3 MB, a claim of 100 takes 3 events (the one
/// that reaches the bound is the last), and every later claim too, until
/// all are claimed, in order.
#[tokio::test(flavor = "multi_thread")]
async fn a_claim_stops_at_max_batch_bytes() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let dir = test_dir("claim-bytes");
    let config = write_config(
        &dir,
        &db.url,
        "lanes = 1
max_batch_bytes = 3000000",
        &file_body(&dir, ""),
    )?;
    db.migrate(&config)?;
    sqlx::query(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), 'order', 'o-' || g, 'order-created', \
                json_build_object('pad', repeat(md5(g::text), 1000000 / 32)) \
         FROM generate_series(1, 40) g",
    )
    .execute(&db.pool)
    .await?;
    let store = open_store(&config, "bytes").await?;
    let lanes = store.lease_round().await?.lanes;
    let mut got = Vec::new();
    for _ in 0..40 {
        let claims = store.claim(&lanes, 100).await?.claims;
        if claims.is_empty() {
            break;
        }
        let bytes: u64 = claims.iter().map(|c| c.bytes()).sum();
        assert!(
            claims.len() <= 3 && bytes < 4_000_000,
            "a claim took {} events, {bytes} bytes",
            claims.len()
        );
        let refs: Vec<&Claim> = claims.iter().collect();
        assert_eq!(store.mark_published(&refs).await?, claims.len() as u64);
        got.extend(claims.iter().map(|c| c.sequence()));
    }
    assert_eq!(got.len(), 40);
    assert!(got.windows(2).all(|w| w[0] < w[1]), "{got:?}");
    db.drop_db().await;
    Ok(())
}

/// A *disabled* queue trigger (someone ran `ALTER TABLE … DISABLE TRIGGER`
/// for a bulk load): rows inserted meanwhile are never listed, so under the
/// queue they would never be published and would count as published. The
/// source does not start: it waits, naming the trigger and the way back,
/// while the relay runs on; nothing is published behind the operator's back.
#[tokio::test(flavor = "multi_thread")]
async fn a_disabled_queue_trigger_keeps_the_source_from_starting() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let dir = test_dir("claim-trigger-off");
    let config = write_config(&dir, &db.url, "lanes = 4", &file_body(&dir, ""))?;
    db.migrate(&config)?;
    fill(&db, 1, 10).await?;
    sqlx::query("ALTER TABLE outbox DISABLE TRIGGER outroute_enqueue")
        .execute(&db.pool)
        .await?;
    let mut relay = Relay::start(&config, &[])?;
    let named = eventually(Duration::from_secs(30), || async {
        relay
            .log_text()
            .contains("trigger `outroute_enqueue` on `outbox` is disabled")
    })
    .await;
    assert!(named, "{}", relay.log_text());
    assert!(
        relay.log_text().contains("ENABLE TRIGGER outroute_enqueue"),
        "{}",
        relay.log_text()
    );
    assert!(relay.child.try_wait()?.is_none(), "the relay exited");
    assert!(
        !relay.log_text().contains("source started"),
        "the source started with its trigger disabled: {}",
        relay.log_text()
    );
    assert_eq!(db.unpublished("").await, 10, "rows were published");
    relay.terminate(Duration::from_secs(15));
    db.drop_db().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_pending_queue_is_filled_by_its_trigger_and_claims_read_only_the_batch()
-> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let dir = test_dir("claim-queue");
    let config = write_config(
        &dir,
        &db.url,
        "lanes = 4",
        // An existing table switched over from `published_at`.
        &file_body(
            &dir,
            &example_table("outbox-published-at.toml")?.replace(
                "marking = { style = \"published_at\" }",
                "marking = { style = \"queue\", column = \"published_at\" }",
            ),
        ),
    )?;
    db.migrate(&config)?;
    // Rows from before the switch: 10 already published, 40,000 pending.
    fill(&db, 1, 40_010).await?;
    sqlx::query("UPDATE outbox SET published_at = now() WHERE seq <= 10")
        .execute(&db.pool)
        .await?;
    // Without its trigger the source must not start (new rows would never
    // be listed): it waits, naming the command that mends it, while the
    // relay (and any other source) runs on.
    let c = config.to_string_lossy().to_string();
    let mut relay = Relay::start(&config, &[])?;
    let named = eventually(Duration::from_secs(30), || async {
        relay.log_text().contains("migrate --table")
    })
    .await;
    assert!(named, "{}", relay.log_text());
    assert!(relay.child.try_wait()?.is_none(), "the relay exited");
    relay.terminate(Duration::from_secs(15));
    assert!(
        !relay.log_text().contains("source started"),
        "the source started without its trigger: {}",
        relay.log_text()
    );
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE published_at IS NULL")
            .await,
        40_000,
        "nothing was published without the trigger"
    );
    let (code, out, err) = cli(&["migrate", "--table", "-c", &c])?;
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(
        db.count("SELECT count(*) FROM outroute_queue WHERE source = 'outbox'")
            .await,
        40_000,
        "the backfill lists the pending rows, not the published ones"
    );
    // New rows are listed by the trigger.
    fill(&db, 40_011, 50_010).await?;
    assert_eq!(
        db.count("SELECT count(*) FROM outroute_queue WHERE source = 'outbox'")
            .await,
        50_000
    );
    assert_never_analysed(&db, "outroute_queue", false).await;
    let store = open_store(&config, "q").await?;
    assert_eq!(store.missing_index(), None);
    // The gauge counts a bounded number of entries and estimates the rest
    // from the sequence span.
    let (estimate, oldest) = store.backlog().await?;
    assert!(
        (50_000..=50_010).contains(&estimate),
        "backlog estimate {estimate} for 50,000 queued events"
    );
    assert!(oldest.is_some());
    let lanes = store.lease_round().await?.lanes;
    // Cost per batch on a never-analysed queue: the claim reads the batch's rows.
    let (rows, indexed) = claim_cost(&store, &lanes, 500).await?;
    assert!(
        indexed && rows <= 502.0,
        "a 500-event claim read {rows} outbox rows"
    );

    // A claim marked twice is marked once.
    let claims = store.claim(&lanes, 1000).await?.claims;
    assert_eq!(claims.len(), 1000);
    let refs: Vec<&Claim> = claims.iter().collect();
    // The mark goes to each entry by the ctid its claim saw: TID fetches
    // only, no index walk and no scan of the queue, on a never-analysed
    // queue, for a batch of the size the relay marks (given 1,000 known
    // ctids, a join of them with the queue was planned as a hash of the
    // source's every entry).
    let (read, by_tid) = mark_cost(&store, &claims).await?;
    assert!(
        by_tid && read <= 2000.0,
        "marking 1,000 claims read {read} queue entries of 50,000 (TID fetches only: {by_tid})"
    );
    assert_eq!(store.mark_published(&refs).await?, 1000);
    assert_eq!(store.mark_published(&refs).await?, 0);
    let mut seen: std::collections::HashSet<String> =
        claims.iter().map(|c| c.id().to_string()).collect();
    // Drain the rest: every pending event once, none of the published ones.
    loop {
        let claims = store.claim(&lanes, 1000).await?.claims;
        if claims.is_empty() {
            break;
        }
        let refs: Vec<&Claim> = claims.iter().collect();
        assert_eq!(store.mark_published(&refs).await?, claims.len() as u64);
        for c in &claims {
            assert!(seen.insert(c.id().to_string()), "{} claimed twice", c.id());
        }
    }
    assert_eq!(seen.len(), 50_000);
    assert_eq!(
        db.count("SELECT count(*) FROM outroute_queue").await,
        0,
        "published entries are gone"
    );
    assert_eq!(
        db.count("SELECT count(*) FROM outbox").await,
        50_010,
        "rows are kept"
    );
    let (n, _) = store.backlog().await?;
    assert_eq!(n, 0);

    // A failure for good takes the event off the queue; `failed retry`
    // puts it back and it is claimed again.
    fill(&db, 60_001, 60_001).await?;
    let claims = store.claim(&lanes, 10).await?.claims;
    assert_eq!(claims.len(), 1);
    let c = &claims[0];
    let failure = failed_for_good(c, false)?;
    assert_eq!(store.record_failures(&[failure]).await?, 1);
    assert_eq!(db.count("SELECT count(*) FROM outroute_queue").await, 0);
    assert!(store.claim(&lanes, 10).await?.claims.is_empty());
    assert_eq!(
        store
            .failed_retry(&outroute::store::Filter::default())
            .await?,
        1
    );
    assert_eq!(db.count("SELECT count(*) FROM outroute_queue").await, 1);
    let again = store.claim(&lanes, 10).await?.claims;
    assert_eq!(again.len(), 1);
    let refs: Vec<&Claim> = again.iter().collect();
    assert_eq!(store.mark_published(&refs).await?, 1);

    // Retention (by age of the row) deletes published rows, oldest first,
    // and keeps a pending one.
    fill(&db, 70_001, 70_001).await?;
    assert_eq!(
        purge_rounds(&store, std::time::Duration::ZERO, 1000).await?,
        50_011
    );
    assert_eq!(db.count("SELECT count(*) FROM outbox").await, 1);
    assert_eq!(db.count("SELECT count(*) FROM outroute_queue").await, 1);
    db.drop_db().await;
    Ok(())
}

/// Claim up to 100 pending events and mark them all published: how many.
async fn publish_pending(store: &Store, lanes: &[i32]) -> anyhow::Result<u64> {
    let claims = store.claim(lanes, 100).await?.claims;
    let refs: Vec<&Claim> = claims.iter().collect();
    let marked = store.mark_published(&refs).await?;
    assert_eq!(marked, claims.len() as u64, "every claimed event is marked");
    Ok(marked)
}

/// The mark finds each queue entry by the ctid its claim saw, so it must
/// delete it only while that slot still holds the same entry: once VACUUM
/// has freed the slot, another event's entry may sit there, and that event
/// stays pending.
#[tokio::test(flavor = "multi_thread")]
async fn a_queue_mark_never_deletes_another_events_entry_from_a_reused_slot() -> anyhow::Result<()>
{
    let db = TestDb::new().await?;
    let dir = test_dir("claim-queue-reused-slot");
    let config = write_config(&dir, &db.url, "lanes = 2", &file_body(&dir, ""))?;
    db.migrate(&config)?;
    let store = open_store(&config, "reuse").await?;
    let lanes = store.lease_round().await?.lanes;
    fill(&db, 1, 100).await?;
    let old = store.claim(&lanes, 100).await?.claims;
    assert_eq!(old.len(), 100);
    let tids: Vec<String> = old.iter().filter_map(|c| c.tid.clone()).collect();
    assert_eq!(
        tids.len(),
        100,
        "every queue claim carries its entry's ctid"
    );
    // The entries leave the queue behind the claim's back (as a failure
    // recorded by another relay would take them), VACUUM frees their slots
    // and new events' entries take them.
    sqlx::query("DELETE FROM outroute_queue")
        .execute(&db.pool)
        .await?;
    sqlx::query("VACUUM outroute_queue")
        .execute(&db.pool)
        .await?;
    fill(&db, 101, 200).await?;
    let reused: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outroute_queue WHERE ctid = ANY($1::text[]::tid[])",
    )
    .bind(&tids)
    .fetch_one(&db.pool)
    .await?;
    assert!(
        reused >= 50,
        "the test needs reused slots: {reused} of the old ctids hold new entries"
    );
    let refs: Vec<&Claim> = old.iter().collect();
    assert_eq!(
        store.mark_published(&refs).await?,
        0,
        "a stale claim marked the entry now in its slot"
    );
    assert_eq!(db.count("SELECT count(*) FROM outroute_queue").await, 100);
    // The new events are claimed and marked as usual.
    let new = store.claim(&lanes, 1000).await?.claims;
    assert_eq!(new.len(), 100);
    assert!(new.iter().all(|c| c.sequence() > 100));
    let refs: Vec<&Claim> = new.iter().collect();
    assert_eq!(store.mark_published(&refs).await?, 100);
    assert_eq!(db.count("SELECT count(*) FROM outroute_queue").await, 0);
    db.drop_db().await;
    Ok(())
}

/// Queue entries whose row was deleted or failed by hand are removed by
/// the orphan sweep wherever they sit in a lane: each round goes on from
/// where the last one stopped, past live entries, to the lane's end.
#[tokio::test(flavor = "multi_thread")]
async fn queue_entries_of_rows_deleted_or_failed_by_hand_are_removed() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let dir = test_dir("claim-queue-orphans");
    let config = write_config(&dir, &db.url, "lanes = 2", &file_body(&dir, ""))?;
    db.migrate(&config)?;
    let store = open_store(&config, "orphans").await?;
    let lanes = store.lease_round().await?.lanes;
    // ~300 entries per lane; every orphan sits past the first 64 of its
    // lane, behind live entries.
    fill(&db, 1, 600).await?;
    sqlx::query("DELETE FROM outbox WHERE seq > 300 AND seq % 3 <> 0")
        .execute(&db.pool)
        .await?;
    sqlx::query("UPDATE outbox SET failed_at = now() WHERE seq BETWEEN 201 AND 210")
        .execute(&db.pool)
        .await?;
    assert_eq!(db.count("SELECT count(*) FROM outroute_queue").await, 600);
    // Rounds as the relay's sweep makes them: the lanes with entries left,
    // each from where its walk stopped.
    let (mut todo, mut after) = (lanes.clone(), vec![i64::MIN; lanes.len()]);
    let (mut dropped, mut rounds) = (0, 0);
    while !todo.is_empty() {
        let walk = store.drop_orphans(&todo, &after).await?;
        dropped += walk.dropped;
        rounds += 1;
        (todo, after) = walk.more.into_iter().unzip();
        assert!(rounds <= 10, "a walk of ~300 entries per lane ends");
    }
    assert!(
        rounds >= 4,
        "64 entries per lane per round: {rounds} rounds"
    );
    assert_eq!(dropped, 210);
    assert_eq!(
        db.count(
            "SELECT count(*) FROM outroute_queue q WHERE NOT EXISTS \
             (SELECT 1 FROM outbox o WHERE o.seq = q.seq AND o.failed_at IS NULL)"
        )
        .await,
        0
    );
    // Every remaining row is still pending and claimed once.
    let claims = store.claim(&lanes, 1000).await?.claims;
    assert_eq!(claims.len(), 390);
    db.drop_db().await;
    Ok(())
}

/// The orphan sweep reads only the entries it walks and deletes by ctid,
/// on a never-analysed queue of 400,000 entries in 64 lanes (the size at
/// which the walk's earlier form, run from psql, read each lane whole and
/// sorted it; see `PgStore::orphan_sql`). The store's connections turn
/// bitmap scans and sorts off, as the relay's do, so this guards the plan
/// the relay gets rather than reproducing the psql one.
#[tokio::test(flavor = "multi_thread")]
async fn the_orphan_sweep_reads_only_its_walk_on_a_never_analysed_queue() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let dir = test_dir("claim-queue-orphan-cost");
    let config = write_config(&dir, &db.url, "lanes = 64", &file_body(&dir, ""))?;
    db.migrate(&config)?;
    let store = open_store(&config, "orphan-cost").await?;
    let lanes = store.lease_round().await?.lanes;
    assert_eq!(lanes.len(), 64);
    sqlx::query(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), 'order', 'o-' || g, 'order-created', '{}' \
         FROM generate_series(1, 400000) g",
    )
    .execute(&db.pool)
    .await?;
    sqlx::query("DELETE FROM outbox WHERE seq % 1000 = 7")
        .execute(&db.pool)
        .await?;
    let pg = store
        .postgres()
        .ok_or_else(|| anyhow::anyhow!("not PostgreSQL"))?;
    let scans = pg.orphan_cost(&lanes, &vec![i64::MIN; lanes.len()]).await?;
    let walked: f64 = scans
        .iter()
        .filter(|(n, _)| n.starts_with("Index"))
        .map(|(_, r)| r)
        .sum();
    assert!(
        scans
            .iter()
            .all(|(n, _)| n.starts_with("Index") || n == "Tid Scan" || n == "ModifyTable"),
        "only index walks and the delete by ctid: {scans:?}"
    );
    assert!(
        walked <= 64.0 * 64.0,
        "{walked} entries read for a walk of 64 per lane: {scans:?}"
    );
    // The round itself finds the orphans among the entries it walked.
    let walk = store
        .drop_orphans(&lanes, &vec![i64::MIN; lanes.len()])
        .await?;
    assert!(
        walk.dropped > 0,
        "some of the first 4,096 entries are orphans"
    );
    assert_eq!(walk.more.len(), 64);
    db.drop_db().await;
    Ok(())
}

/// Failed rows at the bottom of a queue-marked table, many rounds' worth,
/// do not hold retention back: rounds step over them to the published
/// rows above, and the next pass starts from the bottom again.
#[tokio::test(flavor = "multi_thread")]
async fn queue_retention_steps_over_failed_rows_at_the_bottom() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let dir = test_dir("claim-queue-purge");
    let config = write_config(&dir, &db.url, "lanes = 4", &file_body(&dir, ""))?;
    db.migrate(&config)?;
    let store = open_store(&config, "purger").await?;
    let lanes = store.lease_round().await?.lanes;
    // 40 events that fail for good, then 10 that are published.
    fill(&db, 1, 40).await?;
    let claims = store.claim(&lanes, 100).await?.claims;
    assert_eq!(claims.len(), 40);
    let failures = claims
        .iter()
        .map(|c| failed_for_good(c, false))
        .collect::<anyhow::Result<Vec<_>>>()?;
    assert_eq!(store.record_failures(&failures).await?, 40);
    fill(&db, 41, 50).await?;
    assert_eq!(publish_pending(&store, &lanes).await?, 10);

    // Rounds of 3 rows: 13 rounds walk the failed rows before one reaches
    // a published row; every published row goes, no failed one does.
    assert_eq!(
        purge_rounds(&store, std::time::Duration::ZERO, 3).await?,
        10
    );
    assert_eq!(db.count("SELECT count(*) FROM outbox").await, 40);
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE failed_at IS NULL")
            .await,
        0,
        "only the failed rows are left"
    );
    // Later published rows are found by the next pass, from the bottom.
    fill(&db, 51, 55).await?;
    assert_eq!(publish_pending(&store, &lanes).await?, 5);
    assert_eq!(purge_rounds(&store, std::time::Duration::ZERO, 3).await?, 5);
    assert_eq!(db.count("SELECT count(*) FROM outbox").await, 40);
    db.drop_db().await;
    Ok(())
}

/// A held aggregate with more queued events than a claim takes, at the
/// head of its lane, holds back only itself: the claim walks past them.
#[tokio::test(flavor = "multi_thread")]
async fn a_held_aggregate_at_the_head_of_a_queue_lane_holds_back_only_itself() -> anyhow::Result<()>
{
    let db = TestDb::new().await?;
    let dir = test_dir("claim-queue-held");
    let config = write_config(&dir, &db.url, "lanes = 1", &file_body(&dir, ""))?;
    db.migrate(&config)?;
    // 30 events of one aggregate, then one each of five others: one lane.
    sqlx::query(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), 'order', 'busy', 'order-created', jsonb_build_object('n', g) \
         FROM generate_series(1, 30) g",
    )
    .execute(&db.pool)
    .await?;
    fill(&db, 1, 5).await?;
    let store = open_store(&config, "held").await?;
    let lanes = store.lease_round().await?.lanes;
    let first = store.claim(&lanes, 10).await?.claims;
    assert_eq!(first.len(), 10);
    // The first fails for good and holds its aggregate.
    let c = &first[0];
    let failure = failed_for_good(c, true)?;
    assert_eq!(failure.aggregate_id, "busy");
    assert_eq!(store.record_failures(&[failure]).await?, 1);
    // 29 held entries lead the lane; a claim of 10 still finds the others.
    let next = store.claim(&lanes, 10).await?.claims;
    let mut aggregates: Vec<String> = next
        .iter()
        .filter_map(|c| c.row.as_ref().ok().map(|e| e.aggregate_id.clone()))
        .collect();
    aggregates.sort();
    assert_eq!(aggregates, vec!["o-1", "o-2", "o-3", "o-4", "o-5"]);
    db.drop_db().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_queue_refuses_a_sequence_that_may_be_null() -> anyhow::Result<()> {
    // The trigger would fail a producer's insert of a row without a number.
    let db = TestDb::new().await?;
    let dir = test_dir("claim-queue-null");
    sqlx::query(
        "CREATE TABLE events (n bigint UNIQUE, id uuid NOT NULL, aggregate_id text NOT NULL, \
         event_type text NOT NULL, payload jsonb NOT NULL, created_at timestamptz NOT NULL DEFAULT now(), \
         failed_at timestamptz)",
    )
    .execute(&db.pool)
    .await?;
    let mapping = "[store.table]\nname = \"events\"\nid = \"id\"\nsequence = \"n\"\naggregate_type_value = \"order\"\n\
                   aggregate_id = \"aggregate_id\"\nevent_type = \"event_type\"\npayload = \"payload\"\n\
                   created_at = \"created_at\"\nfailed_at = \"failed_at\"\nmarking = { style = \"queue\" }\n";
    let config = write_config(&dir, &db.url, "lanes = 4", &file_body(&dir, mapping))?;
    let err = match open_store(&config, "q").await {
        Ok(_) => anyhow::bail!("a nullable sequence was accepted for the queue"),
        Err(e) => format!("{e:#}"),
    };
    assert!(
        err.contains("may be NULL") && err.contains("NOT NULL"),
        "{err}"
    );
    db.drop_db().await;
    Ok(())
}

/// A row that turns up below its lane's claim floor in a live relay (here:
/// written with a sequence number taken long before, as a producer that
/// allocates numbers in blocks or an import would) is found by the floor
/// sweep, published, and counted in
/// `outroute_claim_floor_lowered_total{source}`: late, never lost.
#[tokio::test(flavor = "multi_thread")]
async fn a_row_below_the_claim_floor_is_swept_up_and_counted() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let dir = test_dir("floor-lowered");
    let http = free_addr();
    let config = write_config(
        &dir,
        &db.url,
        "lanes = 4",
        &file_body(&dir, "").replace("listen = \"\"", &format!("listen = \"{http}\"")),
    )?;
    db.migrate(&config)?;
    let early: i64 = sqlx::query_scalar("SELECT nextval(pg_get_serial_sequence('outbox', 'seq'))")
        .fetch_one(&db.pool)
        .await?;
    fill(&db, 1, 400).await?;
    let out = dir.join("out.jsonl");
    let relay = Relay::start(&config, &[])?;
    assert!(
        file_sink_reaches(&out, 400, Duration::from_secs(30)).await,
        "{}",
        relay.log_text()
    );
    // Floor rounds run every 250 ms: let them rise past `early`.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let id = uuid::Uuid::new_v4().to_string();
    sqlx::query(
        "INSERT INTO outbox (seq, id, aggregate_type, aggregate_id, event_type, payload) \
         OVERRIDING SYSTEM VALUE VALUES ($1, $2::uuid, 'order', 'late', 'order-created', '{}')",
    )
    .bind(early)
    .bind(&id)
    .execute(&db.pool)
    .await?;
    let counted = |http: String| async move {
        http_get(&http, "/metrics")
            .await
            .ok()
            .and_then(|(_, m)| metric(&m, "outroute_claim_floor_lowered_total{source=\"default\"}"))
            .unwrap_or(0.0)
    };
    // The sweep looks below the floors every 30 s.
    let sent = eventually(Duration::from_secs(75), || async {
        file_sink_deliveries(&out).iter().any(|d| d.id() == id)
    })
    .await;
    assert!(
        sent,
        "the row below the floor was never published: {}",
        relay.log_text()
    );
    assert!(counted(http.clone()).await >= 1.0, "{}", relay.log_text());
    assert!(
        relay
            .log_text()
            .contains("a pending row turned up below the lane's claim floor"),
        "{}",
        relay.log_text()
    );
    drop(relay);
    db.drop_db().await;
    Ok(())
}
