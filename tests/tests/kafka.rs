//! End to end through Kafka (tansu): business transactions → outbox →
//! order-router plugin → Kafka, with headers, keys, metrics, readiness and a
//! graceful shutdown checked on the way.

use std::collections::HashMap;
use std::time::Duration;

use outroute_e2e::*;

#[tokio::test(flavor = "multi_thread")]
async fn kafka_end_to_end_with_headers_keys_metrics_and_shutdown() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let t = tag();
    let topic = format!("t{t}.order-updated");
    create_topic(&topic, 3).await?;
    let http = free_addr();
    let dir = test_dir("kafka");
    let config = write_config(
        &dir,
        &db.url,
        "lease_ttl = \"3s\"\nlanes = 16",
        &relay_body(
            &http,
            &[TestSink::Kafka],
            "order-router",
            "orders",
            &format!(
                "aggregate_types = [\"order\"]\nconfig = {{ sink = \"kafka\", topic = \"t{t}.{{event_type}}\" }}\nallow = {{ kafka = [\"t{t}.*\"] }}"
            ),
        ),
    )?;
    db.migrate(&config)?;
    let work = produce(&db.pool, "agg", 50, 4, 7).await?;
    assert!(!work.rolled_back.is_empty());

    let mut relay = Relay::start(&config, &[])?;
    let delivered = consume_kafka(&topic, 3, work.committed.len(), Duration::from_secs(60))?;
    let report = check(&work, &delivered);
    println!("kafka: {report}");
    report.assert_clean();

    // CloudEvents headers and trace context on every message.
    for d in &delivered {
        for h in [
            "ce_id",
            "ce_type",
            "ce_source",
            "ce_specversion",
            "ce_time",
            "ce_aggregateid",
            "ce_eventversion",
            "traceparent",
        ] {
            assert!(
                d.headers.contains_key(h),
                "message lacks header {h}: {:?}",
                d.headers
            );
        }
        assert_eq!(d.headers["ce_type"], "order-updated");
        assert_eq!(d.headers["ce_specversion"], "1.0");
        assert_eq!(
            d.key.as_deref(),
            Some(d.aggregate()),
            "key is the aggregate id"
        );
    }
    // Keys land on consistent partitions.
    let mut partition_of: HashMap<String, i32> = HashMap::new();
    for d in &delivered {
        let p = *partition_of
            .entry(d.key.clone().unwrap_or_default())
            .or_insert(d.partition);
        assert_eq!(p, d.partition, "key {:?} seen on two partitions", d.key);
    }
    assert!(
        partition_of
            .values()
            .collect::<std::collections::HashSet<_>>()
            .len()
            > 1,
        "all keys on one partition"
    );

    // Rows marked only after acks: all published, none pending.
    assert!(
        eventually(Duration::from_secs(10), || async {
            db.unpublished("").await == 0
        })
        .await
    );
    assert_eq!(db.published("").await, work.committed.len() as i64);

    // Metrics after a known workload.
    let (status, text) = http_get(&http, "/metrics").await?;
    assert_eq!(status, 200);
    assert_eq!(
        metric(&text, "outroute_events_published_total{route=\"orders\"}"),
        Some(work.committed.len() as f64)
    );
    assert_eq!(
        metric(
            &text,
            "outroute_messages_published_total{route=\"orders\",sink=\"kafka\"}"
        ),
        Some(work.committed.len() as f64)
    );
    assert!(
        text.contains("outroute_commit_to_ack_seconds_bucket"),
        "{text}"
    );
    assert!(text.contains("outroute_plugin_call_seconds_bucket"));
    assert!(metric(&text, "outroute_lanes_owned").unwrap_or(0.0) >= 16.0);
    let (ready, body) = http_get(&http, "/readyz").await?;
    assert_eq!(ready, 200, "{body}");
    assert_eq!(http_get(&http, "/healthz").await?.0, 200);

    // Graceful shutdown: exits cleanly and gives its lanes back.
    let status = relay
        .terminate(Duration::from_secs(15))
        .expect("relay did not stop within 15s of SIGTERM");
    assert!(
        status.success(),
        "exit status {status:?}\n{}",
        relay.log_text()
    );
    assert_eq!(
        db.count("SELECT count(*) FROM outroute_lanes WHERE owner IS NOT NULL")
            .await,
        0
    );
    db.drop_db().await;
    Ok(())
}

/// `sinks.<name>.options` cannot weaken what makes an acknowledgement mean
/// stored and in order: `outroute run` itself (not only `config check`)
/// refuses to start with `enable.idempotence = false` or `acks = 1`,
/// naming each key and why, and publishes nothing.
#[tokio::test(flavor = "multi_thread")]
async fn kafka_options_that_weaken_delivery_are_refused_at_run() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let t = tag();
    let dir = test_dir("kafka-weak-options");
    let route = format!(
        "config = {{ sink = \"kafka\", topic = \"w{t}.{{event_type}}\" }}\nallow = {{ kafka = [\"w{t}.*\"] }}"
    );
    let body = relay_body("", &[TestSink::Kafka], "order-router", "orders", &route).replace(
        "kind = \"kafka\"\n",
        "kind = \"kafka\"\noptions = { \"enable.idempotence\" = \"false\", \"acks\" = \"1\" }\n",
    );
    let config = write_config(&dir, &db.url, "", &body)?;
    let mut relay = Relay::start(&config, &[])?;
    let status = relay.wait_exit(Duration::from_secs(30));
    let log = relay.log_text();
    assert!(
        status.is_some_and(|s| !s.success()),
        "the relay ran with weakened Kafka options: {status:?}\n{log}"
    );
    for key in ["enable.idempotence", "acks"] {
        assert!(
            log.contains(&format!("sinks.kafka.options.\"{key}\"")),
            "`{key}` not named:\n{log}"
        );
    }
    assert!(log.contains("outroute sets this itself"), "{log}");
    db.drop_db().await;
    Ok(())
}

