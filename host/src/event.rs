//! The domain types every other module speaks: an [`Event`] read from the
//! outbox, the [`Message`]s a plugin routes it to, and why a plugin may
//! refuse it ([`Rejection`]). Also the envelope: the CloudEvents headers the
//! relay puts on every message so consumers can deduplicate by event id.

use std::borrow::Cow;

use chrono::{DateTime, SecondsFormat, Utc};

/// A message header: name and value, borrowed from the event where they can
/// be (the envelope of every message would otherwise allocate ~20 strings).
pub type Header<'a> = (&'a str, std::borrow::Cow<'a, str>);

/// One outbox row, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub id: String,
    /// Order key within the table (the sequence column, or created_at in µs).
    pub sequence: i64,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub event_type: String,
    pub event_version: u32,
    /// UTF-8 JSON.
    pub payload: Vec<u8>,
    pub headers: Vec<(String, String)>,
    pub created_at: DateTime<Utc>,
    /// Delivery attempts that already failed.
    pub attempts: u32,
}

impl Event {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn traceparent(&self) -> Option<&str> {
        self.header("traceparent")
    }
}

/// A row exactly as the store read it, before validation. Every field a
/// producer could leave NULL or malformed is optional here; [`RawRow::validate`]
/// turns it into an [`Event`] or into the reason it is malformed.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RawRow {
    pub id: String,
    /// NULL when the order column (or created_at standing in) is NULL.
    pub sequence: Option<i64>,
    pub aggregate_type: Option<String>,
    pub aggregate_id: Option<String>,
    pub event_type: Option<String>,
    /// As text, so a non-numeric value is a reason, not a read error.
    pub event_version: Option<String>,
    pub payload: Option<String>,
    pub headers: Option<String>,
    pub created_at: Option<DateTime<Utc>>,
    #[serde(skip)]
    pub attempts: i32,
    /// The payload comes from a `json`/`jsonb` column: PostgreSQL already
    /// checked that it is JSON, so it is not parsed again.
    #[serde(skip)]
    pub payload_is_json: bool,
}

/// A row that cannot become an event, with the reason.
#[derive(Debug, Clone, PartialEq)]
pub struct Malformed {
    pub id: String,
    pub sequence: i64,
    pub aggregate_type: String,
    pub aggregate_id: String,
    /// As far as it could be read ("" when not), so `failed list
    /// --event-type` still finds the row.
    pub event_type: String,
    pub reason: String,
    /// The row as read, when it could be read: a parked record keeps it
    /// (the table row may be gone) so it can be shown, repaired and retried.
    pub raw: Option<Box<RawRow>>,
}

impl RawRow {
    // `Event` (the Ok side) is larger still: boxing the error saves nothing.
    #[allow(clippy::result_large_err)]
    pub fn validate(self) -> Result<Event, Malformed> {
        // The first thing wrong with the row, if anything (no copies: the
        // fields move into the event once all are known to be fine).
        let problem = (|| -> Option<String> {
            let required = |v: &Option<String>, col: &str| match v.as_deref() {
                Some("") => Some(format!("{col} is empty")),
                None => Some(format!("{col} is NULL")),
                Some(_) => None,
            };
            if self.id.is_empty() {
                return Some("id is NULL or empty".into());
            }
            let Some(payload) = &self.payload else {
                return Some("payload is NULL".into());
            };
            if !self.payload_is_json
                && let Err(e) = serde_json::from_str::<serde::de::IgnoredAny>(payload)
            {
                return Some(format!("payload is not valid JSON: {e}"));
            }
            required(&self.aggregate_type, "aggregate_type")
                .or_else(|| required(&self.aggregate_id, "aggregate_id"))
                .or_else(|| required(&self.event_type, "event_type"))
        })();
        let version = match self.event_version.as_deref().map(str::trim) {
            None => Ok(1),
            Some(v) => v
                .parse::<u32>()
                .map_err(|_| format!("event_version `{v}` is not a version number")),
        };
        let headers = match self.headers.as_deref() {
            None | Some("") | Some("null") => Ok(Vec::new()),
            Some(h) => parse_headers(h),
        };
        let reason = match (problem, version, self.sequence, headers, self.created_at) {
            (Some(p), ..) => p,
            (None, Err(v), ..) => v,
            (None, Ok(_), None, ..) => {
                "the ordering column (sequence, or created_at standing in) is NULL".into()
            }
            (None, Ok(_), Some(_), Err(h), _) => h,
            (None, Ok(_), Some(_), Ok(_), None) => "created_at is NULL".into(),
            (None, Ok(event_version), Some(sequence), Ok(headers), Some(created_at)) => {
                return Ok(Event {
                    id: self.id,
                    aggregate_type: self.aggregate_type.unwrap_or_default(),
                    aggregate_id: self.aggregate_id.unwrap_or_default(),
                    event_type: self.event_type.unwrap_or_default(),
                    event_version,
                    sequence,
                    headers,
                    created_at,
                    payload: self.payload.unwrap_or_default().into_bytes(),
                    attempts: u32::try_from(self.attempts).unwrap_or(0),
                });
            }
        };
        let raw = Some(Box::new(self.clone()));
        Err(Malformed {
            raw,
            id: self.id,
            // Unknown order: 0 holds back every event of its aggregate
            // under the `block` policy (the conservative choice).
            sequence: self.sequence.unwrap_or(0),
            aggregate_type: self.aggregate_type.unwrap_or_default(),
            aggregate_id: self.aggregate_id.unwrap_or_default(),
            event_type: self.event_type.unwrap_or_default(),
            reason,
        })
    }
}

