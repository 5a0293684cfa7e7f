//! pii-redact: removes or masks personal data at configured JSON paths
//! before the payload leaves the database.
//!
//! Route config: `{"sink": "kafka", "topic": "customers.{event_type}",
//! "paths": ["email", "address.street", "cards.*.number"], "mode": "mask"}`
//! `mode` is `remove` (drop the field) or `mask` (keep the field, replace the
//! value with `"****"`, keeping the last 4 characters of strings longer than
//! 8). `*` matches every element of an array or every key of an object.

use outroute_guest::{Event, Message, Outcome, Rejection, Router, headers, parse_config};
use serde::Deserialize;
use serde_json::Value;

#[derive(Deserialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
enum Mode {
    Remove,
    Mask,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    sink: String,
    topic: String,
    paths: Vec<String>,
    #[serde(default = "mask")]
    mode: Mode,
}
fn mask() -> Mode {
    Mode::Mask
}

pub struct PiiRedact {
    sink: String,
    topic: String,
    paths: Vec<Vec<String>>,
    mode: Mode,
}

fn masked(v: &Value) -> Value {
    match v {
        Value::String(s) if s.chars().count() > 8 => {
            let tail: String = s
                .chars()
                .rev()
                .take(4)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect();
            Value::String(format!("****{tail}"))
        }
        _ => Value::String("****".into()),
    }
}

fn redact(value: &mut Value, path: &[String], mode: Mode) {
    let Some((head, rest)) = path.split_first() else {
        return;
    };
    match value {
        Value::Object(map) => {
            if head == "*" {
                let keys: Vec<String> = map.keys().cloned().collect();
                for k in keys {
                    redact_key(map, &k, rest, mode);
                }
            } else {
                redact_key(map, head, rest, mode);
            }
        }
        Value::Array(items) if head == "*" => {
            for item in items {
                if rest.is_empty() {
                    if mode == Mode::Mask {
                        *item = masked(item);
                    }
                } else {
                    redact(item, rest, mode);
                }
            }
        }
        _ => {}
    }
}

fn redact_key(map: &mut serde_json::Map<String, Value>, key: &str, rest: &[String], mode: Mode) {
    if rest.is_empty() {
        match mode {
            Mode::Remove => {
                map.remove(key);
            }
            Mode::Mask => {
                if let Some(v) = map.get_mut(key) {
                    *v = masked(v);
                }
            }
        }
    } else if let Some(child) = map.get_mut(key) {
        redact(child, rest, mode);
    }
}

impl Router for PiiRedact {
    const NAME: &'static str = "pii-redact";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");

    fn init(config: serde_json::Value) -> Result<Self, String> {
        let c: Config = parse_config(Self::NAME, config)?;
        if c.paths
            .iter()
            .any(|p| p.is_empty() || p.split('.').any(str::is_empty))
        {
            return Err(
                "pii-redact: paths must be non-empty dotted paths like \"address.street\"".into(),
            );
        }
        Ok(PiiRedact {
            sink: c.sink,
            topic: c.topic,
            paths: c
                .paths
                .iter()
                .map(|p| p.split('.').map(String::from).collect())
                .collect(),
            mode: c.mode,
        })
    }

    fn route(&self, event: &Event) -> Outcome {
        let mut doc = event.json()?.clone();
        for path in &self.paths {
            redact(&mut doc, path, self.mode);
        }
        let payload = serde_json::to_vec(&doc).map_err(|e| Rejection::invalid(e.to_string()))?;
        Ok(vec![
            Message::to(&self.sink, event.expand(&self.topic))
                .key(&event.aggregate_id)
                .header(headers::DATA_CONTENT_TYPE, "application/json")
                .payload(payload),
        ])
    }
}

outroute_guest::export_router!(PiiRedact);

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn event() -> Event {
        Event::new(
            "customer",
            "c1",
            "customer-registered",
            json!({"name": "Ada", "email": "ada@example.com",
                   "address": {"street": "1 Analytical Way", "city": "London"},
                   "cards": [{"number": "4111111111111111"}, {"number": "5500000000000004"}]}),
        )
    }

    #[test]
    fn mask_keeps_fields_and_last_four() {
        let r = PiiRedact::init(json!({"sink": "k", "topic": "t", "paths": ["email", "address.street", "cards.*.number"]})).unwrap();
        let out = r.route(&event()).unwrap()[0].payload_json().unwrap();
        assert_eq!(out["email"], "****.com");
        assert_eq!(out["address"]["street"], "**** Way");
        assert_eq!(out["address"]["city"], "London");
        assert_eq!(out["cards"][0]["number"], "****1111");
        assert_eq!(out["cards"][1]["number"], "****0004");
        assert_eq!(out["name"], "Ada");
    }

    #[test]
    fn remove_drops_fields() {
        let r = PiiRedact::init(
            json!({"sink": "k", "topic": "t", "paths": ["email", "address"], "mode": "remove"}),
        )
        .unwrap();
        let out = r.route(&event()).unwrap()[0].payload_json().unwrap();
        assert!(out.get("email").is_none());
        assert!(out.get("address").is_none());
        assert_eq!(out["name"], "Ada");
    }

    #[test]
    fn non_json_payload_is_invalid() {
        let r = PiiRedact::init(json!({"sink": "k", "topic": "t", "paths": ["email"]})).unwrap();
        let e = event().with_raw_payload(b"not json".to_vec());
        assert!(matches!(r.route(&e), Err(Rejection::Invalid(_))));
    }

    #[test]
    fn empty_path_is_refused() {
        assert!(PiiRedact::init(json!({"sink": "k", "topic": "t", "paths": ["a..b"]})).is_err());
    }
}
