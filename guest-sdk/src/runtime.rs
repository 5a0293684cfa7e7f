//! Glue between the WIT bindings and the [`Router`](crate::Router) trait.
//! Everything here is used by the `export_router!` macro and is not public
//! API. Plugins are single-threaded; the router instance lives in a
//! thread-local set by `init`.

use std::any::Any;
use std::cell::RefCell;

use crate::{Event, Level, Message, Rejection, Router};

#[allow(clippy::all, missing_docs)]
pub mod bindings {
    wit_bindgen::generate!({
        path: "../wit",
        world: "router",
        pub_export_macro: true,
        default_bindings_module: "outroute_guest::__private::bindings",
    });
    pub use outroute::router::types::{Message, Rejection};
}

use bindings::outroute::router::{host, types as wit};

thread_local! {
    static ROUTER: RefCell<Option<Box<dyn Any>>> = const { RefCell::new(None) };
}

pub fn describe<R: Router>() -> wit::PluginInfo {
    wit::PluginInfo {
        name: R::NAME.to_string(),
        version: R::VERSION.to_string(),
    }
}

pub fn init<R: Router>(config: String) -> Result<(), String> {
    let value = if config.trim().is_empty() {
        serde_json::Value::Null
    } else {
        serde_json::from_str(&config).map_err(|e| format!("route config is not JSON: {e}"))?
    };
    let router = R::init(value)?;
    ROUTER.with(|r| *r.borrow_mut() = Some(Box::new(router)));
    Ok(())
}

fn with_router<R: Router, T>(f: impl FnOnce(&R) -> T, fallback: impl FnOnce() -> T) -> T {
    ROUTER.with(
        |r| match r.borrow().as_ref().and_then(|b| b.downcast_ref::<R>()) {
            Some(router) => f(router),
            None => fallback(),
        },
    )
}

fn not_initialised() -> Rejection {
    Rejection::Retryable("plugin called before init".into())
}

pub fn route<R: Router>(event: wit::Event) -> wit::Outcome {
    let event = from_wit(event);
    to_wit(with_router::<R, _>(
        |r| r.route(&event),
        || Err(not_initialised()),
    ))
}

pub fn route_batch<R: Router>(events: Vec<wit::Event>) -> Vec<wit::Outcome> {
    let events: Vec<Event> = events.into_iter().map(from_wit).collect();
    let n = events.len();
    let outcomes = with_router::<R, _>(
        |r| r.route_batch(&events),
        || (0..n).map(|_| Err(not_initialised())).collect(),
    );
    outcomes.into_iter().map(to_wit).collect()
}

fn from_wit(e: wit::Event) -> Event {
    Event {
        id: e.id,
        sequence: e.sequence,
        aggregate_type: e.aggregate_type,
        aggregate_id: e.aggregate_id,
        event_type: e.event_type,
        event_version: e.event_version,
        payload: e.payload,
        headers: e.headers,
        created_at_ms: e.created_at_ms,
        attempt: e.attempt,
        json: Default::default(),
    }
}

fn to_wit(outcome: crate::Outcome) -> wit::Outcome {
    match outcome {
        Ok(messages) => Ok(messages.into_iter().map(message_to_wit).collect()),
        Err(Rejection::Retryable(r)) => Err(wit::Rejection::Retryable(r)),
        Err(Rejection::Invalid(r)) => Err(wit::Rejection::Invalid(r)),
    }
}

fn message_to_wit(m: Message) -> wit::Message {
    wit::Message {
        sink: m.sink,
        topic: m.topic,
        key: m.key,
        partition: m.partition,
        headers: m.headers,
        payload: m.payload,
    }
}

#[cfg(target_arch = "wasm32")]
pub fn log(level: Level, message: &str) {
    let level = match level {
        Level::Trace => host::Level::Trace,
        Level::Debug => host::Level::Debug,
        Level::Info => host::Level::Info,
        Level::Warn => host::Level::Warn,
        Level::Error => host::Level::Error,
    };
    host::log(level, message);
}

#[cfg(not(target_arch = "wasm32"))]
pub fn log(level: Level, message: &str) {
    let _ = host::log; // the import exists only inside a component
    eprintln!("[{level:?}] {message}");
}

#[cfg(target_arch = "wasm32")]
pub fn count(name: &str, delta: u64) {
    host::count(name, delta);
}

#[cfg(target_arch = "wasm32")]
pub fn counted(_name: &str) -> u64 {
    0
}

#[cfg(not(target_arch = "wasm32"))]
thread_local! {
    static COUNTS: RefCell<std::collections::BTreeMap<String, u64>> =
        const { RefCell::new(std::collections::BTreeMap::new()) };
}

#[cfg(not(target_arch = "wasm32"))]
pub fn count(name: &str, delta: u64) {
    let _ = host::count; // the import exists only inside a component
    COUNTS.with(|c| {
        let mut c = c.borrow_mut();
        let total = c.entry(name.to_string()).or_default();
        *total = total.saturating_add(delta);
    });
}

#[cfg(not(target_arch = "wasm32"))]
pub fn counted(name: &str) -> u64 {
    COUNTS.with(|c| c.borrow().get(name).copied().unwrap_or(0))
}
