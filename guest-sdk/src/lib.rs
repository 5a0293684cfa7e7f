//! # outroute-guest — write outroute routing plugins in Rust
//!
//! A routing plugin decides, for every outbox event, which messages to
//! publish: the sink (a Kafka cluster, a NATS server, a file), the topic or
//! subject, the key, headers and payload. It can also refuse an event, either
//! for now ([`Rejection::Retryable`]) or for good ([`Rejection::Invalid`]).
//!
//! ```
//! use outroute_guest::{Event, Message, Outcome, Router};
//!
//! struct Orders;
//!
//! impl Router for Orders {
//!     const NAME: &'static str = "orders";
//!     const VERSION: &'static str = env!("CARGO_PKG_VERSION");
//!
//!     fn init(_config: serde_json::Value) -> Result<Self, String> {
//!         Ok(Orders)
//!     }
//!
//!     fn route(&self, event: &Event) -> Outcome {
//!         Ok(vec![Message::to("kafka", format!("orders.{}", event.event_type))
//!             .key(&event.aggregate_id)
//!             .payload(event.payload.clone())])
//!     }
//! }
//!
//! outroute_guest::export_router!(Orders);
//! ```
//!
//! Build it with `cargo build --release --target wasm32-wasip2` (in this
//! workspace: `--profile plugin`, tuned for size); the `.wasm` file in
//! `target/wasm32-wasip2/<profile>/` is the plugin. The routing logic is
//! plain Rust, so `cargo test` exercises it natively: build [`Event`]s with
//! [`Event::new`] and call your `route` directly.
//!
//! The host and the plugin meet only at the WIT contract in `wit/`; this crate
//! hides the generated bindings behind [`Router`] and [`export_router!`].
//!
//! ## What the relay enforces
//!
//! Each route of the relay's config sets the limits (defaults in brackets):
//! CPU time per event (`cpu_budget`, 50 ms; `init` gets at least 100 ms),
//! memory per instance (`memory_mib`, 64), messages and payload bytes per
//! event (`max_messages_per_event`, 100; `max_bytes_per_event`, 16 MiB), and
//! [`log`] lines and bytes per event (100; 64 KiB). A call that runs over
//! one is stopped and counts toward the route's quarantine. Every message
//! must name a sink and a topic the route's allow-list permits, and a name
//! the sink accepts (see [`Message::to`]); headers follow the rules in
//! [`headers`]. A message that breaks a rule fails its event as
//! [`Rejection::Invalid`] with a reason naming the rule, before anything of
//! the event is sent.
//!
//! A panic (or any trap) is treated as [`Rejection::Retryable`]: the event is
//! retried with backoff until the route's `max_attempts` (10), then fails.
//! For input that can never be routed, return [`Rejection::Invalid`] rather
//! than `unwrap()`: the event fails at once, with your reason.
//!
//! The sandbox has no files, network, environment or real clock: clocks read
//! 1970 and randomness is the same in every instance (never use it for ids
//! or secrets), so the same event always gets the same answer. Use
//! [`Event::created_at_ms`] for time.

use std::cell::OnceCell;

pub use serde_json;

mod message;
mod runtime;

pub use message::Message;

