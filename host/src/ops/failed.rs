//! `outroute failed list|show|retry|edit|discard`: the events that failed,
//! selected by id, route, type or aggregate; what an operator does about them.

use super::*;

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
    /// List failed events, with the team that owns each one's route.
    List {
        #[command(flatten)]
        config: ConfigArg,
        #[command(flatten)]
        filter: FilterArgs,
        /// Only events of routes this team owns.
        #[arg(long)]
        owner: Option<String>,
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

pub(super) fn require_filter(f: &FilterArgs) -> Result<()> {
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
            owner,
            all,
            json,
        } => {
            let loaded = config.load()?;
            let f = Filter {
                include_discarded: all,
                // One team's events may be anywhere in the list.
                limit: owner.as_ref().map(|_| 1_000_000),
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
            let mut list: Vec<(String, crate::store::FailedEvent, (String, Option<String>))> = list
                .into_iter()
                .map(|(source, e)| {
                    let who = loaded.owner_of(e.route.as_deref());
                    (source, e, who)
                })
                .collect();
            if let Some(owner) = &owner {
                list.retain(|(_, _, (o, _))| o == owner);
            }
            let many = loaded.config.sources.len() > 1;
            if json {
                let rows: Vec<serde_json::Value> = list
                    .iter()
                    .map(|(source, e, who)| with_owner(source, e, who))
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
                    "{}{:<38} {:<12} {:<16} {:<20} {:<16} {:<12} {:>3}  reason",
                    src("source"),
                    "id",
                    "aggregate",
                    "aggregate id",
                    "event type",
                    "route",
                    "owner",
                    "att"
                );
                for (source, e, (owner, _)) in &list {
                    println!(
                        "{}{:<38} {:<12} {:<16} {:<20} {:<16} {:<12} {:>3}  {}{}",
                        src(source),
                        e.id,
                        e.aggregate_type,
                        e.aggregate_id,
                        e.event_type,
                        e.route.as_deref().unwrap_or("-"),
                        owner,
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
            let who = loaded.owner_of(e.route.as_deref());
            println!(
                "{}",
                serde_json::to_string_pretty(&with_owner(&source, &e, &who))?
            );
            Ok(ExitCode::SUCCESS)
        }
        FailedAction::Retry { config, filter } => change_failed(&config, &filter, true).await,
        FailedAction::Discard { config, filter } => change_failed(&config, &filter, false).await,
    }
}

/// A failed event as `failed list --json` and `failed show` print it: the
/// store's record, its source, its route's owner and how to reach them.
fn with_owner(
    source: &str,
    e: &crate::store::FailedEvent,
    (owner, contact): &(String, Option<String>),
) -> serde_json::Value {
    let mut v = serde_json::to_value(e).unwrap_or_default();
    if let Some(o) = v.as_object_mut() {
        o.insert("source".into(), source.into());
        o.insert("owner".into(), owner.as_str().into());
        o.insert("owner_contact".into(), contact.clone().into());
    }
    v
}

/// The failed event `id` (discarded ones too) and its source: the first
/// source that has it. A source that cannot be read is reported and
/// skipped when there are others.
pub(super) async fn find_failed(
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
pub(super) async fn failed_of(
    loaded: &Loaded,
    source: &str,
    f: &Filter,
) -> Result<Vec<crate::store::FailedEvent>> {
    open_for_command(loaded, source, "failed")
        .await?
        .failed_list(f)
        .await
}

/// `failed retry` (`retry`) or `failed discard`, over every source. The
/// events of routes with a `dead_letter` get a resolution record there
/// (`relay/dead_letter.rs`); one that cannot be published is reported and
/// the command exits non-zero (the change itself stands).
pub(super) async fn change_failed(
    config: &ConfigArg,
    filter: &FilterArgs,
    retry: bool,
) -> Result<ExitCode> {
    use crate::relay::dead_letter::{Resolution, ResolutionRecord, send_resolution};
    require_filter(filter)?;
    let loaded = config.load()?;
    let f = filter.filter();
    let resolution = if retry {
        Resolution::Retried
    } else {
        Resolution::Discarded
    };
    let route_of = |name: Option<&str>| {
        loaded
            .config
            .routes
            .iter()
            .find(|r| Some(r.name.as_str()) == name && r.dead_letter.is_some())
    };
    let tells = loaded.config.routes.iter().any(|r| r.dead_letter.is_some());
    let mut sinks: Option<crate::sink::Sinks> = None;
    let (mut n, mut told, mut untold) = (0, 0usize, Vec::new());
    let mut failures = Failures::new(&loaded);
    for source in sources(&loaded) {
        let done = async {
            let store = open_for_command(&loaded, &source, "failed").await?;
            // The events that changed, for their resolution records: those
            // failed (and not discarded) before and no longer after. A
            // retry or discard is one transaction: on an error, none.
            let all = Filter {
                limit: Some(1_000_000),
                ..f.clone()
            };
            let before = if tells {
                store.failed_list(&all).await?
            } else {
                Vec::new()
            };
            let k = if retry {
                store.failed_retry(&f).await?
            } else {
                store.failed_discard(&f).await?
            };
            let mut changed = before;
            if !changed.is_empty() {
                let still: std::collections::HashSet<String> = store
                    .failed_list(&all)
                    .await?
                    .into_iter()
                    .map(|e| e.id)
                    .collect();
                changed.retain(|e| !still.contains(&e.id));
            }
            anyhow::Ok((k, changed))
        }
        .await;
        let changed = match done {
            Ok((k, changed)) => {
                n += k;
                changed
            }
            Err(e) => {
                failures.add(&source, e)?;
                continue;
            }
        };
        let to_tell: Vec<_> = changed
            .iter()
            .filter_map(|e| route_of(e.route.as_deref()).map(|r| (e, r)))
            .collect();
        if to_tell.is_empty() {
            continue;
        }
        if sinks.is_none() {
            match crate::relay::build_sinks(&loaded).await {
                Ok(s) => sinks = Some(s),
                Err(e) => {
                    untold.extend(
                        to_tell
                            .iter()
                            .map(|(ev, _)| (ev.id.clone(), format!("{e:#}"))),
                    );
                    continue;
                }
            }
        }
        let Some(sinks) = &sinks else { continue };
        let table = match loaded.config.source(&source) {
            Ok(sc) => sc.table().name,
            Err(e) => {
                failures.add(&source, e)?;
                continue;
            }
        };
        let ce_source = crate::relay::ce_source(&loaded.config, &source, &table);
        for (e, route) in to_tell {
            let record = ResolutionRecord {
                event: e,
                resolution,
                route,
                source: &source,
                ce_source: &ce_source,
            };
            match send_resolution(sinks, record, loaded.config.relay.publish_timeout).await {
                Ok(()) => told += 1,
                Err(err) => untold.push((e.id.clone(), err.to_string())),
            }
        }
    }
    if let Some(sinks) = &sinks {
        for sink in sinks.values() {
            sink.flush().await;
        }
    }
    let done = if retry {
        "put back in line"
    } else {
        "discarded"
    };
    println!("{n} event(s) {done}");
    if told > 0 {
        println!("{told} resolution record(s) published to dead-letter topics");
    }
    failures.finish()?;
    if !untold.is_empty() {
        eprintln!(
            "{} resolution record(s) could not be published (the events are {done} all the same):",
            untold.len()
        );
        for (id, why) in untold.iter().take(20) {
            eprintln!("  {id}: {why}");
        }
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}
