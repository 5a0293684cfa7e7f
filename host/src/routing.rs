//! Routes: which events a plugin sees, and what its messages may do.
//!
//! A route selects events by glob patterns over aggregate type and event
//! type. Routes are subscriptions: every route that selects an event gets
//! it, with its own plugin call, messages, retries and failures; an event no
//! route selects fails with that reason (nothing is dropped silently). Every message a plugin returns is checked against its route's
//! allow-list before anything is published: the sink must be allowed, the
//! topic/subject must match one of the sink's patterns, the payload must fit
//! the sink. This is how one shared relay keeps a team's plugin out of
//! another team's topics.

use globset::GlobMatcher;

use crate::config::{Config, Grant, RouteConfig};

/// How the stand-in route of a team whose file is refused is named.
const WAITING_PREFIX: &str = "team:";
use crate::event::Message;
pub use crate::pattern::{name_matcher, topic_key, topic_matcher};

/// Compile a list of name patterns (a route's `aggregate_types` or
/// `event_types`).
fn name_matchers(patterns: &[String]) -> Result<Vec<GlobMatcher>, String> {
    patterns.iter().map(|p| name_matcher(p)).collect()
}

/// One sink a route may publish to.
#[derive(Debug)]
struct Allowed {
    sink: String,
    kind: SinkKind,
    max_message_bytes: usize,
    patterns: Vec<(String, GlobMatcher)>,
    /// Topics already found to match `patterns`. A route publishes to few
    /// topics over and over, and matching a glob was ~2,000 instructions
    /// per message (callgrind); a lookup here is ~100. Bounded: cleared
    /// when full, so routes that make a topic per aggregate still match.
    matched: std::sync::Mutex<foldhash::HashSet<String>>,
}

/// How many matched topics [`Allowed::matched`] keeps before starting over.
const MATCHED_TOPICS: usize = 1024;

impl Allowed {
    /// `topic` matches one of the sink's patterns.
    fn allows(&self, topic: &str) -> bool {
        let lock = || self.matched.lock().unwrap_or_else(|e| e.into_inner());
        if lock().contains(topic) {
            return true;
        }
        let key = topic_key(topic);
        let ok = self.patterns.iter().any(|(_, g)| g.is_match(&key));
        if ok {
            let mut matched = lock();
            if matched.len() >= MATCHED_TOPICS {
                matched.clear();
            }
            matched.insert(topic.to_string());
        }
        ok
    }
}

/// What a sink accepts as a topic/subject name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SinkKind {
    Kafka,
    Nats,
    File,
}

/// Longest header name and value a plugin may set.
const MAX_HEADER_NAME: usize = 256;
const MAX_HEADER_VALUE: usize = 8 * 1024;

/// A topic/subject the sink would refuse or misread, and why. Checked
/// before anything is sent, so a plugin's bad name fails only its event.
fn check_name(kind: SinkKind, topic: &str) -> Result<(), String> {
    if topic.chars().any(|c| c.is_control()) {
        return Err(format!("topic {topic:?} contains control characters"));
    }
    match kind {
        SinkKind::Kafka => {
            if topic.len() > 249 {
                return Err(format!("Kafka topic is {} bytes, over 249", topic.len()));
            }
            if topic == "." || topic == ".." {
                return Err(format!("`{topic}` is not a valid Kafka topic"));
            }
            if let Some(c) = topic
                .chars()
                .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
            {
                return Err(format!(
                    "Kafka topic `{topic}` has `{c}` (allowed: letters, digits, `.`, `_`, `-`)"
                ));
            }
        }
        SinkKind::Nats => {
            if topic.len() > 1024 {
                return Err(format!("NATS subject is {} bytes, over 1024", topic.len()));
            }
            if topic.chars().any(char::is_whitespace) {
                return Err(format!("NATS subject {topic:?} contains whitespace"));
            }
            for token in topic.split('.') {
                if token.is_empty() {
                    return Err(format!("NATS subject `{topic}` has an empty token"));
                }
                if token == "*" || token == ">" {
                    return Err(format!(
                        "NATS subject `{topic}` has the wildcard `{token}` (publishing needs a concrete subject)"
                    ));
                }
            }
        }
        SinkKind::File => {
            if topic.len() > 1024 {
                return Err(format!("topic is {} bytes, over 1024", topic.len()));
            }
        }
    }
    Ok(())
}

