//! `outroute reconcile` against real brokers: a window the relay published
//! to Kafka and JetStream (fan-out) reconciles clean; after the test
//! deletes one message from the JetStream stream and duplicates one in the
//! Kafka topic, it reports exactly those two (one missing, one duplicated)
//! and exits non-zero. The scheduled check (`relay.reconcile_every`)
//! reports a message lost from a window it has not checked yet in its
//! gauges and log, and the next window clean again.

use std::time::Duration;

use outroute_e2e::*;
use rdkafka::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

/// Every finding of a `reconcile --json` report, over all topics:
/// (missing, duplicated, out of order, unexpected, not checked).
fn findings(report: &serde_json::Value) -> [Vec<String>; 5] {
    let mut out: [Vec<String>; 5] = Default::default();
    for t in report["topics"].as_array().into_iter().flatten() {
        let at = format!(
            "{}/{}",
            t["sink"].as_str().unwrap_or(""),
            t["topic"].as_str().unwrap_or("")
        );
        for id in t["missing"].as_array().into_iter().flatten() {
            out[0].push(format!("{} on {at}", id.as_str().unwrap_or("")));
        }
        for d in t["duplicated"].as_array().into_iter().flatten() {
            out[1].push(format!(
                "{} on {at} x{}",
                d["event_id"].as_str().unwrap_or(""),
                d["copies"]
            ));
        }
        for o in t["out_of_order"].as_array().into_iter().flatten() {
            out[2].push(format!("{o}"));
        }
        for id in t["unexpected"].as_array().into_iter().flatten() {
            out[3].push(format!("{id} on {at}"));
        }
        if let Some(why) = t["not_checked"].as_str() {
            out[4].push(format!("{at}: {why}"));
        }
    }
    out
}

/// A window the relay published through the fan-out route (Kafka topic
/// `{p}{tag}.order-updated`, 3 partitions; JetStream stream `{P}{tag}`),
/// every message checked at a consumer; the relay still runs.
struct FanOut {
    db: TestDb,
    config: std::path::PathBuf,
    topic: String,
    stream: String,
    js: async_nats::jetstream::Context,
    since: chrono::DateTime<chrono::Utc>,
    kafka: Vec<Delivered>,
    relay: Relay,
}

/// [`FanOut`] with `relay` keys for `[relay]` and `http` as the listener
/// (`""`: none).
async fn fan_out(prefix: &str, relay: &str, http: &str) -> anyhow::Result<FanOut> {
    let db = TestDb::new().await?;
    let t = tag();
    let topic = format!("{prefix}{t}.order-updated");
    create_topic(&topic, 3).await?;
    let stream = format!("{}{t}", prefix.to_uppercase());
    let js = nats_stream(&stream, vec![format!("{prefix}{t}.>")]).await?;
    let dir = test_dir(&format!("reconcile-{prefix}"));
    let body = fanout_body(&format!("{prefix}{t}"))
        .replace("listen = \"\"", &format!("listen = \"{http}\""));
    let config = write_config(&dir, &db.url, relay, &body)?;
    db.migrate(&config)?;
    let since = chrono::Utc::now() - chrono::Duration::seconds(5);
    let work = produce(&db.pool, prefix, 5, 6, 0).await?;
    let n = work.committed.len();
    let relay = Relay::start(&config, &[])?;
    let kafka = consume_kafka(&topic, 3, n, Duration::from_secs(60))?;
    let nats = consume_nats(&js, &stream, n, Duration::from_secs(60)).await?;
    check(&work, &kafka).assert_clean();
    check(&work, &nats).assert_clean();
    Ok(FanOut {
        db,
        config,
        topic,
        stream,
        js,
        since,
        kafka,
        relay,
    })
}

/// Delete `stream`'s first message: its event id and subject.
async fn lose_first(
    js: &async_nats::jetstream::Context,
    stream: &str,
) -> anyhow::Result<(String, String)> {
    let s = js.get_stream(stream).await?;
    let first = s.get_raw_message(1).await?;
    let lost = first
        .headers
        .get("ce_id")
        .map(|v| v.as_str().to_string())
        .unwrap_or_default();
    assert!(!lost.is_empty(), "the message has its ce_id");
    assert!(s.delete_message(1).await?);
    let _ = js.get_stream(stream).await?.info().await?;
    Ok((lost, first.subject.to_string()))
}

