//! Sinks: where messages go, and the only place that knows a broker's
//! acknowledgement protocol. Every sink implements [`Sink`]; the batch
//! pipeline (`pipeline.rs`) knows nothing else about brokers.
//!
//! Publishing is two steps: [`Sink::send`] hands a message to the broker
//! client *in call order* (so per-key order holds) and returns an [`Ack`];
//! [`Ack::wait`] resolves only once the broker has acknowledged (Kafka
//! delivery report, JetStream PubAck, core NATS server round trip, file
//! written and fsynced), which is what lets the relay mark a row published
//! afterwards. Many acks are awaited at once; the number in flight per sink
//! is bounded.
//!
//! Each sink is a config struct (in `config.rs`) plus a builder, in its own
//! file. Every failure is classified: [`PublishError::Unavailable`] (broker
//! down or not answering: the event waits as long as it takes),
//! [`PublishError::Retryable`] (the broker refused this message for now:
//! retried, counting attempts) or [`PublishError::Permanent`] (too large,
//! topic unknown, not authorised: the event fails with the broker's reason).

use std::collections::BTreeMap;
use std::sync::Arc;

use anyhow::Result;
use futures::future::BoxFuture;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::SinkConfig;
use crate::routing::Routes;

pub mod file;
pub mod kafka;
pub mod nats;

/// A message header: name and value, borrowed from the event where they can
/// be (the envelope of every message would otherwise allocate ~20 strings).
pub type Header<'a> = (&'a str, std::borrow::Cow<'a, str>);

/// One message with its final headers, ready for a broker.
#[derive(Debug, Clone)]
pub struct Outgoing<'a> {
    pub topic: &'a str,
    pub key: Option<&'a [u8]>,
    pub partition: Option<i32>,
    pub headers: &'a [Header<'a>],
    pub payload: &'a [u8],
    /// Broker-side deduplication id (JetStream `Nats-Msg-Id`): the event id,
    /// plus `:n` for the n-th message of a fan-out.
    pub dedup_id: &'a str,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PublishError {
    /// The broker is unreachable or not answering (down, timed out, no
    /// leader): the event waits, however long it takes; it never uses up
    /// `max_attempts`.
    #[error("{0}")]
    Unavailable(String),
    /// The broker answered but did not take this message this time: retried,
    /// counting towards `max_attempts`.
    #[error("{0}")]
    Retryable(String),
    /// The message can never succeed (too large, not authorised).
    #[error("{0}")]
    Permanent(String),
}