/// Producer headers: a JSON object of string (or scalar) values.
fn parse_headers(text: &str) -> Result<Vec<(String, String)>, String> {
    let v: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("headers are not valid JSON: {e}"))?;
    let obj = v.as_object().ok_or("headers must be a JSON object")?;
    Ok(obj
        .iter()
        .map(|(k, v)| {
            let s = match v {
                serde_json::Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            (k.clone(), s)
        })
        .collect())
}

/// One message to publish (what a plugin returned, after validation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub sink: String,
    pub topic: String,
    pub key: Option<Vec<u8>>,
    pub partition: Option<i32>,
    pub headers: Vec<(String, String)>,
    pub payload: Vec<u8>,
}

/// Why a plugin (or the host on its behalf) refused an event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rejection {
    /// Transient: retry with backoff.
    Retryable(String),
    /// Permanent: the event goes to the failed state.
    Invalid(String),
}

impl Rejection {
    pub fn reason(&self) -> &str {
        match self {
            Rejection::Retryable(r) | Rejection::Invalid(r) => r,
        }
    }

    pub fn kind(&self) -> &'static str {
        match self {
            Rejection::Retryable(_) => "retryable",
            Rejection::Invalid(_) => "invalid",
        }
    }
}

/// What a plugin made of one event.
pub type Outcome = Result<Vec<Message>, Rejection>;

/// CloudEvents header names (Kafka and NATS protocol bindings, binary mode).
pub mod ce {
    pub const ID: &str = "ce_id";
    pub const TYPE: &str = "ce_type";
    pub const SOURCE: &str = "ce_source";
    pub const SPEC_VERSION: &str = "ce_specversion";
    pub const TIME: &str = "ce_time";
    pub const SUBJECT: &str = "ce_subject";
    /// The one CloudEvents attribute a plugin may set: the schema of the
    /// payload it produced.
    pub const DATA_SCHEMA: &str = "ce_dataschema";
    /// Extension attributes (lower-case alphanumerics, per the spec).
    pub const AGGREGATE_TYPE: &str = "ce_aggregatetype";
    pub const AGGREGATE_ID: &str = "ce_aggregateid";
    pub const EVENT_VERSION: &str = "ce_eventversion";
    pub const SEQUENCE: &str = "ce_sequence";
    pub const TRACEPARENT: &str = "traceparent";
    pub const TRACESTATE: &str = "tracestate";
}

/// The headers every message carries, first and in this order (see
/// [`envelope`]); a sink may rely on the order to build its header block
/// from a template (`sink/nats.rs`).
pub const ENVELOPE: [&str; 10] = [
    ce::ID,
    ce::TYPE,
    ce::SOURCE,
    ce::SPEC_VERSION,
    ce::TIME,
    ce::SUBJECT,
    ce::AGGREGATE_TYPE,
    ce::AGGREGATE_ID,
    ce::EVENT_VERSION,
    ce::SEQUENCE,
];

