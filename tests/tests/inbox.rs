//! The consumer inbox (`outroute-inbox`) end to end: a consumer applies
//! 10,000 events from Kafka while the relay is killed -9 twenty times and a
//! replay re-sends a range; every event is applied exactly once, each
//! aggregate's in outbox order, and the copies are counted as duplicates.

use std::sync::Arc;
use std::time::{Duration, Instant};

use outroute_e2e::*;
use outroute_inbox::{Inbox, Outcome, Received};
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

const PARTITIONS: i32 = 3;

/// Apply every message of `topic` through `inbox` into table `applied`
/// (one row per application, in application order) until `stop`.
async fn consume(
    pool: sqlx::PgPool,
    topic: String,
    inbox: Arc<Inbox>,
    stop: tokio_util_stop::Stop,
) -> anyhow::Result<()> {
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", KAFKA)
        .set("group.id", format!("inbox-{}", tag()))
        .set("enable.auto.commit", "false")
        .create()?;
    let mut tpl = TopicPartitionList::new();
    for p in 0..PARTITIONS {
        tpl.add_partition_offset(&topic, p, Offset::Beginning)?;
    }
    consumer.assign(&tpl)?;
    while !stop.is_set() {
        let m = match tokio::time::timeout(Duration::from_millis(200), consumer.recv()).await {
            Err(_) => continue,
            Ok(m) => m?,
        };
        let received = Received::from_kafka(&m)?;
        let (id, agg, seq) = (
            received.event_id.clone(),
            received.aggregate_id.clone().unwrap_or_default(),
            received.sequence.unwrap_or(-1),
        );
        let outcome = inbox
            .handle(&pool, &received, |db| {
                Box::pin(async move {
                    sqlx::query(
                        "INSERT INTO applied (event_id, aggregate_id, seq) VALUES ($1, $2, $3)",
                    )
                    .bind(id)
                    .bind(agg)
                    .bind(seq)
                    .execute(db)
                    .await?;
                    Ok(())
                })
            })
            .await?;
        if let Outcome::Stale { .. } = outcome {
            eprintln!("stale: {received:?} ({outcome:?})");
        }
    }
    Ok(())
}

/// A flag the consumer task polls (no extra dependency for one bool).
mod tokio_util_stop {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    #[derive(Clone, Default)]
    pub struct Stop(Arc<AtomicBool>);

    impl Stop {
        pub fn set(&self) {
            self.0.store(true, Ordering::SeqCst);
        }
        pub fn is_set(&self) -> bool {
            self.0.load(Ordering::SeqCst)
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn every_event_is_applied_once_in_order_through_kills_and_a_replay() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let t = tag();
    let topic = format!("ib{t}.order-updated");
    create_topic(&topic, PARTITIONS).await?;
    let dir = test_dir("inbox");
    let config = write_config(
        &dir,
        &db.url,
        "batch_size = 100\nlease_ttl = \"2s\"",
        &relay_body(
            "",
            &[TestSink::Kafka],
            "order-router",
            "orders",
            &format!(
                "config = {{ sink = \"kafka\", topic = \"ib{t}.{{event_type}}\" }}\n\
                 allow = {{ kafka = [\"ib{t}.*\"] }}\n"
            ),
        ),
    )?;
    db.migrate(&config)?;
    Inbox::create_tables(&db.pool).await?;
    sqlx::query(
        "CREATE TABLE applied (n bigserial PRIMARY KEY, event_id text NOT NULL, aggregate_id text NOT NULL, seq bigint NOT NULL)",
    )
    .execute(&db.pool)
    .await?;

    let inbox = Arc::new(Inbox::new("inbox-test"));
    let stop = tokio_util_stop::Stop::default();
    let consumer = tokio::spawn(consume(
        db.pool.clone(),
        topic.clone(),
        inbox.clone(),
        stop.clone(),
    ));
    // Producers commit 10,000 events (100 orders × 100) while the relay
    // is killed -9 twenty times mid-drain.
    let producing = {
        let pool = db.pool.clone();
        tokio::spawn(async move { produce(&pool, "ib", 100, 100, 0).await })
    };
    let mut rng = proxy::Rng::from_env();
    let mut kills = 0;
    let mut relay = Relay::start(&config, &[])?;
    while kills < 20 {
        tokio::time::sleep(Duration::from_millis(300 + rng.below(700))).await;
        relay.kill();
        kills += 1;
        relay = Relay::start(&config, &[])?;
    }
    let work = producing.await??;
    assert_eq!(work.committed.len(), 10_000);
    let all_marked = eventually(Duration::from_secs(120), || async {
        db.unpublished("").await == 0
    })
    .await;
    assert!(all_marked, "{}", relay.log_text());
    // A replay of the second half: every copy is a duplicate to the inbox.
    let half: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT created_at FROM outbox ORDER BY seq OFFSET 5000 LIMIT 1")
            .fetch_one(&db.pool)
            .await?;
    let (code, out, err) = cli(&[
        "replay",
        "-c",
        &config.display().to_string(),
        "--since",
        &half.to_rfc3339(),
    ])?;
    assert_eq!(code, 0, "{out}{err}");
    let replayed: u64 = out
        .split("re-published ")
        .nth(1)
        .and_then(|r| r.split(';').next())
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0);
    assert!(replayed >= 4000, "{out}");

    // The consumer has seen everything once the replay's copies arrived.
    let deadline = Instant::now() + Duration::from_secs(180);
    while Instant::now() < deadline {
        let s = inbox.stats();
        if s.applied >= 10_000 && s.duplicates >= replayed {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.set();
    consumer.await??;
    let s = inbox.stats();
    println!("kills {kills}, replayed {replayed}, inbox {s:?}");

    let rows: Vec<(String, String, i64)> =
        sqlx::query_as("SELECT event_id, aggregate_id, seq FROM applied ORDER BY n")
            .fetch_all(&db.pool)
            .await?;
    assert_eq!(rows.len(), 10_000, "applied once each: {s:?}");
    let ids: std::collections::HashSet<&str> = rows.iter().map(|(id, _, _)| id.as_str()).collect();
    assert_eq!(ids.len(), 10_000, "no event applied twice");
    for e in &work.committed {
        assert!(ids.contains(e.id.as_str()), "event {} never applied", e.id);
    }
    let mut last: std::collections::HashMap<&str, i64> = std::collections::HashMap::new();
    for (id, agg, seq) in &rows {
        let prev = last.insert(agg.as_str(), *seq);
        assert!(
            prev.is_none_or(|p| p < *seq),
            "aggregate {agg}: {id} (seq {seq}) applied after seq {prev:?}"
        );
    }
    assert_eq!(s.applied, 10_000);
    assert_eq!(s.stale, 0);
    assert!(
        s.duplicates >= replayed,
        "every replayed copy skipped as a duplicate: {s:?}, replayed {replayed}"
    );
    drop(relay);
    db.drop_db().await;
    Ok(())
}
