//! {{name}}: an outroute routing plugin.
//!
//! Every event goes to one topic built from a template, keyed by its
//! aggregate id (one aggregate, one partition: its events stay in order);
//! events whose payload is not a JSON object are refused for good.
//!
//! Route config (the route's `config` key; all optional):
//! `{"sink": "kafka", "topic": "{aggregate_type}.{event_type}"}`
//!
//! Test:  cargo test
//! Build: cargo build --release --target wasm32-wasip2
//!        (the plugin: target/wasm32-wasip2/release/{{crate}}.wasm)
//! Try:   outroute plugin test target/wasm32-wasip2/release/{{crate}}.wasm --event sample-event.json

use outroute_guest::{Event, Message, Outcome, Rejection, Router, parse_config};
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
    "{aggregate_type}.{event_type}".into()
}

pub struct Plugin {
    config: Config,
}

impl Router for Plugin {
    const NAME: &'static str = "{{name}}";
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
        Ok(Plugin { config })
    }

    fn route(&self, event: &Event) -> Outcome {
        // A payload that is not JSON at all is refused by `json()` itself.
        if !event.json()?.is_object() {
            return Err(Rejection::invalid("the payload is not a JSON object"));
        }
        Ok(vec![
            Message::to(&self.config.sink, event.expand(&self.config.topic))
                .key(&event.aggregate_id)
                .payload(event.payload.clone()),
        ])
    }
}

outroute_guest::export_router!(Plugin);

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn routes_by_template_and_keys_by_aggregate() {
        let p = Plugin::init(serde_json::Value::Null).unwrap();
        let e = Event::new("order", "o-1", "order-created", json!({"total": 10}));
        let msgs = p.route(&e).unwrap();
        assert_eq!(msgs.len(), 1);
        assert_eq!(msgs[0].topic, "order.order-created");
        assert_eq!(msgs[0].key.as_deref(), Some(&b"o-1"[..]));
    }

    #[test]
    fn refuses_a_payload_that_is_not_an_object() {
        let p = Plugin::init(json!({"sink": "nats"})).unwrap();
        let e = Event::new("order", "o-1", "order-created", json!([1, 2]));
        assert!(matches!(p.route(&e), Err(Rejection::Invalid(_))));
    }
}