/// Headers a plugin may not set, or could not send.
pub(crate) fn check_headers(headers: &[(String, String)]) -> Result<(), String> {
    for (k, v) in headers {
        if k.is_empty() {
            return Err("a header has an empty name".into());
        }
        if k.len() > MAX_HEADER_NAME || v.len() > MAX_HEADER_VALUE {
            return Err(format!(
                "header `{}` is too long (names up to {MAX_HEADER_NAME} bytes, values up to {MAX_HEADER_VALUE})",
                k.chars().take(64).collect::<String>()
            ));
        }
        if k.chars()
            .any(|c| c.is_control() || c.is_whitespace() || c == ':')
        {
            return Err(format!(
                "header name {k:?} has a control character, whitespace or `:`"
            ));
        }
        if v.chars().any(|c| matches!(c, '\r' | '\n' | '\0')) {
            return Err(format!("the value of header `{k}` contains CR, LF or NUL"));
        }
        let lower = k.to_ascii_lowercase();
        // The envelope is the relay's; of the CloudEvents attributes only
        // `dataschema` describes what the plugin made of the payload.
        if (lower.starts_with("ce_") && lower != crate::event::ce::DATA_SCHEMA)
            || lower.starts_with("nats-")
        {
            return Err(format!(
                "header `{k}` is reserved: `ce_*` (but `ce_dataschema`) and `Nats-*` headers are set by the relay only"
            ));
        }
    }
    Ok(())
}

/// A compiled route.
#[derive(Debug)]
pub struct Route {
    pub index: usize,
    pub config: RouteConfig,
    aggregate_types: Vec<GlobMatcher>,
    event_types: Vec<GlobMatcher>,
    allowed: Vec<Allowed>,
}

impl Route {
    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// The stand-in route of team `team`, whose file is refused and that
    /// has no last known good copy running: it selects what the team's
    /// grant lets it read (or, `exclusive`, what it owns: its own routes
    /// may have kept those from copies) and never delivers. So the team's
    /// events wait for it — nothing is marked for a route that did not run
    /// — while other routes deliver them. Named `team:<team>` (a `:` no
    /// route name has).
    pub fn waiting_for(
        team: &str,
        grant: &Grant,
        exclusive: bool,
        index: usize,
    ) -> Result<Route, String> {
        let all = || vec!["*".to_string()];
        let aggregate_types = if exclusive {
            grant.owns.clone()
        } else {
            grant.aggregate_types.clone().unwrap_or_else(all)
        };
        let event_types = grant.event_types.clone().unwrap_or_else(all);
        let config: RouteConfig = serde_json::from_value(serde_json::json!({
            "name": format!("{WAITING_PREFIX}{team}"),
            "plugin": "",
            "allow": {},
            "aggregate_types": aggregate_types,
            "event_types": event_types,
            "exclusive": exclusive,
            "owner": team,
        }))
        .map_err(|e| format!("team `{team}`'s stand-in route: {e}"))?;
        Ok(Route {
            index,
            aggregate_types: name_matchers(&config.aggregate_types)?,
            event_types: name_matchers(&config.event_types)?,
            config,
            allowed: Vec::new(),
        })
    }

    /// The team this route stands in for (see [`Route::waiting_for`]).
    pub fn waiting_team(&self) -> Option<&str> {
        self.config.name.strip_prefix(WAITING_PREFIX)
    }

    pub fn selects(&self, aggregate_type: &str, event_type: &str) -> bool {
        self.aggregate_types
            .iter()
            .any(|m| m.is_match(aggregate_type))
            && self.event_types.iter().any(|m| m.is_match(event_type))
    }

