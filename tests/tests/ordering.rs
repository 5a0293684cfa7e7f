//! Order and no-loss where rows tie or fail part-way (issue: order and
//! no-loss under partial failure). Real PostgreSQL, the real binary.

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
