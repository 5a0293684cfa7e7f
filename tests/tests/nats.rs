//! NATS JetStream and fan-out: one event to a Kafka topic and a NATS
//! subject, both acknowledged before the row is marked; JetStream drops a
//! re-sent duplicate by `Nats-Msg-Id`; oversize messages fail for good;
//! `replay` re-publishes exactly the selected events; a core-NATS ack that a
//! finished round trip covers never waits behind one in flight.

use std::time::Duration;

use outroute::config::{NatsMode, NatsSinkConfig};
use outroute::sink::nats::NatsSink;
use outroute::sink::{Outgoing, PublishError, Sink};
use outroute_e2e::*;

fn fanout_config(
    dir: &std::path::Path,
    db: &TestDb,
    t: &str,
) -> anyhow::Result<std::path::PathBuf> {
    write_config(
        dir,
        &db.url,
        "lease_ttl = \"3s\"",
        &fanout_body(&format!("f{t}")),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn fanout_reaches_kafka_and_jetstream_and_replay_republishes_the_selection()
-> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let t = tag();
    let topic = format!("f{t}.order-updated");
    create_topic(&topic, 3).await?;
    let stream = format!("F{t}");
    let js = nats_stream(&stream, vec![format!("f{t}.>")]).await?;
    let dir = test_dir("fanout");
    let config = fanout_config(&dir, &db, &t)?;
    db.migrate(&config)?;
    let work = produce(&db.pool, "agg", 20, 5, 6).await?;

    let mut relay = Relay::start(&config, &[])?;
    let kafka = consume_kafka(&topic, 3, work.committed.len(), Duration::from_secs(60))?;
    let nats = consume_nats(&js, &stream, work.committed.len(), Duration::from_secs(60)).await?;
    let (rk, rn) = (check(&work, &kafka), check(&work, &nats));
    println!("fanout kafka: {rk}\nfanout nats: {rn}");
    rk.assert_clean();
    rn.assert_clean();
    for m in &nats {
        assert_eq!(
            m.headers.get("Nats-Msg-Id").map(String::as_str),
            Some(format!("/outroute/outbox:{}:fanout:{}", m.id(), m.topic).as_str())
        );
        assert!(
            m.topic.starts_with(&format!("f{t}.{}.", m.aggregate())),
            "{}",
            m.topic
        );
        assert!(m.headers.contains_key("traceparent") && m.headers.contains_key("ce_time"));
    }
    assert!(
        eventually(Duration::from_secs(10), || async {
            db.unpublished("").await == 0
        })
        .await
    );
    relay.terminate(Duration::from_secs(15));

    // Replay one aggregate: exactly its events go out again, to both sinks.
    let cfg = config.to_str().unwrap_or_default();
    let selected: Vec<&Expected> = work
        .committed
        .iter()
        .filter(|e| e.aggregate_id == "agg-3")
        .collect();
    let (code, out, err) = cli(&["replay", "--aggregate-id", "agg-3", "--dry-run", "-c", cfg])?;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.starts_with(&format!("{} published event(s) match", selected.len())),
        "{out}"
    );
    let (code, out, err) = cli(&["replay", "--aggregate-id", "agg-3", "-c", cfg])?;
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains(&format!(
            "selected {n} published event(s); re-published {n};",
            n = selected.len()
        )),
        "{out}"
    );
    let kafka2 = consume_kafka(&topic, 3, usize::MAX, Duration::from_secs(5))?;
    let nats2 = consume_nats(&js, &stream, usize::MAX, Duration::from_secs(3)).await?;
    for (name, before, after) in [("kafka", &kafka, &kafka2), ("nats", &nats, &nats2)] {
        // What arrived after the replay, beyond what was there before.
        let mut seen: std::collections::HashMap<&str, i64> = std::collections::HashMap::new();
        for d in before.iter() {
            *seen.entry(d.id()).or_default() -= 1;
        }
        for d in after.iter() {
            *seen.entry(d.id()).or_default() += 1;
        }
        let mut extra_ids: Vec<&str> = seen
            .iter()
            .flat_map(|(id, n)| std::iter::repeat_n(*id, (*n).max(0) as usize))
            .collect();
        extra_ids.sort();
        let mut want: Vec<&str> = selected.iter().map(|e| e.id.as_str()).collect();
        want.sort();
        assert_eq!(
            extra_ids, want,
            "{name}: replay re-published something else"
        );
    }
    db.drop_db().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn jetstream_drops_a_resent_duplicate_and_refuses_oversize() -> anyhow::Result<()> {
    let t = tag();
    let stream = format!("D{t}");
    let js = nats_stream(&stream, vec![format!("d{t}.>")]).await?;
    let cfg = NatsSinkConfig {
        url: NATS.into(),
        mode: NatsMode::Jetstream,
        max_message_bytes: 1 << 20,
        max_in_flight: 100,
        create_stream: None,
        tls: None,
        auth: None,
    };
    let sink = NatsSink::build("nats", &cfg, &[format!("d{t}.*")], Duration::from_secs(5)).await?;
    let headers: Vec<outroute::sink::Header> = vec![("ce_id", "event-1".into())];
    let subject = format!("d{t}.x");
    let msg = |payload: &'static [u8]| Outgoing {
        topic: &subject,
        key: None,
        partition: None,
        headers: &headers,
        payload,
        dedup_id: "event-1",
    };
    sink.send(msg(b"{}"), None).await?.wait().await?;
    sink.send(msg(b"{}"), None).await?.wait().await?; // after a crash between ack and mark
    let info = js.get_stream(&stream).await?.info().await?.state.messages;
    assert_eq!(info, 1, "JetStream kept a duplicate");

    let big: &'static [u8] = Box::leak(vec![b'x'; 2 << 20].into_boxed_slice());
    match sink.send(msg(big), None).await {
        Err(PublishError::Permanent(reason)) => assert!(reason.contains(&subject), "{reason}"),
        other => panic!("oversize not refused: {:?}", other.map(|_| ())),
    }

    // Producer data that no NATS header can carry fails that message, clearly.
    let bad: Vec<outroute::sink::Header> = vec![("ce_subject", "line\nbreak".into())];
    let m = Outgoing {
        topic: &subject,
        key: None,
        partition: None,
        headers: &bad,
        payload: b"{}",
        dedup_id: "event-2",
    };
    match sink.send(m, None).await {
        Err(PublishError::Permanent(reason)) => {
            assert!(reason.contains("value of header `ce_subject`"), "{reason}")
        }
        other => panic!("bad header not refused: {:?}", other.map(|_| ())),
    }

    // No stream captures a subject the routes allow: refused at start-up.
    let err = NatsSink::build(
        "nats",
        &cfg,
        &[format!("nostream{t}.*")],
        Duration::from_secs(5),
    )
    .await
    .err()
    .expect("started without a stream");
    assert!(
        format!("{err:#}").contains("no JetStream stream captures subject"),
        "{err:#}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_batch_larger_than_the_in_flight_limit_does_not_wait_on_itself() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let t = tag();
    let stream = format!("S{t}");
    let js = nats_stream(&stream, vec![format!("s{t}.>")]).await?;
    let dir = test_dir("inflight");
    let config = write_config(
        &dir,
        &db.url,
        "batch_size = 200\nconcurrency = 2",
        &relay_body(
            "",
            &[TestSink::NatsWith("max_in_flight = 3")],
            "order-router",
            "orders",
            &format!(
                "config = {{ sink = \"nats\", topic = \"s{t}.{{event_type}}\" }}\nallow = {{ nats = [\"s{t}.*\"] }}"
            ),
        ),
    )?;
    db.migrate(&config)?;
    let work = produce(&db.pool, "agg", 40, 10, 0).await?;
    let mut relay = Relay::start(&config, &[])?;
    let got = consume_nats(&js, &stream, work.committed.len(), Duration::from_secs(60)).await?;
    let r = check(&work, &got);
    r.assert_clean();
    relay.terminate(Duration::from_secs(15));
    db.drop_db().await;
    Ok(())
}