/// CloudEvents header names (Kafka and NATS protocol bindings). The relay
/// sets the envelope (`ce_id`, `ce_type`, …) on every message and refuses a
/// message whose plugin set a `ce_*` header itself — except
/// [`DATA_SCHEMA`](headers::DATA_SCHEMA), the schema of the payload the
/// plugin produced — or a `Nats-*` header. Other headers (`content-type`,
/// `x-…`) are the plugin's: names up to 256 bytes with no whitespace, `:`
/// or control characters, values up to 8 KiB with no CR, LF or NUL. A
/// `traceparent`/`tracestate` the event carries wins over the plugin's.
pub mod headers {
    pub const ID: &str = "ce_id";
    pub const TYPE: &str = "ce_type";
    pub const SOURCE: &str = "ce_source";
    pub const SPEC_VERSION: &str = "ce_specversion";
    pub const TIME: &str = "ce_time";
    /// The event's aggregate id.
    pub const SUBJECT: &str = "ce_subject";
    pub const AGGREGATE_TYPE: &str = "ce_aggregatetype";
    pub const AGGREGATE_ID: &str = "ce_aggregateid";
    pub const EVENT_VERSION: &str = "ce_eventversion";
    /// The event's position in its outbox.
    pub const SEQUENCE: &str = "ce_sequence";
    pub const DATA_CONTENT_TYPE: &str = "content-type";
    /// The schema of the payload the plugin produced: the one `ce_*`
    /// header a plugin may set (the relay sets the rest of the envelope).
    pub const DATA_SCHEMA: &str = "ce_dataschema";
    /// W3C trace context, carried from the event into every message.
    pub const TRACEPARENT: &str = "traceparent";
    pub const TRACESTATE: &str = "tracestate";
}

/// Why a plugin refused an event. Either way the reason is recorded with
/// the event (`outroute failed list`), and under the route's default
/// `on_failure = "block"` the aggregate's later events wait behind it;
/// other aggregates flow on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rejection {
    /// Transient: the relay retries the event later, with backoff, and
    /// after the route's `max_attempts` (default 10) it fails for good.
    Retryable(String),
    /// Permanent: the event goes to the failed state with this reason, with
    /// no further attempt (`outroute failed retry` sends it again).
    Invalid(String),
}

impl Rejection {
    pub fn invalid(reason: impl Into<String>) -> Self {
        Rejection::Invalid(reason.into())
    }
    pub fn retryable(reason: impl Into<String>) -> Self {
        Rejection::Retryable(reason.into())
    }
}

impl std::fmt::Display for Rejection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Rejection::Retryable(r) => write!(f, "retryable: {r}"),
            Rejection::Invalid(r) => write!(f, "invalid: {r}"),
        }
    }
}

/// The result of routing one event: the messages to publish (possibly none),
/// or a rejection.
pub type Outcome = Result<Vec<Message>, Rejection>;

/// One outbox event, as the relay read it.
#[derive(Debug, Clone)]
pub struct Event {
    pub id: String,
    pub sequence: i64,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub event_type: String,
    pub event_version: u32,
    /// UTF-8 JSON bytes, exactly as stored.
    pub payload: Vec<u8>,
    pub headers: Vec<(String, String)>,
    /// Milliseconds since the Unix epoch.
    pub created_at_ms: i64,
    /// 1 on the first attempt, 2 on the first retry, …
    pub attempt: u32,
    json: OnceCell<Result<serde_json::Value, String>>,
}

impl Event {
    /// An event for tests: version 1, first attempt, empty headers.
    pub fn new(
        aggregate_type: impl Into<String>,
        aggregate_id: impl Into<String>,
        event_type: impl Into<String>,
        payload: serde_json::Value,
    ) -> Self {
        Event {
            id: "00000000-0000-0000-0000-000000000001".into(),
            sequence: 1,
            aggregate_type: aggregate_type.into(),
            aggregate_id: aggregate_id.into(),
            event_type: event_type.into(),
            event_version: 1,
            payload: payload.to_string().into_bytes(),
            headers: Vec::new(),
            created_at_ms: 0,
            attempt: 1,
            json: OnceCell::new(),
        }
    }

    /// Same event with another schema version (for tests).
    pub fn with_version(mut self, version: u32) -> Self {
        self.event_version = version;
        self
    }

    /// Same event with another id (for tests).
    pub fn with_id(mut self, id: impl Into<String>) -> Self {
        self.id = id.into();
        self
    }

    /// Same event with a header added (for tests).
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// Same event with raw payload bytes (for tests of malformed input).
    pub fn with_raw_payload(mut self, payload: impl Into<Vec<u8>>) -> Self {
        self.payload = payload.into();
        self.json = OnceCell::new();
        self
    }

