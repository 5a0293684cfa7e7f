//! Reading back what a topic holds, for `outroute reconcile`
//! (`ops/reconcile.rs`): every message of a window with its envelope
//! ([`Held`]) and place (Kafka partition and offset, JetStream stream
//! sequence). Readers of their own with the sinks' connection settings;
//! they commit no consumer offsets and create nothing that lasts.

use std::time::Duration;

use anyhow::{Context, Result};
use async_nats::jetstream;
use chrono::{DateTime, Utc};
use rdkafka::ClientConfig;

use crate::config::{KafkaSinkConfig, NatsSinkConfig, redact_url, scrub};

/// One message as read back from a topic.
#[derive(Debug, Clone)]
pub struct Held {
    /// Kafka partition (JetStream: 0).
    pub partition: i32,
    /// Offset (JetStream: stream sequence).
    pub offset: i64,
    pub event_id: String,
    pub source: String,
    pub aggregate: String,
    pub seq: Option<i64>,
    pub time: Option<DateTime<Utc>>,
}

impl Held {
    /// From a message's headers (name, value).
    pub fn from_headers<'a>(
        partition: i32,
        offset: i64,
        headers: impl IntoIterator<Item = (&'a str, &'a [u8])>,
    ) -> Held {
        use crate::event::ce;
        let mut h = Held {
            partition,
            offset,
            event_id: String::new(),
            source: String::new(),
            aggregate: String::new(),
            seq: None,
            time: None,
        };
        let (mut at, mut ai) = (String::new(), String::new());
        for (k, v) in headers {
            let v = String::from_utf8_lossy(v);
            match k {
                ce::ID => h.event_id = v.into_owned(),
                ce::SOURCE => h.source = v.into_owned(),
                ce::AGGREGATE_TYPE => at = v.into_owned(),
                ce::AGGREGATE_ID => ai = v.into_owned(),
                ce::SEQUENCE => h.seq = v.trim().parse().ok(),
                ce::TIME => {
                    h.time = DateTime::parse_from_rfc3339(&v)
                        .ok()
                        .map(|t| t.with_timezone(&Utc))
                }
                _ => {}
            }
        }
        h.aggregate = format!("{at}/{ai}");
        h
    }
}

/// Read back what `topic` holds from `since` (by message timestamp) to the
/// end of each partition, or to its first message stamped after `until`
/// (a busy topic has no end to wait for), for `outroute reconcile`: every
/// message's envelope, partition and offset. A consumer of its own (no
/// group offsets are committed), with the sink's connection settings.
pub fn kafka(
    c: &KafkaSinkConfig,
    topic: &str,
    since: DateTime<Utc>,
    until: DateTime<Utc>,
) -> Result<Vec<Held>> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::message::Headers;
    use rdkafka::{Message, Offset, TopicPartitionList};
    let wait = Duration::from_secs(10);
    let mut cc = ClientConfig::new();
    cc.set("bootstrap.servers", &c.brokers)
        .set(
            "group.id",
            format!("outroute-reconcile-{}", uuid::Uuid::new_v4()),
        )
        .set("enable.auto.commit", "false");
    super::kafka::secure(&mut cc, c);
    let consumer: BaseConsumer = cc.create().context("creating a Kafka consumer")?;
    let md = consumer
        .fetch_metadata(Some(topic), wait)
        .with_context(|| format!("reading topic `{topic}`'s metadata"))?;
    let t = md
        .topics()
        .iter()
        .find(|t| t.name() == topic)
        .ok_or_else(|| anyhow::anyhow!("topic `{topic}` is not there"))?;
    if let Some(e) = t.error() {
        anyhow::bail!("topic `{topic}`: {e:?}");
    }
    let mut at = TopicPartitionList::new();
    for p in t.partitions() {
        at.add_partition_offset(topic, p.id(), Offset::Offset(since.timestamp_millis()))?;
    }
    let starts = consumer
        .offsets_for_times(at, wait)
        .with_context(|| format!("finding topic `{topic}`'s offsets at {since}"))?;
    let mut assign = TopicPartitionList::new();
    let mut open: std::collections::HashMap<i32, i64> = std::collections::HashMap::new();
    for e in starts.elements() {
        let (_, high) = consumer.fetch_watermarks(topic, e.partition(), wait)?;
        // No message at or after `since` in this partition: nothing to read.
        let Offset::Offset(start) = e.offset() else {
            continue;
        };
        if start < high {
            assign.add_partition_offset(topic, e.partition(), Offset::Offset(start))?;
            open.insert(e.partition(), high);
        }
    }
    let mut out = Vec::new();
    if open.is_empty() {
        return Ok(out);
    }
    consumer.assign(&assign)?;
    // A partition is read when it passed a message stamped after `until`,
    // or when a second passed without a message from it and its position
    // is at least its high watermark. Not at the watermark alone: tansu's
    // can lag what it acknowledged and what a fetch returns (seen: a
    // partition's last 6–200 messages past it), nor at librdkafka's
    // end-of-partition event, which follows the fetch's own watermark.
    let until_ms = until.timestamp_millis();
    let started = std::time::Instant::now();
    let mut heard: std::collections::HashMap<i32, std::time::Instant> =
        open.keys().map(|p| (*p, started)).collect();
    let mut last_check = started;
    loop {
        match consumer.poll(Duration::from_millis(100)) {
            Some(Err(e)) => return Err(anyhow::anyhow!("reading topic `{topic}`: {e}")),
            Some(Ok(m)) => {
                let p = m.partition();
                if !open.contains_key(&p) {
                    continue;
                }
                heard.insert(p, std::time::Instant::now());
                if m.timestamp().to_millis().is_some_and(|t| t > until_ms) {
                    open.remove(&p);
                    let mut done = TopicPartitionList::new();
                    done.add_partition(topic, p);
                    consumer.pause(&done)?;
                    if open.is_empty() {
                        break;
                    }
                    continue;
                }
                let headers: Vec<(&str, &[u8])> = m
                    .headers()
                    .map(|h| {
                        h.iter()
                            .map(|h| (h.key, h.value.unwrap_or_default()))
                            .collect()
                    })
                    .unwrap_or_default();
                out.push(Held::from_headers(p, m.offset(), headers));
            }
            None => {}
        }
        // Quiet partitions: done once at their watermark.
        if last_check.elapsed() < Duration::from_millis(500) {
            continue;
        }
        last_check = std::time::Instant::now();
        let quiet: Vec<i32> = open
            .keys()
            .filter(|p| {
                heard
                    .get(p)
                    .is_none_or(|t| t.elapsed() >= Duration::from_secs(1))
            })
            .copied()
            .collect();
        if quiet.is_empty() {
            continue;
        }
        let at = consumer.position()?;
        for p in quiet {
            let high = open.get(&p).copied().unwrap_or(0);
            let (_, now_high) = consumer.fetch_watermarks(topic, p, wait)?;
            let pos = at
                .find_partition(topic, p)
                .and_then(|e| match e.offset() {
                    Offset::Offset(o) => Some(o),
                    _ => None,
                })
                .unwrap_or(0);
            if pos >= high.max(now_high) {
                open.remove(&p);
            } else if heard
                .get(&p)
                .is_some_and(|t| t.elapsed() > Duration::from_secs(30))
            {
                anyhow::bail!(
                    "topic `{topic}` partition {p}: no message for 30 s before its end (position {pos}, high watermark {})",
                    high.max(now_high)
                );
            }
        }
        if open.is_empty() {
            break;
        }
    }
    Ok(out)
}

