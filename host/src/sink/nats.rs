//! NATS sink (async-nats). JetStream mode (default) waits for the stream's
//! PubAck and sets `Nats-Msg-Id` so the server drops re-sent duplicates
//! within the stream's duplicate window.
//!
//! Core mode has no acknowledgement: a message counts as delivered once a
//! server round trip issued after it came back (a request nobody answers;
//! the server's "no responders" reply proves it processed everything sent
//! before on the connection). One round trip covers every message sent
//! before it. Beyond the server, core NATS is at-most-once: a subscriber
//! that is not connected never sees the message.
//!
//! Ordering: one connection delivers in send order, but across a reconnect
//! a message written to the dead socket may be lost while a later one, still
//! buffered in the client, is stored. So the pipeline keeps at most one
//! unacknowledged event per aggregate on a NATS sink
//! ([`Sink::keeps_order_in_flight`] is false): different aggregates are
//! still in flight together.

use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::config::{redact_url, scrub};
use std::str::FromStr;

use async_nats::HeaderMap;
use async_nats::header::{HeaderName, HeaderValue};
use async_nats::jetstream::{self, context::PublishErrorKind, message::PublishMessage};
use std::sync::Arc;

use async_nats::jetstream::context::PublishAckFuture;
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::{Ack, Header, Outgoing, Permit, PublishError, Sink};
use crate::config::{NatsMode, NatsSinkConfig};
use crate::event::ENVELOPE;

pub struct NatsSink {
    name: String,
    client: async_nats::Client,
    js: Option<jetstream::Context>,
    headers: HeaderTemplate,
    in_flight: Arc<Semaphore>,
    /// Core mode: messages sent, and messages a server round trip confirmed.
    barrier: Arc<Barrier>,
    timeout: Duration,
}

/// Core NATS delivery confirmation: one round trip at a time, each covering
/// every message sent before it started.
#[derive(Default)]
struct Barrier {
    sent: AtomicU64,
    confirmed: AtomicU64,
    lock: tokio::sync::Mutex<()>,
}

impl Barrier {
    /// Resolve once the server has processed message number `seq`, sent
    /// on connection number `connection`. A round trip on a later
    /// connection proves nothing about it (it may have died with the old
    /// socket): that fails as unavailable and the event is sent again.
    async fn after(
        &self,
        seq: u64,
        connection: u64,
        client: &async_nats::Client,
        timeout: Duration,
        sink: &str,
    ) -> Result<(), PublishError> {
        let reconnected = || client.statistics().connects.load(Ordering::Acquire) != connection;
        let covered = || self.confirmed.load(Ordering::Acquire) >= seq && !reconnected();
        // Covered by a round trip already: no queueing for the lock. (A
        // batch awaits its acks one after the other; had each of them
        // queued behind the round trips other sources' messages wait for,
        // a 500-message batch beside 99 busy sources took 30 s.)
        if covered() {
            return Ok(());
        }
        let _one_at_a_time = self.lock.lock().await;
        if covered() {
            return Ok(());
        }
        let upto = self.sent.load(Ordering::Acquire);
        let ping = client.new_inbox();
        let reply = tokio::time::timeout(timeout, client.request(ping, bytes::Bytes::new())).await;
        use async_nats::RequestErrorKind as K;
        match reply {
            // "No responders" or an answer: either way the server got here.
            Ok(Ok(_)) => {}
            Ok(Err(e)) if e.kind() == K::NoResponders => {}
            Ok(Err(e)) => {
                return Err(PublishError::Unavailable(format!(
                    "nats sink `{sink}`: no server round trip after publishing: {e}"
                )));
            }
            Err(_) => {
                return Err(PublishError::Unavailable(format!(
                    "nats sink `{sink}`: no server round trip within {timeout:?}"
                )));
            }
        }
        if reconnected() {
            return Err(PublishError::Unavailable(format!(
                "nats sink `{sink}`: the connection was replaced after publishing; the message may be lost"
            )));
        }
        self.confirmed.fetch_max(upto, Ordering::AcqRel);
        Ok(())
    }
}

