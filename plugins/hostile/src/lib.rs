//! hostile: a test fixture, not an example. It misbehaves on purpose so the
//! test suite can prove the host contains it. The misbehaviour comes from the
//! route config (`{"mode": "loop"}`) or, per event, from a `"hostile"` field
//! in the payload; any other event is routed normally to `sink`/`topic`.
//!
//! Modes: `loop` (never returns), `oom` (allocates 1 GiB), `trap` (panics),
//! `forbidden-topic`, `unknown-sink`, `oversize` (2 MiB payload),
//! `retry` (always retryable), `reject` (always invalid), `nothing` (no
//! messages at all), `fan-out-bomb` (10,000 messages for one event),
//! `sleep` (sleeps 10 s, then routes normally), `sleep-loop` (sleeps 1 ms
//! forever), `stderr-flood` (writes 1 MiB to stderr, then routes normally),
//! `log-flood` (10,000 `host.log` lines), `slow` (a few ms of CPU, then
//! routes normally), `wrong-count` (route config only: `route-batch`
//! answers one outcome short), `counter-name` (`host.count` with a name
//! that breaks the rules), `counter-flood` (100 distinct counter names),
//! `spoof-header` / `spoof-nats` (sets the relay's own `ce_id` /
//! `Nats-Msg-Id` header), `dataschema` (sets `ce_dataschema`, the one
//! `ce_*` header a plugin may set), `no-key` (a message without key or
//! partition), `to-nats` (the message goes to sink `nats`), `big-log` (64 KiB of `host.log` lines, in 8 KiB lines), `probe-world`
//! (publishes what it got from files, sockets, environment, clock and
//! `wasi:random`).

use outroute_guest::{Event, Level, Message, Outcome, Rejection, Router, count, log, parse_config};
use serde::Deserialize;

#[derive(Deserialize)]
struct Config {
    #[serde(default)]
    mode: Option<String>,
    #[serde(default = "kafka")]
    sink: String,
    #[serde(default = "topic")]
    topic: String,
}
fn kafka() -> String {
    "kafka".into()
}
fn topic() -> String {
    "orders.{event_type}".into()
}

pub struct Hostile {
    config: Config,
}

impl Router for Hostile {
    const NAME: &'static str = "hostile";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");

    fn init(config: serde_json::Value) -> Result<Self, String> {
        let config = if config.is_null() {
            Config {
                mode: None,
                sink: kafka(),
                topic: topic(),
            }
        } else {
            parse_config(Self::NAME, config)?
        };
        Ok(Hostile { config })
    }