    /// The payload parsed as JSON, parsed once on first use. A payload that
    /// is not JSON is an [`Rejection::Invalid`] naming the parse error.
    pub fn json(&self) -> Result<&serde_json::Value, Rejection> {
        self.json
            .get_or_init(|| serde_json::from_slice(&self.payload).map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|e| Rejection::Invalid(format!("payload is not valid JSON: {e}")))
    }

    /// The payload deserialized into `T`; a mismatch is [`Rejection::Invalid`].
    pub fn parse<T: serde::de::DeserializeOwned>(&self) -> Result<T, Rejection> {
        serde_json::from_slice(&self.payload).map_err(|e| {
            Rejection::Invalid(format!(
                "payload of {} v{} does not match the expected schema: {e}",
                self.event_type, self.event_version
            ))
        })
    }

    /// Fill a topic/subject template: `{aggregate_type}`, `{aggregate_id}`,
    /// `{event_type}` and `{event_version}` are replaced by the event's values.
    ///
    /// `Event::new("order", "42", "order-created", json!({})).expand("orders.{event_type}")`
    /// is `"orders.order-created"`.
    ///
    /// One pass over the template: a value is never expanded again, and any
    /// other `{…}` stays as written. (It runs for every message, so it is
    /// kept cheap: measured in the relay, four `str::replace` calls cost a
    /// metadata-only router about a quarter of its time in the plugin.)
    pub fn expand(&self, template: &str) -> String {
        use std::fmt::{Display, Write};
        let fields: [(&str, &dyn Display); 4] = [
            ("{aggregate_type}", &self.aggregate_type),
            ("{aggregate_id}", &self.aggregate_id),
            ("{event_type}", &self.event_type),
            ("{event_version}", &self.event_version),
        ];
        let mut out = String::with_capacity(template.len() + 32);
        let mut rest = template;
        while let Some(at) = rest.find('{') {
            out.push_str(&rest[..at]);
            rest = &rest[at..];
            match fields.iter().find(|(name, _)| rest.starts_with(name)) {
                Some((name, value)) => {
                    let _ = write!(out, "{value}");
                    rest = &rest[name.len()..];
                }
                None => {
                    out.push('{');
                    rest = &rest[1..];
                }
            }
        }
        out.push_str(rest);
        out
    }

    /// The first header with this name (case-sensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Log levels for [`log`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    Trace,
    Debug,
    Info,
    Warn,
    Error,
}

/// Write a line to the relay's log, tagged with the plugin's name (and,
/// when routing one event, its id). Lines
/// are cut at 4,096 characters; at most 100 lines and 64 KiB per event by
/// default (the route's `max_log_lines_per_event`, `max_log_bytes_per_event`):
/// one more stops the call as a breach of the route's limits. Natively (in
/// `cargo test`) it goes to standard error.
pub fn log(level: Level, message: impl AsRef<str>) {
    runtime::log(level, message.as_ref());
}

/// Add `delta` to this plugin's counter `name` (contract 0.1.1): the relay
/// exports it as `outroute_plugin_count_total{route, plugin, name}`. Names
/// are 1–64 characters of `a-z`, `0-9` and `_`, at most 32 per plugin
/// instance; a bad name traps the call with a reason saying so (retried
/// like a [`Rejection::Retryable`]). Increments made while routing an event
/// that then fails are not kept.
///
/// Natively (in `cargo test`) the counts are kept per thread: read them
/// with [`counted`].
pub fn count(name: &str, delta: u64) {
    runtime::count(name, delta);
}

/// What [`count`] added to `name` on this thread so far, in native tests
/// (inside a component the relay keeps the counts, and this is 0).
pub fn counted(name: &str) -> u64 {
    runtime::counted(name)
}