/// An aggregate's two events in one batch: X1 to JetStream, whose stream
/// stores messages of at most 512 bytes, so the server refuses X1's 1 KB
/// message when it acknowledges; X2 to Kafka. Under `ordering =
/// "aggregate"` X2 is sent while X1 is in flight and is acknowledged: that
/// first delivery is out of order, so the relay counts it in
/// `outroute_order_risk_total{sink}`, logs both ids and leaves X2 pending
/// behind X1. Under `"strict"` X2 is sent only after X1's acknowledgement:
/// it never reaches Kafka, nothing is counted.
async fn ack_time_failure_ahead_of_a_later_event(ordering: &str) -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let t = tag();
    let topic = format!("t{t}.updated");
    create_topic(&topic, 3).await?;
    let stream = format!("R{t}");
    let js = async_nats::jetstream::new(async_nats::connect(NATS).await?);
    let _ = js.delete_stream(&stream).await;
    js.create_stream(async_nats::jetstream::stream::Config {
        name: stream.clone(),
        subjects: vec![format!("t{t}.>")],
        max_message_size: 512,
        ..Default::default()
    })
    .await?;
    let http = free_addr();
    let dir = test_dir(&format!("order-risk-{ordering}"));
    // batch_size 16: a worker's first claim takes 2 events (slow start).
    let config = write_config(
        &dir,
        &db.url,
        &format!("ordering = \"{ordering}\"\nbatch_size = 16\nconcurrency = 1"),
        &relay_body(
            &http,
            &[TestSink::Kafka, TestSink::Nats],
            "hostile",
            "orders",
            &format!(
                "config = {{ sink = \"kafka\", topic = \"t{t}.{{event_type}}\" }}\n\
                 allow = {{ kafka = [\"t{t}.*\"], nats = [\"t{t}.*\"] }}\nmax_attempts = 1"
            ),
        ),
    )?;
    db.migrate(&config)?;
    let (x1, x2) = (
        uuid::Uuid::new_v4().to_string(),
        uuid::Uuid::new_v4().to_string(),
    );
    let mut tx = db.pool.begin().await?;
    for (id, payload) in [
        (
            &x1,
            serde_json::json!({"hostile": "to-nats", "pad": "x".repeat(1000)}),
        ),
        (&x2, serde_json::json!({})),
    ] {
        sqlx::query("INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1::uuid, 'order', 'one', 'updated', $2)")
            .bind(id)
            .bind(payload)
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await?;
    let relay = Relay::start(&config, &[])?;
    let metrics = || async {
        http_get(&http, "/metrics")
            .await
            .map(|(_, m)| m)
            .unwrap_or_default()
    };
    // X1 fails for good (one attempt): it is recorded.
    let x1_failed = eventually(Duration::from_secs(30), || async {
        metric(
            &metrics().await,
            "outroute_events_failed_total{route=\"orders\",source=\"default\"}",
        )
        .is_some_and(|n| n >= 1.0)
    })
    .await;
    assert!(x1_failed, "{ordering}: {}", relay.log_text());
    let delivered = consume_kafka(&topic, 3, 1, Duration::from_secs(5))?;
    let log = relay.log_text();
    let risk = metric(
        &metrics().await,
        "outroute_order_risk_total{sink=\"kafka\"}",
    );
    assert_eq!(
        db.published(&format!("o.id = '{x2}'")).await,
        0,
        "{ordering}: X2 stays pending behind X1"
    );
    if ordering == "strict" {
        assert!(
            delivered.is_empty(),
            "{ordering}: X2 was sent before X1 was acknowledged: {delivered:?}"
        );
        assert_eq!(risk, None, "{ordering}: {log}");
    } else {
        assert!(
            delivered.iter().any(|d| d.id() == x2),
            "{ordering}: X2 was not sent while X1 was in flight: {log}"
        );
        assert!(risk.is_some_and(|n| n >= 1.0), "{ordering}: {risk:?} {log}");
        assert!(
            log.lines().any(|l| l.contains("order risk")
                && l.contains(&format!("event_id={x2}"))
                && l.contains(&format!("earlier_event_id={x1}"))),
            "{ordering}: {log}"
        );
    }
    drop(relay);
    drop_nats_stream(&stream).await;
    db.drop_db().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn an_ack_time_failure_under_aggregate_ordering_is_counted_as_order_risk()
-> anyhow::Result<()> {
    ack_time_failure_ahead_of_a_later_event("aggregate").await
}

#[tokio::test(flavor = "multi_thread")]
async fn strict_ordering_sends_an_aggregates_next_event_only_after_the_ack() -> anyhow::Result<()> {
    ack_time_failure_ahead_of_a_later_event("strict").await
}
