//! Operator commands: `run`, `migrate`, `status`, `failed …`, `replay`,
//! `plugin test|inspect`, `config check`. Each loads the config, talks to
//! the store (and for replay, the sinks) and prints something a person can
//! act on; `--json` where a script would want it.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use chrono::{DateTime, Utc};
use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use tokio_util::sync::CancellationToken;

use crate::config::{self, Loaded, LogFormat};
use crate::event::{Event, Rejection};
use crate::metrics::{self, Health};
use crate::plugin::{self, Limits, PluginHandle, Runtime};
use crate::relay::Relay;
use crate::store::{Cursor, Filter, Store};

/// `--config FILE` (or `OUTROUTE_CONFIG`), shared by the commands.
#[derive(Args, Clone)]
pub struct ConfigArg {
    /// Configuration file.
    #[arg(short, long, env = "OUTROUTE_CONFIG", default_value = "outroute.toml")]
    pub config: PathBuf,
}

/// An error and its causes on one line, each cause once: sqlx's database
/// errors repeat their source's text ("…: role \"x\" does not exist: role
/// \"x\" does not exist"), so a cause already ending the text is skipped.
pub fn describe(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.ends_with(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}

/// Load config or explain every problem.
pub fn load(path: &Path) -> Result<Loaded> {
    config::load(path).map_err(|e| anyhow::anyhow!("invalid configuration:\n{e}"))
}

pub fn init_logging(format: LogFormat, level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
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

async fn open_store(loaded: &Loaded, relay_id: &str) -> Result<Store> {
    let mut store = Store::connect(&loaded.config, relay_id).await?;
    store.migrate(false).await?;
    store.check_table().await?;
    Ok(store)
}

/// `outroute run`.
pub async fn run(path: &Path) -> Result<ExitCode> {
    let loaded = load(path)?;
    if let Err(e) = loaded.check_runnable() {
        bail!("invalid configuration:\n{}:{e}", path.display());
    }
    init_logging(loaded.config.log.format, &loaded.config.log.level);
    let prom = metrics::install()?;
    let id = relay_id(&loaded);
    let store = open_store(&loaded, &id).await?;
    if let Some(ddl) = store.missing_index() {
        tracing::warn!(
            table = %loaded.config.store.table().name,
            "no usable lane index: every claim scans and sorts the whole backlog. \
             Run `outroute migrate --table -c <config>`, or: {ddl}"
        );
    }
    let store = Arc::new(store);
    let health = Health::new(loaded.config.relay.stall_after);
    let relay = Arc::new(Relay::build(&loaded, store.clone(), health.clone()).await?);
    let shutdown = CancellationToken::new();
    let http = if loaded.config.http.listen.is_empty() {
        None
    } else {
        Some(
            metrics::serve(
                &loaded.config.http.listen,
                prom,
                health,
                store,
                relay.sinks.clone(),
                shutdown.clone(),
            )
            .await?,
        )
    };
    tokio::spawn(signal_shutdown(shutdown.clone()));
    tracing::info!(relay = %id, routes = relay.routes.0.len(), "outroute relay started");
    relay.run(shutdown).await?;
    if let Some(h) = http {
        let _ = tokio::time::timeout(Duration::from_secs(2), h).await;
    }
    tracing::info!("outroute relay stopped");
    Ok(ExitCode::SUCCESS)
}

async fn signal_shutdown(token: CancellationToken) {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {},
                    _ = tokio::signal::ctrl_c() => {},
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
    tracing::info!("signal received");
    token.cancel();
}

/// `outroute migrate [--table]`: coordination tables, the canonical outbox
/// table (unless `outbox` is false), and the lane index the claim walks —
/// always for the canonical table, for an existing table with `table`.
pub async fn migrate(
    path: &Path,
    outbox: bool,
    table: bool,
    add_sequence: bool,
) -> Result<ExitCode> {
    let loaded = load(path)?;
    let mut store = Store::connect(&loaded.config, "migrate").await?;
    store.migrate(outbox).await?;
    println!(
        "migrations applied to {}",
        config::redact_url(&loaded.config.store.url)
    );
    let canonical = outbox && loaded.config.store.table() == config::TableConfig::canonical();
    if !(canonical || table) {
        return Ok(ExitCode::SUCCESS);
    }
    let name = loaded.config.store.table().name;
    if add_sequence {
        let Some(pg) = store.postgres() else {
            bail!("--add-sequence: only PostgreSQL tables are mapped");
        };
        if loaded.config.store.table().sequence.is_some() {
            println!("`{name}` already has a sequence column (store.table.sequence)");
        } else {
            println!(
                "adding the sequence column `outroute_seq` to `{name}`: ALTER TABLE … ADD COLUMN … GENERATED BY DEFAULT \
                 AS IDENTITY rewrites the table under an ACCESS EXCLUSIVE lock: producers' inserts and every \
                 read of `{name}` wait until it finishes (time grows with the table's size). Rows already in the \
                 table are numbered in their physical order."
            );
            match pg.add_sequence().await? {
                true => println!("added `outroute_seq`"),
                false => println!("`outroute_seq` is already there"),
            }
            println!(
                "now set `sequence = \"outroute_seq\"` under [store.table] and run `outroute migrate --table` again: \
                 the lane index is built on the sequence, and events of one transaction go out in insert order"
            );
            return Ok(ExitCode::SUCCESS);
        }
    }
    store.check_table().await?;
    if let Some(ddl) = store.missing_index() {
        println!(
            "creating the lane index on `{name}`:\n  {ddl}\n\
             CONCURRENTLY: producers keep inserting and updating; it takes a SHARE UPDATE EXCLUSIVE lock \
             (only DDL, VACUUM and other index builds on `{name}` wait), waits for transactions already \
             running on the table, and reads the table twice (time grows with its size)."
        );
    }
    match store.create_lane_index().await? {
        Some(_) => println!("lane index on `{name}` created; claims now cost per batch"),
        None => println!("lane index on `{name}`: present"),
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn status(path: &Path, json: bool) -> Result<ExitCode> {
    let loaded = load(path)?;
    let store = open_store(&loaded, "status").await?;
    let s = store.status().await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&s)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!("table            {}", s.table);
    println!("backlog          {} events", s.backlog);
    match s.oldest_pending_age_seconds {
        Some(a) => println!("oldest pending   {a:.1}s"),
        None => println!("oldest pending   -"),
    }
    println!("retrying         {}", s.retrying);
    println!("failed           {}", s.failed);
    if !s.backlog_by_aggregate_type.is_empty() {
        println!("backlog by aggregate type:");
        for (t, n) in &s.backlog_by_aggregate_type {
            println!("  {t:<20} {n}");
        }
    }
    if !s.events_without_messages.is_empty() {
        println!("published without messages (the plugin returned none), by route:");
        for (r, n) in &s.events_without_messages {
            println!("  {r:<20} {n}");
        }
    }
    for q in &s.quarantined_routes {
        println!(
            "quarantined      route `{}` since {}: {}",
            q.route,
            q.since.format("%Y-%m-%d %H:%M:%S UTC"),
            q.reason
        );
    }
    println!("relays           {}", s.relays.len());
    for r in &s.relays {
        println!(
            "  {} (host {}, pid {}, heartbeat {:.1}s ago) holds {} lanes {:?}",
            r.relay_id,
            r.hostname,
            r.pid,
            r.heartbeat_age_seconds,
            r.lanes.len(),
            r.lanes
        );
    }
    Ok(ExitCode::SUCCESS)
}

#[derive(Subcommand)]
pub enum RouteAction {
    /// The configured routes, each with its quarantine state.
    List {
        #[command(flatten)]
        config: ConfigArg,
    },
    /// Resume a quarantined route now: every relay calls its plugin again
    /// and its waiting events are due at once.
    Resume {
        #[command(flatten)]
        config: ConfigArg,
        /// Route name.
        name: String,
    },
}

pub async fn route(action: RouteAction) -> Result<ExitCode> {
    match action {
        RouteAction::List { config } => {
            let loaded = load(&config.config)?;
            let store = open_store(&loaded, "route").await?;
            let quarantined = store.quarantined_routes().await?;
            for r in &loaded.config.routes {
                match quarantined.iter().find(|q| q.route == r.name) {
                    Some(q) => println!(
                        "{:<24} quarantined since {}: {}",
                        r.name,
                        q.since.format("%Y-%m-%d %H:%M:%S UTC"),
                        q.reason
                    ),
                    None => println!("{:<24} flowing", r.name),
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        RouteAction::Resume { config, name } => {
            let loaded = load(&config.config)?;
            if !loaded.config.routes.iter().any(|r| r.name == name) {
                bail!("no route named `{name}` in {}", config.config.display());
            }
            let store = open_store(&loaded, "route").await?;
            let (was, due) = store.resume_route(&name).await?;
            if was {
                println!("route `{name}` resumed; {due} waiting events are due now");
            } else {
                println!("route `{name}` was not quarantined; {due} waiting events are due now");
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

#[derive(Args, Clone, Default)]
pub struct FilterArgs {
    /// Only these event ids.
    #[arg(long = "id")]
    pub ids: Vec<String>,
    #[arg(long)]
    pub route: Option<String>,
    #[arg(long)]
    pub event_type: Option<String>,
    #[arg(long)]
    pub aggregate_type: Option<String>,
    #[arg(long)]
    pub aggregate_id: Option<String>,
}

impl FilterArgs {
    fn filter(&self) -> Filter {
        Filter {
            ids: self.ids.clone(),
            route: self.route.clone(),
            event_type: self.event_type.clone(),
            aggregate_type: self.aggregate_type.clone(),
            aggregate_id: self.aggregate_id.clone(),
            ..Filter::default()
        }
    }
}

#[derive(Subcommand)]
pub enum FailedAction {
    /// List failed events.
    List {
        #[command(flatten)]
        config: ConfigArg,
        #[command(flatten)]
        filter: FilterArgs,
        /// Include discarded events.
        #[arg(long)]
        all: bool,
        #[arg(long)]
        json: bool,
    },
    /// Show one failed event in full.
    Show {
        #[command(flatten)]
        config: ConfigArg,
        id: String,
    },
    /// Put failed events back in line (attempts reset, outbox order kept).
    Retry {
        #[command(flatten)]
        config: ConfigArg,
        #[command(flatten)]
        filter: FilterArgs,
    },
    /// Give up on failed events; they stop holding back their aggregate.
    Discard {
        #[command(flatten)]
        config: ConfigArg,
        #[command(flatten)]
        filter: FilterArgs,
    },
}

fn require_filter(f: &FilterArgs) -> Result<()> {
    if f.ids.is_empty()
        && f.route.is_none()
        && f.event_type.is_none()
        && f.aggregate_type.is_none()
        && f.aggregate_id.is_none()
    {
        bail!("name the events: --id, --route, --event-type, --aggregate-type or --aggregate-id");
    }
    Ok(())
}

pub async fn failed(action: FailedAction) -> Result<ExitCode> {
    match action {
        FailedAction::List {
            config,
            filter,
            all,
            json,
        } => {
            let store = open_store(&load(&config.config)?, "failed").await?;
            let f = Filter {
                include_discarded: all,
                ..filter.filter()
            };
            let list = store.failed_list(&f).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&list)?);
            } else if list.is_empty() {
                println!("no failed events");
            } else {
                println!(
                    "{:<38} {:<12} {:<16} {:<20} {:>3}  reason",
                    "id", "aggregate", "aggregate id", "event type", "att"
                );
                for e in &list {
                    println!(
                        "{:<38} {:<12} {:<16} {:<20} {:>3}  {}{}",
                        e.id,
                        e.aggregate_type,
                        e.aggregate_id,
                        e.event_type,
                        e.attempts,
                        e.reason.as_deref().unwrap_or("-"),
                        if e.discarded_at.is_some() {
                            " (discarded)"
                        } else {
                            ""
                        }
                    );
                }
                println!("{} failed event(s)", list.len());
            }
            Ok(ExitCode::SUCCESS)
        }
        FailedAction::Show { config, id } => {
            let store = open_store(&load(&config.config)?, "failed").await?;
            let f = Filter {
                ids: vec![id.clone()],
                include_discarded: true,
                ..Filter::default()
            };
            match store.failed_list(&f).await?.into_iter().next() {
                Some(e) => {
                    println!("{}", serde_json::to_string_pretty(&e)?);
                    Ok(ExitCode::SUCCESS)
                }
                None => {
                    eprintln!("no failed event with id {id}");
                    Ok(ExitCode::FAILURE)
                }
            }
        }
        FailedAction::Retry { config, filter } => {
            require_filter(&filter)?;
            let store = open_store(&load(&config.config)?, "failed").await?;
            let n = store.failed_retry(&filter.filter()).await?;
            println!("{n} event(s) put back in line");
            Ok(ExitCode::SUCCESS)
        }
        FailedAction::Discard { config, filter } => {
            require_filter(&filter)?;
            let store = open_store(&load(&config.config)?, "failed").await?;
            let n = store.failed_discard(&filter.filter()).await?;
            println!("{n} event(s) discarded");
            Ok(ExitCode::SUCCESS)
        }
    }
}

#[derive(Args)]
pub struct ReplayArgs {
    #[command(flatten)]
    config: ConfigArg,
    /// Events created at or after this time (RFC 3339).
    #[arg(long)]
    since: Option<DateTime<Utc>>,
    /// Events created before this time (RFC 3339).
    #[arg(long)]
    until: Option<DateTime<Utc>>,
    #[arg(long)]
    aggregate_type: Option<String>,
    #[arg(long)]
    aggregate_id: Option<String>,
    #[arg(long)]
    event_type: Option<String>,
    /// Count what would be re-published, publish nothing.
    #[arg(long)]
    dry_run: bool,
}

pub async fn replay(a: ReplayArgs) -> Result<ExitCode> {
    let loaded = load(&a.config.config)?;
    init_logging(loaded.config.log.format, "warn");
    if a.since.is_none()
        && a.until.is_none()
        && a.aggregate_type.is_none()
        && a.aggregate_id.is_none()
        && a.event_type.is_none()
    {
        bail!(
            "replay needs a selection: --since/--until, --aggregate-type, --aggregate-id or --event-type"
        );
    }
    let filter = Filter {
        since: a.since,
        until: a.until,
        aggregate_type: a.aggregate_type,
        aggregate_id: a.aggregate_id,
        event_type: a.event_type,
        ..Filter::default()
    };
    let store = Arc::new(open_store(&loaded, "replay").await?);
    let total = store.published_count(&filter).await?;
    if a.dry_run {
        println!("{total} published event(s) match; nothing re-published (dry run)");
        return Ok(ExitCode::SUCCESS);
    }
    let relay = Relay::build(
        &loaded,
        store.clone(),
        Health::new(Duration::from_secs(3600)),
    )
    .await?;
    let bar = ProgressBar::new(total as u64).with_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} events ({per_sec}, eta {eta})")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let (mut selected, mut sent, mut failed) = (0usize, 0usize, Vec::new());
    let mut after: Option<Cursor> = None;
    let run = Utc::now().format("%Y%m%dT%H%M%S").to_string();
    loop {
        let page = store.published(&filter, after.as_ref(), 500).await?;
        let Some(last) = page.last() else { break };
        after = Some(Cursor::after(last));
        let n = page.len();
        selected += n;
        let (ok, bad) = relay.replay_batch(page, &run).await;
        sent += ok.len();
        failed.extend(bad);
        bar.inc(n as u64);
    }
    bar.finish_and_clear();
    for sink in relay.sinks.values() {
        sink.flush().await;
    }
    println!(
        "selected {selected} published event(s); re-published {sent}; {} could not be",
        failed.len()
    );
    for (id, reason) in failed.iter().take(20) {
        println!("  {id}: {reason}");
    }
    if sent != selected {
        eprintln!(
            "replay incomplete: {} of {selected} selected event(s) were not re-published",
            selected - sent
        );
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

#[derive(Subcommand)]
pub enum PluginAction {
    /// Route sample events through a plugin and print the messages or the
    /// rejection as JSON.
    Test {
        /// The compiled plugin (.wasm).
        plugin: PathBuf,
        /// Route config handed to the plugin's init (JSON text or @file).
        #[arg(long, default_value = "null")]
        config: String,
        /// Event file (one JSON event or an array); `-` for standard input.
        #[arg(long, default_value = "-")]
        event: String,
        /// CPU budget per event.
        #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
        cpu_budget: Duration,
        /// Memory cap in MiB.
        #[arg(long, default_value_t = 64)]
        memory_mib: u32,
    },
    /// Print the plugin's world, imports, exports, name and version.
    Inspect { plugin: PathBuf },
}

fn plugin_runtime() -> Result<Runtime> {
    Runtime::new(config::default_plugin_cache())
}

/// A sample event as `plugin test` reads it; everything but the type and
/// payload has a default.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct SampleEvent {
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    sequence: i64,
    aggregate_type: String,
    aggregate_id: String,
    event_type: String,
    #[serde(default = "one")]
    event_version: u32,
    payload: serde_json::Value,
    #[serde(default)]
    headers: std::collections::BTreeMap<String, String>,
    #[serde(default)]
    created_at: Option<DateTime<Utc>>,
}

fn one() -> u32 {
    1
}

fn read_text(arg: &str) -> Result<String> {
    if arg == "-" {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .context("reading standard input")?;
        Ok(s)
    } else {
        let p = arg.strip_prefix('@').unwrap_or(arg);
        std::fs::read_to_string(p).with_context(|| format!("reading {p}"))
    }
}

pub async fn plugin(action: PluginAction) -> Result<ExitCode> {
    match action {
        PluginAction::Inspect { plugin } => {
            let rt = plugin_runtime()?;
            let info = tokio::task::spawn_blocking(move || plugin::inspect(&rt, &plugin)).await??;
            println!("{}", serde_json::to_string_pretty(&info)?);
            Ok(ExitCode::SUCCESS)
        }
        PluginAction::Test {
            plugin,
            config,
            event,
            cpu_budget,
            memory_mib,
        } => {
            let config_text = if config.starts_with('@') {
                read_text(&config)?
            } else {
                config
            };
            let config: serde_json::Value =
                serde_json::from_str(&config_text).context("--config is not JSON")?;
            let text = read_text(&event)?;
            let value: serde_json::Value =
                serde_json::from_str(&text).context("--event is not JSON")?;
            let samples: Vec<SampleEvent> = match value {
                serde_json::Value::Array(_) => serde_json::from_value(value),
                other => serde_json::from_value(other).map(|e| vec![e]),
            }
            .context("--event: expected {aggregate_type, aggregate_id, event_type, payload, …} or a list of them")?;
            let events: Vec<Event> = samples
                .into_iter()
                .enumerate()
                .map(|(i, s)| Event {
                    id: s.id.unwrap_or_else(|| uuid::Uuid::new_v4().to_string()),
                    sequence: if s.sequence == 0 {
                        i as i64 + 1
                    } else {
                        s.sequence
                    },
                    aggregate_type: s.aggregate_type,
                    aggregate_id: s.aggregate_id,
                    event_type: s.event_type,
                    event_version: s.event_version,
                    payload: s.payload.to_string().into_bytes(),
                    headers: s.headers.into_iter().collect(),
                    created_at: s.created_at.unwrap_or_else(Utc::now),
                    attempts: 0,
                })
                .collect();
            let rt = plugin_runtime()?;
            let limits = Limits {
                cpu_budget,
                memory_bytes: (memory_mib as usize) << 20,
                log_lines_per_event: 100,
                log_bytes_per_event: 64 << 10,
                max_idle_bytes: 0,
            };
            let outcomes = tokio::task::spawn_blocking(move || -> Result<_> {
                let handle = PluginHandle::load(&rt, &plugin, config, limits)?;
                let p = handle.current().context("plugin unavailable")?;
                Ok(events
                    .iter()
                    .zip(p.route_batch(&events))
                    .map(|(e, a)| (e.id.clone(), a.into_outcome()))
                    .collect::<Vec<_>>())
            })
            .await??;
            let mut all_ok = true;
            let out: Vec<serde_json::Value> = outcomes
                .into_iter()
                .map(|(id, o)| match o {
                    Ok(msgs) => serde_json::json!({
                        "event_id": id,
                        "messages": msgs.iter().map(|m| serde_json::json!({
                            "sink": m.sink,
                            "topic": m.topic,
                            "key": m.key.as_ref().map(|k| String::from_utf8_lossy(k).into_owned()),
                            "partition": m.partition,
                            "headers": m.headers.iter().cloned().collect::<std::collections::BTreeMap<_, _>>(),
                            "payload": serde_json::from_slice::<serde_json::Value>(&m.payload)
                                .unwrap_or_else(|_| serde_json::json!(String::from_utf8_lossy(&m.payload))),
                        })).collect::<Vec<_>>(),
                    }),
                    Err(r) => {
                        all_ok = false;
                        let kind = match r {
                            Rejection::Retryable(_) => "retryable",
                            Rejection::Invalid(_) => "invalid",
                        };
                        serde_json::json!({"event_id": id, "rejection": {"kind": kind, "reason": r.reason()}})
                    }
                })
                .collect();
            println!("{}", serde_json::to_string_pretty(&out)?);
            Ok(if all_ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(3)
            })
        }
    }
}

pub async fn config_check(path: &Path, store: bool) -> Result<ExitCode> {
    let l = match config::load(path) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("{e}");
            return Ok(ExitCode::FAILURE);
        }
    };
    if let Err(e) = l.check_runnable() {
        eprintln!("{}:{e}", path.display());
        return Ok(ExitCode::FAILURE);
    }
    println!(
        "{}: ok ({} routes, {} sinks, {} plugins)",
        path.display(),
        l.config.routes.len(),
        l.config.sinks.len(),
        l.config.plugins.len()
    );
    let table = l.config.store.table();
    if table.sequence.is_none()
        && l.config.relay.ordering != config::Ordering::None
        && l.config.store.url.starts_with("postgres")
    {
        println!(
            "warning: store.table.sequence is unset: `{}` is ordered by ({}, id); ordering = \"{}\" orders \
             events across transactions, but two events of one aggregate with the same timestamp (one \
             transaction using now()) go out in id order. `outroute migrate --table --add-sequence -c {}` \
             adds a sequence column that keeps insert order.",
            table.name,
            table.created_at,
            serde_json::to_value(l.config.relay.ordering)
                .ok()
                .and_then(|v| v.as_str().map(str::to_string))
                .unwrap_or_default(),
            path.display()
        );
    }
    if store {
        let name = l.config.store.table().name;
        let mut s = Store::connect(&l.config, "config-check")
            .await
            .context("store.url")?;
        s.check_table().await?;
        match s.missing_index() {
            None => println!("store: table `{name}` ok, lane index usable"),
            Some(ddl) => println!(
                "store: table `{name}` ok\nwarning: store.table: `{name}` has no usable lane index: every claim \
                 would scan and sort the whole backlog. Run `outroute migrate --table -c {}`, or:\n  {ddl}",
                path.display()
            ),
        }
    }
    Ok(ExitCode::SUCCESS)
}
