//! Kafka sink (rdkafka over a bundled librdkafka): idempotent producer with
//! the gapless guarantee, `acks=all`, at most 5 requests in flight per
//! connection, per-message key/partition/headers. A send resolves on the
//! delivery report, so many messages are in flight at once while each event
//! still waits for its own acknowledgement.
//!
//! Ordering: messages of one key go to one partition in send order. The
//! idempotent producer keeps that order across retries, and with
//! `enable.gapless.guarantee` a message that fails after a later one of the
//! same partition was written makes the producer fatal instead of leaving a
//! silent gap; the sink then starts a new producer (a new
//! [`Sink::session`]), and the pipeline counts any event acknowledged after
//! an earlier event of its aggregate failed as an order risk. `options` may
//! not weaken any of this: see [`PROTECTED_OPTIONS`].

use std::time::Duration;

use anyhow::{Context, Result};
use rdkafka::ClientConfig;
use rdkafka::client::ClientContext;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use rdkafka::producer::DeliveryFuture;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::{Ack, Outgoing, Permit, PublishError, Sink};
use crate::config::KafkaSinkConfig;

pub use crate::config::KAFKA_PROTECTED_OPTIONS as PROTECTED_OPTIONS;

/// The producer type: librdkafka with our [`SinkContext`].
type KafkaProducer = FutureProducer<SinkContext>;

/// librdkafka's client context for a sink: remembers the last
/// connection-level error librdkafka reported (TLS handshake, SASL, broker
/// down), so start-up can say why the brokers cannot be used instead of
/// retrying silently.
#[derive(Clone, Default)]
pub struct SinkContext {
    last_error: Arc<Mutex<Option<LastError>>>,
}

/// An error librdkafka reported: its code (if any) and text.
type LastError = (Option<RDKafkaErrorCode>, String);

impl ClientContext for SinkContext {
    fn error(&self, error: KafkaError, reason: &str) {
        tracing::warn!(target: "librdkafka", "librdkafka: {error}: {reason}");
        self.remember(error.rdkafka_error_code(), reason);
    }

    /// librdkafka reports a failed TLS handshake or SASL exchange in its log
    /// (the error callback only says the broker is down): keep those too.
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, fac: &str, message: &str) {
        use rdkafka::config::RDKafkaLogLevel as L;
        match level {
            L::Emerg | L::Alert | L::Critical | L::Error => {
                tracing::error!(target: "librdkafka", "librdkafka: {fac} {message}")
            }
            L::Warning => tracing::warn!(target: "librdkafka", "librdkafka: {fac} {message}"),
            L::Notice | L::Info => {
                tracing::info!(target: "librdkafka", "librdkafka: {fac} {message}")
            }
            L::Debug => tracing::debug!(target: "librdkafka", "librdkafka: {fac} {message}"),
        }
        if is_config_error(None, message) {
            self.remember(None, message);
        }
    }
}

impl SinkContext {
    fn remember(&self, code: Option<RDKafkaErrorCode>, reason: &str) {
        let mut slot = match self.last_error.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        };
        // A TLS or SASL failure explains the "all brokers down" after it.
        if slot.as_ref().is_some_and(|(c, r)| is_config_error(*c, r))
            && !is_config_error(code, reason)
        {
            return;
        }
        *slot = Some((code, reason.to_string()));
    }

    fn last_error(&self) -> Option<LastError> {
        match self.last_error.lock() {
            Ok(g) => g.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }
}

/// Errors no retry fixes: the configuration (certificate, credentials) is
/// wrong for these brokers.
fn is_config_error(code: Option<RDKafkaErrorCode>, reason: &str) -> bool {
    use RDKafkaErrorCode as C;
    matches!(
        code,
        Some(C::SSL | C::Authentication | C::SaslAuthenticationFailed)
    ) || reason.contains("SSL handshake failed")
        || reason.contains("SSL routines")
        || reason.contains("SASL")
        || reason.contains("Authentication")
}

/// What [`KafkaSink::reach`] found: the cluster's brokers and topics.
struct Cluster {
    brokers: usize,
    topics: Vec<String>,
}

