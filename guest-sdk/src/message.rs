//! The message builder: what a plugin asks the relay to publish.

/// One message to publish. Build it with [`Message::to`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// Sink name from the relay config (e.g. "kafka", "nats").
    pub sink: String,
    /// Kafka topic or NATS subject.
    pub topic: String,
    /// Kafka key (partitioning); ignored by NATS. With neither key nor
    /// partition the relay keys the message by the event's aggregate id.
    pub key: Option<Vec<u8>>,
    /// Explicit Kafka partition.
    pub partition: Option<i32>,
    /// Extra headers; the relay adds the CloudEvents headers itself.
    pub headers: Vec<(String, String)>,
    pub payload: Vec<u8>,
}

impl Message {
    /// A message for `topic` (or subject) on `sink`, with an empty payload.
    ///
    /// The route's allow-list must permit `topic` on `sink`, and the sink
    /// must accept the name: Kafka topics at most 249 bytes of `A-Z a-z 0-9
    /// . _ -`; NATS subjects at most 1024 bytes, no whitespace, no empty
    /// token, no `*` or `>` token; no control characters in either.
    /// Otherwise the event fails as [`Rejection::Invalid`](crate::Rejection)
    /// with a reason naming the rule.
    pub fn to(sink: impl Into<String>, topic: impl Into<String>) -> Self {
        Message {
            sink: sink.into(),
            topic: topic.into(),
            key: None,
            partition: None,
            headers: Vec::new(),
            payload: Vec::new(),
        }
    }

    pub fn key(mut self, key: impl AsRef<[u8]>) -> Self {
        self.key = Some(key.as_ref().to_vec());
        self
    }

    pub fn partition(mut self, partition: i32) -> Self {
        self.partition = Some(partition);
        self
    }

    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    pub fn payload(mut self, payload: impl Into<Vec<u8>>) -> Self {
        self.payload = payload.into();
        self
    }

    /// Serialize `value` as the JSON payload.
    pub fn json(mut self, value: &serde_json::Value) -> Self {
        self.payload = value.to_string().into_bytes();
        self
    }

    /// The payload as UTF-8 text (for assertions in tests).
    pub fn payload_str(&self) -> &str {
        std::str::from_utf8(&self.payload).unwrap_or("<binary>")
    }

    /// The payload parsed as JSON (for assertions in tests).
    pub fn payload_json(&self) -> Option<serde_json::Value> {
        serde_json::from_slice(&self.payload).ok()
    }
}
