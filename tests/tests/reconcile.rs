//! `outroute reconcile` against real brokers: a window the relay published
//! to Kafka and JetStream (fan-out) reconciles clean; after the test
//! deletes one message from the JetStream stream and duplicates one in the
//! Kafka topic, it reports exactly those two (one missing, one duplicated)
//! and exits non-zero.

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

#[tokio::test(flavor = "multi_thread")]
async fn reconcile_finds_exactly_the_deleted_and_the_duplicated_message() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let t = tag();
    let topic = format!("r{t}.order-updated");
    create_topic(&topic, 3).await?;
    let stream = format!("R{t}");
    let js = nats_stream(&stream, vec![format!("r{t}.>")]).await?;
    let dir = test_dir("reconcile");
    let config = write_config(&dir, &db.url, "", &fanout_body(&format!("r{t}")))?;
    db.migrate(&config)?;
    let since = chrono::Utc::now() - chrono::Duration::seconds(5);
    let work = produce(&db.pool, "rec", 5, 6, 0).await?;
    let n = work.committed.len();
    let relay = Relay::start(&config, &[])?;
    let kafka = consume_kafka(&topic, 3, n, Duration::from_secs(60))?;
    let nats = consume_nats(&js, &stream, n, Duration::from_secs(60)).await?;
    check(&work, &kafka).assert_clean();
    check(&work, &nats).assert_clean();
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
    let mut s = js.get_stream(&stream).await?;
    let first = s.get_raw_message(1).await?;
    let lost = first
        .headers
        .get("ce_id")
        .map(|v| v.as_str().to_string())
        .unwrap_or_default();
    let lost_subject = first.subject.to_string();
    assert!(s.delete_message(1).await?);
    let _ = s.info().await?;
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