/// `config check --sinks` reaches every sink as `run` would and changes
/// nothing: a NATS subject no stream captures fails the check (naming the
/// pattern), a `create_stream` not made yet is reported and left uncreated,
/// Kafka brokers that answer pass and an address nobody listens on fails.
#[tokio::test(flavor = "multi_thread")]
async fn config_check_reaches_the_sinks_and_creates_nothing() -> anyhow::Result<()> {
    let t = tag();
    let dir = test_dir("check-sinks");
    let stream = format!("CHK{t}");
    let write = |nats_extra: &str, brokers: &str| -> anyhow::Result<String> {
        let f = dir.join("outroute.toml");
        std::fs::write(
            &f,
            format!(
                "[store]\nurl = \"sqlite://{db}\"\n\
                 [sinks.kafka]\nkind = \"kafka\"\nbrokers = \"{brokers}\"\n\
                 [sinks.nats]\nkind = \"nats\"\nurl = \"{NATS}\"\n{nats_extra}\n\
                 [plugins.p]\npath = \"{plugin}\"\n[[routes]]\nname = \"orders\"\nplugin = \"p\"\n\
                 config = {{ sink = \"nats\", topic = \"c{t}.{{event_type}}\" }}\n\
                 allow = {{ nats = [\"c{t}.*\"], kafka = [\"c{t}.*\"] }}\n",
                db = dir.join("outbox.db").display(),
                plugin = plugin("order-router").display(),
            ),
        )?;
        Ok(f.display().to_string())
    };

    // No stream captures c<t>.*: refused, naming the sink and the pattern.
    let f = write("", KAFKA)?;
    let (code, out, err) = cli(&["config", "check", "--sinks", "-c", &f])?;
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.contains(&format!(
            "{f}:sinks.nats: no JetStream stream captures subject `c{t}.x` (allowed pattern `c{t}.*`)"
        )),
        "{err}"
    );
    assert!(
        out.contains(&format!("sinks.kafka: reached {KAFKA}")),
        "{out}"
    );
    // No Kafka topic matches c<t>.* yet: said (a cluster may create topics
    // on first use), not refused.
    assert!(
        out.contains(&format!(
            "sinks.kafka: no topic matches `c{t}.*` yet: create the topics first"
        )),
        "{out}"
    );
    // Without --sinks nothing is reached and the file passes.
    let (code, _, err) = cli(&["config", "check", "-c", &f])?;
    assert_eq!(code, 0, "{err}");

    // create_stream would capture it: reported, and still not created.
    let f = write(
        &format!("create_stream = {{ name = \"{stream}\", subjects = [\"c{t}.>\"] }}"),
        KAFKA,
    )?;
    let (code, out, err) = cli(&["config", "check", "--sinks", "-c", &f])?;
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains(&format!(
            "stream `{stream}` does not exist yet; `run` creates it"
        )) && out.contains(&format!(
            "`c{t}.*` will go to stream `{stream}` (created by `run`)"
        )),
        "{out}"
    );
    let js = async_nats::jetstream::new(async_nats::connect(NATS).await?);
    assert!(
        js.get_stream(&stream).await.is_err(),
        "the check created the stream"
    );

    // An existing stream is found by subject; existing Kafka topics by
    // pattern (`*` stops at a dot).
    let _js = nats_stream(&stream, vec![format!("c{t}.>")]).await?;
    create_topic(&format!("c{t}.order-created"), 1).await?;
    create_topic(&format!("c{t}.order.deep"), 1).await?;
    let f = write("", KAFKA)?;
    let (code, out, err) = cli(&["config", "check", "--sinks", "-c", &f])?;
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains(&format!("sinks.nats: `c{t}.*` goes to stream `{stream}`")),
        "{out}"
    );
    assert!(
        out.contains(&format!(
            "sinks.kafka: `c{t}.*` matches 1 topic (c{t}.order-created)"
        )),
        "{out}"
    );
    // A create_stream whose subjects that stream already captures: the
    // server would refuse to create it, so the check refuses it too.
    let f = write(
        &format!("create_stream = {{ name = \"{stream}B\", subjects = [\"c{t}.>\"] }}"),
        KAFKA,
    )?;
    let (code, out, err) = cli(&["config", "check", "--sinks", "-c", &f])?;
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.contains(&format!(
            "sinks.nats.create_stream: cannot create stream `{stream}B`: subject `c{t}.>` is already captured by stream `{stream}`"
        )),
        "{err}"
    );

    // Kafka brokers nobody runs: refused (at start-up this is an outage the
    // relay waits out; a check says so).
    let f = write("", "127.0.0.1:1")?;
    let (code, out, err) = cli(&["config", "check", "--sinks", "-c", &f])?;
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.contains(&format!(
            "{f}:sinks.kafka: no Kafka broker at 127.0.0.1:1 answered"
        )),
        "{err}"
    );
    let _ = js.delete_stream(&stream).await;
    Ok(())
}

