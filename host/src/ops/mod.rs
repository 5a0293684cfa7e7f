//! Operator commands: `run`, `migrate`, `status`, `failed …`, `replay`,
//! `reconcile`, `plugin …`, `config check`. Each loads the config, talks to the store
//! (and for replay, the sinks) and prints something a person can act on;
//! `--json` where a script would want it. One file per command family; this
//! one holds what they share (the `--config` argument, loading, logging,
//! opening a source's store).

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use chrono::{DateTime, Utc};
use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use tokio_util::sync::CancellationToken;

use crate::config::{self, Loaded, LogFormat};
use crate::event::{Event, Rejection};
use crate::health::{self, Health};
use crate::metrics;
use crate::plugin::{self, Limits, PluginHandle, Runtime};
use crate::relay::Relay;
use crate::store::{Cursor, Filter, Store};
use crate::topology::Topology;

mod config_check;
mod failed;
mod migrate;
mod plugins;
mod reconcile;
mod replay;
mod run;
mod status;

pub use config_check::{config_check, config_diff};
pub use failed::{FailedAction, FilterArgs, failed};
pub use migrate::migrate;
pub use plugins::{PluginAction, plugin};
pub use reconcile::{ReconcileArgs, reconcile};
pub use replay::{ReplayArgs, replay};
pub use run::run;
pub use status::{RouteAction, SlotAction, route, slot, status};

/// `--config FILE` (or `OUTROUTE_CONFIG`) and `--source NAME`, shared by
/// the commands.
#[derive(Args, Clone)]
pub struct ConfigArg {
    /// Configuration file.
    #[arg(short, long, env = "OUTROUTE_CONFIG", default_value = "outroute.toml")]
    pub config: PathBuf,
    /// Only this source (`[sources.<name>]`; `default` for `[store]`).
    /// Unset: every source.
    #[arg(long)]
    pub source: Option<String>,
}

impl ConfigArg {
    /// Load the config, keeping only `--source` when given.
    pub fn load(&self) -> Result<Loaded> {
        let mut loaded = load(&self.config)?;
        if let Some(only) = &self.source {
            loaded.config.source(only)?;
            loaded.config.sources.retain(|name, _| name == only);
        }
        Ok(loaded)
    }
}

/// The names of the sources in `loaded`, each with a heading printer: a
/// command working on several sources prints `source <name>:` before each.
fn sources(loaded: &Loaded) -> Vec<String> {
    loaded.config.sources.keys().cloned().collect()
}

fn heading(loaded: &Loaded, name: &str) {
    if loaded.config.sources.len() > 1 {
        println!("source {name}:");
    }
}

/// The sources a command over every source could not do. One unreachable
/// database never stops the others: each failure is reported when it
/// happens and the command goes on; [`Failures::finish`] then exits
/// non-zero naming them. With a single source its error is the command's.
struct Failures {
    sources: usize,
    failed: Vec<String>,
}

impl Failures {
    fn new(loaded: &Loaded) -> Self {
        Failures {
            sources: loaded.config.sources.len(),
            failed: Vec::new(),
        }
    }

    /// Source `source` failed with `e`: reported now (an error only when
    /// it is the only source).
    fn add(&mut self, source: &str, e: anyhow::Error) -> Result<()> {
        if self.sources <= 1 {
            return Err(e);
        }
        eprintln!("source `{source}` failed: {}", describe(&e));
        self.failed.push(source.to_string());
        Ok(())
    }

    fn finish(self) -> Result<()> {
        if self.failed.is_empty() {
            return Ok(());
        }
        bail!(
            "{} of {} sources failed (each reported above): {}",
            self.failed.len(),
            self.sources,
            self.failed.join(", ")
        )
    }
}

pub use crate::error::describe;

/// Load config or explain every problem.
pub fn load(path: &Path) -> Result<Loaded> {
    config::load(path).map_err(|e| anyhow::anyhow!("invalid configuration:\n{e}"))
}

pub fn init_logging(format: LogFormat, level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    // Colours only for a terminal: a log file or journald gets plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Human => builder.try_init(),
        LogFormat::Json => builder
            .json()
            .with_current_span(true)
            .with_span_list(true)
            .try_init(),
    };
}

fn relay_id(loaded: &Loaded) -> String {
    loaded.config.relay.id.clone().unwrap_or_else(|| {
        let host = hostname::get()
            .map(|h| h.to_string_lossy().into_owned())
            .unwrap_or_else(|_| "relay".into());
        let short = uuid::Uuid::new_v4().simple().to_string();
        format!("{host}-{}-{}", std::process::id(), &short[..8])
    })
}

/// A store for a one-shot command (`status`, `failed`, `replay`, …):
/// connected, coordination tables migrated, table checked. Unlike the
/// relay's `topology::open_store` it opens no connections ahead and does
/// not warn about indexes.
async fn open_for_command(loaded: &Loaded, source: &str, relay_id: &str) -> Result<Store> {
    let mut store = Store::connect(&loaded.config, source, relay_id).await?;
    store.migrate(false).await?;
    store.check_table().await?;
    Ok(store)
}

/// `GET path` from the relay's HTTP listener (with `token` as bearer, if
/// given); the body of a 200 answer.
pub(super) async fn http_get(listen: &str, path: &str, token: Option<&str>) -> Result<String> {
    let (head, body) = http_answer(listen, path, token).await?;
    if !head.starts_with("HTTP/1.1 200") && !head.starts_with("HTTP/1.0 200") {
        bail!("{}", head.lines().next().unwrap_or(&head));
    }
    Ok(body)
}

/// `GET path` from the relay's HTTP listener: the status line and headers,
/// and the body, whatever the status.
pub(super) async fn http_answer(
    listen: &str,
    path: &str,
    token: Option<&str>,
) -> Result<(String, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::time::timeout(
        Duration::from_secs(5),
        tokio::net::TcpStream::connect(listen),
    )
    .await
    .map_err(|_| anyhow!("no answer within 5s"))??;
    stream
        .write_all(
            format!(
                "GET {path} HTTP/1.0\r\nHost: {listen}\r\n{}\r\n",
                token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"))
            )
            .as_bytes(),
        )
        .await?;
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut answer))
        .await
        .map_err(|_| anyhow!("no answer within 5s"))??;
    let answer = String::from_utf8_lossy(&answer);
    let (head, body) = answer
        .split_once("\r\n\r\n")
        .ok_or_else(|| anyhow!("not an HTTP answer"))?;
    Ok((head.to_string(), body.to_string()))
}
