//! The consumer's half of the outbox: an **inbox** that applies each event
//! once, in the same transaction as the consumer's own writes.
//!
//! outroute delivers every event at least once: a relay killed after the
//! broker acknowledged but before it marked the row sends it again, and
//! `outroute replay` re-sends on purpose. Every copy carries the same event
//! id (`ce_id`), its aggregate (`ce_aggregatetype`, `ce_aggregateid`) and
//! its place in the outbox (`ce_sequence`). A consumer that records the id
//! in the transaction that applies the event can never apply it twice:
//!
//! ```text
//! BEGIN;
//!   INSERT INTO outroute_inbox (consumer, event_id, …) … ON CONFLICT DO NOTHING;
//!   -- 0 rows: a duplicate; ROLLBACK and acknowledge the message.
//!   upsert outroute_inbox_aggregates … WHERE last_seq < this event's sequence;
//!   -- 0 rows: older than one already handled for its aggregate; report it.
//!   … the consumer's own writes …
//! COMMIT;  -- then acknowledge the message (commit the offset, ack JetStream)
//! ```
//!
//! [`Inbox::handle`] does exactly that around a handler; [`Inbox::admit`] is
//! the same first two steps inside a transaction the caller owns. An event
//! older than the last one handled for its aggregate is never applied
//! silently: it comes back as [`Outcome::Stale`] (outroute keeps order per
//! aggregate, so this means a consumer read two topics, or a partition was
//! re-read from an old offset, or the producer's own order was not the
//! outbox's). Duplicates and stale events are counted ([`Inbox::stats`]).
//!
//! The tables are PostgreSQL's ([`POSTGRES_SCHEMA`], created by
//! [`Inbox::create_tables`] or by the consumer's own migrations); the same
//! pattern in plain SQL for other languages and databases is in the user
//! guide (`docs/src/operating/consumers.md`).

use std::sync::atomic::{AtomicU64, Ordering};

use futures::future::BoxFuture;
use sqlx::{PgConnection, PgPool};

/// The inbox tables. One row per handled event (kept until
/// [`Inbox::purge`]), and one per aggregate: the last sequence handled.
pub const POSTGRES_SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS outroute_inbox (
    consumer        text        NOT NULL,
    event_id        text        NOT NULL,
    source          text        NOT NULL DEFAULT '',
    aggregate_type  text,
    aggregate_id    text,
    seq             bigint,
    handled_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id)
);
CREATE INDEX IF NOT EXISTS outroute_inbox_handled_at ON outroute_inbox (consumer, handled_at);
CREATE TABLE IF NOT EXISTS outroute_inbox_aggregates (
    consumer        text   NOT NULL,
    source          text   NOT NULL,
    aggregate_type  text   NOT NULL,
    aggregate_id    text   NOT NULL,
    last_seq        bigint NOT NULL,
    last_event_id   text   NOT NULL,
    PRIMARY KEY (consumer, source, aggregate_type, aggregate_id)
);
";

/// Header names of outroute's envelope (CloudEvents, binary mode).
pub mod header {
    pub const ID: &str = "ce_id";
    pub const SOURCE: &str = "ce_source";
    pub const AGGREGATE_TYPE: &str = "ce_aggregatetype";
    pub const AGGREGATE_ID: &str = "ce_aggregateid";
    pub const SEQUENCE: &str = "ce_sequence";
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The message is not one of outroute's: it has no `ce_id`, or a
    /// header is not what the envelope puts there.
    #[error("not an outroute message: {0}")]
    NotAnEvent(String),
    #[error("inbox: {0}")]
    Database(#[from] sqlx::Error),
    /// The handler refused the event; nothing it wrote was kept.
    #[error("handler: {0}")]
    Handler(Box<dyn std::error::Error + Send + Sync>),
}

/// What identifies a received message: the envelope outroute put on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Received {
    pub event_id: String,
    /// The CloudEvents `source` (the relay's source and table): sequences
    /// are compared only within one.
    pub source: String,
    pub aggregate_type: Option<String>,
    pub aggregate_id: Option<String>,
    /// The event's place in its outbox (`ce_sequence`).
    pub sequence: Option<i64>,
}

