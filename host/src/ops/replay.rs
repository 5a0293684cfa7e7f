//! `outroute replay`: re-publish published events of a selection, with
//! their original ids, and say (and exit non-zero) if any could not be.

use super::*;

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