/// Why [`KafkaSink::reach`] got no metadata.
enum Unreached {
    /// The brokers refused this client's configuration (TLS, SASL).
    Refused(String),
    /// No broker answered (down, unreachable, wrong address).
    Down(String),
}

pub struct KafkaSink {
    name: String,
    /// Replaced when librdkafka reports a fatal error (e.g. the idempotent
    /// producer lost its sequence after a broker stall): a fatal producer
    /// never recovers on its own.
    producer: RwLock<KafkaProducer>,
    client_config: ClientConfig,
    context: SinkContext,
    /// Set when the broker stopped accepting this producer's identity.
    reset: Arc<AtomicBool>,
    /// How many times the producer was replaced ([`Sink::session`]).
    generation: AtomicU64,
    in_flight: Arc<Semaphore>,
}

/// A message librdkafka has queued; resolves on its delivery report.
pub struct PendingAck {
    delivery: DeliveryFuture,
    reset: Arc<AtomicBool>,
    sink: String,
    topic: String,
    _permit: Option<OwnedSemaphorePermit>,
}

impl PendingAck {
    pub async fn wait(self) -> Result<(), PublishError> {
        match self.delivery.await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err((e, _))) => {
                if fences_producer(&e) {
                    self.reset.store(true, Ordering::Relaxed);
                }
                Err(classify(&self.sink, &self.topic, e))
            }
            Err(_) => Err(PublishError::Unavailable(format!(
                "kafka sink `{}`: producer went away",
                self.sink
            ))),
        }
    }
}

/// Errors after which the broker will not take more from this producer
/// identity (idempotent sequence lost after a stall): only a new producer
/// helps.
fn fences_producer(e: &KafkaError) -> bool {
    use RDKafkaErrorCode as C;
    matches!(
        e.rdkafka_error_code(),
        Some(
            C::ProducerFenced
                | C::InvalidProducerEpoch
                | C::UnknownProducerId
                | C::OutOfOrderSequenceNumber
        )
    )
}

impl KafkaSink {
    pub fn build(name: &str, c: &KafkaSinkConfig, publish_timeout: Duration) -> Result<Self> {
        let mut cc = ClientConfig::new();
        cc.set("bootstrap.servers", &c.brokers)
            .set("enable.idempotence", "true")
            .set("enable.gapless.guarantee", "true")
            .set("acks", "all")
            // Ordering with idempotence needs ≤ 5 in flight per connection.
            .set("max.in.flight.requests.per.connection", "5")
            .set("linger.ms", c.linger_ms.max(1).to_string())
            // librdkafka drops the bootstrap connection after the first
            // metadata and may connect to the broker it named only after
            // `reconnect.backoff.ms / 2`; a first produce queued before that
            // can wait ~500 ms for the idempotent producer's id (measured
            // here). 10 ms gets the id before the first batch; reconnects
            // still back off exponentially to `reconnect.backoff.max.ms`.
            .set("reconnect.backoff.ms", "10")
            .set("compression.type", &c.compression)
            .set(
                "message.timeout.ms",
                publish_timeout.as_millis().to_string(),
            )
            .set(
                "message.max.bytes",
                (c.max_message_bytes + 64 * 1024).to_string(),
            )
            .set(
                "queue.buffering.max.messages",
                (c.max_in_flight * 2).max(1000).to_string(),
            );
        for (k, v) in &c.options {
            if let Some((_, why)) = PROTECTED_OPTIONS.iter().find(|(p, _)| p == k) {
                anyhow::bail!("sinks.{name}.options.\"{k}\": outroute sets this itself ({why})");
            }
            cc.set(k, v);
        }
        secure(&mut cc, c);
        let context = SinkContext::default();
        let producer: KafkaProducer = cc
            .create_with_context(context.clone())
            .with_context(|| format!("sinks.{name}: cannot create the Kafka producer"))?;
        Ok(KafkaSink {
            name: name.to_string(),
            producer: RwLock::new(producer),
            client_config: cc,
            context,
            reset: Arc::new(AtomicBool::new(false)),
            generation: AtomicU64::new(0),
            in_flight: Arc::new(Semaphore::new(c.max_in_flight.max(1))),
        })
    }