    fn route(&self, event: &Event) -> Outcome {
        let per_event = event
            .json()
            .ok()
            .and_then(|v| v.get("hostile").and_then(|m| m.as_str()).map(String::from));
        let mode = per_event
            .or_else(|| self.config.mode.clone())
            .unwrap_or_default();
        let good = Message::to(&self.config.sink, event.expand(&self.config.topic))
            .key(&event.aggregate_id)
            .payload(event.payload.clone());
        match mode.as_str() {
            "loop" => {
                let mut x: u64 = 0;
                loop {
                    x = std::hint::black_box(x.wrapping_add(1));
                }
            }
            "oom" => {
                let mut v: Vec<u8> = Vec::new();
                v.resize(1 << 30, 1);
                Ok(vec![good.payload(vec![v[v.len() - 1]])])
            }
            "trap" => panic!("hostile plugin panics on purpose"),
            "forbidden-topic" => Ok(vec![
                Message::to(&self.config.sink, "payroll.salaries").payload(event.payload.clone()),
            ]),
            "unknown-sink" => Ok(vec![
                Message::to("nowhere", event.expand(&self.config.topic))
                    .payload(event.payload.clone()),
            ]),
            "oversize" => Ok(vec![good.payload(vec![b'x'; 2 << 20])]),
            "nothing" => Ok(vec![]),
            "sleep" => {
                std::thread::sleep(std::time::Duration::from_secs(10));
                Ok(vec![good])
            }
            "sleep-loop" => loop {
                std::thread::sleep(std::time::Duration::from_millis(1));
            },
            "stderr-flood" => {
                let filler = ".".repeat(16 << 10);
                for i in 0..64 {
                    eprintln!("hostile stderr line {i:>2} {filler}");
                }
                Ok(vec![good])
            }
            "log-flood" => {
                for i in 0..10_000 {
                    log(Level::Info, format!("hostile log line {i}"));
                }
                Ok(vec![good])
            }
            "counter-name" => {
                count("Bad Name!", 1);
                Ok(vec![good])
            }
            "counter-flood" => {
                for i in 0..100 {
                    count(&format!("counter_{i}"), 1);
                }
                Ok(vec![good])
            }
            "slow" => {
                let mut x: u64 = 0;
                for i in 0..3_000_000u64 {
                    x = std::hint::black_box(x.wrapping_add(i));
                }
                Ok(vec![good.header("x-slow", x.to_string())])
            }
            "fan-out-bomb" => Ok(vec![good; 10_000]),
            "spoof-header" => Ok(vec![good.header("ce_id", "spoofed")]),
            "to-nats" => Ok(vec![
                Message::to("nats", event.expand(&self.config.topic))
                    .key(&event.aggregate_id)
                    .payload(event.payload.clone()),
            ]),
            "spoof-nats" => Ok(vec![good.header("Nats-Msg-Id", "spoofed")]),
            "dataschema" => Ok(vec![good.header("ce_dataschema", "urn:test:order:1")]),
            "no-key" => Ok(vec![
                Message::to(&self.config.sink, event.expand(&self.config.topic))
                    .payload(event.payload.clone()),
            ]),
            "big-log" => {
                for _ in 0..8 {
                    log(Level::Info, "x".repeat(8 << 10));
                }
                Ok(vec![good])
            }
            // Reach for the world outside: what comes back is published,
            // so a test can see that none of it is there.
            "probe-world" => {
                let outcome = |r: Result<String, String>| match r {
                    Ok(v) => serde_json::json!({"ok": v}),
                    Err(e) => serde_json::json!({"error": e}),
                };
                let file = std::fs::read_to_string("/etc/hostname").map_err(|e| e.to_string());
                let dir = std::fs::read_dir("/")
                    .map(|d| d.count().to_string())
                    .map_err(|e| e.to_string());
                let socket = std::net::TcpStream::connect("127.0.0.1:5432")
                    .map(|_| "connected".to_string())
                    .map_err(|e| e.to_string());
                let env: Vec<String> = std::env::vars().map(|(k, _)| k).collect();
                // The clock, and `wasi:random` (std seeds its hash keys
                // from it on first use in an instance).
                let clock = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos().to_string())
                    .unwrap_or_else(|e| e.to_string());
                let random = {
                    use std::hash::BuildHasher;
                    std::collections::hash_map::RandomState::new().hash_one("outroute")
                };
                let report = serde_json::json!({
                    "file": outcome(file),
                    "dir": outcome(dir),
                    "socket": outcome(socket),
                    "env": env,
                    "args": std::env::args().count(),
                    "clock_ns": clock,
                    "random": random.to_string(),
                });
                Ok(vec![good.payload(report.to_string().into_bytes())])
            }
            "retry" => Err(Rejection::retryable("hostile plugin asks for a retry")),
            "reject" => Err(Rejection::invalid("hostile plugin rejects this event")),
            _ => Ok(vec![good]),
        }
    }

    fn route_batch(&self, events: &[Event]) -> Vec<Outcome> {
        let mut out: Vec<Outcome> = events.iter().map(|e| self.route(e)).collect();
        if self.config.mode.as_deref() == Some("wrong-count") {
            out.pop();
        }
        out
    }
}

outroute_guest::export_router!(Hostile);

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn benign_events_route_normally() {
        let h = Hostile::init(serde_json::Value::Null).unwrap();
        let m = h
            .route(&Event::new("order", "1", "created", json!({})))
            .unwrap();
        assert_eq!(m[0].topic, "orders.created");
    }

    #[test]
    fn per_event_mode_overrides() {
        let h = Hostile::init(serde_json::Value::Null).unwrap();
        let e = Event::new(
            "order",
            "1",
            "created",
            json!({"hostile": "forbidden-topic"}),
        );
        assert_eq!(h.route(&e).unwrap()[0].topic, "payroll.salaries");
        let e = Event::new("order", "1", "created", json!({"hostile": "reject"}));
        assert!(matches!(h.route(&e), Err(Rejection::Invalid(_))));
    }
}