/// The envelope headers for every message routed from `event` (the
/// [`ENVELOPE`] names, then the event's trace context), followed by the
/// plugin's own headers (a plugin cannot override the envelope).
pub fn envelope<'a>(
    event: &'a Event,
    source: &'a str,
    plugin_headers: &'a [(String, String)],
) -> Vec<Header<'a>> {
    let b = Cow::Borrowed;
    let mut h: Vec<Header<'a>> = Vec::with_capacity(12 + plugin_headers.len());
    h.push((ce::ID, b(&event.id)));
    h.push((ce::TYPE, b(&event.event_type)));
    h.push((ce::SOURCE, b(source)));
    h.push((ce::SPEC_VERSION, b("1.0")));
    h.push((
        ce::TIME,
        Cow::Owned(
            event
                .created_at
                .to_rfc3339_opts(SecondsFormat::Micros, true),
        ),
    ));
    h.push((ce::SUBJECT, b(&event.aggregate_id)));
    h.push((ce::AGGREGATE_TYPE, b(&event.aggregate_type)));
    h.push((ce::AGGREGATE_ID, b(&event.aggregate_id)));
    h.push((
        ce::EVENT_VERSION,
        Cow::Owned(event.event_version.to_string()),
    ));
    h.push((ce::SEQUENCE, Cow::Owned(event.sequence.to_string())));
    for name in [ce::TRACEPARENT, ce::TRACESTATE] {
        if let Some(v) = event.header(name) {
            h.push((name, b(v)));
        }
    }
    for (k, v) in plugin_headers {
        if !h.iter().any(|(hk, _)| *hk == k.as_str()) {
            h.push((k, b(v)));
        }
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw() -> RawRow {
        RawRow {
            id: "e1".into(),
            sequence: Some(7),
            aggregate_type: Some("order".into()),
            aggregate_id: Some("o1".into()),
            event_type: Some("created".into()),
            event_version: Some("2".into()),
            payload: Some(r#"{"a":1}"#.into()),
            headers: Some(
                r#"{"traceparent":"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}"#
                    .into(),
            ),
            created_at: Some(Utc::now()),
            attempts: 0,
            payload_is_json: false,
        }
    }

    #[test]
    fn valid_row_becomes_event() {
        let e = raw().validate().unwrap();
        assert_eq!(e.event_version, 2);
        assert!(e.traceparent().unwrap().starts_with("00-0af7"));
    }

    #[test]
    fn malformed_rows_say_why() {
        let mut r = raw();
        r.payload = Some("{oops".into());
        assert!(
            r.validate()
                .unwrap_err()
                .reason
                .starts_with("payload is not valid JSON")
        );
        let mut r = raw();
        r.aggregate_id = None;
        assert_eq!(r.validate().unwrap_err().reason, "aggregate_id is NULL");
        let mut r = raw();
        r.event_version = Some("v2".into());
        assert_eq!(
            r.validate().unwrap_err().reason,
            "event_version `v2` is not a version number"
        );
        let mut r = raw();
        r.sequence = None;
        assert!(r.validate().unwrap_err().reason.contains("ordering column"));
        let mut r = raw();
        r.headers = Some("[1]".into());
        assert_eq!(
            r.validate().unwrap_err().reason,
            "headers must be a JSON object"
        );
    }

    #[test]
    fn envelope_carries_id_and_trace_and_keeps_plugin_headers() {
        let e = raw().validate().unwrap();
        let plugin = [("x".into(), "1".into()), ("ce_id".into(), "forged".into())];
        let h = envelope(&e, "/outroute/test", &plugin);
        let get = |k: &str| h.iter().find(|(hk, _)| *hk == k).map(|(_, v)| v.as_ref());
        assert_eq!(get("ce_id"), Some("e1"));
        assert_eq!(get("ce_specversion"), Some("1.0"));
        assert_eq!(get("ce_eventversion"), Some("2"));
        assert!(get("traceparent").is_some());
        assert_eq!(get("x"), Some("1"));
        assert_eq!(h.iter().filter(|(k, _)| *k == "ce_id").count(), 1);
        // Sinks rely on the fixed names coming first, in ENVELOPE's order.
        let first: Vec<&str> = h.iter().take(ENVELOPE.len()).map(|(k, _)| *k).collect();
        assert_eq!(first, ENVELOPE);
    }
}