#[tokio::test(flavor = "multi_thread")]
async fn reconcile_finds_exactly_the_deleted_and_the_duplicated_message() -> anyhow::Result<()> {
    let FanOut {
        db,
        config,
        topic,
        stream,
        js,
        since,
        kafka,
        relay,
    } = fan_out("r", "", "").await?;
    let n = kafka.len();
    assert!(
        eventually(Duration::from_secs(20), || async {
            db.unpublished("").await == 0
        })
        .await
    );
    drop(relay);
    let cfg = config.display().to_string();
    let since_arg = since.to_rfc3339();
    let run = || -> anyhow::Result<(i32, serde_json::Value, String)> {
        let (code, out, err) = cli(&["reconcile", "-c", &cfg, "--since", &since_arg, "--json"])?;
        let v: serde_json::Value =
            serde_json::from_str(&out).map_err(|e| anyhow::anyhow!("{e}: {out}\n{err}"))?;
        Ok((code, v, err))
    };

    // Clean: every published event on both sinks, once, in order.
    let (code, report, err) = run()?;
    let [missing, duplicated, disorder, unexpected, unchecked] = findings(&report);
    assert_eq!(report["published"], n, "{report}");
    assert!(
        missing.is_empty()
            && duplicated.is_empty()
            && disorder.is_empty()
            && unexpected.is_empty()
            && unchecked.is_empty(),
        "{report}\n{err}"
    );
    assert_eq!(code, 0, "{report}");
    assert_eq!(report["clean"], true);

    // Lose one JetStream message, duplicate one Kafka message.
    let (lost, lost_subject) = lose_first(&js, &stream).await?;
    let copy = &kafka[kafka.len() / 2];
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", KAFKA)
        .create()?;
    let mut headers = OwnedHeaders::new();
    for (k, v) in &copy.headers {
        headers = headers.insert(Header {
            key: k,
            value: Some(v.as_bytes()),
        });
    }
    producer
        .send(
            FutureRecord::to(&topic)
                .partition(copy.partition)
                .key(copy.key.as_deref().unwrap_or(""))
                .payload(&copy.payload)
                .headers(headers),
            Duration::from_secs(10),
        )
        .await
        .map_err(|(e, _)| e)?;

    let (code, report, err) = run()?;
    let [missing, duplicated, disorder, unexpected, unchecked] = findings(&report);
    assert_eq!(
        missing,
        vec![format!("{lost} on nats/{lost_subject}")],
        "{report}\n{err}"
    );
    assert_eq!(
        duplicated,
        vec![format!("{} on kafka/{topic} x2", copy.id())],
        "{report}"
    );
    assert!(
        disorder.is_empty() && unexpected.is_empty() && unchecked.is_empty(),
        "{report}"
    );
    assert_eq!(code, 1, "a missing message exits non-zero: {report}");
    assert_eq!(report["clean"], false);
    // The table says the same.
    let (code, out, _) = cli(&["reconcile", "-c", &cfg, "--since", &since_arg])?;
    assert_eq!(code, 1);
    assert!(
        out.contains(&format!("missing: {lost} on nats/{lost_subject}")),
        "{out}"
    );
    assert!(out.contains("NOT clean"), "{out}");
    drop_nats_stream(&stream).await;
    db.drop_db().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn scheduled_reconciliation_reports_a_lost_message() -> anyhow::Result<()> {
    let http = free_addr();
    // Checked every 2 s, each window ending 40 s ago: the test loses a
    // message well before the window holding its event is checked.
    let settle = Duration::from_secs(40);
    let produced = std::time::Instant::now();
    let FanOut {
        db,
        stream,
        js,
        relay,
        ..
    } = fan_out(
        "s",
        "reconcile_every = \"2s\"\nreconcile_settle = \"40s\"\n",
        &http,
    )
    .await?;
    let (lost, _) = lose_first(&js, &stream).await?;
    assert!(
        produced.elapsed() < settle - Duration::from_secs(10),
        "the test took {:?} to lose the message: the window may have been checked already",
        produced.elapsed()
    );
    let gauge = |text: &str, name: &str| {
        metric(
            text,
            &format!("{name}{{route=\"fanout\",source=\"default\"}}"),
        )
    };
    // The window with the events: one missing on the route, nothing else.
    let found = eventually(Duration::from_secs(90), || async {
        let text = http_get(&http, "/metrics")
            .await
            .map(|(_, b)| b)
            .unwrap_or_default();
        gauge(&text, "outroute_reconcile_missing") == Some(1.0)
    })
    .await;
    let text = http_get(&http, "/metrics").await?.1;
    assert!(found, "{text}\n{}", relay.log_text());
    assert_eq!(
        gauge(&text, "outroute_reconcile_duplicated"),
        Some(0.0),
        "{text}"
    );
    assert_eq!(
        gauge(&text, "outroute_reconcile_out_of_order"),
        Some(0.0),
        "{text}"
    );
    assert_eq!(
        gauge(&text, "outroute_reconcile_unchecked"),
        Some(0.0),
        "{text}"
    );
    assert!(
        metric(
            &text,
            "outroute_reconcile_runs_total{result=\"findings\",source=\"default\"}"
        ) == Some(1.0),
        "{text}"
    );
    let log = relay.log_text();
    assert!(
        log.lines()
            .any(|l| l.contains("not in the topic") && l.contains(&lost)),
        "the log names the lost event {lost}:\n{log}"
    );
    // The next windows hold nothing lost: the gauge says so, and the
    // checks move on.
    let until = metric(
        &text,
        "outroute_reconcile_checked_until_seconds{source=\"default\"}",
    )
    .unwrap_or(0.0);
    let moved_on = eventually(Duration::from_secs(30), || async {
        let text = http_get(&http, "/metrics")
            .await
            .map(|(_, b)| b)
            .unwrap_or_default();
        gauge(&text, "outroute_reconcile_missing") == Some(0.0)
            && metric(
                &text,
                "outroute_reconcile_checked_until_seconds{source=\"default\"}",
            )
            .is_some_and(|u| u > until)
    })
    .await;
    assert!(moved_on, "{}", http_get(&http, "/metrics").await?.1);
    drop(relay);
    drop_nats_stream(&stream).await;
    db.drop_db().await;
    Ok(())
}
