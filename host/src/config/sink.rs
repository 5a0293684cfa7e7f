//! `[sinks.<name>]`: the brokers messages go to (Kafka, NATS, file) and
//! the Kafka options no config may change (they keep delivery safe). It
//! never connects: `sink/` does.

use super::*;

/// A destination.
#[derive(PartialEq, Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum SinkConfig {
    Kafka(KafkaSinkConfig),
    Nats(NatsSinkConfig),
    File(FileSinkConfig),
}

impl SinkConfig {
    pub fn max_message_bytes(&self) -> usize {
        match self {
            SinkConfig::Kafka(k) => k.max_message_bytes,
            SinkConfig::Nats(n) => n.max_message_bytes,
            SinkConfig::File(f) => f.max_message_bytes,
        }
    }
}

/// librdkafka settings `sinks.<name>.options` may not set, with what each
/// protects: they are what makes "acknowledged" mean stored and keeps an
/// aggregate's messages in order. `config check` and start-up refuse them.
pub const KAFKA_PROTECTED_OPTIONS: &[(&str, &str)] = &[
    (
        "enable.idempotence",
        "no duplicates or reordering on producer retries",
    ),
    (
        "enable.gapless.guarantee",
        "a failed message never leaves a silent gap before a later one",
    ),
    (
        "acks",
        "an acknowledgement means every in-sync replica has the message",
    ),
    (
        "request.required.acks",
        "an acknowledgement means every in-sync replica has the message",
    ),
    (
        "max.in.flight.requests.per.connection",
        "order with idempotence needs at most 5 requests in flight",
    ),
    (
        "max.in.flight",
        "order with idempotence needs at most 5 requests in flight",
    ),
    (
        "retries",
        "the producer retries in order instead of failing",
    ),
    (
        "message.send.max.retries",
        "the producer retries in order instead of failing",
    ),
    ("message.timeout.ms", "set from relay.publish_timeout"),
    ("delivery.timeout.ms", "set from relay.publish_timeout"),
    ("bootstrap.servers", "set from sinks.<name>.brokers"),
    ("metadata.broker.list", "set from sinks.<name>.brokers"),
    ("partitioner", "one key always goes to one partition"),
    ("security.protocol", "set from sinks.<name>.tls and .sasl"),
    ("sasl.mechanism", "set from sinks.<name>.sasl"),
    ("sasl.mechanisms", "set from sinks.<name>.sasl"),
    ("sasl.username", "set from sinks.<name>.sasl"),
    (
        "sasl.password",
        "set from sinks.<name>.sasl (password_file keeps it out of the file)",
    ),
    ("ssl.ca.location", "set from sinks.<name>.tls.ca_file"),
    (
        "ssl.certificate.location",
        "set from sinks.<name>.tls.cert_file",
    ),
    ("ssl.key.location", "set from sinks.<name>.tls.key_file"),
    (
        "enable.ssl.certificate.verification",
        "the brokers' certificates are verified; a test cluster may opt out with tls.insecure_skip_verify",
    ),
    (
        "ssl.endpoint.identification.algorithm",
        "a broker's certificate must name its host; a test cluster may opt out with tls.insecure_skip_verify",
    ),
];

#[derive(PartialEq, Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct KafkaSinkConfig {
    /// `bootstrap.servers`.
    pub brokers: String,
    /// Largest payload accepted (bytes); larger messages fail their event.
    #[serde(default = "default_max_message_bytes")]
    pub max_message_bytes: usize,
    /// `compression.type` (none, gzip, snappy, lz4). The default, lz4, is
    /// cheap for the relay and cuts what the brokers take in, store and
    /// replicate (1 KB JSON events: a third of the broker's CPU per event
    /// here; see the performance page); every Kafka client reads it.
    #[serde(default = "default_compression")]
    pub compression: String,
    /// `linger.ms`: how long the producer waits to fill a batch.
    #[serde(default = "default_linger_ms")]
    pub linger_ms: u32,
    /// Messages awaiting acknowledgement before publishing waits.
    #[serde(default = "default_max_in_flight")]
    pub max_in_flight: usize,
    /// TLS to the brokers (`security.protocol` `ssl`, or `sasl_ssl` with
    /// `sasl`).
    #[serde(default)]
    pub tls: Option<TlsConfig>,
    /// SASL authentication (PLAIN, SCRAM-SHA-256/512). Without `tls` the
    /// credentials cross the network unencrypted (`sasl_plaintext`).
    #[serde(default)]
    pub sasl: Option<KafkaSaslConfig>,
    /// Any other librdkafka producer setting (tuning), passed
    /// through verbatim. Settings that make an acknowledgement mean "stored,
    /// in order" are refused: `enable.idempotence`, `enable.gapless.guarantee`,
    /// `acks`, `max.in.flight*`, `retries`, `message.timeout.ms`,
    /// `bootstrap.servers`, `partitioner` and their aliases; TLS and SASL
    /// are set from `tls` and `sasl`.
    #[serde(default)]
    pub options: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum NatsMode {
    /// JetStream: every publish waits for the stream's PubAck.
    #[default]
    Jetstream,
    /// Core NATS: no acknowledgement. An event is marked once a server
    /// round trip after its messages came back (the server has them); a
    /// subscriber that is not connected then never sees them:
    /// **at-most-once** beyond the server. Only for subjects nobody needs
    /// to see reliably.
    Core,
}

#[derive(PartialEq, Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NatsSinkConfig {
    pub url: String,
    #[serde(default)]
    pub mode: NatsMode,
    #[serde(default = "default_max_message_bytes")]
    pub max_message_bytes: usize,
    #[serde(default = "default_max_in_flight")]
    pub max_in_flight: usize,
    /// Create this stream at start-up if it does not exist. Unset: start-up
    /// fails when no stream captures a subject the routes allow.
    pub create_stream: Option<NatsStreamConfig>,
    /// TLS to the server (required when set; `tls://` URLs need it too).
    #[serde(default)]
    pub tls: Option<TlsConfig>,
    /// Credentials: user + password, token, NKey or `.creds` file.
    #[serde(default)]
    pub auth: Option<NatsAuthConfig>,
}

#[derive(PartialEq, Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NatsStreamConfig {
    pub name: String,
    pub subjects: Vec<String>,
    /// Deduplication window for `Nats-Msg-Id`.
    #[serde(default = "default_dedup_window", with = "humantime_serde")]
    #[schemars(with = "String")]
    pub duplicate_window: Duration,
}

fn default_dedup_window() -> Duration {
    Duration::from_secs(120)
}

#[derive(PartialEq, Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct FileSinkConfig {
    /// JSON-lines file to append to; `-` for standard output.
    pub path: String,
    #[serde(default = "default_max_message_bytes")]
    pub max_message_bytes: usize,
}

fn default_max_message_bytes() -> usize {
    1024 * 1024
}

fn default_compression() -> String {
    "lz4".into()
}

fn default_linger_ms() -> u32 {
    5
}

fn default_max_in_flight() -> usize {
    10_000
}
