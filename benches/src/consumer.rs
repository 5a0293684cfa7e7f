//! The benchmark's stopwatch at the far end: an independent consumer that
//! reads what the relay published from the broker, as a downstream service
//! would, and says when the last of `n` distinct events (by header `ce_id`)
//! arrived. A drain's figure is relay start → that instant, so nothing the
//! relay counts about itself (its published counter moves at the ack,
//! before the mark) can flatter it. A consumer that misses its deadline
//! fails the run.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use outroute_e2e::{KAFKA, NATS};

/// Read Kafka `topic` (partitions `0..partitions`) from the beginning until
/// `n` distinct events (by header `id_header`) arrived: the instant the
/// last one did.
pub fn kafka_last_arrival(
    topic: &str,
    partitions: i32,
    id_header: &str,
    n: usize,
    deadline: Instant,
) -> Result<Instant> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::message::{Headers, Message};
    let c: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", KAFKA)
        .set("group.id", format!("bench-clock-{}", outroute_e2e::tag()))
        .set("enable.auto.commit", "false")
        .set("fetch.wait.max.ms", "10")
        .create()?;
    let mut tpl = rdkafka::TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition_offset(topic, p, rdkafka::Offset::Beginning)?;
    }
    c.assign(&tpl)?;
    let mut ids: HashSet<Vec<u8>> = HashSet::with_capacity(n);
    while Instant::now() < deadline {
        match c.poll(Duration::from_millis(50)) {
            Some(Ok(m)) => {
                let id = m.headers().and_then(|h| {
                    h.iter()
                        .find(|x| x.key == id_header)
                        .and_then(|x| x.value.map(<[u8]>::to_vec))
                });
                if let Some(id) = id
                    && ids.insert(id)
                    && ids.len() >= n
                {
                    return Ok(Instant::now());
                }
            }
            Some(Err(e)) => eprintln!("   bench consumer: {e}"),
            None => {}
        }
    }
    bail!(
        "the consumer read {} of {n} events from {topic} before its deadline",
        ids.len()
    )
}

/// Read JetStream stream `stream` from its first message until `n`
/// distinct events arrived: the instant the last one did.
pub async fn nats_last_arrival(stream: String, n: usize, deadline: Instant) -> Result<Instant> {
    use futures::StreamExt;
    let js = async_nats::jetstream::new(async_nats::connect(NATS).await?);
    let consumer = js
        .get_stream(&stream)
        .await?
        .create_consumer(async_nats::jetstream::consumer::pull::OrderedConfig {
            deliver_policy: async_nats::jetstream::consumer::DeliverPolicy::All,
            ..Default::default()
        })
        .await?;
    let mut messages = consumer.messages().await?;
    let mut ids: HashSet<String> = HashSet::with_capacity(n);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        match tokio::time::timeout(left, messages.next()).await {
            Ok(Some(Ok(m))) => {
                let id = m
                    .headers
                    .as_ref()
                    .and_then(|h| h.get("ce_id"))
                    .map(|v| v.to_string());
                if let Some(id) = id
                    && ids.insert(id)
                    && ids.len() >= n
                {
                    return Ok(Instant::now());
                }
            }
            Ok(Some(Err(e))) => bail!("bench consumer on {stream}: {e}"),
            Ok(None) | Err(_) => break,
        }
    }
    bail!(
        "the consumer read {} of {n} events from stream {stream} before its deadline",
        ids.len()
    )
}

/// Start the consumer of a drain's route (`b<t>.order-created` on Kafka,
/// stream `B<t>` on JetStream) before the relay starts.
pub fn start(
    sink: &str,
    t: &str,
    n: usize,
    deadline: Instant,
) -> tokio::task::JoinHandle<Result<Instant>> {
    if sink == "kafka" {
        let topic = format!("b{t}.order-created");
        let partitions = crate::PARTITIONS.load(std::sync::atomic::Ordering::Relaxed);
        tokio::task::spawn_blocking(move || {
            kafka_last_arrival(&topic, partitions, "ce_id", n, deadline)
        })
    } else {
        tokio::spawn(nats_last_arrival(format!("B{t}"), n, deadline))
    }
}