/// Where every message's header block starts. async-nats keeps headers in
/// a SipHash map that starts empty and has no `with_capacity`: filled from
/// scratch for every message, each name was parsed and copied and the map
/// grew three times. The template holds the envelope's names (and
/// `Nats-Msg-Id` under JetStream) with empty values: a clone has room for a
/// message's headers, its names are static, and every value is overwritten
/// before the message goes out (3.4 % fewer instructions on a NATS drain,
/// callgrind).
struct HeaderTemplate {
    map: HeaderMap,
    names: [HeaderName; ENVELOPE.len()],
}

impl HeaderTemplate {
    fn new(jetstream: bool) -> Self {
        let names = ENVELOPE.map(HeaderName::from_static);
        let mut map = HeaderMap::new();
        for name in &names {
            map.insert(name.clone(), HeaderValue::new());
        }
        if jetstream {
            // Set by `PublishMessage::message_id` on every publish.
            map.insert(async_nats::header::NATS_MESSAGE_ID, HeaderValue::new());
        }
        HeaderTemplate { map, names }
    }

    /// The header map of a message with these headers, each checked
    /// (async-nats panics on invalid names and values). From the template
    /// when they begin with the envelope's names, as the pipeline's always
    /// do; from an empty map otherwise.
    fn fill(&self, headers: &[Header<'_>]) -> Result<HeaderMap, (String, String)> {
        let value = |k: &str, v: &str| {
            HeaderValue::from_str(v).map_err(|e| (format!("value of header `{k}`"), e.to_string()))
        };
        let enveloped = headers.len() >= ENVELOPE.len()
            && headers.iter().zip(ENVELOPE).all(|((k, _), e)| *k == e);
        let (mut map, rest) = if enveloped {
            let mut map = self.map.clone();
            for ((k, v), name) in headers.iter().zip(&self.names) {
                map.insert(name.clone(), value(k, v)?);
            }
            (map, &headers[ENVELOPE.len()..])
        } else {
            (HeaderMap::new(), headers)
        };
        for (k, v) in rest {
            let name = HeaderName::from_str(k)
                .map_err(|e| (format!("header name `{k}`"), e.to_string()))?;
            map.insert(name, value(k, v)?);
        }
        Ok(map)
    }
}

/// A JetStream publish sent, awaiting its PubAck.
pub struct PendingAck {
    ack: PublishAckFuture,
    sink: String,
    subject: String,
    _permit: Option<OwnedSemaphorePermit>,
}

impl PendingAck {
    pub async fn wait(self) -> Result<(), PublishError> {
        let ack = self
            .ack
            .await
            .map_err(|e| classify(&self.sink, &self.subject, &e))?;
        if ack.duplicate {
            // Stored before under this id: counted, so a collision (two
            // events with one dedup id) shows beside the crashes that
            // explain ordinary re-sends.
            metrics::counter!(crate::metrics::DUPLICATE_ACKS, "sink" => self.sink.clone())
                .increment(1);
            tracing::info!(sink = %self.sink, subject = %self.subject, "JetStream acknowledged a duplicate (already stored under this Nats-Msg-Id)");
        }
        Ok(())
    }
}

fn classify(
    sink: &str,
    subject: &str,
    e: &async_nats::jetstream::context::PublishError,
) -> PublishError {
    let reason = format!("nats sink `{sink}`, subject `{subject}`: {e}");
    match e.kind() {
        PublishErrorKind::MaxPayloadExceeded => PublishError::Permanent(reason),
        // No stream (being created or re-elected) and back-pressure are the
        // infrastructure's state, not the event's: wait, do not use attempts.
        PublishErrorKind::TimedOut
        | PublishErrorKind::BrokenPipe
        | PublishErrorKind::StreamNotFound
        | PublishErrorKind::MaxAckPending => PublishError::Unavailable(reason),
        _ => PublishError::Retryable(reason),
    }
}

/// Connection options from the sink's config: name, timeouts, TLS and
/// credentials; problems after start-up are logged naming the sink.
pub(super) async fn connect_options(
    name: &str,
    c: &NatsSinkConfig,
    publish_timeout: Duration,
) -> Result<async_nats::ConnectOptions> {
    crate::tls_provider();
    let mut o = async_nats::ConnectOptions::new()
        .name(format!("outroute/{name}"))
        .connection_timeout(Duration::from_secs(2))
        .request_timeout(Some(publish_timeout));
    if let Some(t) = &c.tls {
        o = o.require_tls(true);
        if let Some(ca) = &t.ca_file {
            o = o.add_root_certificates(ca.clone());
        }
        if let (Some(cert), Some(key)) = (&t.cert_file, &t.key_file) {
            o = o.add_client_certificate(cert.clone(), key.clone());
        }
    }
    if let Some(a) = &c.auth {
        if let (Some(user), Some(password)) = (&a.user, &a.password) {
            o = o.user_and_password(user.clone(), password.expose().to_string());
        } else if let Some(token) = &a.token {
            o = o.token(token.expose().to_string());
        } else if let Some(seed) = &a.nkey_seed {
            o = o.nkey(seed.expose().to_string());
        } else if let Some(creds) = &a.creds_file {
            o = o.credentials_file(creds).await.with_context(|| {
                format!(
                    "sinks.{name}.auth.creds_file: {} is not a NATS credentials file",
                    creds.display()
                )
            })?;
        }
    }
    let sink = name.to_string();
    Ok(o.event_callback(move |event| {
        let sink = sink.clone();
        async move {
            use async_nats::Event as E;
            match event {
                E::ServerError(_) | E::ClientError(_) => {
                    tracing::warn!(sink = %sink, "NATS: {event}")
                }
                _ => tracing::debug!(sink = %sink, "NATS: {event}"),
            }
        }
    }))
}

/// Failures no retry fixes: credentials, certificates, the URL itself.
fn is_config_error(e: &async_nats::ConnectError) -> bool {
    use async_nats::ConnectErrorKind as K;
    let text = e.to_string().to_lowercase();
    matches!(
        e.kind(),
        K::Authentication | K::AuthorizationViolation | K::Tls | K::ServerParse
    ) || text.contains("certificate")
        || text.contains("authorization")
}

/// Which key to look at for a connection refused for its configuration.
fn config_hint(name: &str, c: &NatsSinkConfig, e: &async_nats::ConnectError) -> String {
    use async_nats::ConnectErrorKind as K;
    match e.kind() {
        K::Authentication | K::AuthorizationViolation if c.auth.is_none() => {
            format!(" (the server requires credentials: set sinks.{name}.auth)")
        }
        K::Authentication | K::AuthorizationViolation => {
            format!(" (the server refused the credentials in sinks.{name}.auth)")
        }
        _ if e.to_string().to_lowercase().contains("certificate") => format!(
            " (the server's certificate is not trusted{}: check sinks.{name}.tls.ca_file)",
            match c.tls.as_ref().and_then(|t| t.ca_file.as_ref()) {
                Some(ca) => format!(" by {}", ca.display()),
                None => " by the system's roots".into(),
            }
        ),
        K::Tls => format!(" (check sinks.{name}.tls)"),
        _ => String::new(),
    }
}

impl NatsSink {
    pub async fn build(
        name: &str,
        c: &NatsSinkConfig,
        patterns: &[String],
        publish_timeout: Duration,
    ) -> Result<Self> {
        // A first attempt that does not retry tells wrong credentials or an
        // untrusted certificate (refuse to start, naming the sink) from a
        // server that is down (an outage: start, and keep trying).
        let client = match connect_options(name, c, publish_timeout)
            .await?
            .connect(&c.url)
            .await
        {
            Ok(client) => client,
            Err(e) if is_config_error(&e) => bail!(
                "sinks.{name}: cannot connect to {}: {}{}",
                redact_url(&c.url),
                scrub(&e.to_string(), &c.url),
                config_hint(name, c, &e)
            ),
            Err(e) => {
                let e = scrub(&e.to_string(), &c.url);
                tracing::warn!(sink = %name, "NATS server not reachable yet ({e}); publishing waits for it");
                connect_options(name, c, publish_timeout)
                    .await?
                    .retry_on_initial_connect()
                    .connect(&c.url)
                    .await
                    .map_err(|e| {
                        anyhow::anyhow!(
                            "sinks.{name}: cannot connect to {}: {}",
                            redact_url(&c.url),
                            scrub(&e.to_string(), &c.url)
                        )
                    })?
            }
        };
        let js = match c.mode {
            NatsMode::Core => None,
            NatsMode::Jetstream => {
                // Our in-flight limit (`max_in_flight`: a batch that runs
                // out settles its own acks first) must be the one that
                // binds. The client's own (5,000 unawaited acks by default)
                // made two batches of more than half that each wait inside
                // `publish` for slots only their own unawaited acks held,
                // until the ack timeout: a 3-route drain crawled at 10
                // events/s (`scripts/bench --extra-routes 2`).
                let mut ctx = jetstream::context::ContextBuilder::new()
                    .max_ack_inflight(c.max_in_flight.saturating_add(1))
                    .build(client.clone());
                ctx.set_timeout(publish_timeout);
                if let Some(s) = &c.create_stream {
                    ctx.get_or_create_stream(jetstream::stream::Config {
                        name: s.name.clone(),
                        subjects: s.subjects.clone(),
                        duplicate_window: s.duplicate_window,
                        ..Default::default()
                    })
                    .await
                    .with_context(|| {
                        format!(
                            "sinks.{name}.create_stream: cannot create stream `{}`",
                            s.name
                        )
                    })?;
                }
                // Every subject a route may publish to must be captured by a
                // stream, or every publish would fail with "no responders".
                for p in patterns {
                    let sample = sample_subject(p);
                    if let Err(e) = tokio::time::timeout(
                        Duration::from_secs(5),
                        ctx.stream_by_subject(sample.clone()),
                    )
                    .await
                    .map_err(|_| anyhow::anyhow!("timed out"))
                    .and_then(|r| r.map_err(anyhow::Error::from))
                    {
                        // No answer is an outage (publishing waits for the
                        // server); an answer without a stream is a mistake.
                        if format!("{e:#}").contains("timed out") {
                            tracing::warn!(sink = %name, subject = %sample, "could not check the JetStream stream (the server did not answer); publishing waits for it");
                            continue;
                        }
                        bail!(
                            "sinks.{name}: no JetStream stream captures subject `{sample}` (allowed pattern `{p}`): {e}; \
                             create the stream or set sinks.{name}.create_stream"
                        );
                    }
                }
                Some(ctx)
            }
        };
        Ok(NatsSink {
            name: name.to_string(),
            client,
            headers: HeaderTemplate::new(js.is_some()),
            js,
            in_flight: Arc::new(Semaphore::new(c.max_in_flight.max(1))),
            barrier: Arc::new(Barrier::default()),
            timeout: publish_timeout,
        })
    }
}

#[async_trait::async_trait]
impl Sink for NatsSink {
    fn in_flight(&self) -> Option<&Arc<Semaphore>> {
        Some(&self.in_flight)
    }

