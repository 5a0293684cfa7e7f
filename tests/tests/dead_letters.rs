//! Dead letters with an owner: an event that fails for good on a route
//! with `dead_letter` produces exactly one message on the dead-letter
//! topic, carrying the event and why it failed, whose route owner it is;
//! with the dead-letter sink down the event is not lost (retried, not
//! recorded failed) and its dead letter goes out once the sink is back.
//! `failed list`, `status` and the failed-events gauge name the owner.

use std::time::Duration;

use outroute_e2e::proxy::{Fault, FaultProxy};
use outroute_e2e::*;

/// Two events the route cannot deliver: their event type makes a topic
/// the route's allow-list refuses, which fails them for good.
async fn poison(db: &TestDb, n: usize) -> anyhow::Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    for i in 0..n {
        let id = uuid::Uuid::new_v4().to_string();
        let agg = format!("poisoned-{i}");
        sqlx::query(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, headers) \
             VALUES ($1::uuid, 'order', $2, 'poison', $3, $4)",
        )
        .bind(&id)
        .bind(&agg)
        .bind(serde_json::json!({ "order_id": agg, "n": i }))
        .bind(serde_json::json!({ "x-tenant": "acme", "traceparent": format!("00-{:032x}-{:016x}-01", i + 7, i + 9) }))
        .execute(&db.pool)
        .await?;
        out.push((id, agg));
    }
    Ok(out)
}

