//! Order and no-loss where rows tie or fail part-way (issue: order and
//! no-loss under partial failure). Real PostgreSQL, the real binary.

use std::time::Duration;

use outroute_e2e::*;

/// `t_outbox` (article 004) is ordered by `create_time`: rows written in one
/// statement share it. `replay` pages by (order key, id), so a page boundary
/// inside a run of tied rows skips nothing, keeps each aggregate's order,
/// and it says how many it selected and re-published.
#[tokio::test(flavor = "multi_thread")]
async fn replay_across_tied_rows_republishes_every_selected_event() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    sqlx::query(seed::T_OUTBOX_DDL).execute(&db.pool).await?;
    // 1,234 published rows with one timestamp: pages of 500 split the tie twice.
    sqlx::query(
        "INSERT INTO t_outbox (event_id, aggregate_type, aggregate_id, event_type, payload, status, create_time) \
         SELECT 'ev-' || g, 'order', 'o-' || (g % 17), 'order-created', '{\"n\":' || g || '}', 'SENT', \
                timestamp '2026-11-30 12:00:00' \
         FROM generate_series(1, 1234) g",
    )
    .execute(&db.pool)
    .await?;
    let dir = test_dir("replay-ties");
    let out = dir.join("out.jsonl");
    let body = format!(
        "{}\n{}",
        seed::T_OUTBOX_MAPPING,
        relay_body(
            "",
            &[TestSink::File(&out)],
            "order-router",
            "r",
            "config = { sink = \"file\", topic = \"orders.{event_type}\" }\nallow = { file = [\"orders.*\"] }",
        )
    );
    let config = write_config(&dir, &db.url, "lanes = 8", &body)?;
    db.migrate(&config)?;
    let c = config.to_string_lossy().to_string();

    let (code, stdout, stderr) = cli(&["replay", "--aggregate-type", "order", "-c", &c])?;
    assert_eq!(code, 0, "replay failed: {stdout}{stderr}");
    assert!(
        stdout.contains("selected 1234") && stdout.contains("re-published 1234"),
        "{stdout}"
    );
    let text = std::fs::read_to_string(&out)?;
    let mut ids: Vec<String> = text
        .lines()
        .map(|l| -> anyhow::Result<String> {
            let v: serde_json::Value = serde_json::from_str(l)?;
            Ok(v["headers"]["ce_id"]
                .as_str()
                .unwrap_or_default()
                .to_string())
        })
        .collect::<anyhow::Result<_>>()?;
    assert_eq!(ids.len(), 1234, "messages written");
    // Order holds on replay: each aggregate's events go out in outbox
    // order, here (one timestamp for all) their id order.
    let mut last: std::collections::HashMap<String, String> = std::collections::HashMap::new();
    for d in file_sink_deliveries(&out) {
        if let Some(before) = last.insert(d.aggregate().to_string(), d.id().to_string()) {
            assert!(
                before.as_str() < d.id(),
                "aggregate {}: {} replayed after {before}",
                d.aggregate(),
                d.id()
            );
        }
    }
    assert_eq!(last.len(), 17, "aggregates replayed");
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 1234, "distinct events re-published");
    db.drop_db().await;
    Ok(())
}