    /// Queue one message (waiting while librdkafka's queue is full); the
    /// delivery report comes later. `permit` is this message's in-flight
    /// slot, held until the report arrives.
    async fn queue(
        &self,
        m: Outgoing<'_>,
        permit: Option<OwnedSemaphorePermit>,
    ) -> Result<PendingAck, PublishError> {
        let mut headers = OwnedHeaders::new_with_capacity(m.headers.len());
        for (k, v) in m.headers {
            headers = headers.insert(Header {
                key: k,
                value: Some(v.as_bytes()),
            });
        }
        let mut record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(m.topic)
            .payload(m.payload)
            .headers(headers);
        if let Some(k) = m.key {
            record = record.key(k);
        }
        if let Some(p) = m.partition {
            record = record.partition(p);
        }
        let producer = self.healthy_producer();
        let delivery = loop {
            match producer.send_result(record) {
                Ok(d) => break d,
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r)) => {
                    record = r;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Err((e, _)) => return Err(classify(&self.name, m.topic, e)),
            }
        };
        Ok(PendingAck {
            delivery,
            reset: self.reset.clone(),
            sink: self.name.clone(),
            topic: m.topic.to_string(),
            _permit: permit,
        })
    }

    /// Start-up check: reach the brokers. A TLS or SASL failure (wrong CA,
    /// client certificate refused, bad credentials, a server that does not
    /// speak SASL) is an error naming the sink; brokers that are merely down
    /// are an outage — the relay starts and waits for them.
    pub async fn verify(&self) -> Result<()> {
        match self.reach(Duration::from_secs(5)).await {
            Ok(_) => Ok(()),
            Err(Unreached::Refused(reason)) => Err(self.refused(&reason)),
            Err(Unreached::Down(why)) => {
                tracing::warn!(sink = %self.name, "Kafka brokers not reachable yet ({why}); publishing waits for them");
                Ok(())
            }
        }
    }

    /// `outroute config check --sinks`: reach the brokers as [`Self::verify`]
    /// does, but brokers that are down are an error too; then, for each
    /// topic pattern the routes allow on this sink, which existing topics
    /// it matches (a message to a topic that does not exist fails its event,
    /// unless the cluster creates topics on first use). What was found, one
    /// line each, or a problem.
    pub async fn check(&self, brokers: &str, patterns: &[String]) -> Vec<Result<String>> {
        let cluster = match self.reach(Duration::from_secs(5)).await {
            Ok(c) => c,
            Err(Unreached::Refused(reason)) => return vec![Err(self.refused(&reason))],
            Err(Unreached::Down(why)) => {
                return vec![Err(anyhow::anyhow!(
                    "sinks.{}: no Kafka broker at {brokers} answered within 5 s ({why})",
                    self.name
                ))];
            }
        };
        let mut found = vec![Ok(format!(
            "sinks.{}: reached {brokers} ({} broker{} in the cluster)",
            self.name,
            cluster.brokers,
            if cluster.brokers == 1 { "" } else { "s" }
        ))];
        let patterns: std::collections::BTreeSet<&String> = patterns.iter().collect();
        for pattern in patterns {
            let matcher = match crate::pattern::topic_matcher(pattern) {
                Ok(m) => m,
                Err(e) => {
                    found.push(Err(anyhow::anyhow!("sinks.{}: {e}", self.name)));
                    continue;
                }
            };
            let matching: Vec<&str> = cluster
                .topics
                .iter()
                .filter(|t| matcher.is_match(crate::pattern::topic_key(t)))
                .map(String::as_str)
                .collect();
            found.push(Ok(match matching.len() {
                0 => format!(
                    "sinks.{}: no topic matches `{pattern}` yet: create the topics first, or messages \
                     to them fail their events (unless the cluster creates topics on first use)",
                    self.name
                ),
                k => format!(
                    "sinks.{}: `{pattern}` matches {k} topic{} ({}{})",
                    self.name,
                    if k == 1 { "" } else { "s" },
                    matching[..k.min(3)].join(", "),
                    if k > 3 { ", …" } else { "" }
                ),
            }));
        }
        found
    }

    /// The brokers refused this client's TLS or SASL settings.
    fn refused(&self, reason: &str) -> anyhow::Error {
        anyhow::anyhow!(
            "sinks.{}: cannot use the Kafka brokers: {reason} (check sinks.{0}.tls and sinks.{0}.sasl)",
            self.name
        )
    }

    /// Fetch the cluster's metadata, trying for up to `within`: its
    /// brokers and topics, or why not.
    async fn reach(&self, within: Duration) -> Result<Cluster, Unreached> {
        let started = std::time::Instant::now();
        while started.elapsed() < within {
            let p = self.healthy_producer();
            let cluster = tokio::task::spawn_blocking(move || {
                p.client()
                    .fetch_metadata(None, Duration::from_millis(500))
                    .map(|m| Cluster {
                        brokers: m.brokers().len(),
                        topics: m.topics().iter().map(|t| t.name().to_string()).collect(),
                    })
                    .ok()
            })
            .await
            .ok()
            .flatten();
            if let Some(cluster) = cluster {
                return Ok(cluster);
            }
            if let Some((code, reason)) = self.context.last_error()
                && is_config_error(code, &reason)
            {
                return Err(Unreached::Refused(reason));
            }
        }
        Err(Unreached::Down(
            self.context
                .last_error()
                .map(|(_, r)| r)
                .unwrap_or_else(|| "no answer".into()),
        ))
    }

    /// The current producer, replaced first if librdkafka declared it dead.
    fn healthy_producer(&self) -> KafkaProducer {
        let generation = self.generation.load(Ordering::Acquire);
        let current = match self.producer.read() {
            Ok(p) => p.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        };
        let fatal = current.client().fatal_error();
        if fatal.is_none() && !self.reset.swap(false, Ordering::Relaxed) {
            return current;
        }
        let mut slot = match self.producer.write() {
            Ok(p) => p,
            Err(poisoned) => poisoned.into_inner(),
        };
        // Another worker saw the same fatal error and replaced it already.
        if self.generation.load(Ordering::Acquire) != generation {
            return slot.clone();
        }
        tracing::warn!(sink = %self.name, ?fatal, "the broker no longer accepts this Kafka producer; creating a new one");
        match self
            .client_config
            .create_with_context::<SinkContext, KafkaProducer>(self.context.clone())
        {
            Ok(fresh) => {
                let old = std::mem::replace(&mut *slot, fresh.clone());
                self.generation.fetch_add(1, Ordering::AcqRel);
                drop(slot);
                // Dropping the last handle flushes (blocking): not on a
                // runtime thread, not under the lock.
                let old = (old, current);
                match tokio::runtime::Handle::try_current() {
                    Ok(h) => {
                        h.spawn_blocking(move || drop(old));
                    }
                    Err(_) => drop(old),
                }
                fresh
            }
            Err(e) => {
                tracing::error!(sink = %self.name, "cannot recreate the Kafka producer: {e}");
                current
            }
        }
    }
}