/// Two services' outboxes whose events share an id (each table's ids are
/// unique only in that table), routed to one JetStream subject: both are
/// stored. The dedup id (`Nats-Msg-Id`) names the source, so the second is
/// never taken for a re-sent copy of the first and dropped while marked
/// published (issue 41, item 1).
#[tokio::test(flavor = "multi_thread")]
async fn events_of_two_sources_with_one_id_are_both_stored() -> anyhow::Result<()> {
    let (a, b) = (TestDb::new().await?, TestDb::new().await?);
    let t = tag();
    let stream = format!("D{t}");
    let js = nats_stream(&stream, vec![format!("d{t}.>")]).await?;
    let dir = test_dir("dedup-sources");
    let body = format!(
        "[relay]\ncache_dir = \"{}\"\n[sources.a]\nurl = \"{}\"\n[sources.b]\nurl = \"{}\"\n\
         [http]\nlisten = \"\"\n[sinks.nats]\nkind = \"nats\"\nurl = \"{NATS}\"\n\
         [plugins.p]\npath = \"{}\"\n[[routes]]\nname = \"r\"\nplugin = \"p\"\n\
         config = {{ sink = \"nats\", topic = \"d{t}.{{event_type}}\" }}\nallow = {{ nats = [\"d{t}.*\"] }}\n",
        std::env::temp_dir().join("outroute-test-cache").display(),
        a.url,
        b.url,
        plugin("order-router").display()
    );
    std::fs::create_dir_all(&dir)?;
    let config = dir.join("outroute.toml");
    std::fs::write(&config, body)?;
    a.migrate(&config)?;
    let id = uuid::Uuid::new_v4();
    for (db, who) in [(&a, "a"), (&b, "b")] {
        sqlx::query(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
             VALUES ($1, 'order', $2, 'order-created', $3)",
        )
        .bind(id)
        .bind(format!("{who}-1"))
        .bind(serde_json::json!({ "from": who }))
        .execute(&db.pool)
        .await?;
    }
    let mut relay = Relay::start(&config, &[])?;
    let marked = eventually(Duration::from_secs(30), || async {
        a.unpublished("").await == 0 && b.unpublished("").await == 0
    })
    .await;
    assert!(marked, "{}", relay.log_text());
    // Both marked; both must be in the stream.
    let stored = js.get_stream(&stream).await?.info().await?.state.messages;
    assert_eq!(
        stored, 2,
        "one of two distinct events was dropped as a duplicate"
    );
    relay.terminate(Duration::from_secs(15));
    drop_nats_stream(&stream).await;
    a.drop_db().await;
    b.drop_db().await;
    Ok(())
}

