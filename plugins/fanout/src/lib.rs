//! fanout: one event to several destinations, e.g. a Kafka topic for
//! analytics and a NATS subject for low-latency consumers. The relay marks
//! the event published only when every destination acknowledged.
//!
//! Route config: `{"targets": [
//!   {"sink": "kafka", "topic": "orders.{event_type}"},
//!   {"sink": "nats", "topic": "orders.{aggregate_id}.{event_type}"}]}`

use outroute_guest::{Event, Message, Outcome, Router, headers, parse_config};
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Target {
    sink: String,
    topic: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    targets: Vec<Target>,
}

pub struct Fanout {
    targets: Vec<Target>,
}

impl Router for Fanout {
    const NAME: &'static str = "fanout";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");

    fn init(config: serde_json::Value) -> Result<Self, String> {
        let c: Config = parse_config(Self::NAME, config)?;
        if c.targets.is_empty() {
            return Err("fanout: `targets` must name at least one sink".into());
        }
        Ok(Fanout { targets: c.targets })
    }

    fn route(&self, event: &Event) -> Outcome {
        Ok(self
            .targets
            .iter()
            .map(|t| {
                Message::to(&t.sink, event.expand(&t.topic))
                    .key(&event.aggregate_id)
                    .header(headers::DATA_CONTENT_TYPE, "application/json")
                    .payload(event.payload.clone())
            })
            .collect())
    }
}

outroute_guest::export_router!(Fanout);

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn one_message_per_target() {
        let f = Fanout::init(json!({"targets": [
            {"sink": "kafka", "topic": "orders.{event_type}"},
            {"sink": "nats", "topic": "orders.{aggregate_id}.{event_type}"}]}))
        .unwrap();
        let msgs = f
            .route(&Event::new("order", "o7", "order-paid", json!({"x": 1})))
            .unwrap();
        let dests: Vec<_> = msgs
            .iter()
            .map(|m| (m.sink.as_str(), m.topic.as_str()))
            .collect();
        assert_eq!(
            dests,
            [
                ("kafka", "orders.order-paid"),
                ("nats", "orders.o7.order-paid")
            ]
        );
        assert!(
            msgs.iter()
                .all(|m| m.payload_json() == Some(json!({"x": 1})))
        );
    }

    #[test]
    fn no_targets_is_refused() {
        assert!(Fanout::init(json!({"targets": []})).is_err());
    }
}
