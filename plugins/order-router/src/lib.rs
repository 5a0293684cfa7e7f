//! order-router: metadata-only routing. Every event goes to one topic chosen
//! from its event type (`orders.order-created`), keyed by aggregate id so all
//! events of one order land on one partition, payload passed through as is.
//!
//! Route config (all optional):
//! `{"sink": "kafka", "topic": "orders.{event_type}"}`

use outroute_guest::{Event, Level, Message, Outcome, Router, headers, log, parse_config};
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    #[serde(default = "default_sink")]
    sink: String,
    #[serde(default = "default_topic")]
    topic: String,
}

fn default_sink() -> String {
    "kafka".into()
}
fn default_topic() -> String {
    "orders.{event_type}".into()
}

pub struct OrderRouter {
    config: Config,
}

impl Router for OrderRouter {
    const NAME: &'static str = "order-router";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");

    fn init(config: serde_json::Value) -> Result<Self, String> {
        let config = if config.is_null() {
            Config {
                sink: default_sink(),
                topic: default_topic(),
            }
        } else {
            parse_config(Self::NAME, config)?
        };
        log(
            Level::Info,
            format!("routing to {} `{}`", config.sink, config.topic),
        );
        Ok(OrderRouter { config })
    }

    fn route(&self, event: &Event) -> Outcome {
        Ok(vec![
            Message::to(&self.config.sink, event.expand(&self.config.topic))
                .key(&event.aggregate_id)
                .header(headers::DATA_CONTENT_TYPE, "application/json")
                .payload(event.payload.clone()),
        ])
    }
}

outroute_guest::export_router!(OrderRouter);

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn topic_from_event_type_and_key_from_aggregate() {
        let r = OrderRouter::init(serde_json::Value::Null).unwrap();
        let e = Event::new("order", "o-42", "order-created", json!({"total": 10}));
        let msgs = r.route(&e).unwrap();
        assert_eq!(msgs.len(), 1);
        assert_eq!(msgs[0].sink, "kafka");
        assert_eq!(msgs[0].topic, "orders.order-created");
        assert_eq!(msgs[0].key.as_deref(), Some(&b"o-42"[..]));
        assert_eq!(msgs[0].payload_json(), Some(json!({"total": 10})));
    }

    #[test]
    fn config_picks_sink_and_template() {
        let r = OrderRouter::init(
            json!({"sink": "nats", "topic": "shop.{aggregate_type}.{event_type}"}),
        )
        .unwrap();
        let e = Event::new("order", "1", "order-paid", json!({}));
        let m = &r.route(&e).unwrap()[0];
        assert_eq!(
            (m.sink.as_str(), m.topic.as_str()),
            ("nats", "shop.order.order-paid")
        );
    }

    #[test]
    fn unknown_config_key_is_refused() {
        let err = OrderRouter::init(json!({"topik": "x"})).err().unwrap();
        assert!(err.contains("topik"), "{err}");
    }
}