/// Implement this for your plugin type and export it with [`export_router!`].
pub trait Router: Sized + 'static {
    /// Plugin name (at most 128 bytes), recorded with every failed event.
    const NAME: &'static str;
    /// Plugin version (at most 64 bytes), recorded with every failed event.
    const VERSION: &'static str;

    /// Build the plugin from its route's static configuration (JSON; `null`
    /// when the route has none). An error refuses the route at start-up.
    /// Runs once per instance, within the route's CPU budget (at least
    /// 100 ms) and memory cap: a place to build lookup tables.
    fn init(config: serde_json::Value) -> Result<Self, String>;

    /// Route one event.
    fn route(&self, event: &Event) -> Outcome;

    /// Route several events; the default calls [`Router::route`] for each.
    /// An override must answer exactly as `route` would: the relay calls
    /// `route` for a batch of one, and again event by event when a batch
    /// call panics, runs over its budget or returns the wrong count.
    fn route_batch(&self, events: &[Event]) -> Vec<Outcome> {
        events.iter().map(|e| self.route(e)).collect()
    }
}

/// Parse a route configuration into a typed struct, with an error message
/// that names the plugin. Handy in [`Router::init`].
pub fn parse_config<T: serde::de::DeserializeOwned>(
    plugin: &str,
    config: serde_json::Value,
) -> Result<T, String> {
    serde_json::from_value(config).map_err(|e| format!("{plugin}: invalid route config: {e}"))
}

#[doc(hidden)]
pub mod __private {
    pub use crate::runtime::*;
}

/// Export `$ty` (which implements [`Router`]) as the plugin's `router` world.
/// Use it exactly once per plugin crate.
#[macro_export]
macro_rules! export_router {
    ($ty:ty) => {
        const _: () = {
            struct OutrouteGuestExport;
            impl $crate::__private::bindings::Guest for OutrouteGuestExport {
                fn describe() -> $crate::__private::bindings::PluginInfo {
                    $crate::__private::describe::<$ty>()
                }
                fn init(config: ::std::string::String) -> ::std::result::Result<(), ::std::string::String> {
                    $crate::__private::init::<$ty>(config)
                }
                fn route(event: $crate::__private::bindings::Event) -> $crate::__private::bindings::Outcome {
                    $crate::__private::route::<$ty>(event)
                }
                fn route_batch(
                    events: ::std::vec::Vec<$crate::__private::bindings::Event>,
                ) -> ::std::vec::Vec<$crate::__private::bindings::Outcome> {
                    $crate::__private::route_batch::<$ty>(events)
                }
            }
            $crate::__private::bindings::export!(OutrouteGuestExport with_types_in $crate::__private::bindings);
        };
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_is_parsed_lazily_and_errors_are_invalid() {
        let e = Event::new("order", "1", "created", serde_json::json!({"a": 1}));
        assert_eq!(e.json().unwrap()["a"], 1);
        let bad = e.with_raw_payload(b"{not json".to_vec());
        match bad.json() {
            Err(Rejection::Invalid(r)) => assert!(r.contains("not valid JSON"), "{r}"),
            other => panic!("expected invalid, got {other:?}"),
        }
    }

    #[test]
    fn templates_expand_in_one_pass() {
        let e = Event::new(
            "order",
            "{event_type}",
            "order-created",
            serde_json::json!({}),
        );
        assert_eq!(
            e.expand("{aggregate_type}s.{event_type}.v{event_version}"),
            "orders.order-created.v1"
        );
        // A value is not expanded again; unknown or unclosed braces stay.
        assert_eq!(
            e.expand("{aggregate_id}/{tenant}/{"),
            "{event_type}/{tenant}/{"
        );
        assert_eq!(e.expand("plain"), "plain");
    }

    #[test]
    fn header_lookup() {
        let e = Event::new("order", "1", "created", serde_json::json!({}))
            .with_header("traceparent", "00-abc-def-01");
        assert_eq!(e.header("traceparent"), Some("00-abc-def-01"));
        assert_eq!(e.header("missing"), None);
    }
}