    fn session(&self) -> u64 {
        self.client.statistics().connects.load(Ordering::Relaxed)
    }

    /// Seen through the fault proxy (`tests/tests/network_faults.rs`): a
    /// publish written to a connection that died is lost while the next
    /// one, still buffered, goes out on the new connection and is stored.
    fn keeps_order_in_flight(&self) -> bool {
        false
    }

    /// Send one message; the acknowledgement (JetStream PubAck, or a core
    /// round trip) comes later.
    async fn send(&self, m: Outgoing<'_>, permit: Permit) -> Result<Ack, PublishError> {
        // Header names and values come from event rows and plugins: check
        // them here (async-nats panics on invalid ones).
        let bad = |what: &str, e: &dyn std::fmt::Display| {
            PublishError::Permanent(format!(
                "nats sink `{}`, subject `{}`: {what}: {e}",
                self.name, m.topic
            ))
        };
        let headers = self
            .headers
            .fill(m.headers)
            .map_err(|(what, e)| bad(&what, &e))?;
        HeaderValue::from_str(m.dedup_id).map_err(|e| bad("message id", &e))?;
        let payload = bytes::Bytes::copy_from_slice(m.payload);
        let subject = m.topic.to_string();
        match &self.js {
            Some(js) => {
                let publish = PublishMessage::build()
                    .payload(payload)
                    .headers(headers)
                    .message_id(m.dedup_id);
                let ack = js
                    .send_publish(subject, publish)
                    .await
                    .map_err(|e| classify(&self.name, m.topic, &e))?;
                Ok(Ack::new(
                    PendingAck {
                        ack,
                        sink: self.name.clone(),
                        subject: m.topic.to_string(),
                        _permit: permit,
                    }
                    .wait(),
                ))
            }
            None => {
                let connection = self.client.statistics().connects.load(Ordering::Acquire);
                self.client
                    .publish_with_headers(subject, headers, payload)
                    .await
                    .map_err(|e| {
                        PublishError::Unavailable(format!(
                            "nats sink `{}`, subject `{}`: {e}",
                            self.name, m.topic
                        ))
                    })?;
                let seq = self.barrier.sent.fetch_add(1, Ordering::AcqRel) + 1;
                let (barrier, client, timeout, sink) = (
                    self.barrier.clone(),
                    self.client.clone(),
                    self.timeout,
                    self.name.clone(),
                );
                Ok(Ack::new(async move {
                    let _permit = permit;
                    barrier
                        .after(seq, connection, &client, timeout, &sink)
                        .await
                }))
            }
        }
    }

