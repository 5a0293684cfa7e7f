//! `outroute`: the transactional-outbox relay with WebAssembly routing
//! plugins. The binary (`main.rs`) is the command line; this library holds the
//! modules it calls into, so the end-to-end tests can drive them too:
//!
//! * `relay`   — the run loop (row → event → plugin → messages → acks → mark)
//! * `store`   — the outbox table, leases, failure state (PostgreSQL, MySQL, SQLite)
//! * `capture` — log-based capture: events streamed from a replication slot
//! * `plugin`  — the sandboxed wasmtime runtime for routing plugins
//! * `sink`    — Kafka, NATS and file publishers that wait for acks
//! * `routing` — which route handles an event, what its messages may do
//! * `pattern` — name and topic patterns: syntax and matching
//! * `config`  — the TOML file, its schema and its validation
//! * `metrics` — every Prometheus series, named once
//! * `http`    — `/metrics`, `/healthz`, `/readyz`, `/shadow`
//! * `console` — the operator console in the browser (`/console`), per team
//! * `health`  — which sources, sinks and routes are up (`/readyz`)
//! * `topology` — the sources of one process, each brought up on its own
//! * `shadow`  — a candidate plugin version compared on live events
//! * `trial`   — a candidate plugin tried on a route's recent events
//! * `reconcile` — the outbox's published events against what the brokers hold
//! * `ops`     — status, failed events, replay, plugin test (operator tools)
//! * `backoff`, `error` — retry delays with jitter; errors on one line

pub mod backoff;
pub mod capture;
pub mod config;
pub mod console;
pub mod error;
pub mod event;
pub mod failpoint;
pub mod health;
pub mod http;
pub mod metrics;
pub mod ops;
pub mod pattern;
pub mod pipeline;
pub mod plugin;
pub mod quarantine;
pub mod quickstart;
pub mod reconcile;
pub mod relay;
pub mod routing;
pub mod scaffold;
pub mod shadow;
pub mod sink;
pub mod store;
pub mod topology;
pub mod trial;

/// Make ring the process's TLS provider, once. Two rustls providers are
/// compiled in (pgwire-replication's TLS brings aws-lc-rs beside ring, see
/// `host/Cargo.toml`), and a TLS client that does not name its own (the
/// NATS client, the replication connection) then finds none and panics.
/// Called before any such client is built.
pub fn tls_provider() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}
