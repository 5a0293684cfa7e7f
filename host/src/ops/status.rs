//! Reading and steering a fleet: `outroute status` (backlog, failures,
//! quarantines, slot, relays), `outroute slot drop`, `outroute route
//! list|resume`.

use super::*;

/// `outroute status`: per source. `--json` prints one object for one source,
/// else an object keyed by source name.
pub async fn status(arg: &ConfigArg, json: bool) -> Result<ExitCode> {
    let loaded = arg.load()?;
    let mut all = serde_json::Map::new();
    let mut failures = Failures::new(&loaded);
    for source in sources(&loaded) {
        let status = async {
            let store = open_for_command(&loaded, &source, "status").await?;
            let s = store.status().await?;
            // The failed events by route, each with who answers for them.
            let failed: Vec<FailedByRoute> = store
                .failed_by_route()
                .await?
                .into_iter()
                .map(|(route, failed)| {
                    let (owner, owner_contact) = loaded.owner_of(Some(&route));
                    FailedByRoute {
                        route,
                        owner,
                        owner_contact,
                        failed,
                    }
                })
                .collect();
            anyhow::Ok((s, failed))
        }
        .await
        .with_context(|| format!("source `{source}`"));
        let (s, failed) = match status {
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
            let mut v = serde_json::to_value(&s)?;
            if let Some(o) = v.as_object_mut() {
                o.insert("failed_by_route".into(), serde_json::to_value(&failed)?);
            }
            all.insert(source.clone(), v);
            continue;
        }
        heading(&loaded, &source);
        print_status(&s, &failed);
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
pub(super) async fn print_relay_parts(loaded: &Loaded) {
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

/// A route's failed events and who answers for them (`status`).
#[derive(serde::Serialize)]
pub(super) struct FailedByRoute {
    route: String,
    owner: String,
    owner_contact: Option<String>,
    failed: i64,
}

pub(super) fn print_status(s: &crate::store::Status, failed: &[FailedByRoute]) {
    println!("table            {}", s.table);
    println!("backlog          {} events", s.backlog);
    match s.oldest_pending_age_seconds {
        Some(a) => println!("oldest pending   {a:.1}s"),
        None => println!("oldest pending   -"),
    }
    println!("retrying         {}", s.retrying);
    println!("failed           {}", s.failed);
    for f in failed {
        println!(
            "  route {:<20} {:>6}  owner {}{}",
            f.route,
            f.failed,
            f.owner,
            f.owner_contact
                .as_deref()
                .map_or(String::new(), |c| format!(" ({c})"))
        );
    }
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
    if let Some(b) = &s.binlog {
        print_binlog(b);
    }
    println!("relays           {}", s.relays.len());
    if let Some(n) = s.relay_connections {
        println!("connections      {n} (every relay's, to this database)");
    }
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

/// A binlog source's recorded position against the server's binary log.
fn print_binlog(b: &crate::store::mysql::BinlogStatus) {
    match (&b.position, b.behind_transactions) {
        (Some(p), Some(n)) => println!(
            "binlog           position {p}{}, {n} transactions behind the server's {}",
            if b.backfilled {
                ""
            } else {
                " (the table's pending rows first)"
            },
            b.server_position
        ),
        _ => println!(
            "binlog           no position recorded yet (the first stream starts at a snapshot, after the table's pending rows)"
        ),
    }
    if let (Some(files), Some(bytes)) = (b.files, b.bytes) {
        println!(
            "                 the server keeps {files} binary log file{}, {bytes} bytes{}{}",
            if files == 1 { "" } else { "s" },
            b.oldest_position
                .as_deref()
                .map_or(String::new(), |o| format!(", from position {o}")),
            match b.expire_seconds {
                Some(s) if s > 0 => format!(", each for {s}s"),
                _ => String::new(),
            }
        );
    }
    if b.purged {
        println!(
            "                 PURGED: the server no longer has what follows the recorded position; the next stream \
             publishes the table's pending rows first (none is lost, some may go out twice)"
        );
    }
}