/// Core NATS has no acks: a message counts once a server round trip sent
/// after it came back, one round trip at a time. A message a finished round
/// trip already covers is acknowledged at once, never queued behind the
/// round trip another message is waiting for (a batch awaits its acks one
/// after the other: queued, each of 500 waited its turn behind the round
/// trips of every other source's messages). Through the fault proxy, the
/// later round trip takes 2 × 2 s.
#[tokio::test(flavor = "multi_thread")]
async fn a_core_ack_already_covered_does_not_wait_for_a_round_trip_in_flight() -> anyhow::Result<()>
{
    let proxy = outroute_e2e::proxy::FaultProxy::start("127.0.0.1:0", "127.0.0.1:4222").await?;
    let t = tag();
    let cfg = NatsSinkConfig {
        url: format!("nats://{}", proxy.addr),
        mode: NatsMode::Core,
        max_message_bytes: 1 << 20,
        max_in_flight: 100,
        create_stream: None,
        tls: None,
        auth: None,
    };
    let sink = NatsSink::build("nats", &cfg, &[format!("c{t}.*")], Duration::from_secs(30)).await?;
    let headers: Vec<outroute::sink::Header> = vec![("ce_id", "event-1".into())];
    let subject = format!("c{t}.x");
    let msg = |id: &'static str| Outgoing {
        topic: &subject,
        key: None,
        partition: None,
        headers: &headers,
        payload: b"{}",
        dedup_id: id,
    };
    // A and B sent; A's round trip covers both.
    let a = sink.send(msg("a"), None).await?;
    let b = sink.send(msg("b"), None).await?;
    a.wait().await?;
    // C's round trip is slow and holds the one-at-a-time turn.
    proxy.set(outroute_e2e::proxy::Fault::Delay(Duration::from_secs(2)));
    let c = sink.send(msg("c"), None).await?;
    let c = tokio::spawn(c.wait());
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !c.is_finished(),
        "C's round trip was not slowed by the proxy"
    );
    // B is covered already: its ack resolves while C's round trip is out.
    let b = b.wait().await;
    let c_done_first = c.is_finished();
    assert!(b.is_ok(), "B: {b:?}");
    assert!(
        !c_done_first,
        "B's ack waited for C's round trip, though A's had covered it"
    );
    proxy.set(outroute_e2e::proxy::Fault::None);
    c.await??;
    Ok(())
}
