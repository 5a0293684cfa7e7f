//! Order and no-loss where rows tie or fail part-way (issue: order and
//! no-loss under partial failure). Real PostgreSQL, the real binary.

use std::time::Duration;

use outroute_e2e::*;

/// `t_outbox` (article 004) is ordered by `create_time`: rows written in one
/// statement share it. `replay` pages by (order key, id), so a page boundary
/// inside a run of tied rows skips nothing, and it says how many it selected
/// and re-published.
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
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 1234, "distinct events re-published");
    db.drop_db().await;
    Ok(())
}

/// Is this process stopped (SIGSTOP)? Linux: state `T` in /proc/<pid>/stat.
fn stopped(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, rest)| rest.trim_start().starts_with('T'))
        })
        .unwrap_or(false)
}

/// A relay frozen (SIGSTOP) past its lease — right after claiming a batch,
/// and again after handing the first event of a batch to the broker — while
/// another relay takes its lanes and publishes everything. Resumed, it
/// publishes nothing more for the lanes it lost: every event arrives once,
/// except at most the one event it had handed over before freezing.
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
    ] {
        let db = TestDb::new().await?;
        let t = tag();
        let topic = format!("t{t}.order-updated");
        create_topic(&topic, 3).await?;
        let dir = test_dir(&format!("frozen-{point}"));
        let route = format!(
            "config = {{ sink = \"kafka\", topic = \"t{t}.{{event_type}}\" }}\nallow = {{ kafka = [\"t{t}.*\"] }}"
        );
        let config = write_config(
            &dir,
            &db.url,
            "lease_ttl = \"2s\"\nlanes = 8\nbatch_size = 400\nconcurrency = 1",
            &relay_body("", &[TestSink::Kafka], "order-router", "orders", &route),
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
        let mut other = Relay::start(&config, &[])?;
        assert!(
            eventually(Duration::from_secs(60), || async {
                db.count("SELECT count(*) FROM outbox WHERE published_at IS NULL")
                    .await
                    == 0
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
        frozen.terminate(Duration::from_secs(15));
        other.terminate(Duration::from_secs(15));
        db.drop_db().await;
    }
    Ok(())
}