    async fn connected(&self) -> bool {
        self.client.connection_state() == async_nats::connection::State::Connected
    }

    async fn flush(&self) {
        let _ = tokio::time::timeout(Duration::from_secs(5), self.client.flush()).await;
    }
}

/// `outroute config check --sinks`: connect as `run` does, once (a server
/// that is down is a problem here, not an outage to wait out), and find the
/// JetStream stream each allowed pattern's subjects go to. Changes
/// nothing: a `create_stream` that does not exist yet is reported (with the
/// patterns it would capture), not created. One finding or problem each.
pub async fn check(
    name: &str,
    c: &NatsSinkConfig,
    patterns: &[String],
    publish_timeout: Duration,
) -> Vec<Result<String>> {
    use jetstream::context::GetStreamByNameErrorKind as StreamByName;
    let client = match connect_options(name, c, publish_timeout).await {
        Ok(o) => o.connect(&c.url).await.map_err(|e| {
            anyhow::anyhow!(
                "sinks.{name}: cannot connect to {}: {}{}",
                redact_url(&c.url),
                scrub(&e.to_string(), &c.url),
                config_hint(name, c, &e)
            )
        }),
        Err(e) => Err(e),
    };
    let client = match client {
        Ok(client) => client,
        Err(e) => return vec![Err(e)],
    };
    let mut found = vec![Ok(format!(
        "sinks.{name}: connected to {}",
        redact_url(&c.url)
    ))];
    if c.mode == NatsMode::Core {
        return found;
    }
    let mut ctx = jetstream::new(client);
    ctx.set_timeout(publish_timeout);
    let mut to_create = None;
    if let Some(s) = &c.create_stream {
        use jetstream::context::GetStreamErrorKind as K;
        match ctx.get_stream(&s.name).await {
            Ok(_) => {}
            Err(e) if matches!(e.kind(), K::JetStream(j) if j.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND) =>
            {
                // The server refuses a stream whose subjects overlap
                // another's: `run` would fail to create it.
                let mut overlap = None;
                for subject in &s.subjects {
                    match ctx.stream_by_subject(subject.clone()).await {
                        Ok(other) => {
                            overlap = Some(format!(
                                "sinks.{name}.create_stream: cannot create stream `{}`: subject `{subject}` \
                                 is already captured by stream `{other}`",
                                s.name
                            ));
                            break;
                        }
                        Err(e) if e.kind() == StreamByName::NotFound => {}
                        Err(e) => {
                            overlap = Some(format!(
                                "sinks.{name}.create_stream: cannot look up subject `{subject}`: {e}"
                            ));
                            break;
                        }
                    }
                }
                match overlap {
                    Some(problem) => found.push(Err(anyhow::anyhow!(problem))),
                    None => {
                        found.push(Ok(format!(
                            "sinks.{name}.create_stream: stream `{}` does not exist yet; `run` creates it",
                            s.name
                        )));
                        to_create = Some(s);
                    }
                }
            }
            Err(e) => found.push(Err(anyhow::anyhow!(
                "sinks.{name}.create_stream: cannot look up stream `{}`: {e}",
                s.name
            ))),
        }
    }
    for p in patterns {
        let sample = sample_subject(p);
        let stream = tokio::time::timeout(
            Duration::from_secs(5),
            ctx.stream_by_subject(sample.clone()),
        )
        .await;
        found.push(match stream {
            Err(_) => Err(anyhow::anyhow!(
                "sinks.{name}: the server did not answer which stream captures `{sample}`"
            )),
            Ok(Ok(stream)) => Ok(format!("sinks.{name}: `{p}` goes to stream `{stream}`")),
            Ok(Err(e))
                if e.kind() == StreamByName::NotFound
                    && to_create
                        .is_some_and(|s| s.subjects.iter().any(|f| subject_matches(f, &sample))) =>
            {
                Ok(format!(
                    "sinks.{name}: `{p}` will go to stream `{}` (created by `run`)",
                    to_create.map(|s| s.name.as_str()).unwrap_or_default()
                ))
            }
            Ok(Err(e)) => Err(anyhow::anyhow!(
                "sinks.{name}: no JetStream stream captures subject `{sample}` (allowed pattern `{p}`): {e}; \
                 create the stream or set sinks.{name}.create_stream"
            )),
        });
    }
    found
}

/// Whether NATS subject filter `filter` (`*` one token, `>` the rest)
/// matches the concrete `subject`.
fn subject_matches(filter: &str, subject: &str) -> bool {
    let mut want = filter.split('.');
    let mut have = subject.split('.');
    loop {
        match (want.next(), have.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(_)) => {}
            (Some(w), Some(h)) if w == h => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

/// A concrete subject matching an allow-list pattern (`*`/`**` → `x`).
fn sample_subject(pattern: &str) -> String {
    pattern
        .split('.')
        .map(|t| if t.contains('*') { "x" } else { t })
        .collect::<Vec<_>>()
        .join(".")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::borrow::Cow;

    fn scratch(headers: &[Header<'_>]) -> HeaderMap {
        headers
            .iter()
            .map(|(k, v)| {
                (
                    HeaderName::from_str(k).unwrap(),
                    HeaderValue::from_str(v).unwrap(),
                )
            })
            .collect()
    }

    #[test]
    fn header_blocks_from_the_template_are_the_message_headers() {
        let mut enveloped: Vec<Header<'_>> = ENVELOPE
            .iter()
            .enumerate()
            .map(|(i, k)| (*k, Cow::Owned(format!("v{i}"))))
            .collect();
        enveloped.push(("traceparent", Cow::Borrowed("00-abc-def-01")));
        enveloped.push(("content-type", Cow::Borrowed("application/json")));
        let core = HeaderTemplate::new(false);
        assert_eq!(core.fill(&enveloped).unwrap(), scratch(&enveloped));
        // Under JetStream the template's `Nats-Msg-Id` is left for
        // `PublishMessage::message_id`; everything else is the message's.
        let js = HeaderTemplate::new(true).fill(&enveloped).unwrap();
        assert_eq!(js.len(), enveloped.len() + 1);
        for (k, v) in &enveloped {
            assert_eq!(js.get(*k).map(HeaderValue::as_str), Some(v.as_ref()), "{k}");
        }
        // Headers that do not start with the envelope: no template entry
        // may be left behind.
        let other: Vec<Header<'_>> =
            vec![("ce_id", Cow::Borrowed("e1")), ("x", Cow::Borrowed("1"))];
        assert_eq!(core.fill(&other).unwrap(), scratch(&other));
        // A bad value is refused, naming the header.
        enveloped[3].1 = Cow::Borrowed("a\r\nb");
        let (what, _) = core.fill(&enveloped).unwrap_err();
        assert_eq!(what, format!("value of header `{}`", ENVELOPE[3]));
    }

    #[test]
    fn sample_subjects() {
        assert_eq!(sample_subject("orders.*.created"), "orders.x.created");
        assert_eq!(sample_subject("orders.**"), "orders.x");
    }

    #[test]
    fn subject_filters() {
        use super::subject_matches as m;
        assert!(m("orders.>", "orders.x.created"));
        assert!(m("orders.*", "orders.x"));
        assert!(!m("orders.*", "orders.x.created"));
        assert!(!m("orders.>", "orders"));
        assert!(m("orders.created", "orders.created"));
        assert!(!m("audit.*", "orders.x"));
    }
}
