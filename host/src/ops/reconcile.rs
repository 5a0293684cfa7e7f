//! `outroute reconcile`: does what the outbox says was published match what
//! the brokers hold, over a window given on the command line? The checking
//! is `reconcile.rs` (shared with the relay's scheduled check,
//! `relay.reconcile_every`); this file is the command: its arguments, the
//! progress bar, the table or JSON, the exit status (1 when anything is
//! missing or out of order, or a topic could not be read: nothing could be
//! proved there).

use super::*;
use crate::reconcile::{Findings, TopicReport, check};

#[derive(Args)]
pub struct ReconcileArgs {
    #[command(flatten)]
    config: ConfigArg,
    /// Events created at or after this time (RFC 3339).
    #[arg(long)]
    since: DateTime<Utc>,
    /// Events created before this time (RFC 3339). Default: now.
    #[arg(long)]
    until: Option<DateTime<Utc>>,
    /// Only the messages of this route.
    #[arg(long)]
    route: Option<String>,
    /// Print the whole report as JSON.
    #[arg(long)]
    json: bool,
}

pub async fn reconcile(a: ReconcileArgs) -> Result<ExitCode> {
    let loaded = a.config.load()?;
    init_logging(loaded.config.log.format, "warn");
    let until = a.until.unwrap_or_else(Utc::now);
    if until <= a.since {
        bail!("--until ({until}) must be after --since ({})", a.since);
    }
    if let Some(r) = &a.route
        && !loaded.config.routes.iter().any(|x| &x.name == r)
    {
        bail!("no route named `{r}` in the configuration");
    }
    let started = std::time::Instant::now();
    let mut all = Findings::default();
    for source in sources(&loaded) {
        let store = Arc::new(open_for_command(&loaded, &source, "reconcile").await?);
        let relay = Relay::build(
            &loaded,
            &source,
            store,
            Arc::new(std::collections::BTreeMap::new()),
            Health::new(&source, Duration::from_secs(3600)),
        )
        .await?;
        let bar = if a.json {
            ProgressBar::hidden()
        } else {
            ProgressBar::new(0).with_style(
                ProgressStyle::with_template(
                    "{bar:40} {pos}/{len} published events planned ({per_sec})",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
            )
        };
        let f = check(
            &relay.planner(),
            &loaded.config.sinks,
            a.since,
            until,
            a.route.as_deref(),
            &bar,
        )
        .await?;
        all.published += f.published;
        all.topics.extend(f.topics);
        all.not_planned.extend(f.not_planned);
    }
    let bad = all.bad();
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "since": a.since,
                "until": until,
                "published": all.published,
                "topics": all.topics,
                "not_planned": all.not_planned.iter().map(|(id, why)| serde_json::json!({"event_id": id, "reason": why})).collect::<Vec<_>>(),
                "clean": !bad,
                "seconds": started.elapsed().as_secs_f64(),
            }))?
        );
    } else {
        print_report(&all, started.elapsed());
    }
    Ok(if bad {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

fn print_report(all: &Findings, took: Duration) {
    let (reports, published, unplanned): (&[TopicReport], usize, &[(String, String)]) =
        (&all.topics, all.published, &all.not_planned);
    println!(
        "{:<12} {:<10} {:<32} {:>9} {:>9} {:>8} {:>10} {:>12} {:>10}",
        "source",
        "sink",
        "topic",
        "expected",
        "found",
        "missing",
        "duplicated",
        "out of order",
        "unexpected"
    );
    for r in reports {
        match &r.not_checked {
            Some(why) => println!(
                "{:<12} {:<10} {:<32} {:>9}  not checked: {why}",
                r.source, r.sink, r.topic, r.expected
            ),
            None => println!(
                "{:<12} {:<10} {:<32} {:>9} {:>9} {:>8} {:>10} {:>12} {:>10}",
                r.source,
                r.sink,
                r.topic,
                r.expected,
                r.found,
                r.missing.len(),
                r.duplicated.len(),
                r.out_of_order.len(),
                r.unexpected.len()
            ),
        }
    }
    let show = |what: &str, ids: Vec<String>| {
        for id in ids.iter().take(20) {
            println!("  {what}: {id}");
        }
        if ids.len() > 20 {
            println!("  … and {} more {what}", ids.len() - 20);
        }
    };
    for r in reports {
        let at = format!("{}/{}", r.sink, r.topic);
        show(
            "missing",
            r.missing.iter().map(|id| format!("{id} on {at}")).collect(),
        );
        show(
            "duplicated",
            r.duplicated
                .iter()
                .map(|d| format!("{} on {at} ({} copies)", d.event_id, d.copies))
                .collect(),
        );
        show(
            "out of order",
            r.out_of_order
                .iter()
                .map(|o| {
                    format!(
                        "{} ({} seq {}) after seq {} on {at} partition {} offset {}",
                        o.event_id, o.aggregate, o.seq, o.after_seq, o.partition, o.offset
                    )
                })
                .collect(),
        );
        show(
            "unexpected",
            r.unexpected
                .iter()
                .map(|id| format!("{id} on {at}"))
                .collect(),
        );
    }
    show(
        "not planned",
        unplanned
            .iter()
            .map(|(id, why)| format!("{id}: {why}"))
            .collect(),
    );
    let bad = all.bad();
    println!(
        "{published} published event(s) in the window, {} topic(s), {:.1}s: {}",
        reports.len(),
        took.as_secs_f64(),
        if bad { "NOT clean" } else { "clean" }
    );
}
