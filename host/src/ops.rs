//! Operator commands: `run`, `migrate`, `status`, `failed …`, `replay`,
//! `plugin test|inspect`, `config check`. Each loads the config, talks to
//! the store (and for replay, the sinks) and prints something a person can
//! act on; `--json` where a script would want it.

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

/// `outroute run`: every source of the config (or `--source`), until
/// SIGTERM/SIGINT; SIGHUP (or a changed file, with
/// `relay.config_watch_interval`) reloads the config.
pub async fn run(arg: &ConfigArg) -> Result<ExitCode> {
    let path = arg.config.as_path();
    let loaded = arg.load()?;
    if let Err(e) = loaded.check_runnable() {
        bail!("invalid configuration:\n{}:{e}", path.display());
    }
    init_logging(loaded.config.log.format, &loaded.config.log.level);
    let prom = metrics::install()?;
    let id = relay_id(&loaded);
    let ready = health::Readiness::default();
    let watch = loaded.config.relay.config_watch_interval;
    let mut stamp = files_stamp(&loaded);
    let http_listen = loaded.config.http.listen.clone();
    // Listen for SIGHUP before anything else: its default action ends the
    // process.
    let mut hup = reload_signal();
    // Health first: `/readyz` says what is still coming up.
    let shutdown = CancellationToken::new();
    let http = if http_listen.is_empty() {
        None
    } else {
        Some(
            crate::http::serve(
                &http_listen,
                prom,
                ready.clone(),
                loaded.config.http.token.clone(),
                shutdown.clone(),
            )
            .await?,
        )
    };
    loaded.report_teams();
    for w in loaded.transport_warnings() {
        tracing::warn!("insecure transport: {w}");
    }
    let mut topology = Topology::start(loaded, id.clone(), ready).await?;
    tokio::spawn(signal_shutdown(shutdown.clone()));
    tracing::info!(relay = %id, routes = topology.route_count(), "outroute relay started");
    loop {
        let reason = tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = next_hup(&mut hup) => "SIGHUP",
            _ = tokio::time::sleep(watch.unwrap_or(Duration::from_secs(3600))) => {
                let now = files_stamp_of(&stamp.0);
                if watch.is_none() || now == stamp.1 {
                    continue;
                }
                "a config file changed"
            }
        };
        reload(&mut topology, arg, reason).await;
        stamp = files_stamp(topology.loaded());
    }
    topology.stop().await;
    if let Some(h) = http {
        let _ = tokio::time::timeout(Duration::from_secs(2), h).await;
    }
    tracing::info!("outroute relay stopped");
    Ok(ExitCode::SUCCESS)
}

/// Load, validate and apply the config again; a refused change leaves the
/// running one as it was.
async fn reload(topology: &mut Topology, arg: &ConfigArg, reason: &str) {
    tracing::info!("{reason}: reloading {}", arg.config.display());
    let started = std::time::Instant::now();
    let outcome = match arg.load() {
        Err(e) => Err(e),
        Ok(new) => match new.check_runnable() {
            Err(e) => Err(anyhow::anyhow!("{}:{e}", arg.config.display())),
            Ok(()) => topology.reload(new).await,
        },
    };
    if outcome.is_ok() {
        topology.loaded().report_teams();
    }
    let result = match &outcome {
        Ok(d) if d.is_empty() => "unchanged",
        Ok(_) => "applied",
        Err(_) => "rejected",
    };
    ::metrics::counter!(metrics::CONFIG_RELOADS, "result" => result).increment(1);
    match outcome {
        Ok(d) => tracing::info!(
            result,
            "config reload {result} in {} ms:\n{d}",
            started.elapsed().as_millis()
        ),
        Err(e) => tracing::error!(
            result,
            "config reload rejected; the running config is unchanged: {}",
            describe(&e)
        ),
    }
}

/// The config's files and their modification times.
fn files_stamp(loaded: &Loaded) -> (Vec<PathBuf>, Vec<Option<std::time::SystemTime>>) {
    let files = loaded.watched.clone();
    let stamps = files_stamp_of(&files);
    (files, stamps)
}

fn files_stamp_of(files: &[PathBuf]) -> Vec<Option<std::time::SystemTime>> {
    files
        .iter()
        .map(|f| std::fs::metadata(f).and_then(|m| m.modified()).ok())
        .collect()
}

#[cfg(unix)]
type Hup = Option<tokio::signal::unix::Signal>;
#[cfg(not(unix))]
type Hup = Option<()>;

fn reload_signal() -> Hup {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::hangup()) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!("cannot listen for SIGHUP (config reload): {e}");
                None
            }
        }
    }
    #[cfg(not(unix))]
    None
}

async fn next_hup(hup: &mut Hup) {
    #[cfg(unix)]
    if let Some(s) = hup {
        s.recv().await;
        return;
    }
    let _ = hup;
    std::future::pending::<()>().await
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
    arg: &ConfigArg,
    outbox: bool,
    table: bool,
    add_sequence: bool,
) -> Result<ExitCode> {
    let loaded = arg.load()?;
    let mut failures = Failures::new(&loaded);
    for source in sources(&loaded) {
        heading(&loaded, &source);
        if let Err(e) = migrate_source(&loaded, &source, outbox, table, add_sequence).await {
            failures.add(&source, e)?;
        }
    }
    failures.finish()?;
    Ok(ExitCode::SUCCESS)
}