/// A message handed to a broker, not yet acknowledged. Holds its in-flight
/// permit until the acknowledgement arrives.
pub struct Ack(BoxFuture<'static, Result<(), PublishError>>);

impl Ack {
    /// An acknowledgement that resolves when `f` does.
    pub fn new(f: impl Future<Output = Result<(), PublishError>> + Send + 'static) -> Self {
        Ack(Box::pin(f))
    }

    /// Already acknowledged.
    pub fn done() -> Self {
        Ack::new(std::future::ready(Ok(())))
    }

    /// Wait for the broker's acknowledgement.
    pub async fn wait(self) -> Result<(), PublishError> {
        self.0.await
    }
}

/// A slot for one message in flight on a sink (none for sinks without a
/// limit). Held by the message's [`Ack`] until the broker answers.
pub type Permit = Option<OwnedSemaphorePermit>;

/// A configured destination.
#[async_trait::async_trait]
pub trait Sink: Send + Sync {
    /// The semaphore bounding messages in flight, if the sink has a limit.
    fn in_flight(&self) -> Option<&Arc<Semaphore>>;

    /// Hand one message to the broker. Messages sent one after another reach
    /// the broker in that order *while [`Sink::session`] stays the same*;
    /// await the returned [`Ack`] for durability.
    async fn send(&self, m: Outgoing<'_>, permit: Permit) -> Result<Ack, PublishError>;

    /// The broker session messages are sent on now: changes when the sink
    /// reconnects or replaces its producer. A message sent in an earlier
    /// session may be lost while a later one is stored, so the pipeline
    /// waits for an aggregate's earlier acks before sending it on a new
    /// session.
    fn session(&self) -> u64 {
        0
    }

    /// Do messages in flight at once keep their send order even when the
    /// connection breaks under them? Kafka's idempotent producer re-sends
    /// in sequence and the broker refuses gaps: yes. A NATS client may
    /// write a message to a dead socket and the next one to the new
    /// connection: no — the pipeline then keeps at most one unacknowledged
    /// event per aggregate on this sink.
    fn keeps_order_in_flight(&self) -> bool {
        true
    }

    /// Drop messages handed over but not yet on the wire (their acks fail
    /// as unavailable). Called when a batch's lane lease lapsed, so a relay
    /// that lost its lanes sends no more than it already had. Default:
    /// nothing can be taken back.
    async fn abandon(&self) {}

    /// Is the broker reachable right now (for `/readyz`)?
    async fn connected(&self) -> bool;

    /// Wait (bounded) for queued messages to leave, on shutdown.
    async fn flush(&self);
}

impl dyn Sink {
    /// A slot for one more message if one is free right now.
    pub fn try_reserve(&self) -> Option<Permit> {
        match self.in_flight() {
            None => Some(None),
            Some(s) => s.clone().try_acquire_owned().ok().map(Some),
        }
    }

    /// Wait for a slot. Callers holding un-acknowledged messages of their
    /// own must settle those first, or they may wait on themselves.
    pub async fn reserve(&self) -> Result<Permit, PublishError> {
        match self.in_flight() {
            None => Ok(None),
            Some(s) => s
                .clone()
                .acquire_owned()
                .await
                .map(Some)
                .map_err(|_| PublishError::Unavailable("sink is shutting down".into())),
        }
    }

    /// Reserve, send and wait for the acknowledgement.
    pub async fn publish(&self, m: Outgoing<'_>) -> Result<(), PublishError> {
        let permit = self.reserve().await?;
        self.send(m, permit).await?.wait().await
    }
}

/// All sinks by name.
pub type Sinks = Arc<BTreeMap<String, Arc<dyn Sink>>>;

/// Build every configured sink. Configuration errors (a bad librdkafka
/// option, a JetStream subject no stream captures) refuse start-up; a broker
/// that is merely down is not an error (the relay retries and is not ready).
pub async fn build_all(
    configs: &BTreeMap<String, SinkConfig>,
    routes: &Routes,
    base_dir: &std::path::Path,
    publish_timeout: std::time::Duration,
) -> Result<Sinks> {
    let mut sinks: BTreeMap<String, Arc<dyn Sink>> = BTreeMap::new();
    for (name, cfg) in configs {
        let sink: Arc<dyn Sink> = match cfg {
            SinkConfig::Kafka(k) => {
                let sink = kafka::KafkaSink::build(name, k, publish_timeout)?;
                sink.verify().await?;
                Arc::new(sink)
            }
            SinkConfig::Nats(n) => {
                let patterns = routes.patterns_for_sink(name);
                Arc::new(nats::NatsSink::build(name, n, &patterns, publish_timeout).await?)
            }
            SinkConfig::File(f) => Arc::new(file::FileSink::build(name, f, base_dir)?),
        };
        sinks.insert(name.clone(), sink);
    }
    Ok(Arc::new(sinks))
}

/// `outroute config check --sinks`: reach every configured sink as `run`
/// would, publishing and creating nothing. What was found, one line each,
/// or a problem. Unlike start-up, a broker that is down is a problem here.
pub async fn check_all(
    configs: &BTreeMap<String, SinkConfig>,
    routes: &Routes,
    base_dir: &std::path::Path,
    publish_timeout: std::time::Duration,
) -> Vec<Result<String>> {
    let mut out = Vec::new();
    for (name, cfg) in configs {
        match cfg {
            SinkConfig::Kafka(k) => match kafka::KafkaSink::build(name, k, publish_timeout) {
                Ok(sink) => out.extend(
                    sink.check(&k.brokers, &routes.patterns_for_sink(name))
                        .await,
                ),
                Err(e) => out.push(Err(e)),
            },
            SinkConfig::Nats(n) => out.extend(
                nats::check(name, n, &routes.patterns_for_sink(name), publish_timeout).await,
            ),
            SinkConfig::File(f) => out.push(file::check(name, f, base_dir)),
        }
    }
    out
}