/// Read back what the JetStream stream holding `subject` has of it from
/// `since` (by the message's stream time) to its last message now, for
/// `outroute reconcile`: every message's envelope and stream sequence.
pub async fn jetstream(
    name: &str,
    c: &NatsSinkConfig,
    subject: &str,
    since: DateTime<Utc>,
) -> Result<Vec<Held>> {
    use futures::StreamExt;
    let client = super::nats::connect_options(name, c, Duration::from_secs(10))
        .await?
        .connect(&c.url)
        .await
        .map_err(|e| {
            anyhow::anyhow!(
                "connecting to {}: {}",
                redact_url(&c.url),
                scrub(&e.to_string(), &c.url)
            )
        })?;
    let ctx = jetstream::new(client);
    let stream_name = ctx
        .stream_by_subject(subject)
        .await
        .map_err(|e| anyhow::anyhow!("no JetStream stream holds `{subject}`: {e}"))?;
    let mut stream = ctx.get_stream(&stream_name).await?;
    let last = stream.info().await?.state.last_sequence;
    let start = time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(
        since.timestamp_nanos_opt().unwrap_or(0),
    ))
    .map_err(|e| anyhow::anyhow!("start time {since}: {e}"))?;
    let mut consumer = stream
        .create_consumer(jetstream::consumer::pull::OrderedConfig {
            filter_subject: subject.to_string(),
            deliver_policy: jetstream::consumer::DeliverPolicy::ByStartTime { start_time: start },
            ..Default::default()
        })
        .await?;
    let mut out = Vec::new();
    // Nothing of the subject from the start time on.
    if consumer.info().await?.num_pending == 0 {
        return Ok(out);
    }
    let mut messages = consumer.messages().await?;
    loop {
        let next = tokio::time::timeout(Duration::from_secs(3), messages.next()).await;
        let m = match next {
            // Nothing more within 3 s: the subject has no message left
            // before the stream's last one.
            Err(_) | Ok(None) => break,
            Ok(Some(m)) => m.map_err(|e| anyhow::anyhow!("reading `{subject}`: {e}"))?,
        };
        let (seq, pending) = m
            .info()
            .map(|i| (i.stream_sequence, i.pending))
            .unwrap_or((0, 1));
        let headers: Vec<(&str, &[u8])> = m
            .headers
            .as_ref()
            .map(|h| {
                h.iter()
                    .filter_map(|(k, vs)| vs.first().map(|v| (k.as_ref(), v.as_str().as_bytes())))
                    .collect()
            })
            .unwrap_or_default();
        out.push(Held::from_headers(0, seq as i64, headers));
        // The subject's last message now, or the stream's.
        if pending == 0 || seq >= last {
            break;
        }
    }
    Ok(out)
}