/// A relay frozen (SIGSTOP) past its lease — right after claiming a batch,
/// after handing the first event of a batch to the broker, and after the
/// broker acknowledged a batch — while another relay takes its lanes and
/// publishes everything. Resumed, it publishes nothing more for the lanes
/// it lost: every event arrives once, except at most the one event it had
/// handed over before freezing (or, frozen after the acknowledgement, the
/// batch it had sent, which its mark, fenced, leaves to the new owner).
/// Operators see it in `/metrics`: the new owner's
/// `outroute_lease_handovers_total`, and for the fenced mark the thawed
/// relay's `outroute_mark_fenced_total`.
#[tokio::test(flavor = "multi_thread")]
async fn a_relay_frozen_past_its_lease_publishes_nothing_for_lost_lanes_after_it_resumes()
-> anyhow::Result<()> {
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
        let db = TestDb::new().await?;
        let t = tag();
        let topic = format!("t{t}.order-updated");
        create_topic(&topic, 3).await?;
        let dir = test_dir(&format!("frozen-{point}"));
        let route = format!(
            "config = {{ sink = \"kafka\", topic = \"t{t}.{{event_type}}\" }}\nallow = {{ kafka = [\"t{t}.*\"] }}"
        );
        // One config per relay: each its own metrics endpoint.
        let (frozen_http, other_http) = (free_addr(), free_addr());
        let settings = "lease_ttl = \"2s\"\nlanes = 8\nbatch_size = 400\nconcurrency = 1";
        let config = write_config(
            &dir,
            &db.url,
            settings,
            &relay_body(
                &frozen_http,
                &[TestSink::Kafka],
                "order-router",
                "orders",
                &route,
            ),
        )?;
        let other_config = write_config(
            &dir.join("other"),
            &db.url,
            settings,
            &relay_body(
                &other_http,
                &[TestSink::Kafka],
                "order-router",
                "orders",
                &route,
            ),
        )?;
        db.migrate(&config)?;
        let w = produce(&db.pool, &format!("frozen-{point}"), 40, 5, 0).await?;

        let mut frozen = Relay::start(
            &config,
            &[
                ("OUTROUTE_FAILPOINT", point),
                ("OUTROUTE_FAILPOINT_ACTION", "stop"),
            ],
        )?;
        let pid = frozen.child.id();
        assert!(
            eventually(Duration::from_secs(30), || async { stopped(pid) }).await,
            "{point}: the relay never stopped at the failpoint:\n{}",
            frozen.log_text()
        );
        // Another relay takes the lanes once the lease lapses, and publishes all.
        let mut other = Relay::start(&other_config, &[])?;
        assert!(
            eventually(Duration::from_secs(60), || async {
                db.unpublished("").await == 0
            })
            .await,
            "{point}: the second relay did not publish the backlog:\n{}",
            other.log_text()
        );
        // Thaw the first relay, well past its lease.
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(pid as i32, libc::SIGCONT);
        }
        tokio::time::sleep(Duration::from_secs(4)).await;
        let delivered = consume_kafka(&topic, 3, usize::MAX, Duration::from_secs(5))?;
        let report = check(&w, &delivered);
        println!("{point}: {report}");
        assert_eq!(report.lost, 0, "{point}: {report}");
        assert_eq!(report.order_violations, 0, "{point}: {report}");
        assert!(
            report.duplicates <= may_duplicate,
            "{point}: the thawed relay published for lanes it lost: {report}\n{}",
            frozen.log_text()
        );
        let log = frozen.log_text();
        assert!(
            log.contains(noticed) && frozen.child.try_wait()?.is_none(),
            "{point}: the thawed relay should notice its lease lapsed and keep running:\n{log}"
        );
        let (_, metrics) = http_get(&other_http, "/metrics").await?;
        let handovers = metric(
            &metrics,
            "outroute_lease_handovers_total{source=\"default\"}",
        );
        assert!(
            handovers.is_some_and(|n| n >= 1.0),
            "{point}: the new owner's outroute_lease_handovers_total: {handovers:?}"
        );
        if point == "after-ack" {
            let (_, metrics) = http_get(&frozen_http, "/metrics").await?;
            let fenced = metric(&metrics, "outroute_mark_fenced_total{source=\"default\"}");
            assert!(
                fenced.is_some_and(|n| n >= 1.0),
                "{point}: the thawed relay's outroute_mark_fenced_total: {fenced:?}"
            );
        }
        frozen.terminate(Duration::from_secs(15));
        other.terminate(Duration::from_secs(15));
        db.drop_db().await;
    }
    Ok(())
}

