//! Configuration: one TOML file, with `OUTROUTE_`-prefixed environment
//! variables overriding any key (`OUTROUTE_STORE__URL` sets `store.url`), so
//! secrets and per-deployment values stay out of the file.
//!
//! Loading never half-works: [`load`] parses, then [`Config::validate`]
//! checks every cross-reference (routes → plugins and sinks, allow-lists,
//! column names, budgets). Every problem is reported as `file:key: reason`
//! and the relay refuses to start. `outroute config schema` prints the JSON
//! Schema derived from these structs.
//!
//! This file holds the whole file's shape ([`Config`]); each section's
//! structs are in their own file: `relay.rs` (`[relay]`, `[http]`, `[log]`),
//! `source.rs` (`[sources.*]`/`[store]`), `sink.rs` (`[sinks.*]`),
//! `route.rs` (`[plugins.*]`, `[[routes]]`), `security.rs` (TLS,
//! credentials, secrets), `teams.rs` (grants, team files). Then `load.rs`
//! (file + environment + team files → [`Loaded`]), `validate.rs`
//! (cross-checks), `redact.rs` (URLs without secrets), `diff.rs` (what a
//! reload changes), `reference.rs` (the generated reference page).

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

mod diff;
mod grants;
mod load;
mod redact;
mod reference;
mod relay;
mod route;
mod security;
mod sink;
mod source;
mod teams;
mod validate;
pub use diff::{Changes, Diff, diff};
pub use grants::Grant;
pub use load::*;
pub use redact::*;
pub use reference::reference_markdown;
pub use relay::*;
pub use route::*;
pub use security::{
    KafkaSaslConfig, NatsAuthConfig, PgTlsConfig, PgTlsMode, SaslMechanism, Secret, TlsConfig,
};
pub use sink::*;
pub use source::*;

use figment::Figment;
use figment::providers::{Env, Format, Toml};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The whole configuration file.
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// How the relay runs: batching, concurrency, leases, wake-up.
    #[serde(default)]
    pub relay: RelayConfig,
    /// Where the outbox lives: the one-source shorthand for
    /// `[sources.default]`. Use either `[store]` or `[sources.<name>]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store: Option<StoreConfig>,
    /// The outboxes this relay serves, by name: each its own database
    /// connection pool, table mapping, lanes and leases, and its own workers
    /// (one source's backlog never holds up another's events). Routes name
    /// the sources they read (`routes[].sources`; unset: every source).
    #[serde(default)]
    pub sources: BTreeMap<String, StoreConfig>,
    /// Set when the sources came from the `[store]` shorthand (error keys
    /// then say `store.…`).
    #[serde(skip)]
    #[schemars(skip)]
    pub store_shorthand: bool,
    /// Team files (plugins and routes of one team each), relative to this
    /// file; wildcards in the file name (`teams/*.toml`).
    #[serde(default)]
    pub include: Vec<String>,
    /// Per team: the sources its routes may read and the sink patterns they
    /// may publish to.
    #[serde(default)]
    pub grants: BTreeMap<String, Grant>,
    /// Named destinations (Kafka clusters, NATS servers, files).
    #[serde(default)]
    pub sinks: BTreeMap<String, SinkConfig>,
    /// Named WebAssembly plugins.
    #[serde(default)]
    pub plugins: BTreeMap<String, PluginConfig>,
    /// Which events go to which plugin, and what that plugin may do.
    #[serde(default)]
    pub routes: Vec<RouteConfig>,
    /// HTTP endpoint for `/metrics`, `/healthz` and `/readyz`.
    #[serde(default)]
    pub http: HttpConfig,
    /// Log format and level.
    #[serde(default)]
    pub log: LogConfig,
}

impl Config {
    /// The source named `name`.
    pub fn source(&self, name: &str) -> anyhow::Result<&StoreConfig> {
        self.sources.get(name).ok_or_else(|| {
            anyhow::anyhow!(
                "no source named `{name}` (sources: {})",
                self.sources.keys().cloned().collect::<Vec<_>>().join(", ")
            )
        })
    }

    /// The config key of source `name`: `store` for the shorthand,
    /// `sources.<name>` otherwise.
    pub fn source_key(&self, name: &str) -> String {
        if self.store_shorthand {
            "store".into()
        } else {
            format!("sources.{name}")
        }
    }

    /// Does route `r` read source `name`?
    pub fn route_reads(r: &RouteConfig, source: &str) -> bool {
        r.sources.is_empty() || r.sources.iter().any(|s| s == source)
    }
}

/// The name of the `[store]` shorthand's source.
pub const DEFAULT_SOURCE: &str = "default";

#[cfg(test)]
mod tests;