/// librdkafka's TLS and SASL settings from `tls` and `sasl`.
pub(super) fn secure(cc: &mut ClientConfig, c: &KafkaSinkConfig) {
    let protocol = match (&c.tls, &c.sasl) {
        (None, None) => return,
        (Some(_), None) => "ssl",
        (None, Some(_)) => "sasl_plaintext",
        (Some(_), Some(_)) => "sasl_ssl",
    };
    cc.set("security.protocol", protocol);
    if let Some(t) = &c.tls {
        if let Some(ca) = &t.ca_file {
            cc.set("ssl.ca.location", ca.display().to_string());
        }
        if let (Some(cert), Some(key)) = (&t.cert_file, &t.key_file) {
            cc.set("ssl.certificate.location", cert.display().to_string())
                .set("ssl.key.location", key.display().to_string());
        }
        if t.insecure_skip_verify {
            // The explicit opt-in (warned about at start and by `config check`).
            cc.set("enable.ssl.certificate.verification", "false")
                .set("ssl.endpoint.identification.algorithm", "none");
        }
    }
    if let Some(s) = &c.sasl {
        cc.set("sasl.mechanism", s.mechanism.librdkafka())
            .set("sasl.username", &s.username)
            .set(
                "sasl.password",
                s.password.as_ref().map(|p| p.expose()).unwrap_or_default(),
            );
    }
}