async fn migrate_source(
    loaded: &Loaded,
    source: &str,
    outbox: bool,
    table: bool,
    add_sequence: bool,
) -> Result<()> {
    let sc = loaded.config.source(source)?;
    let key = loaded.config.source_key(source);
    let logical = sc.logical(source);
    // Tableless capture reads logical messages: no outbox table to create.
    let outbox = outbox
        && !logical
            .as_ref()
            .is_some_and(|l| l.input == config::LogicalInput::Messages);
    let mut store = Store::connect(&loaded.config, source, "migrate").await?;
    store.migrate(outbox).await?;
    println!("migrations applied to {}", config::redact_url(&sc.url));
    if let Some(pg) = store.logical() {
        if outbox {
            // Before the slot: rows published through a pending queue
            // would look unpublished to the slot's backfill.
            pg.refuse_leftover_queue().await?;
        }
        for line in pg.setup_capture().await? {
            println!("{line}");
        }
        // Streamed, never claimed: no lane index to build.
        return Ok(());
    }
    let canonical =
        outbox && (sc.table.is_none() || sc.table() == config::TableConfig::canonical());
    if !(canonical || table) {
        return Ok(());
    }
    let name = sc.table().name;
    if add_sequence {
        let Some(pg) = store.postgres() else {
            bail!("--add-sequence: only PostgreSQL tables are mapped");
        };
        if sc.table().sequence.is_some() {
            println!("`{name}` already has a sequence column ({key}.table.sequence)");
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
                "now set `sequence = \"outroute_seq\"` under [{key}.table] and run `outroute migrate --table` again: \
                 the lane index is built on the sequence, and events of one transaction go out in insert order"
            );
            return Ok(());
        }
    }
    store.check_table().await?;
    if store.queue_marking() {
        if let Some(ddl) = store.missing_index() {
            println!(
                "setting up the pending queue of `{name}`:\n{ddl}\n\
                 One transaction: CREATE TRIGGER takes a SHARE ROW EXCLUSIVE lock on `{name}`, waits for the \
                 inserts in flight and holds new ones until the rows already pending are listed (time grows \
                 with their number; reads go on)."
            );
        }
        match store.create_lane_index().await? {
            Some(_) => {
                println!("pending queue of `{name}` set up; claims now walk only pending events")
            }
            None => {
                println!("pending queue of `{name}`: present");
                if let Some(pg) = store.postgres()
                    && pg.refresh_queue_function().await?.is_some()
                {
                    println!(
                        "its trigger function and `outroute_requeue` (follows producers' updates of a pending \
                         row's aggregate or sequence number) are up to date"
                    );
                }
            }
        }
        if let Some(pg) = store.postgres() {
            for index in pg.lane_indexes().await? {
                println!(
                    "note: the lane index {index} is not read under the pending queue, but producers still \
                     pay an index insert per event: DROP INDEX CONCURRENTLY {index};"
                );
            }
        }
        return Ok(());
    }
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
    Ok(())
}

/// `outroute status`: per source. `--json` prints one object for one source,
/// else an object keyed by source name.
pub async fn status(arg: &ConfigArg, json: bool) -> Result<ExitCode> {
    let loaded = arg.load()?;
    let mut all = serde_json::Map::new();
    let mut failures = Failures::new(&loaded);
    for source in sources(&loaded) {
        let status = async {
            let store = open_for_command(&loaded, &source, "status").await?;
            store.status().await
        }
        .await
        .with_context(|| format!("source `{source}`"));
        let s = match status {
            Ok(s) => s,
            Err(e) => {
                if json {
                    all.insert(source.clone(), serde_json::json!({ "error": describe(&e) }));
                } else {
                    heading(&loaded, &source);
                    println!("unreachable      {}", describe(&e));
                }
                failures.add(&source, e)?;
                continue;
            }
        };
        if json {
            all.insert(source.clone(), serde_json::to_value(&s)?);
            continue;
        }
        heading(&loaded, &source);
        print_status(&s);
    }
    if json {
        let out = if all.len() == 1 {
            all.into_iter().next().map(|(_, v)| v).unwrap_or_default()
        } else {
            serde_json::Value::Object(all)
        };
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        print_relay_parts(&loaded).await;
    }
    failures.finish()?;
    Ok(ExitCode::SUCCESS)
}

/// What the relay serving this config (at `http.listen`) says of its parts
/// — sources, sinks, routes — and since when they are down: its `/readyz`.
/// A relay that does not answer is said so; that is no error here.
async fn print_relay_parts(loaded: &Loaded) {
    let listen = &loaded.config.http.listen;
    if listen.is_empty() || listen.ends_with(":0") {
        return;
    }
    match http_answer(listen, "/readyz?strict", None).await {
        Ok((_, body)) => {
            println!("relay at {listen}:");
            for line in body.lines() {
                println!("  {line}");
            }
        }
        Err(e) => println!("relay at {listen}: not answering ({e})"),
    }
}