impl Received {
    /// From header (name, value) pairs, whatever the broker.
    pub fn from_headers<'a>(
        headers: impl IntoIterator<Item = (&'a str, &'a [u8])>,
    ) -> Result<Received, Error> {
        let mut r = Received {
            event_id: String::new(),
            source: String::new(),
            aggregate_type: None,
            aggregate_id: None,
            sequence: None,
        };
        let text = |name: &str, v: &[u8]| {
            String::from_utf8(v.to_vec())
                .map_err(|_| Error::NotAnEvent(format!("header `{name}` is not UTF-8")))
        };
        for (name, value) in headers {
            match name {
                header::ID => r.event_id = text(name, value)?,
                header::SOURCE => r.source = text(name, value)?,
                header::AGGREGATE_TYPE => r.aggregate_type = Some(text(name, value)?),
                header::AGGREGATE_ID => r.aggregate_id = Some(text(name, value)?),
                header::SEQUENCE => {
                    let s = text(name, value)?;
                    r.sequence = Some(s.trim().parse().map_err(|_| {
                        Error::NotAnEvent(format!(
                            "`{}` = `{s}` is not a sequence number",
                            header::SEQUENCE
                        ))
                    })?);
                }
                _ => {}
            }
        }
        if r.event_id.is_empty() {
            return Err(Error::NotAnEvent(format!("no `{}` header", header::ID)));
        }
        Ok(r)
    }

    /// From a Kafka message (rdkafka).
    #[cfg(feature = "kafka")]
    pub fn from_kafka(m: &impl rdkafka::Message) -> Result<Received, Error> {
        use rdkafka::message::Headers;
        let Some(h) = m.headers() else {
            return Err(Error::NotAnEvent("no headers".into()));
        };
        Received::from_headers(h.iter().map(|h| (h.key, h.value.unwrap_or_default())))
    }

    /// From a NATS message (async-nats; JetStream messages deref to one).
    #[cfg(feature = "nats")]
    pub fn from_nats(m: &async_nats::Message) -> Result<Received, Error> {
        let Some(h) = &m.headers else {
            return Err(Error::NotAnEvent("no headers".into()));
        };
        Received::from_headers(
            h.iter()
                .filter_map(|(k, vs)| vs.first().map(|v| (k.as_ref(), v.as_str().as_bytes()))),
        )
    }
}

/// What became of a received event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// New: recorded, and (with [`Inbox::handle`]) the handler ran and its
    /// writes committed with the record.
    Applied,
    /// Already handled: nothing was done.
    Duplicate,
    /// Older than the last event handled for its aggregate (`last_seq`,
    /// `last_event_id`): nothing was done. Report it; acknowledging it
    /// skips it for good, not acknowledging it stops this partition.
    Stale {
        last_seq: i64,
        last_event_id: String,
    },
}

/// Counts since the inbox was made.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Stats {
    pub applied: u64,
    pub duplicates: u64,
    pub stale: u64,
}

/// One consumer's inbox (`consumer`: its name, e.g. the consumer group;
/// consumers sharing tables keep apart by it).
#[derive(Debug)]
pub struct Inbox {
    consumer: String,
    applied: AtomicU64,
    duplicates: AtomicU64,
    stale: AtomicU64,
}

impl Inbox {
    pub fn new(consumer: impl Into<String>) -> Inbox {
        Inbox {
            consumer: consumer.into(),
            applied: AtomicU64::new(0),
            duplicates: AtomicU64::new(0),
            stale: AtomicU64::new(0),
        }
    }

    /// Create the tables ([`POSTGRES_SCHEMA`]) if they are not there.
    pub async fn create_tables(pool: &PgPool) -> Result<(), Error> {
        sqlx::raw_sql(POSTGRES_SCHEMA).execute(pool).await?;
        Ok(())
    }

    pub fn stats(&self) -> Stats {
        Stats {
            applied: self.applied.load(Ordering::Relaxed),
            duplicates: self.duplicates.load(Ordering::Relaxed),
            stale: self.stale.load(Ordering::Relaxed),
        }
    }

    /// Record `msg` in the caller's transaction `tx`. [`Outcome::Applied`]:
    /// apply the event in the same transaction, then commit it.
    /// Anything else: roll back (nothing of it may be kept) and do not
    /// apply. Concurrent deliveries of one event, or of one aggregate's
    /// events, wait for each other here.
    pub async fn admit(&self, tx: &mut PgConnection, msg: &Received) -> Result<Outcome, Error> {
        let inserted = sqlx::query(
            "INSERT INTO outroute_inbox (consumer, event_id, source, aggregate_type, aggregate_id, seq) \
             VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (consumer, event_id) DO NOTHING",
        )
        .bind(&self.consumer)
        .bind(&msg.event_id)
        .bind(&msg.source)
        .bind(&msg.aggregate_type)
        .bind(&msg.aggregate_id)
        .bind(msg.sequence)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if inserted == 0 {
            self.duplicates.fetch_add(1, Ordering::Relaxed);
            return Ok(Outcome::Duplicate);
        }
        let (Some(at), Some(ai), Some(seq)) =
            (&msg.aggregate_type, &msg.aggregate_id, msg.sequence)
        else {
            // No aggregate or no sequence: nothing to order by.
            self.applied.fetch_add(1, Ordering::Relaxed);
            return Ok(Outcome::Applied);
        };
        let moved: Option<i64> = sqlx::query_scalar(
            "INSERT INTO outroute_inbox_aggregates AS a (consumer, source, aggregate_type, aggregate_id, last_seq, last_event_id) \
             VALUES ($1, $2, $3, $4, $5, $6) \
             ON CONFLICT (consumer, source, aggregate_type, aggregate_id) DO UPDATE \
               SET last_seq = EXCLUDED.last_seq, last_event_id = EXCLUDED.last_event_id \
               WHERE a.last_seq < EXCLUDED.last_seq \
             RETURNING last_seq",
        )
        .bind(&self.consumer)
        .bind(&msg.source)
        .bind(at)
        .bind(ai)
        .bind(seq)
        .bind(&msg.event_id)
        .fetch_optional(&mut *tx)
        .await?;
        if moved.is_some() {
            self.applied.fetch_add(1, Ordering::Relaxed);
            return Ok(Outcome::Applied);
        }
        let (last_seq, last_event_id): (i64, String) = sqlx::query_as(
            "SELECT last_seq, last_event_id FROM outroute_inbox_aggregates \
             WHERE consumer = $1 AND source = $2 AND aggregate_type = $3 AND aggregate_id = $4",
        )
        .bind(&self.consumer)
        .bind(&msg.source)
        .bind(at)
        .bind(ai)
        .fetch_one(&mut *tx)
        .await?;
        self.stale.fetch_add(1, Ordering::Relaxed);
        Ok(Outcome::Stale {
            last_seq,
            last_event_id,
        })
    }