    /// Check one message against the allow-list; `Err` is the reason the
    /// event is rejected as invalid.
    pub fn check(&self, m: &Message) -> Result<(), String> {
        let Some(a) = self.allowed.iter().find(|a| a.sink == m.sink) else {
            let allowed: Vec<&str> = self.allowed.iter().map(|a| a.sink.as_str()).collect();
            return Err(format!(
                "route `{}` may not publish to sink `{}` (allowed: {})",
                self.name(),
                m.sink,
                allowed.join(", ")
            ));
        };
        if m.topic.is_empty() {
            return Err(format!("message for sink `{}` has an empty topic", m.sink));
        }
        check_name(a.kind, &m.topic).map_err(|e| format!("sink `{}`: {e}", m.sink))?;
        check_headers(&m.headers).map_err(|e| format!("message to `{}`: {e}", m.topic))?;
        if !a.allows(&m.topic) {
            let pats: Vec<&str> = a.patterns.iter().map(|(p, _)| p.as_str()).collect();
            return Err(format!(
                "route `{}` may not publish to `{}` on sink `{}` (allowed: {})",
                self.name(),
                m.topic,
                m.sink,
                pats.join(", ")
            ));
        }
        if m.payload.len() > a.max_message_bytes {
            return Err(format!(
                "message to `{}` on sink `{}` is {} bytes, over the sink's max_message_bytes of {}",
                m.topic,
                m.sink,
                m.payload.len(),
                a.max_message_bytes
            ));
        }
        Ok(())
    }
}

/// All routes, in config order.
#[derive(Debug)]
pub struct Routes(pub Vec<Route>);

impl Routes {
    /// Compile routes from a validated config.
    pub fn compile(config: &Config) -> Result<Self, String> {
        let mut out = Vec::new();
        for (index, r) in config.routes.iter().enumerate() {
            let mut allowed = Vec::new();
            for (sink, pats) in &r.allow {
                let sink_cfg = config
                    .sinks
                    .get(sink)
                    .ok_or_else(|| format!("route `{}`: no sink named `{sink}`", r.name))?;
                allowed.push(Allowed {
                    sink: sink.clone(),
                    kind: match sink_cfg {
                        crate::config::SinkConfig::Kafka(_) => SinkKind::Kafka,
                        crate::config::SinkConfig::Nats(_) => SinkKind::Nats,
                        crate::config::SinkConfig::File(_) => SinkKind::File,
                    },
                    max_message_bytes: sink_cfg.max_message_bytes(),
                    patterns: pats
                        .iter()
                        .map(|p| topic_matcher(p).map(|g| (p.clone(), g)))
                        .collect::<Result<_, _>>()?,
                    matched: Default::default(),
                });
            }
            out.push(Route {
                index,
                config: r.clone(),
                aggregate_types: name_matchers(&r.aggregate_types)?,
                event_types: name_matchers(&r.event_types)?,
                allowed,
            });
        }
        Ok(Routes(out))
    }