/// The failure record of event `id`: (reason, failed for good).
async fn state_of(db: &TestDb, id: &str) -> Option<(String, bool)> {
    sqlx::query_as::<_, (Option<String>, bool)>(
        "SELECT last_error, failed_at IS NOT NULL FROM outroute_event_state WHERE event_id = $1",
    )
    .bind(id)
    .fetch_optional(&db.pool)
    .await
    .ok()
    .flatten()
    .map(|(r, f)| (r.unwrap_or_default(), f))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_failed_event_sends_one_dead_letter_naming_its_reason_and_owner() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let t = tag();
    let (topic, dead) = (format!("dl{t}.order-updated"), format!("dl{t}.dead"));
    create_topic(&topic, 1).await?;
    create_topic(&dead, 1).await?;
    let dir = test_dir("dead-letter");
    let http = free_addr();
    let config = write_config(
        &dir,
        &db.url,
        "",
        &relay_body(
            &http,
            &[TestSink::Kafka],
            "order-router",
            "orders",
            &format!(
                "config = {{ sink = \"kafka\", topic = \"dl{t}.{{event_type}}\" }}\n\
                 allow = {{ kafka = [\"{topic}\"] }}\n\
                 owner = \"orders-team\"\nowner_contact = \"#orders-oncall\"\n\
                 dead_letter = {{ sink = \"kafka\", topic = \"{dead}\" }}\n"
            ),
        ),
    )?;
    db.migrate(&config)?;
    let work = produce(&db.pool, "good", 4, 3, 0).await?;
    let poisoned = poison(&db, 2).await?;

    let relay = Relay::start(&config, &[])?;
    let delivered = consume_kafka(&topic, 1, work.committed.len(), Duration::from_secs(60))?;
    check(&work, &delivered).assert_clean();
    // Both failed for good (recorded after their dead letters' acks).
    let failed = eventually(Duration::from_secs(30), || async {
        let mut all = true;
        for (id, _) in &poisoned {
            all &= state_of(&db, id).await.is_some_and(|(_, f)| f);
        }
        all
    })
    .await;
    assert!(failed, "{}", relay.log_text());
    let letters = consume_kafka(&dead, 1, poisoned.len(), Duration::from_secs(30))?;
    assert_eq!(
        letters.len(),
        poisoned.len(),
        "one dead letter per failed event: {letters:?}"
    );
    for (id, agg) in &poisoned {
        let l = letters
            .iter()
            .find(|l| l.id() == id)
            .unwrap_or_else(|| panic!("no dead letter for {id}: {letters:?}"));
        let h = &l.headers;
        let reason = &h["outroute-failure-reason"];
        assert!(
            reason.contains(&format!("dl{t}.poison")),
            "the reason names the refused topic: {reason}"
        );
        for (name, want) in [
            ("outroute-failure-attempts", "1"),
            ("outroute-failure-route", "orders"),
            ("outroute-failure-plugin", "order-router"),
            ("outroute-failure-owner", "orders-team"),
            ("outroute-failure-owner-contact", "#orders-oncall"),
            ("outroute-failure-source", "default"),
            ("ce_type", "poison"),
            ("ce_aggregateid", agg.as_str()),
            ("x-tenant", "acme"),
        ] {
            assert_eq!(h.get(name).map(String::as_str), Some(want), "{name}: {h:?}");
        }
        assert!(!h["outroute-failure-plugin-version"].is_empty(), "{h:?}");
        let first = chrono::DateTime::parse_from_rfc3339(&h["outroute-failure-first-error-at"])?;
        assert!(
            (chrono::Utc::now() - first.with_timezone(&chrono::Utc)).num_seconds() < 120,
            "{first}"
        );
        assert!(h["traceparent"].starts_with("00-"), "{h:?}");
        assert_eq!(l.key.as_deref(), Some(agg.as_str()), "keyed by aggregate");
        let payload: serde_json::Value = serde_json::from_slice(&l.payload)?;
        assert_eq!(payload["order_id"], agg.as_str(), "the event's own payload");
    }
    // The operator's view names the owner, and so does the gauge.
    let cfg = config.display().to_string();
    let (code, out, err) = cli(&["failed", "list", "-c", &cfg, "--json"])?;
    assert_eq!(code, 0, "{err}");
    let rows: Vec<serde_json::Value> = serde_json::from_str(&out)?;
    assert_eq!(rows.len(), 2, "{out}");
    for r in &rows {
        assert_eq!(r["owner"], "orders-team", "{r}");
        assert_eq!(r["owner_contact"], "#orders-oncall", "{r}");
    }
    let (_, out, _) = cli(&["failed", "list", "-c", &cfg, "--owner", "billing"])?;
    assert!(out.contains("no failed events"), "{out}");
    let (code, out, err) = cli(&["status", "-c", &cfg])?;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.lines().any(|l| l.contains("route orders")
            && l.contains("owner orders-team (#orders-oncall)")
            && l.contains(" 2 ")),
        "{out}"
    );
    let gauge = eventually(Duration::from_secs(10), || async {
        let text = http_get(&http, "/metrics")
            .await
            .map(|(_, b)| b)
            .unwrap_or_default();
        metric(
            &text,
            "outroute_failed_events{owner=\"orders-team\",route=\"orders\",source=\"default\"}",
        ) == Some(2.0)
            && metric(
                &text,
                "outroute_dead_letters_total{result=\"sent\",route=\"orders\"}",
            ) == Some(2.0)
    })
    .await;
    assert!(gauge, "{}", http_get(&http, "/metrics").await?.1);
    // Discarded, then one more fails: the gauge counts what is failed now
    // (1), not every failure so far (3).
    let (code, out, err) = cli(&["failed", "discard", "-c", &cfg, "--route", "orders"])?;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("2 event(s) discarded"), "{out}");
    // ... and the dead-letter topic hears of it: one resolution record each.
    assert!(out.contains("2 resolution record(s) published"), "{out}");
    let all = consume_kafka(&dead, 1, poisoned.len(), Duration::from_secs(30))?;
    let resolved: Vec<&Delivered> = all
        .iter()
        .filter(|m| m.headers.get("outroute-resolution").map(String::as_str) == Some("discarded"))
        .collect();
    assert_eq!(resolved.len(), 2, "{all:?}");
    for (id, agg) in &poisoned {
        let r = resolved
            .iter()
            .find(|m| m.id() == id)
            .unwrap_or_else(|| panic!("no resolution record for {id}"));
        assert_eq!(r.key.as_deref(), Some(agg.as_str()));
        let body: serde_json::Value = serde_json::from_slice(&r.payload)?;
        assert_eq!(body["resolution"], "discarded");
        assert_eq!(body["owner"], "orders-team");
    }
    poison(&db, 1).await?;
    let counted = eventually(Duration::from_secs(30), || async {
        let text = http_get(&http, "/metrics")
            .await
            .map(|(_, b)| b)
            .unwrap_or_default();
        metric(&text, "outroute_failed_events{route=\"orders\"}") == Some(1.0)
    })
    .await;
    assert!(counted, "{}", http_get(&http, "/metrics").await?.1);
    drop(relay);
    db.drop_db().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dead_letter_waits_for_its_sink_and_loses_nothing() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let t = tag();
    let (topic, dead) = (format!("dw{t}.order-updated"), format!("dw{t}.dead"));
    create_topic(&topic, 1).await?;
    let stream = format!("DW{t}");
    let js = nats_stream(&stream, vec![dead.clone()]).await?;
    // A second route fails the poisoned event too; its dead-letter sink
    // (Kafka) is up, so its dead letter goes out at the first failure and
    // must not be sent again while the event is retried for the other's.
    let audit_dead = format!("dw{t}.audit-dead");
    let audit = format!(
        "[[routes]]\nname = \"audit\"\nplugin = \"p\"\nevent_types = [\"poison\"]\n\
         config = {{ sink = \"kafka\", topic = \"dw{t}.audit.{{event_type}}\" }}\n\
         allow = {{ kafka = [\"dw{t}.audit.ok\"] }}\n\
         dead_letter = {{ sink = \"kafka\", topic = \"{audit_dead}\" }}\n"
    );
    // The dead-letter sink is down from the start.
    let proxy = FaultProxy::start("127.0.0.1:0", NATS.trim_start_matches("nats://")).await?;
    proxy.set(Fault::Refuse);
    let dir = test_dir("dead-letter-down");
    let config = write_config(
        &dir,
        &db.url,
        "",
        &format!(
            "{}[sinks.dlq]\nkind = \"nats\"\nurl = \"nats://{}\"\n{audit}",
            relay_body(
                "",
                &[TestSink::Kafka],
                "order-router",
                "orders",
                &format!(
                    "config = {{ sink = \"kafka\", topic = \"dw{t}.{{event_type}}\" }}\n\
                     allow = {{ kafka = [\"{topic}\"] }}\n\
                     backoff_min = \"200ms\"\nbackoff_max = \"1s\"\n\
                     dead_letter = {{ sink = \"dlq\", topic = \"{dead}\" }}\n"
                ),
            ),
            proxy.addr
        ),
    )?;
    db.migrate(&config)?;
    create_topic(&audit_dead, 1).await?;
    let poisoned = poison(&db, 1).await?;
    let id = poisoned[0].0.clone();
    let work = produce(&db.pool, "good", 2, 2, 0).await?;

    let mut relay = Relay::start(&config, &[])?;
    // Other events flow while the dead-letter sink is down.
    let delivered = consume_kafka(&topic, 1, work.committed.len(), Duration::from_secs(60))?;
    check(&work, &delivered).assert_clean();
    // The failed event is retried, not recorded failed, and stays pending.
    let waiting = eventually(Duration::from_secs(30), || async {
        state_of(&db, &id)
            .await
            .is_some_and(|(r, failed)| !failed && r.contains("dead letter to `dlq`"))
    })
    .await;
    assert!(
        waiting,
        "{:?}\n{}",
        state_of(&db, &id).await,
        relay.log_text()
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        state_of(&db, &id).await.is_some_and(|(_, f)| !f),
        "not failed while its dead letter is unsent"
    );
    assert_eq!(
        db.published(&format!("o.id = '{id}'")).await,
        0,
        "never marked published"
    );
    // A restart in between loses nothing either.
    relay.kill();
    let _relay = Relay::start(&config, &[])?;
    proxy.set(Fault::None);
    let failed = eventually(Duration::from_secs(60), || async {
        state_of(&db, &id).await.is_some_and(|(_, f)| f)
    })
    .await;
    assert!(failed, "{:?}", state_of(&db, &id).await);
    let letters = consume_nats(&js, &stream, 1, Duration::from_secs(20)).await?;
    // Exactly one, with the original reason (not the sink's outage).
    tokio::time::sleep(Duration::from_secs(2)).await;
    let letters_again = consume_nats(&js, &stream, 2, Duration::from_secs(3)).await?;
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!(letters_again.len(), 1, "{letters_again:?}");
    let l = &letters[0];
    assert_eq!(l.id(), id);
    // The other route's dead letter went out once, though the event was
    // retried several times while the first one's sink was down.
    let audit_letters = consume_kafka(&audit_dead, 1, 1, Duration::from_secs(10))?;
    assert_eq!(audit_letters.len(), 1, "{audit_letters:?}");
    assert_eq!(
        audit_letters[0]
            .headers
            .get("outroute-failure-route")
            .map(String::as_str),
        Some("audit")
    );
    assert_eq!(
        l.headers.get("outroute-failure-owner").map(String::as_str),
        Some("platform")
    );
    let reason = &l.headers["outroute-failure-reason"];
    assert!(
        reason.contains(&format!("dw{t}.poison")) && !reason.contains("dead letter"),
        "{reason}"
    );
    drop_nats_stream(&stream).await;
    db.drop_db().await;
    Ok(())
}