    /// Handle `msg` exactly once: in one transaction, record it and run
    /// `handler` on the same connection, then commit. A duplicate or a
    /// stale event runs nothing; a handler error rolls everything back
    /// (the message is handled again when redelivered). Acknowledge the
    /// message to the broker only after this returns `Ok`.
    ///
    /// ```ignore
    /// let outcome = inbox.handle(&pool, &Received::from_kafka(&m)?, |db| Box::pin(async move {
    ///     sqlx::query("UPDATE accounts SET balance = balance + 1 WHERE id = $1")
    ///         .bind(7).execute(db).await?;
    ///     Ok(())
    /// })).await?;
    /// ```
    pub async fn handle<F>(
        &self,
        pool: &PgPool,
        msg: &Received,
        handler: F,
    ) -> Result<Outcome, Error>
    where
        F: for<'c> FnOnce(
            &'c mut PgConnection,
        )
            -> BoxFuture<'c, Result<(), Box<dyn std::error::Error + Send + Sync>>>,
    {
        let mut tx = pool.begin().await?;
        let outcome = self.admit(&mut tx, msg).await?;
        if outcome != Outcome::Applied {
            tx.rollback().await?;
            return Ok(outcome);
        }
        if let Err(e) = handler(&mut tx).await {
            // Not applied after all.
            self.applied.fetch_sub(1, Ordering::Relaxed);
            tx.rollback().await?;
            return Err(Error::Handler(e));
        }
        tx.commit().await?;
        Ok(outcome)
    }

    /// Forget handled events older than `age` (their aggregates' last
    /// sequence is kept): a copy arriving after that is applied again, so
    /// keep longer than any redelivery or replay window. Returns how many.
    pub async fn purge(&self, pool: &PgPool, age: std::time::Duration) -> Result<u64, Error> {
        let micros = i64::try_from(age.as_micros()).unwrap_or(i64::MAX);
        Ok(sqlx::query(
            "DELETE FROM outroute_inbox WHERE consumer = $1 \
             AND handled_at < now() - make_interval(secs => $2::double precision / 1e6)",
        )
        .bind(&self.consumer)
        .bind(micros as f64)
        .execute(pool)
        .await?
        .rows_affected())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_envelope_is_read_and_a_message_without_one_is_refused() {
        let h: Vec<(&str, &[u8])> = vec![
            ("ce_id", b"e1"),
            ("ce_source", b"/outroute/outbox"),
            ("ce_aggregatetype", b"order"),
            ("ce_aggregateid", b"o-1"),
            ("ce_sequence", b"42"),
            ("x-other", b"\xff"),
        ];
        let r = Received::from_headers(h).unwrap();
        assert_eq!(r.event_id, "e1");
        assert_eq!(r.sequence, Some(42));
        assert_eq!(r.aggregate_id.as_deref(), Some("o-1"));
        assert!(matches!(
            Received::from_headers(vec![("ce_type", b"x".as_slice())]),
            Err(Error::NotAnEvent(_))
        ));
        #[cfg(feature = "nats")]
        {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("ce_id", "e2");
            headers.insert("ce_aggregateid", "o-2");
            headers.insert("ce_sequence", "7");
            let m = async_nats::Message {
                subject: "orders.o-2".into(),
                reply: None,
                payload: Default::default(),
                headers: Some(headers),
                status: None,
                description: None,
                length: 0,
            };
            let r = Received::from_nats(&m).unwrap();
            assert_eq!(
                (r.event_id.as_str(), r.aggregate_id.as_deref(), r.sequence),
                ("e2", Some("o-2"), Some(7))
            );
        }
        let bad: Vec<(&str, &[u8])> = vec![("ce_id", b"e1"), ("ce_sequence", b"forty")];
        let e = Received::from_headers(bad).unwrap_err().to_string();
        assert!(
            e.contains("`ce_sequence` = `forty` is not a sequence number"),
            "{e}"
        );
    }
}