fn print_status(s: &crate::store::Status) {
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
    if let Some(slot) = &s.slot {
        println!(
            "slot             {} ({}), confirmed {}, {} bytes of WAL kept behind it{}",
            slot.slot,
            match slot.active_pid {
                Some(p) => format!("streaming, backend {p}"),
                None => "idle".into(),
            },
            slot.confirmed_flush_lsn.as_deref().unwrap_or("-"),
            slot.lag_bytes,
            match slot.wal_status.as_deref() {
                Some("lost") => ": LOST (WAL past max_slot_wal_keep_size was removed)".to_string(),
                Some(w) => format!(", WAL {w}"),
                None => String::new(),
            }
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
}

#[derive(Subcommand)]
pub enum SlotAction {
    /// Drop the replication slot of each `capture = "logical"` source (or
    /// `--source`): the server stops keeping WAL for it. Events not yet
    /// confirmed are then only in the table (table input) — or gone
    /// (message input). Refused while a relay streams from it.
    Drop {
        #[command(flatten)]
        config: ConfigArg,
    },
}

/// `outroute slot drop`.
pub async fn slot(action: SlotAction) -> Result<ExitCode> {
    let SlotAction::Drop { config } = action;
    let loaded = config.load()?;
    let mut any = false;
    for source in sources(&loaded) {
        let store = Store::connect(&loaded.config, &source, "slot").await?;
        let Some(pg) = store.logical() else {
            continue;
        };
        any = true;
        let slot = pg.logical().map(|l| l.slot.clone()).unwrap_or_default();
        match pg.drop_slot().await? {
            true => println!("source {source}: dropped replication slot `{slot}`"),
            false => println!("source {source}: replication slot `{slot}` does not exist"),
        }
    }
    if !any {
        bail!(
            "no source of {} has `capture = \"logical\"`",
            config.config.display()
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
            let loaded = config.load()?;
            for source in sources(&loaded) {
                heading(&loaded, &source);
                let store = open_for_command(&loaded, &source, "route").await?;
                let quarantined = store.quarantined_routes().await?;
                for r in loaded
                    .config
                    .routes
                    .iter()
                    .filter(|r| config::Config::route_reads(r, &source))
                {
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
            }
            Ok(ExitCode::SUCCESS)
        }
        RouteAction::Resume { config, name } => {
            let loaded = config.load()?;
            let Some(route) = loaded.config.routes.iter().find(|r| r.name == name) else {
                bail!("no route named `{name}` in {}", config.config.display());
            };
            for source in sources(&loaded) {
                if !config::Config::route_reads(route, &source) {
                    continue;
                }
                heading(&loaded, &source);
                let store = open_for_command(&loaded, &source, "route").await?;
                let (was, due) = store.resume_route(&name).await?;
                if was {
                    println!("route `{name}` resumed; {due} waiting events are due now");
                } else {
                    println!(
                        "route `{name}` was not quarantined; {due} waiting events are due now"
                    );
                }
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
    /// Repair the row kept with a failed event parked by log-based capture
    /// (its table row may be gone): `--set payload='{"n":1}'`; then
    /// `failed retry` reads it again.
    Edit {
        #[command(flatten)]
        config: ConfigArg,
        id: String,
        /// FIELD=VALUE: aggregate_type, aggregate_id, event_type,
        /// event_version, payload or headers.
        #[arg(long = "set", value_name = "FIELD=VALUE", required = true)]
        set: Vec<String>,
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
            let loaded = config.load()?;
            let f = Filter {
                include_discarded: all,
                ..filter.filter()
            };
            let mut list = Vec::new();
            let mut failures = Failures::new(&loaded);
            for source in sources(&loaded) {
                match failed_of(&loaded, &source, &f).await {
                    Ok(found) => list.extend(found.into_iter().map(|e| (source.clone(), e))),
                    Err(e) => failures.add(&source, e)?,
                }
            }
            let many = loaded.config.sources.len() > 1;
            if json {
                let rows: Vec<serde_json::Value> = list
                    .iter()
                    .map(|(source, e)| {
                        let mut v = serde_json::to_value(e).unwrap_or_default();
                        if let Some(o) = v.as_object_mut() {
                            o.insert("source".into(), source.clone().into());
                        }
                        v
                    })
                    .collect();
                println!("{}", serde_json::to_string_pretty(&rows)?);
            } else if list.is_empty() {
                println!("no failed events");
            } else {
                let src = |s: &str| {
                    if many {
                        format!("{s:<12} ")
                    } else {
                        String::new()
                    }
                };
                println!(
                    "{}{:<38} {:<12} {:<16} {:<20} {:<16} {:>3}  reason",
                    src("source"),
                    "id",
                    "aggregate",
                    "aggregate id",
                    "event type",
                    "route",
                    "att"
                );
                for (source, e) in &list {
                    println!(
                        "{}{:<38} {:<12} {:<16} {:<20} {:<16} {:>3}  {}{}",
                        src(source),
                        e.id,
                        e.aggregate_type,
                        e.aggregate_id,
                        e.event_type,
                        e.route.as_deref().unwrap_or("-"),
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
            failures.finish()?;
            Ok(ExitCode::SUCCESS)
        }
        FailedAction::Edit { config, id, set } => {
            let set: Vec<(String, String)> = set
                .iter()
                .map(|kv| {
                    kv.split_once('=')
                        .map(|(k, v)| (k.trim().to_string(), v.to_string()))
                        .ok_or_else(|| anyhow!("--set `{kv}`: expected FIELD=VALUE"))
                })
                .collect::<Result<_>>()?;
            let loaded = config.load()?;
            let Some((source, _)) = find_failed(&loaded, &id).await? else {
                eprintln!("no failed event with id {id}");
                return Ok(ExitCode::FAILURE);
            };
            open_for_command(&loaded, &source, "failed")
                .await?
                .failed_edit(&id, &set)
                .await?;
            println!("event {id}: row changed; `outroute failed retry --id {id}` reads it again");
            Ok(ExitCode::SUCCESS)
        }
        FailedAction::Show { config, id } => {
            let loaded = config.load()?;
            let Some((source, e)) = find_failed(&loaded, &id).await? else {
                eprintln!("no failed event with id {id}");
                return Ok(ExitCode::FAILURE);
            };
            heading(&loaded, &source);
            println!("{}", serde_json::to_string_pretty(&e)?);
            Ok(ExitCode::SUCCESS)
        }
        FailedAction::Retry { config, filter } => change_failed(&config, &filter, true).await,
        FailedAction::Discard { config, filter } => change_failed(&config, &filter, false).await,
    }
}

/// The failed event `id` (discarded ones too) and its source: the first
/// source that has it. A source that cannot be read is reported and
/// skipped when there are others.
async fn find_failed(
    loaded: &Loaded,
    id: &str,
) -> Result<Option<(String, crate::store::FailedEvent)>> {
    let f = Filter {
        ids: vec![id.to_string()],
        include_discarded: true,
        ..Filter::default()
    };
    let mut failures = Failures::new(loaded);
    for source in sources(loaded) {
        match failed_of(loaded, &source, &f)
            .await
            .map(|l| l.into_iter().next())
        {
            Ok(Some(e)) => return Ok(Some((source, e))),
            Ok(None) => {}
            Err(e) => failures.add(&source, e)?,
        }
    }
    failures.finish()?;
    Ok(None)
}

/// Source `source`'s failed events that `f` selects.
async fn failed_of(
    loaded: &Loaded,
    source: &str,
    f: &Filter,
) -> Result<Vec<crate::store::FailedEvent>> {
    open_for_command(loaded, source, "failed")
        .await?
        .failed_list(f)
        .await
}

/// `failed retry` (`retry`) or `failed discard`, over every source.
async fn change_failed(config: &ConfigArg, filter: &FilterArgs, retry: bool) -> Result<ExitCode> {
    require_filter(filter)?;
    let loaded = config.load()?;
    let f = filter.filter();
    let mut n = 0;
    let mut failures = Failures::new(&loaded);
    for source in sources(&loaded) {
        let done = async {
            let store = open_for_command(&loaded, &source, "failed").await?;
            if retry {
                store.failed_retry(&f).await
            } else {
                store.failed_discard(&f).await
            }
        }
        .await;
        match done {
            Ok(k) => n += k,
            Err(e) => failures.add(&source, e)?,
        }
    }
    let done = if retry {
        "put back in line"
    } else {
        "discarded"
    };
    println!("{n} event(s) {done}");
    failures.finish()?;
    Ok(ExitCode::SUCCESS)
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
    let loaded = a.config.load()?;
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
    let sinks = crate::relay::build_sinks(&loaded).await?;
    let run = Utc::now().format("%Y%m%dT%H%M%S").to_string();
    let (mut selected, mut sent, mut failed) = (0usize, 0usize, Vec::new());
    for source in sources(&loaded) {
        heading(&loaded, &source);
        let store = Arc::new(open_for_command(&loaded, &source, "replay").await?);
        let total = store.published_count(&filter).await?;
        if a.dry_run {
            println!("{total} published event(s) match; nothing re-published (dry run)");
            continue;
        }
        let relay = Relay::build(
            &loaded,
            &source,
            store.clone(),
            sinks.clone(),
            Health::new(&source, Duration::from_secs(3600)),
        )
        .await?;
        let bar = ProgressBar::new(total as u64).with_style(
            ProgressStyle::with_template("{bar:40} {pos}/{len} events ({per_sec}, eta {eta})")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        let mut after: Option<Cursor> = None;
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
    }
    if a.dry_run {
        return Ok(ExitCode::SUCCESS);
    }
    for sink in sinks.values() {
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
    /// rejection as JSON. Exit status: 0 when every event was routed, 3
    /// when at least one was rejected (stderr says how many), 1 on an error
    /// (a plugin that does not load or refuses its config, a bad event
    /// file). The route's allow-list is not checked here: `plugin try`
    /// checks it on real events.
    Test {
        /// The compiled plugin (.wasm).
        plugin: PathBuf,
        /// Route config handed to the plugin's init (JSON text or @file).
        #[arg(long, default_value = "null")]
        config: String,
        /// Event file (one JSON event or an array); `-` for standard input.
        #[arg(long, default_value = "-")]
        event: String,
        /// CPU budget per event (a route's `cpu_budget` defaults to 50 ms:
        /// pass that to see whether the plugin fits it).
        #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
        cpu_budget: Duration,
        /// Memory cap in MiB.
        #[arg(long, default_value_t = 64)]
        memory_mib: u32,
    },
    /// Print the plugin's world, imports, exports, name and version.
    Inspect { plugin: PathBuf },
    /// Try a candidate plugin on a route's recent real events (read from
    /// the store, nothing published) and print what it would do
    /// differently from the route's active plugin: messages, topics, keys,
    /// headers, payloads, rejections.
    Try {
        /// The candidate plugin (.wasm).
        candidate: PathBuf,
        #[command(flatten)]
        config: ConfigArg,
        /// The route whose plugin the candidate would replace.
        #[arg(long)]
        route: String,
        /// How many of the route's newest published events, per source.
        #[arg(long, default_value_t = 100)]
        last: usize,
        /// Route config for the candidate (JSON text or @file); default:
        /// the route's own `config`.
        #[arg(long)]
        candidate_config: Option<String>,
    },
    /// What the shadow (candidate) plugins of the running relay would have
    /// done differently so far: per route, events compared, differing, and
    /// the latest differing events (read from the relay's `/shadow`).
    ShadowReport {
        #[command(flatten)]
        config: ConfigArg,
    },
    /// Make plugin PLUGIN's shadow the active version: its `path` becomes
    /// the `shadow` file, in the config file that declares it (comments and
    /// layout kept). The running relay applies it without a restart on
    /// SIGHUP or at its next `relay.config_watch_interval` check.
    Promote {
        /// The plugin (`[plugins.<name>]`).
        plugin: String,
        #[command(flatten)]
        config: ConfigArg,
    },
    /// Start a plugin project that builds and tests as it is: a router, a
    /// test, a sample event, and the commands to build, test and try it.
    New {
        /// Plugin name: lowercase letters, digits and `-`.
        name: String,
        #[arg(long, value_enum, default_value = "rust")]
        lang: crate::scaffold::Lang,
        /// Where to create it (default: ./NAME); must be empty or new.
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Rust: the outroute-guest crate (default: the one this relay was
        /// built from).
        #[arg(long)]
        sdk: Option<PathBuf>,
    },
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
        PluginAction::Try {
            candidate,
            config,
            route,
            last,
            candidate_config,
        } => try_candidate(candidate, &config, &route, last, candidate_config).await,
        PluginAction::New {
            name,
            lang,
            dir,
            sdk,
        } => {
            let (dir, next) = crate::scaffold::new(&name, lang, dir, sdk)?;
            println!(
                "created plugin `{name}` in {}; next, in that directory:",
                dir.display()
            );
            for cmd in next {
                println!("  {cmd}");
            }
            Ok(ExitCode::SUCCESS)
        }
        PluginAction::ShadowReport { config } => {
            let loaded = config.load()?;
            let listen = &loaded.config.http.listen;
            if listen.is_empty() {
                bail!("http.listen is empty: the relay serves no /shadow report");
            }
            let token = loaded.config.http.token.as_ref().map(|t| t.expose());
            let body = http_get(listen, "/shadow", token)
                .await
                .with_context(|| format!("asking the relay at {listen} for /shadow"))?;
            let routes: Vec<serde_json::Value> = serde_json::from_str(&body)
                .with_context(|| format!("the relay's /shadow answer is not JSON: {body}"))?;
            if routes.is_empty() {
                println!("no shadow plugin has answered an event yet");
            }
            for r in routes {
                println!(
                    "source {} route {} (candidate {}): {} events compared, {} different",
                    r["source"].as_str().unwrap_or("?"),
                    r["route"].as_str().unwrap_or("?"),
                    r["candidate"].as_str().unwrap_or("?"),
                    r["compared"],
                    r["differing"]
                );
                for sample in r["samples"].as_array().into_iter().flatten() {
                    let d: Vec<&str> = sample["differences"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|d| d.as_str())
                        .collect();
                    println!(
                        "  {} {}: {}",
                        sample["at"].as_str().unwrap_or(""),
                        sample["event_id"].as_str().unwrap_or("?"),
                        d.join("; ")
                    );
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        PluginAction::Promote { plugin, config } => {
            let loaded = config.load()?;
            let pc = loaded.config.plugins.get(&plugin).ok_or_else(|| {
                anyhow!("no plugin named `{plugin}` in {}", config.config.display())
            })?;
            if pc.shadow.is_none() {
                bail!("plugins.{plugin}.shadow is not set: there is no candidate to promote");
            }
            let file = promote(&loaded.files, &plugin, pc.shadow_config.as_ref())?;
            println!(
                "plugins.{plugin}: the shadow is now the active version ({}). A running relay applies it \
                 on SIGHUP or at its next config check (relay.config_watch_interval).",
                file.display()
            );
            Ok(ExitCode::SUCCESS)
        }
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
            // The plugin's own `log` lines (every level) and the host's
            // warnings, on stderr beside the outcomes on stdout; RUST_LOG
            // overrides.
            init_logging(LogFormat::Human, "warn,outroute::plugin::sandbox=trace");
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
                // The instance that answered `describe` and `init` routes
                // the events, as in the relay (`init` runs once).
                max_idle_bytes: (memory_mib as usize) << 20,
            };
            let (outcomes, counts) = tokio::task::spawn_blocking(move || -> Result<_> {
                let handle = PluginHandle::load(&rt, &plugin, config, limits)?;
                let p = handle.current().context("plugin unavailable")?;
                let outcomes = events
                    .iter()
                    .zip(p.route_batch(&events))
                    .map(|(e, a)| (e.id.clone(), a.into_outcome()))
                    .collect::<Vec<_>>();
                Ok((outcomes, p.take_counts()))
            })
            .await??;
            // What the plugin counted (`host.count`): on stderr, so the
            // JSON on stdout keeps its shape.
            for (name, n) in &counts {
                eprintln!("counted: {name} += {n}");
            }
            let mut rejected = 0usize;
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
                        rejected += 1;
                        let kind = match r {
                            Rejection::Retryable(_) => "retryable",
                            Rejection::Invalid(_) => "invalid",
                        };
                        serde_json::json!({"event_id": id, "rejection": {"kind": kind, "reason": r.reason()}})
                    }
                })
                .collect();
            println!("{}", serde_json::to_string_pretty(&out)?);
            if rejected > 0 {
                eprintln!(
                    "{rejected} of {} events rejected (exit status 3)",
                    out.len()
                );
            }
            Ok(if rejected == 0 {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(3)
            })
        }
    }
}

pub async fn config_check(arg: &ConfigArg, store: bool, sinks: bool) -> Result<ExitCode> {
    let path = arg.config.as_path();
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
    // A refused team file costs `run` only its team, but fails the check.
    let mut refused = false;
    for r in &l.refused {
        for p in &r.problems {
            eprintln!("{p}");
        }
        eprintln!(
            "{}: refused; `run` {}",
            r.file.display(),
            if r.last_good {
                "runs the team's last known good copy instead"
            } else {
                "runs the other teams; this team's routes do not run and their events wait"
            }
        );
        refused = true;
    }
    let l = arg.load()?;
    // Every route's plugin (and shadow) as `run` loads it: compiled, and
    // `init` with the route's config, so a file that is no component or a
    // config the plugin refuses fails here, not at start-up.
    let runtime = Runtime::new(l.cache_dir())?;
    for (i, r) in l.config.routes.iter().enumerate() {
        let Some(pc) = l.config.plugins.get(&r.plugin) else {
            continue; // refused by the load above
        };
        let limits = Limits::of(r);
        let mut plugins = vec![("plugin", pc.path.clone(), r.config.clone())];
        if let Some(shadow) = &pc.shadow {
            let cfg = pc.shadow_config.clone().unwrap_or_else(|| r.config.clone());
            plugins.push(("shadow plugin", shadow.clone(), cfg));
        }
        for (what, file, cfg) in plugins {
            if let Err(e) = crate::relay::load_plugin(&runtime, l.resolve(&file), cfg, limits).await
            {
                eprintln!(
                    "{}:routes[{i}] (route `{}`): {what} {}: {e:#}",
                    path.display(),
                    r.name,
                    l.resolve(&file).display()
                );
                refused = true;
            }
        }
    }
    if refused {
        return Ok(ExitCode::FAILURE);
    }
    println!(
        "{}: ok ({} sources, {} routes, {} sinks, {} plugins{})",
        path.display(),
        l.config.sources.len(),
        l.config.routes.len(),
        l.config.sinks.len(),
        l.config.plugins.len(),
        match l.files.len() {
            1 => String::new(),
            n => format!(", {} included files", n - 1),
        }
    );
    let mut store_failures = Failures::new(&l);
    for w in l.transport_warnings() {
        println!("warning: {w}");
    }
    for source in sources(&l) {
        let sc = l.config.source(&source)?;
        let key = l.config.source_key(&source);
        let table = sc.table();
        if table.sequence.is_none()
            && l.config.relay.ordering != config::Ordering::None
            && sc.url.starts_with("postgres")
        {
            println!(
                "warning: {key}.table.sequence is unset: `{}` is ordered by ({}, id); ordering = \"{}\" orders \
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
            let name = table.name;
            let opened = async {
                let mut s = Store::connect(&l.config, &source, "config-check").await?;
                s.check_table().await?;
                anyhow::Ok(s)
            }
            .await;
            let s = match opened {
                Ok(s) => s,
                Err(e) => {
                    store_failures.add(&source, e)?;
                    continue;
                }
            };
            if let Some(off) = s.postgres().and_then(|p| p.floors_off()) {
                println!("warning: {off}");
            }
            match s.missing_index() {
                None if s.queue_marking() => {
                    println!("{key}: table `{name}` ok, pending queue and its trigger present")
                }
                Some(_) if s.queue_marking() => println!(
                    "{key}: table `{name}` ok\nwarning: {key}.table: `{name}` has no pending-queue trigger yet: \
                     the relay refuses to start. Run `outroute migrate --table -c {}`",
                    path.display()
                ),
                None => println!("{key}: table `{name}` ok, lane index usable"),
                Some(ddl) => println!(
                    "{key}: table `{name}` ok\nwarning: {key}.table: `{name}` has no usable lane index: every claim \
                     would scan and sort the whole backlog. Run `outroute migrate --table -c {}`, or:\n  {ddl}",
                    path.display()
                ),
            }
        }
    }
    store_failures.finish()?;
    if sinks {
        let routes = crate::routing::Routes::compile(&l.config).map_err(anyhow::Error::msg)?;
        let mut failed = false;
        for found in crate::sink::check_all(
            &l.config.sinks,
            &routes,
            &l.base_dir,
            l.config.relay.publish_timeout,
        )
        .await
        {
            match found {
                Ok(line) => println!("{line}"),
                Err(e) => {
                    eprintln!("{}:{e:#}", path.display());
                    failed = true;
                }
            }
        }
        if failed {
            return Ok(ExitCode::FAILURE);
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `outroute config diff OLD NEW`: what loading NEW over a relay running
/// OLD would change (both must be valid).
pub fn config_diff(old: &Path, new: &Path) -> Result<ExitCode> {
    let a = load(old)?;
    let b = load(new)?;
    print!("{}", config::diff(&a.config, &b.config));
    Ok(ExitCode::SUCCESS)
}

/// `outroute plugin try`: the route's newest published events through the
/// active plugin and the candidate, side by side.
async fn try_candidate(
    candidate: PathBuf,
    arg: &ConfigArg,
    route: &str,
    last: usize,
    candidate_config: Option<String>,
) -> Result<ExitCode> {
    let loaded = arg.load()?;
    let routes = crate::routing::Routes::compile(&loaded.config).map_err(anyhow::Error::msg)?;
    let Some(r) = routes.0.iter().find(|r| r.name() == route) else {
        bail!("no route named `{route}` in {}", arg.config.display());
    };
    let active = loaded
        .config
        .plugins
        .get(&r.config.plugin)
        .map(|p| loaded.resolve(&p.path))
        .ok_or_else(|| anyhow::anyhow!("route `{route}`: no plugin `{}`", r.config.plugin))?;
    let candidate_config: serde_json::Value = match candidate_config {
        Some(text) => {
            let text = if text.starts_with('@') {
                read_text(&text)?
            } else {
                text
            };
            serde_json::from_str(&text).context("--candidate-config is not JSON")?
        }
        None => r.config.config.clone(),
    };
    let mut events: Vec<Event> = Vec::new();
    for source in sources(&loaded) {
        if !config::Config::route_reads(&r.config, &source) {
            continue;
        }
        let store = open_for_command(&loaded, &source, "plugin-try").await?;
        let mut mine = Vec::new();
        let mut before: Option<Cursor> = None;
        let mut scanned = 0usize;
        // The route selects by type: read newest first until `last` of its
        // events (or 100 × that many rows) were seen.
        while mine.len() < last && scanned < last.saturating_mul(100).max(1000) {
            let page = store
                .published_newest(&Filter::default(), before.as_ref(), 500)
                .await?;
            let Some(l) = page.last() else { break };
            before = Some(Cursor::after(l));
            scanned += page.len();
            for c in page {
                if let Ok(e) = c.row
                    && r.selects(&e.aggregate_type, &e.event_type)
                    && mine.len() < last
                {
                    mine.push(e);
                }
            }
        }
        mine.reverse();
        events.extend(mine);
    }
    if events.is_empty() {
        println!("route `{route}`: no published events to try the candidate on");
        return Ok(ExitCode::SUCCESS);
    }
    let rt = plugin_runtime()?;
    let limits = Limits::of(&r.config);
    let active_config = r.config.config.clone();
    let (candidate_path, active_path) = (candidate.clone(), active.clone());
    let batch = events.clone();
    let (was, would) = tokio::task::spawn_blocking(move || -> Result<_> {
        let run = |path: &Path,
                   config: serde_json::Value,
                   what: &str|
         -> Result<Vec<crate::event::Outcome>> {
            let handle = PluginHandle::load(&rt, path, config, limits)
                .with_context(|| format!("{what} plugin {}", path.display()))?;
            let p = handle.current().context("plugin unavailable")?;
            Ok(p.route_batch(&batch)
                .into_iter()
                .map(|a| a.into_outcome())
                .collect())
        };
        Ok((
            run(&active_path, active_config, "active")?,
            run(&candidate_path, candidate_config, "candidate")?,
        ))
    })
    .await??;
    // As the relay would take them: a message the route may not send is
    // the event's rejection.
    let checked = |outcomes: Vec<crate::event::Outcome>| -> Vec<crate::event::Outcome> {
        outcomes
            .into_iter()
            .map(|o| crate::relay::checked(r, o))
            .collect()
    };
    let (was, would) = (checked(was), checked(would));
    let mut different = 0usize;
    let mut lines = Vec::new();
    for ((e, a), b) in events.iter().zip(&was).zip(&would) {
        let d = crate::shadow::differences(a, b);
        if !d.is_empty() {
            different += 1;
            if lines.len() < 50 {
                lines.push(format!(
                    "{} ({} {} / {}): {}",
                    e.id,
                    e.aggregate_type,
                    e.aggregate_id,
                    e.event_type,
                    d.join("; ")
                ));
            }
        }
    }
    println!(
        "route `{route}`: {} recent events; candidate {} vs active {}\n  same       {}\n  different  {different}",
        events.len(),
        candidate.display(),
        active.display(),
        events.len() - different
    );
    for l in lines {
        println!("  {l}");
    }
    Ok(ExitCode::SUCCESS)
}

/// In the file of `files` that declares `[plugins.<plugin>]`, make its
/// `shadow` the `path` and drop `shadow`; with a `shadow_config`, it becomes
/// the `config` of every route using the plugin. Returns the plugin's file.
/// Each file is replaced whole (written aside, then renamed), so a relay
/// watching it never reads half of it.
fn promote(
    files: &[PathBuf],
    plugin: &str,
    shadow_config: Option<&serde_json::Value>,
) -> Result<PathBuf> {
    let config = shadow_config
        .map(|c| toml_value(c).with_context(|| format!("plugins.{plugin}.shadow_config")))
        .transpose()?;
    let mut declared = None;
    for file in files {
        let text =
            std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
        let mut doc: toml_edit::DocumentMut = text
            .parse()
            .with_context(|| format!("{} is not valid TOML", file.display()))?;
        let mut changed = false;
        if let Some(table) = doc
            .get_mut("plugins")
            .and_then(|p| p.get_mut(plugin))
            .and_then(|t| t.as_table_like_mut())
        {
            let shadow = table
                .remove("shadow")
                .ok_or_else(|| anyhow!("{}: plugins.{plugin} has no `shadow`", file.display()))?;
            table.insert("path", shadow);
            table.remove("shadow_config");
            declared = Some(file.clone());
            changed = true;
        }
        if let Some(config) = &config
            && let Some(routes) = doc
                .get_mut("routes")
                .and_then(|r| r.as_array_of_tables_mut())
        {
            for route in routes.iter_mut() {
                if route.get("plugin").and_then(|p| p.as_str()) == Some(plugin) {
                    route.insert("config", toml_edit::value(config.clone()));
                    changed = true;
                }
            }
        }
        if changed {
            let tmp = file.with_extension("toml.promote");
            std::fs::write(&tmp, doc.to_string())
                .with_context(|| format!("writing {}", tmp.display()))?;
            std::fs::rename(&tmp, file).with_context(|| format!("replacing {}", file.display()))?;
        }
    }
    declared.ok_or_else(|| anyhow!("no config file declares [plugins.{plugin}]"))
}

/// A JSON value as a TOML value (objects as inline tables); `null` has none.
fn toml_value(v: &serde_json::Value) -> Result<toml_edit::Value> {
    use serde_json::Value as J;
    Ok(match v {
        J::Null => bail!("null has no TOML form"),
        J::Bool(b) => (*b).into(),
        J::Number(n) => match (n.as_i64(), n.as_f64()) {
            (Some(i), _) => i.into(),
            (None, Some(f)) => f.into(),
            _ => bail!("number {n} has no TOML form"),
        },
        J::String(s) => s.as_str().into(),
        J::Array(items) => {
            let mut a = toml_edit::Array::new();
            for i in items {
                a.push(toml_value(i)?);
            }
            a.into()
        }
        J::Object(fields) => {
            let mut t = toml_edit::InlineTable::new();
            for (k, v) in fields {
                t.insert(k, toml_value(v)?);
            }
            t.into()
        }
    })
}

/// `GET path` from the relay's HTTP listener (with `token` as bearer, if
/// given); the body of a 200 answer.
async fn http_get(listen: &str, path: &str, token: Option<&str>) -> Result<String> {
    let (head, body) = http_answer(listen, path, token).await?;
    if !head.starts_with("HTTP/1.1 200") && !head.starts_with("HTTP/1.0 200") {
        bail!("{}", head.lines().next().unwrap_or(&head));
    }
    Ok(body)
}

/// `GET path` from the relay's HTTP listener: the status line and headers,
/// and the body, whatever the status.
async fn http_answer(listen: &str, path: &str, token: Option<&str>) -> Result<(String, String)> {
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