    /// Every route that selects an event (indexes, in config order): each
    /// gets the event. Routes are subscriptions, not a first-match table,
    /// so adding a route never takes events away from another — unless an
    /// `exclusive` route (its owner's, see `grants.<team>.owns`) selects
    /// the event: then only the exclusive routes that select it get it.
    pub fn selecting<'a>(
        &'a self,
        aggregate_type: &'a str,
        event_type: &'a str,
    ) -> impl Iterator<Item = usize> + 'a {
        // (Most relays have no exclusive route: a flag per route, no match.)
        let exclusive = self
            .0
            .iter()
            .any(|r| r.config.exclusive && r.selects(aggregate_type, event_type));
        self.0
            .iter()
            .filter(move |r| {
                (r.config.exclusive || !exclusive) && r.selects(aggregate_type, event_type)
            })
            .map(|r| r.index)
    }

    /// The first route that selects an event, if any.
    #[cfg(test)]
    pub fn select(&self, aggregate_type: &str, event_type: &str) -> Option<&Route> {
        self.0
            .iter()
            .find(|r| r.selects(aggregate_type, event_type))
    }

    /// Topic/subject patterns allowed on a sink by any route, and the
    /// routes' dead-letter topics on it (used to check that a JetStream
    /// stream captures them at start-up).
    pub fn patterns_for_sink(&self, sink: &str) -> Vec<String> {
        let dead_letters = self
            .0
            .iter()
            .filter_map(|r| r.config.dead_letter.as_ref())
            .filter(|d| d.sink == sink)
            .map(|d| d.topic.clone());
        self.0
            .iter()
            .flat_map(|r| r.allowed.iter())
            .filter(|a| a.sink == sink)
            .flat_map(|a| a.patterns.iter().map(|(p, _)| p.clone()))
            .chain(dead_letters)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(sink: &str, topic: &str, n: usize) -> Message {
        Message {
            sink: sink.into(),
            topic: topic.into(),
            key: None,
            partition: None,
            headers: vec![],
            payload: vec![0; n],
        }
    }

    fn routes() -> Routes {
        let toml = r#"
            [store]
            url = "postgres://x/y"
            [sinks.kafka]
            kind = "kafka"
            brokers = "b:9092"
            max_message_bytes = 100
            [sinks.nats]
            kind = "nats"
            url = "nats://n:4222"
            [plugins.p]
            path = "p.wasm"
            [[routes]]
            name = "orders"
            aggregate_types = ["order*"]
            plugin = "p"
            allow = { kafka = ["orders.*"], nats = ["orders.**"] }
            [[routes]]
            name = "rest"
            plugin = "p"
            allow = { kafka = ["misc"] }
        "#;
        let config: Config = toml::from_str(toml).unwrap();
        Routes::compile(&config).unwrap()
    }

    #[test]
    fn names_and_headers_are_checked_per_sink() {
        let r = routes();
        let orders = r.select("order", "x").unwrap();
        let e = orders.check(&m("nats", "orders.>", 1)).unwrap_err();
        assert!(e.contains("wildcard"), "{e}");
        let e = orders.check(&m("nats", "orders..x", 1)).unwrap_err();
        assert!(e.contains("empty token"), "{e}");
        let e = orders.check(&m("nats", "orders.a b", 1)).unwrap_err();
        assert!(
            e.contains("whitespace") || e.contains("may not publish"),
            "{e}"
        );
        let e = orders.check(&m("kafka", "orders.a\nb", 1)).unwrap_err();
        assert!(e.contains("control characters"), "{e}");
        let mut msg = m("kafka", "orders.created", 1);
        for (k, v, needle) in [
            ("", "v", "empty name"),
            ("Nats-Msg-Id", "x", "reserved"),
            ("ce_id", "x", "reserved"),
            ("x-bad", "a\r\nb", "CR, LF or NUL"),
            ("bad name", "v", "whitespace"),
        ] {
            msg.headers = vec![(k.into(), v.into())];
            let e = orders.check(&msg).unwrap_err();
            assert!(e.contains(needle), "{k}: {e}");
        }
        msg.headers = vec![("x-team".into(), "payments".into())];
        assert!(orders.check(&msg).is_ok());
        // The schema of the data the plugin made is the plugin's to say.
        msg.headers = vec![("ce_dataschema".into(), "urn:schema:order:2".into())];
        assert!(orders.check(&msg).is_ok());
    }

    #[test]
    fn every_route_that_selects_an_event_gets_it() {
        let r = routes();
        let names =
            |at: &str| -> Vec<&str> { r.selecting(at, "created").map(|i| r.0[i].name()).collect() };
        // `rest` selects everything; `orders` only orders: an order event
        // goes to both, in config order.
        assert_eq!(names("order"), ["orders", "rest"]);
        assert_eq!(names("customer"), ["rest"]);
    }

    #[test]
    fn an_exclusive_route_keeps_what_it_selects_from_the_others() {
        let mut config: Config = toml::from_str(
            r#"
            [store]
            url = "postgres://x/y"
            [sinks.kafka]
            kind = "kafka"
            brokers = "b:9092"
            [plugins.p]
            path = "p.wasm"
            [[routes]]
            name = "copy"
            plugin = "p"
            allow = { kafka = ["copy"] }
            [[routes]]
            name = "payments"
            aggregate_types = ["payment"]
            exclusive = true
            plugin = "p"
            allow = { kafka = ["pay"] }
            [[routes]]
            name = "refunds"
            aggregate_types = ["payment"]
            event_types = ["refunded"]
            exclusive = true
            plugin = "p"
            allow = { kafka = ["pay"] }
            "#,
        )
        .unwrap();
        let r = Routes::compile(&config).unwrap();
        let names = |r: &Routes, at: &str, et: &str| -> Vec<String> {
            r.selecting(at, et)
                .map(|i| r.0[i].name().to_string())
                .collect()
        };
        assert_eq!(names(&r, "order", "created"), ["copy"]);
        assert_eq!(names(&r, "payment", "paid"), ["payments"]);
        // Every exclusive route that selects an event gets it.
        assert_eq!(names(&r, "payment", "refunded"), ["payments", "refunds"]);
        // Without the flag, the copy gets payments too.
        for route in &mut config.routes {
            route.exclusive = false;
        }
        let r = Routes::compile(&config).unwrap();
        assert_eq!(names(&r, "payment", "paid"), ["copy", "payments"]);
    }

    #[test]
    fn a_waiting_team_stands_in_for_its_grant() {
        let grant = Grant {
            aggregate_types: Some(vec!["payment*".into()]),
            owns: vec!["payment".into()],
            ..Grant::default()
        };
        let all = Route::waiting_for("payments", &grant, false, 0).unwrap();
        assert_eq!(all.name(), "team:payments");
        assert_eq!(all.waiting_team(), Some("payments"));
        assert!(all.selects("payment.refund", "x") && !all.selects("order", "x"));
        assert!(!all.config.exclusive);
        let owned = Route::waiting_for("payments", &grant, true, 1).unwrap();
        assert!(owned.config.exclusive);
        assert!(owned.selects("payment", "x") && !owned.selects("payment.refund", "x"));
        // A real route is never taken for a stand-in.
        assert_eq!(routes().0[0].waiting_team(), None);
    }

    #[test]
    fn allow_list_is_enforced() {
        let r = routes();
        let orders = r.select("order", "x").unwrap();
        assert!(orders.check(&m("kafka", "orders.created", 10)).is_ok());
        let e = orders.check(&m("kafka", "orders.a.b", 10)).unwrap_err();
        assert!(e.contains("may not publish to `orders.a.b`"), "{e}");
        assert!(orders.check(&m("nats", "orders.a.b", 10)).is_ok());
        let e = orders
            .check(&m("kafka", "payroll.salaries", 10))
            .unwrap_err();
        assert!(e.contains("payroll.salaries"), "{e}");
        let e = orders.check(&m("nowhere", "orders.x", 10)).unwrap_err();
        assert!(e.contains("sink `nowhere`"), "{e}");
        let e = orders.check(&m("kafka", "orders.x", 101)).unwrap_err();
        assert!(e.contains("101 bytes"), "{e}");
    }

    #[test]
    fn remembered_topics_answer_as_the_patterns_do() {
        let r = routes();
        let orders = r.select("order", "x").unwrap();
        // Past the memo's bound (it starts over), answers stay the patterns'.
        for i in 0..MATCHED_TOPICS * 2 + 10 {
            for _ in 0..2 {
                assert!(
                    orders
                        .check(&m("kafka", &format!("orders.e{i}"), 1))
                        .is_ok()
                );
                let e = orders
                    .check(&m("kafka", &format!("orders.e{i}.x"), 1))
                    .unwrap_err();
                assert!(e.contains("may not publish"), "{e}");
            }
        }
        // A topic matched once on one sink is not thereby allowed on another.
        assert!(orders.check(&m("nats", "orders.a.b", 1)).is_ok());
        assert!(orders.check(&m("kafka", "orders.a.b", 1)).is_err());
        // Remembering a topic skips no other check.
        assert!(orders.check(&m("kafka", "orders.created", 1)).is_ok());
        let e = orders
            .check(&m("kafka", "orders.created", 101))
            .unwrap_err();
        assert!(e.contains("101 bytes"), "{e}");
    }
}