#[async_trait::async_trait]
impl Sink for KafkaSink {
    fn in_flight(&self) -> Option<&Arc<Semaphore>> {
        Some(&self.in_flight)
    }

    async fn send(&self, m: Outgoing<'_>, permit: Permit) -> Result<Ack, PublishError> {
        let pending = self.queue(m, permit).await?;
        Ok(Ack::new(pending.wait()))
    }

    fn session(&self) -> u64 {
        self.generation.load(Ordering::Relaxed)
    }

    /// Purge librdkafka's queues (not what is already in flight). This
    /// affects every batch queued on the producer: their purged messages
    /// fail as unavailable and are retried.
    async fn abandon(&self) {
        let p = self.healthy_producer();
        let _ = tokio::task::spawn_blocking(move || {
            p.purge(rdkafka::producer::PurgeConfig::default().queue())
        })
        .await;
    }

    async fn connected(&self) -> bool {
        let p = self.healthy_producer();
        tokio::task::spawn_blocking(move || {
            p.client()
                .fetch_metadata(None, Duration::from_secs(2))
                .is_ok()
        })
        .await
        .unwrap_or(false)
    }

    async fn flush(&self) {
        let p = self.healthy_producer();
        let _ = tokio::task::spawn_blocking(move || p.flush(Duration::from_secs(5))).await;
    }
}

/// Permanent when the broker said the message itself can never succeed;
/// unavailable when the cluster could not be reached or did not answer;
/// retryable otherwise.
fn classify(sink: &str, topic: &str, e: KafkaError) -> PublishError {
    use RDKafkaErrorCode as C;
    let code = e.rdkafka_error_code();
    let reason = format!("kafka sink `{sink}`, topic `{topic}`: {e}");
    match code {
        Some(
            C::MessageSizeTooLarge
            | C::InvalidMessageSize
            | C::InvalidMessage
            | C::TopicAuthorizationFailed
            | C::ClusterAuthorizationFailed
            | C::InvalidTopic
            | C::UnknownTopic
            | C::UnknownPartition
            | C::InvalidRecord
            | C::UnsupportedCompressionType,
        ) => PublishError::Permanent(reason),
        Some(
            C::MessageTimedOut
            | C::AllBrokersDown
            | C::BrokerTransportFailure
            | C::RequestTimedOut
            | C::NetworkException
            | C::LeaderNotAvailable
            | C::NotLeaderForPartition
            | C::NotEnoughReplicas
            | C::NotEnoughReplicasAfterAppend
            | C::QueueFull
            | C::Fatal
            | C::PurgeQueue
            | C::PurgeInflight
            | C::ProducerFenced
            | C::InvalidProducerEpoch
            | C::UnknownProducerId
            | C::OutOfOrderSequenceNumber,
        ) => PublishError::Unavailable(reason),
        _ => PublishError::Retryable(reason),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_and_auth_errors_are_permanent() {
        let e = KafkaError::MessageProduction(RDKafkaErrorCode::MessageSizeTooLarge);
        assert!(
            matches!(classify("k", "t", e), PublishError::Permanent(r) if r.contains("topic `t`"))
        );
        let e = KafkaError::MessageProduction(RDKafkaErrorCode::TopicAuthorizationFailed);
        assert!(matches!(classify("k", "t", e), PublishError::Permanent(_)));
        let e = KafkaError::MessageProduction(RDKafkaErrorCode::MessageTimedOut);
        assert!(matches!(
            classify("k", "t", e),
            PublishError::Unavailable(_)
        ));
    }
}
