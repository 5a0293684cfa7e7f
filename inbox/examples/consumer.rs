//! A consumer of outroute's Kafka messages that applies each event exactly
//! once: it keeps a count of events per order in `order_event_counts`,
//! written in the same transaction as the inbox record, and commits the
//! Kafka offset only after that transaction.
//!
//! ```text
//! cargo run -p outroute-inbox --example consumer -- \
//!     postgres://root@127.0.0.1/test 127.0.0.1:9092 orders.order-created
//! ```

use outroute_inbox::{Inbox, Outcome, Received};
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::{ClientConfig, Message};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let (Some(db), Some(brokers), Some(topic)) = (args.next(), args.next(), args.next()) else {
        anyhow::bail!("usage: consumer POSTGRES_URL KAFKA_BROKERS TOPIC");
    };
    let pool = sqlx::PgPool::connect(&db).await?;
    Inbox::create_tables(&pool).await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS order_event_counts (order_id text PRIMARY KEY, events bigint NOT NULL)",
    )
    .execute(&pool)
    .await?;
    let group = "order-event-counter";
    let inbox = Inbox::new(group);
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .create()?;
    consumer.subscribe(&[&topic])?;
    loop {
        let m = consumer.recv().await?;
        let received = match Received::from_kafka(&m) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("skipping offset {}: {e}", m.offset());
                consumer.commit_message(&m, CommitMode::Async)?;
                continue;
            }
        };
        let order = received.aggregate_id.clone().unwrap_or_default();
        let outcome = inbox
            .handle(&pool, &received, |db| {
                Box::pin(async move {
                    sqlx::query(
                        "INSERT INTO order_event_counts (order_id, events) VALUES ($1, 1) \
                         ON CONFLICT (order_id) DO UPDATE SET events = order_event_counts.events + 1",
                    )
                    .bind(order)
                    .execute(db)
                    .await?;
                    Ok(())
                })
            })
            .await?;
        if let Outcome::Stale { last_event_id, .. } = &outcome {
            eprintln!(
                "event {} is older than {last_event_id}, already handled for its order: not applied",
                received.event_id
            );
        }
        // The transaction is committed: only now may the broker forget it.
        consumer.commit_message(&m, CommitMode::Async)?;
        let s = inbox.stats();
        if (s.applied + s.duplicates).is_multiple_of(1000) {
            println!(
                "applied {}, duplicates skipped {}, stale {}",
                s.applied, s.duplicates, s.stale
            );
        }
    }
}