/// `t_outbox` with `DEFAULT now()`: two events of one aggregate written in
/// one transaction share their timestamp. As documented, they go out in id
/// order, and `ce_sequence` (the timestamp) never decreases; after
/// `migrate --table --add-sequence` and `sequence = "outroute_seq"`, they go
/// out in insert order with increasing `ce_sequence`.
#[tokio::test(flavor = "multi_thread")]
async fn a_table_without_a_sequence_orders_same_transaction_events_as_documented()
-> anyhow::Result<()> {
    let db = TestDb::new().await?;
    sqlx::query(&seed::T_OUTBOX_DDL.replace("clock_timestamp()", "now()"))
        .execute(&db.pool)
        .await?;
    let dir = test_dir("same-tx");
    let out = dir.join("out.jsonl");
    let body = |mapping: &str| {
        format!(
            "{mapping}\n{}",
            relay_body(
                "",
                &[TestSink::File(&out)],
                "order-router",
                "r",
                "config = { sink = \"file\", topic = \"orders.{event_type}\" }\nallow = { file = [\"orders.*\"] }",
            )
        )
    };
    let config = write_config(&dir, &db.url, "lanes = 4", &body(seed::T_OUTBOX_MAPPING))?;
    let c = config.to_string_lossy().to_string();
    db.migrate(&config)?;
    let (code, stdout, stderr) = cli(&["migrate", "--table", "-c", &c])?;
    assert_eq!(code, 0, "{stdout}{stderr}");
    let (code, stdout, stderr) = cli(&["config", "check", "-c", &c])?;
    assert!(
        code == 0
            && stdout.contains("store.table.sequence is unset")
            && stdout.contains("--add-sequence"),
        "{stdout}{stderr}"
    );

    // Per aggregate, one transaction: `z-…` first, then `a-…`.
    let write = |first: &'static str, second: &'static str| {
        let pool = db.pool.clone();
        async move {
            for n in 0..10 {
                let mut tx = pool.begin().await?;
                for (id, ty) in [(first, "order-created"), (second, "order-updated")] {
                    sqlx::query(
                        "INSERT INTO t_outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
                         VALUES ($1, 'order', $2, $3, '{}')",
                    )
                    .bind(format!("{id}-{n}"))
                    .bind(format!("o-{n}"))
                    .bind(ty)
                    .execute(&mut *tx)
                    .await?;
                }
                tx.commit().await?;
            }
            anyhow::Ok(())
        }
    };
    // What the relay wrote for the ids starting with `prefix`, per aggregate
    // in output order: (id, ce_sequence).
    let run_and_read = |config: std::path::PathBuf| {
        let db = &db;
        let out = out.clone();
        async move {
            let mut relay = Relay::start(&config, &[])?;
            let done = eventually(Duration::from_secs(30), || async {
                db.count("SELECT count(*) FROM t_outbox WHERE status = 'PENDING'")
                    .await
                    == 0
            })
            .await;
            relay.terminate(Duration::from_secs(15));
            assert!(done, "not relayed:\n{}", relay.log_text());
            let mut by_aggregate: std::collections::BTreeMap<String, Vec<(String, i64)>> =
                Default::default();
            for line in std::fs::read_to_string(&out)?.lines() {
                let v: serde_json::Value = serde_json::from_str(line)?;
                let h = &v["headers"];
                let s = |k: &str| h[k].as_str().unwrap_or_default().to_string();
                by_aggregate
                    .entry(s("ce_aggregateid"))
                    .or_default()
                    .push((s("ce_id"), s("ce_sequence").parse().unwrap_or(-1)));
            }
            anyhow::Ok(by_aggregate)
        }
    };

    write("z", "a").await?;
    let seen = run_and_read(config.clone()).await?;
    assert_eq!(seen.len(), 10);
    for (agg, evs) in &seen {
        let ids: Vec<&str> = evs.iter().map(|(id, _)| &id[..1]).collect();
        assert_eq!(
            ids,
            ["a", "z"],
            "{agg}: same timestamp goes out in id order"
        );
        assert!(
            evs[0].1 <= evs[1].1,
            "{agg}: ce_sequence decreased: {evs:?}"
        );
    }

    // Add a sequence column, map it, rebuild the lane index on it.
    let (code, stdout, stderr) = cli(&["migrate", "--table", "--add-sequence", "-c", &c])?;
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert!(stdout.contains("ACCESS EXCLUSIVE"), "{stdout}");
    let mapping = seed::T_OUTBOX_MAPPING.replace(
        "created_at = \"create_time\"",
        "created_at = \"create_time\"\nsequence = \"outroute_seq\"",
    );
    let config = write_config(&dir, &db.url, "lanes = 4", &body(&mapping))?;
    let (code, stdout, stderr) = cli(&["migrate", "--table", "-c", &c])?;
    assert_eq!(code, 0, "{stdout}{stderr}");
    let (_, stdout, _) = cli(&["config", "check", "-c", &c])?;
    assert!(!stdout.contains("sequence is unset"), "{stdout}");
    std::fs::remove_file(&out)?;
    write("y", "b").await?;
    let seen = run_and_read(config).await?;
    assert_eq!(seen.len(), 10);
    for (agg, evs) in &seen {
        let ids: Vec<&str> = evs.iter().map(|(id, _)| &id[..1]).collect();
        assert_eq!(
            ids,
            ["y", "b"],
            "{agg}: insert order with a sequence column"
        );
        assert!(
            evs[0].1 < evs[1].1,
            "{agg}: ce_sequence not increasing: {evs:?}"
        );
    }
    db.drop_db().await;
    Ok(())
}

