//! The naive baseline: the relay seed article 000 sketches, written as the
//! article describes it and as a careful team would run it, so that the
//! ratio against outroute is honest. Each of `workers` loops leases 100
//! pending rows of the article's `outbox_events` in a short transaction
//! (`UPDATE … WHERE id IN (SELECT … ORDER BY created_at LIMIT 100 FOR
//! UPDATE SKIP LOCKED)`, over a partial index of the pending rows), sends
//! them all to Kafka, awaits every acknowledgement, then stamps
//! `published_at` on the batch in one statement. It is timed by the same
//! clock as outroute's drain: start → last event at an independent
//! consumer, and → the last stamp.

use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use outroute::config::KafkaSinkConfig;
use outroute::sink::{Outgoing, Sink, kafka::KafkaSink};
use outroute_e2e::{KAFKA, TestDb, create_topic, tag};
use serde_json::{Value, json};

use crate::{Shape, consumer};

/// Drain `n` ~1 KB events with `workers` naive pollers; the figures.
pub async fn run(n: usize, workers: u32) -> Result<Value> {
    let db = TestDb::new().await?;
    Shape::OutboxEvents.create_and_fill(&db.pool, n).await?;
    sqlx::query(
        "CREATE INDEX outbox_events_pending ON outbox_events (created_at) WHERE published_at IS NULL",
    )
    .execute(&db.pool)
    .await?;
    let t = tag();
    let topic = format!("b{t}.order-created");
    create_topic(&topic, 3).await?;
    let cfg = KafkaSinkConfig {
        brokers: KAFKA.into(),
        max_message_bytes: 1 << 20,
        compression: "none".into(),
        linger_ms: 1,
        max_in_flight: 5,
        options: Default::default(),
        tls: None,
        sasl: None,
    };
    let sink = std::sync::Arc::new(KafkaSink::build("kafka", &cfg, Duration::from_secs(30))?);
    let deadline = Instant::now() + Duration::from_secs(600);
    let consumer = consumer::start("kafka", &t, n, deadline);
    let started = Instant::now();
    let mut loops = Vec::new();
    for w in 0..workers {
        let (pool, sink, topic) = (db.pool.clone(), sink.clone(), topic.clone());
        loops.push(tokio::spawn(async move {
            let me = format!("naive-{w}");
            loop {
                if Instant::now() > deadline {
                    bail!("the naive poller did not finish within 600 s");
                }
                let rows: Vec<(uuid::Uuid, String, String)> = sqlx::query_as(
                    "UPDATE outbox_events SET lease_owner = $1, lease_until = now() + interval '30 seconds', \
                       attempts = attempts + 1 \
                     WHERE id IN (SELECT id FROM outbox_events WHERE published_at IS NULL \
                       AND (lease_until IS NULL OR lease_until < now()) \
                       ORDER BY created_at LIMIT 100 FOR UPDATE SKIP LOCKED) \
                     RETURNING id, aggregate_id::text, payload::text",
                )
                .bind(&me)
                .fetch_all(&pool)
                .await?;
                if rows.is_empty() {
                    let left: i64 = sqlx::query_scalar(
                        "SELECT count(*) FROM outbox_events WHERE published_at IS NULL",
                    )
                    .fetch_one(&pool)
                    .await?;
                    if left == 0 {
                        return anyhow::Ok(());
                    }
                    // Another worker holds the rest.
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    continue;
                }
                let mut acks = Vec::with_capacity(rows.len());
                for (id, agg, body) in &rows {
                    let ids = id.to_string();
                    let h: Vec<outroute::sink::Header> = vec![("ce_id", ids.as_str().into())];
                    let out = Outgoing {
                        topic: &topic,
                        key: Some(agg.as_bytes()),
                        partition: None,
                        headers: &h,
                        payload: body.as_bytes(),
                        dedup_id: &ids,
                    };
                    acks.push(sink.send(out, None).await?);
                }
                for ack in acks {
                    ack.wait().await?;
                }
                let ids: Vec<uuid::Uuid> = rows.iter().map(|r| r.0).collect();
                sqlx::query("UPDATE outbox_events SET published_at = now() WHERE id = ANY($1)")
                    .bind(&ids)
                    .execute(&pool)
                    .await?;
            }
        }));
    }
    for l in loops {
        l.await??;
    }
    let confirmed = started.elapsed().as_secs_f64();
    let received = match consumer.await {
        Ok(Ok(at)) => (at - started).as_secs_f64(),
        Ok(Err(e)) => bail!("naive baseline: {e:#}"),
        Err(e) => bail!("naive baseline: the consumer task failed: {e}"),
    };
    db.drop_db().await;
    Ok(json!({
        "events": n,
        "workers": workers,
        "seconds": received,
        "events_per_s": n as f64 / received.max(1e-3),
        "seconds_confirmed": confirmed,
        "events_per_s_confirmed": n as f64 / confirmed.max(1e-3),
    }))
}
