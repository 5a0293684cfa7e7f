//! NATS sink (async-nats). JetStream mode (default) waits for the stream's
//! PubAck and sets `Nats-Msg-Id` so the server drops re-sent duplicates
//! within the stream's duplicate window. Core mode is fire-and-forget
//! (at-most-once) and only used when configured explicitly.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use std::str::FromStr;

use async_nats::HeaderMap;
use async_nats::header::{HeaderName, HeaderValue};
use async_nats::jetstream::{self, context::PublishErrorKind, message::PublishMessage};
use std::sync::Arc;

use async_nats::jetstream::context::PublishAckFuture;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::{Outgoing, PublishError};
use crate::config::{NatsMode, NatsSinkConfig};

pub struct NatsSink {
    name: String,
    client: async_nats::Client,
    js: Option<jetstream::Context>,
    in_flight: Arc<Semaphore>,
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
        self.ack
            .await
            .map(|_| ())
            .map_err(|e| classify(&self.sink, &self.subject, &e))
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
        PublishErrorKind::TimedOut | PublishErrorKind::BrokenPipe => {
            PublishError::Unavailable(reason)
        }
        _ => PublishError::Retryable(reason),
    }
}

impl NatsSink {
    pub async fn build(
        name: &str,
        c: &NatsSinkConfig,
        patterns: &[String],
        publish_timeout: Duration,
    ) -> Result<Self> {
        let client = async_nats::ConnectOptions::new()
            .name(format!("outroute/{name}"))
            .retry_on_initial_connect()
            .connection_timeout(Duration::from_secs(2))
            .request_timeout(Some(publish_timeout))
            .connect(&c.url)
            .await
            .with_context(|| format!("sinks.{name}: cannot connect to {}", c.url))?;
        let js = match c.mode {
            NatsMode::Core => None,
            NatsMode::Jetstream => {
                let mut ctx = jetstream::new(client.clone());
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
            js,
            in_flight: Arc::new(Semaphore::new(c.max_in_flight.max(1))),
        })
    }

    /// Send one message; JetStream's PubAck comes later (core NATS has none).
    pub async fn send(
        &self,
        m: Outgoing<'_>,
        permit: Option<OwnedSemaphorePermit>,
    ) -> Result<super::Ack, PublishError> {
        // Header names and values come from event rows and plugins: check
        // them here (async-nats panics on invalid ones).
        let bad = |what: &str, e: &dyn std::fmt::Display| {
            PublishError::Permanent(format!(
                "nats sink `{}`, subject `{}`: {what}: {e}",
                self.name, m.topic
            ))
        };
        let mut headers = HeaderMap::new();
        for (k, v) in m.headers {
            let name =
                HeaderName::from_str(k).map_err(|e| bad(&format!("header name `{k}`"), &e))?;
            let value =
                HeaderValue::from_str(v).map_err(|e| bad(&format!("value of header `{k}`"), &e))?;
            headers.insert(name, value);
        }
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
                Ok(super::Ack::Nats(PendingAck {
                    ack,
                    sink: self.name.clone(),
                    subject: m.topic.to_string(),
                    _permit: permit,
                }))
            }
            None => self
                .client
                .publish_with_headers(subject, headers, payload)
                .await
                .map(|()| super::Ack::Done)
                .map_err(|e| {
                    PublishError::Unavailable(format!(
                        "nats sink `{}`, subject `{}`: {e}",
                        self.name, m.topic
                    ))
                }),
        }
    }

    pub fn in_flight(&self) -> &Arc<Semaphore> {
        &self.in_flight
    }

    pub fn connected(&self) -> bool {
        self.client.connection_state() == async_nats::connection::State::Connected
    }

    pub async fn flush(&self) {
        let _ = tokio::time::timeout(Duration::from_secs(5), self.client.flush()).await;
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
    #[test]
    fn sample_subjects() {
        assert_eq!(
            super::sample_subject("orders.*.created"),
            "orders.x.created"
        );
        assert_eq!(super::sample_subject("orders.**"), "orders.x");
    }
}