/// `relay.ordering = "none"`, as the guide's ordering table says: an event refused
/// before sending (the plugin rejects it) holds nothing back; the later
/// events of its aggregate go out, and it alone fails, with its reason.
/// (Under the default, `aggregate`, they wait: `plugins.rs`.)
#[tokio::test(flavor = "multi_thread")]
async fn under_ordering_none_a_failed_event_holds_nothing_back() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let (config, out) = file_sink_config(
        &db,
        "ordering-none",
        "ordering = \"none\"",
        "hostile",
        "r",
        &format!("{FILE_ROUTE}\nmax_attempts = 1"),
    )?;
    let mut ids = Vec::new();
    for payload in [
        serde_json::json!({"hostile": "reject"}),
        serde_json::json!({"n": 2}),
        serde_json::json!({"n": 3}),
    ] {
        let id = uuid::Uuid::new_v4().to_string();
        sqlx::query(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
             VALUES ($1::uuid, 'order', 'x', 'order-updated', $2)",
        )
        .bind(&id)
        .bind(payload)
        .execute(&db.pool)
        .await?;
        ids.push(id);
    }
    let mut relay = Relay::start(&config, &[])?;
    let went = eventually(Duration::from_secs(30), || async {
        file_sink_deliveries(&out).len() >= 2
    })
    .await;
    let sent: Vec<String> = file_sink_deliveries(&out)
        .iter()
        .map(|d| d.id().to_string())
        .collect();
    assert!(
        went,
        "the aggregate's later events were held back: {sent:?}\n{}",
        relay.log_text()
    );
    assert_eq!(sent, ids[1..].to_vec(), "only the later two, in order");
    let c = config.to_string_lossy().to_string();
    let (_, listed, _) = cli(&["failed", "list", "--json", "-c", &c])?;
    assert!(
        listed.contains(&ids[0]) && listed.contains("rejects this event"),
        "{listed}"
    );
    relay.terminate(Duration::from_secs(15));
    db.drop_db().await;
    Ok(())
}

/// One aggregate's deep backlog cannot starve the others: its 3,000 slow
/// events all sit in the first lane, and an event of the last lane written
/// while they drain goes out long before they are done (claims take turns
/// at which lane comes first; walked in lane order, the last lane would
/// wait for the whole backlog).
#[tokio::test(flavor = "multi_thread")]
async fn a_deep_lane_does_not_starve_the_others() -> anyhow::Result<()> {
    const DEEP: i64 = 3_000;
    let db = TestDb::new().await?;
    let (config, out) = file_sink_config(
        &db,
        "deep-lane",
        "lanes = 16\nbatch_size = 50\nconcurrency = 1",
        "hostile",
        "r",
        FILE_ROUTE,
    )?;
    // Aggregates of the first and the last lane (the relay's lane: hashtext
    // of `type/id`, modulo the lanes).
    let lane = |agg: String| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, i32>("SELECT (hashtext('order/' || $1) & 2147483647) % 16")
                .bind(agg)
                .fetch_one(&pool)
                .await
        }
    };
    let (mut deep, mut fresh) = (String::new(), String::new());
    for i in 0..1000 {
        let candidate = format!("agg-{i}");
        match lane(candidate.clone()).await? {
            0 if deep.is_empty() => deep = candidate,
            15 if fresh.is_empty() => fresh = candidate,
            _ => {}
        }
    }
    assert!(!deep.is_empty() && !fresh.is_empty());
    sqlx::query(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), 'order', $2, 'order-updated', jsonb_build_object('hostile', 'slow', 'n', g) \
         FROM generate_series(1, $1::bigint) g",
    )
    .bind(DEEP)
    .bind(&deep)
    .execute(&db.pool)
    .await?;
    let relay = Relay::start(&config, &[])?;
    let deep_sent = || {
        file_sink_deliveries(&out)
            .iter()
            .filter(|d| d.aggregate() == deep)
            .count()
    };
    let draining = eventually(Duration::from_secs(60), || async { deep_sent() >= 100 }).await;
    assert!(draining, "{}", relay.log_text());
    let id = uuid::Uuid::new_v4().to_string();
    sqlx::query("INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1::uuid, 'order', $2, 'order-updated', '{}')")
        .bind(&id)
        .bind(&fresh)
        .execute(&db.pool)
        .await?;
    let sent = eventually(Duration::from_secs(120), || async {
        file_sink_deliveries(&out).iter().any(|d| d.id() == id)
    })
    .await;
    assert!(sent, "{}", relay.log_text());
    let deep_then = file_sink_deliveries(&out)
        .iter()
        .take_while(|d| d.id() != id)
        .filter(|d| d.aggregate() == deep)
        .count();
    println!("the other lane's event went out after {deep_then} of {DEEP} deep events");
    assert!(
        deep_then <= (DEEP as usize) - 1_000,
        "the other lane's event waited for {deep_then} of the deep lane's {DEEP} events"
    );
    drop(relay);
    db.drop_db().await;
    Ok(())
}
