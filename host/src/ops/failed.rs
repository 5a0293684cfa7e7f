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

/// `failed retry` (`retry`) or `failed discard`, over every source.
pub(super) async fn change_failed(
    config: &ConfigArg,
    filter: &FilterArgs,
    retry: bool,
) -> Result<ExitCode> {
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
