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
pub mod read_back;
pub mod starting;

pub use crate::event::Header;

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

    /// Why the sink is not up and since when, where it knows more than
    /// "not connected" (a sink still starting knows its last error).
    fn down_reason(&self) -> Option<(String, chrono::DateTime<chrono::Utc>)> {
        None
    }

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

/// How long start-up (or a reload) waits for the sinks before it goes on
/// without those not built yet: they become [`starting::StartingSink`]s,
/// built in the background, and only their routes wait.
const START_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// A setting the sink's client library refused: the configuration is
/// broken, waiting will not mend it.
#[derive(Debug, thiserror::Error)]
#[error("{0:#}")]
struct BadSetting(anyhow::Error);

/// Build one sink (one attempt): connect, check, create what it may.
async fn build_one(
    name: String,
    cfg: SinkConfig,
    patterns: Vec<String>,
    base_dir: std::path::PathBuf,
    publish_timeout: std::time::Duration,
) -> Result<Arc<dyn Sink>> {
    Ok(match &cfg {
        SinkConfig::Kafka(k) => {
            // Only builds the client (no network): its refusal is the config's.
            let sink = kafka::KafkaSink::build(&name, k, publish_timeout)
                .map_err(|e| anyhow::Error::new(BadSetting(e)))?;
            sink.verify().await?;
            Arc::new(sink)
        }
        SinkConfig::Nats(n) => {
            Arc::new(nats::NatsSink::build(&name, n, &patterns, publish_timeout).await?)
        }
        SinkConfig::File(f) => Arc::new(file::FileSink::build(&name, f, &base_dir)?),
    })
}

/// Build every configured sink, each on its own. A setting the client
/// library refuses (a bad librdkafka option) is a broken configuration and
/// refuses start-up; anything else — brokers down, credentials refused, a
/// JetStream stream that cannot be created yet — leaves that sink starting
/// in the background ([`starting::StartingSink`]) while the others run.
pub async fn build_all(
    configs: &BTreeMap<String, SinkConfig>,
    routes: &Routes,
    base_dir: &std::path::Path,
    publish_timeout: std::time::Duration,
) -> Result<Sinks> {
    let mut attempts = Vec::new();
    for (name, cfg) in configs {
        let patterns = routes.patterns_for_sink(name);
        let (name, cfg, base_dir) = (name.clone(), cfg.clone(), base_dir.to_path_buf());
        let build: starting::Build = Box::new(move || {
            Box::pin(build_one(
                name.clone(),
                cfg.clone(),
                patterns.clone(),
                base_dir.clone(),
                publish_timeout,
            ))
        });
        attempts.push(build);
    }
    let first = futures::future::join_all(
        attempts
            .iter()
            .map(|build| tokio::time::timeout(START_WAIT, build())),
    )
    .await;
    let mut sinks: BTreeMap<String, Arc<dyn Sink>> = BTreeMap::new();
    for ((name, build), result) in configs.keys().zip(attempts).zip(first) {
        let sink = match result {
            Ok(Ok(sink)) => sink,
            Ok(Err(e)) if e.is::<BadSetting>() => return Err(e),
            Ok(Err(e)) => starting::StartingSink::spawn(name, &e, build),
            Err(_) => starting::StartingSink::spawn(
                name,
                &anyhow::anyhow!("not connected within {}s", START_WAIT.as_secs()),
                build,
            ),
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
