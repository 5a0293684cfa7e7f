//! schema-gate: accepts only the event versions a consumer understands and
//! upcasts old ones, so consumers see one schema.
//!
//! v1 payload: `{"order_id", "customer", "total"}` (total in currency units)
//! v2 payload: `{"order_id", "customer_id", "total_cents", "currency"}`
//!
//! Versions outside `[min_version, max_version]` are `invalid` (permanent):
//! a producer emitting an unknown version is a bug to look at, not to retry.
//!
//! Every upcast is counted (`outroute_plugin_count_total{name="upcast_v1"}`):
//! the figure that says when v1 support can be dropped.
//!
//! Route config: `{"sink": "kafka", "topic": "orders.v2", "min_version": 1,
//! "max_version": 2, "default_currency": "EUR"}`

use outroute_guest::{Event, Message, Outcome, Rejection, Router, count, headers, parse_config};
use serde::{Deserialize, Serialize};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    sink: String,
    topic: String,
    #[serde(default = "one")]
    min_version: u32,
    #[serde(default = "two")]
    max_version: u32,
    #[serde(default = "eur")]
    default_currency: String,
}
fn one() -> u32 {
    1
}
fn two() -> u32 {
    2
}
fn eur() -> String {
    "EUR".into()
}

#[derive(Deserialize)]
struct OrderV1 {
    order_id: String,
    customer: String,
    total: f64,
}

#[derive(Deserialize, Serialize)]
struct OrderV2 {
    order_id: String,
    customer_id: String,
    total_cents: i64,
    currency: String,
}

pub struct SchemaGate {
    config: Config,
}

impl SchemaGate {
    fn upcast(&self, event: &Event) -> Result<OrderV2, Rejection> {
        match event.event_version {
            1 => {
                let v1: OrderV1 = event.parse()?;
                // How many v1 events still arrive: when this reaches zero
                // for long enough, v1 support can go.
                count("upcast_v1", 1);
                Ok(OrderV2 {
                    order_id: v1.order_id,
                    customer_id: v1.customer,
                    total_cents: (v1.total * 100.0).round() as i64,
                    currency: self.config.default_currency.clone(),
                })
            }
            2 => event.parse(),
            v => Err(Rejection::invalid(format!(
                "no upcaster for {} version {v}",
                event.event_type
            ))),
        }
    }
}

impl Router for SchemaGate {
    const NAME: &'static str = "schema-gate";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");

    fn init(config: serde_json::Value) -> Result<Self, String> {
        let config: Config = parse_config(Self::NAME, config)?;
        if config.min_version > config.max_version || config.max_version > 2 {
            return Err(format!(
                "schema-gate: version range {}..={} is not within the supported 1..=2",
                config.min_version, config.max_version
            ));
        }
        Ok(SchemaGate { config })
    }

    fn route(&self, event: &Event) -> Outcome {
        let v = event.event_version;
        if v < self.config.min_version || v > self.config.max_version {
            return Err(Rejection::invalid(format!(
                "{} version {v} is outside the accepted range {}..={}",
                event.event_type, self.config.min_version, self.config.max_version
            )));
        }
        let order = self.upcast(event)?;
        let payload = serde_json::to_vec(&order).map_err(|e| Rejection::invalid(e.to_string()))?;
        Ok(vec![
            Message::to(&self.config.sink, event.expand(&self.config.topic))
                .key(&event.aggregate_id)
                .header(headers::DATA_CONTENT_TYPE, "application/json")
                .header(headers::DATA_SCHEMA, "urn:schema:order:2")
                .payload(payload),
        ])
    }
}

outroute_guest::export_router!(SchemaGate);

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn gate() -> SchemaGate {
        SchemaGate::init(json!({"sink": "kafka", "topic": "orders.v2"})).unwrap()
    }

    #[test]
    fn v1_is_upcast_to_v2() {
        let e = Event::new(
            "order",
            "o1",
            "order-created",
            json!({"order_id": "o1", "customer": "c9", "total": 12.5}),
        );
        let before = outroute_guest::counted("upcast_v1");
        let m = &gate().route(&e).unwrap()[0];
        assert_eq!(
            m.payload_json().unwrap(),
            json!({"order_id": "o1", "customer_id": "c9", "total_cents": 1250, "currency": "EUR"})
        );
        assert_eq!(
            outroute_guest::counted("upcast_v1"),
            before + 1,
            "the upcast is counted"
        );
    }

    #[test]
    fn v2_passes_through() {
        let p = json!({"order_id": "o1", "customer_id": "c9", "total_cents": 5, "currency": "USD"});
        let e = Event::new("order", "o1", "order-created", p.clone()).with_version(2);
        let before = outroute_guest::counted("upcast_v1");
        assert_eq!(gate().route(&e).unwrap()[0].payload_json().unwrap(), p);
        assert_eq!(
            outroute_guest::counted("upcast_v1"),
            before,
            "v2 is not an upcast"
        );
    }

    #[test]
    fn unknown_version_is_invalid() {
        let e = Event::new("order", "o1", "order-created", json!({})).with_version(3);
        match gate().route(&e) {
            Err(Rejection::Invalid(r)) => assert!(r.contains("version 3"), "{r}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn v1_with_wrong_shape_is_invalid() {
        let e = Event::new("order", "o1", "order-created", json!({"order_id": "o1"}));
        assert!(matches!(gate().route(&e), Err(Rejection::Invalid(_))));
    }

    #[test]
    fn narrowed_range_rejects_v1() {
        let g = SchemaGate::init(json!({"sink": "k", "topic": "t", "min_version": 2})).unwrap();
        let e = Event::new(
            "order",
            "o1",
            "x",
            json!({"order_id": "o1", "customer": "c", "total": 1.0}),
        );
        assert!(matches!(g.route(&e), Err(Rejection::Invalid(_))));
    }
}
