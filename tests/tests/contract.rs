//! The WIT contract evolves without breaking plugins. `outroute:router` is
//! semver-versioned; additive changes bump the last number (0.1.0 → 0.1.1,
//! as WASI 0.2.x does), and the relay keeps running plugins built against
//! every earlier 0.1.x. `tests/fixtures/order_router-wit-0.1.0.wasm` is a
//! plugin frozen as built against 0.1.0: it still routes end to end through
//! the current relay, its host imports (`log`) resolved by the newer host.
//! A plugin built against a contract newer than the relay's is refused by
//! name, and the 0.1.1 addition (`host.count`) reaches the metrics.

use std::time::Duration;

use anyhow::{Result, bail};
use outroute_e2e::*;

/// The frozen 0.1.0 plugin (never rebuilt: see tests/fixtures/README.md).
fn fixture() -> std::path::PathBuf {
    workspace().join("tests/fixtures/order_router-wit-0.1.0.wasm")
}

/// The contract version the relay speaks, from `wit/router.wit`.
fn host_contract() -> Result<String> {
    let wit = std::fs::read_to_string(workspace().join("wit/router.wit"))?;
    for line in wit.lines() {
        if let Some(v) = line
            .trim()
            .strip_prefix("package outroute:router@")
            .and_then(|v| v.strip_suffix(';'))
        {
            return Ok(v.to_string());
        }
    }
    bail!("wit/router.wit has no `package outroute:router@…;` line")
}

#[tokio::test(flavor = "multi_thread")]
async fn a_plugin_built_against_the_0_1_0_contract_still_routes() -> Result<()> {
    // The fixture is what it claims to be, and the relay is newer.
    let host = host_contract()?;
    assert!(
        host.starts_with("0.1.") && host != "0.1.0",
        "the relay should speak a newer 0.1.x than the fixture, not {host}"
    );
    let wasm = fixture();
    let (code, out, err) = cli(&["plugin", "inspect", wasm.to_str().unwrap_or_default()])?;
    assert_eq!(code, 0, "{out}{err}");
    let v: serde_json::Value = serde_json::from_str(&out)?;
    assert_eq!(v["contract"], "outroute:router@0.1.0", "{out}");
    assert_eq!(
        v["host_contract"],
        format!("outroute:router@{host}"),
        "{out}"
    );
    let imports: Vec<&str> = v["imports"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|i| i.as_str())
        .collect();
    assert!(
        imports.contains(&"outroute:router/host@0.1.0"),
        "the fixture imports the 0.1.0 host interface: {imports:?}"
    );

    // End to end: relay, frozen plugin, file sink; every event once, in
    // order per aggregate; the plugin's `log` (a 0.1.0 import) reached the
    // relay's log.
    let db = TestDb::new().await?;
    let dir = test_dir("contract");
    let out = dir.join("out.jsonl");
    let body = relay_body(
        "",
        &[TestSink::File(&out)],
        "order-router",
        "orders",
        "config = { sink = \"file\", topic = \"old.{event_type}\" }\nallow = { file = [\"old.*\"] }",
    )
    .replace(
        &plugin("order-router").display().to_string(),
        &wasm.display().to_string(),
    );
    let config = write_config(&dir, &db.url, "", &body)?;
    db.migrate(&config)?;
    let w = produce(&db.pool, "old", 5, 4, 0).await?;
    let relay = Relay::start(&config, &[])?;
    let all = file_sink_reaches(&out, w.committed.len(), Duration::from_secs(60)).await;
    assert!(
        all,
        "events routed by the 0.1.0 plugin: {}",
        relay.log_text()
    );
    let delivered = file_sink_deliveries(&out);
    for d in &delivered {
        assert_eq!(d.topic, "old.order-updated");
    }
    check(&w, &delivered).assert_clean();
    assert!(
        relay
            .log_text()
            .contains("routing to file `old.{event_type}`"),
        "the plugin's init log line: {}",
        relay.log_text()
    );
    // Every instance's init line (the first one's too) carries the name
    // `describe` gave, not the file's.
    for line in relay
        .log_text()
        .lines()
        .filter(|l| l.contains("routing to file"))
    {
        assert!(
            line.contains("order-router") && !line.contains("order_router-wit"),
            "{line}"
        );
    }
    drop(relay);
    db.drop_db().await;
    Ok(())
}

#[test]
fn a_plugin_built_against_a_newer_contract_is_refused_by_name() -> Result<()> {
    // The frozen plugin with its contract imports renamed to 0.9.0 (same
    // length, so the component stays valid): a plugin from the future.
    let mut bytes = std::fs::read(fixture())?;
    let mut renamed = 0;
    for iface in ["host", "types"] {
        let from = format!("outroute:router/{iface}@0.1.0");
        let to = format!("outroute:router/{iface}@0.9.0");
        let mut i = 0;
        while let Some(at) = bytes[i..]
            .windows(from.len())
            .position(|w| w == from.as_bytes())
        {
            bytes[i + at..i + at + to.len()].copy_from_slice(to.as_bytes());
            i += at + to.len();
            renamed += 1;
        }
    }
    assert!(renamed >= 2, "the fixture names its contract imports");
    let dir = test_dir("contract-future");
    let future = dir.join("future.wasm");
    std::fs::write(&future, &bytes)?;
    let (code, out, err) = cli(&["plugin", "inspect", future.to_str().unwrap_or_default()])?;
    assert_ne!(code, 0, "{out}");
    let host = host_contract()?;
    assert!(
        err.contains("outroute:router@0.9.0") && err.contains(&format!("speaks {host}")),
        "the error names both contract versions: {err}"
    );
    Ok(())
}

/// `host.count` (added in 0.1.1): schema-gate counts the v1 events it
/// upcasts; the relay exports the counter per plugin and name.
#[tokio::test(flavor = "multi_thread")]
async fn plugin_counters_reach_the_metrics() -> Result<()> {
    let db = TestDb::new().await?;
    let dir = test_dir("contract-count");
    let out = dir.join("out.jsonl");
    let http = free_addr();
    let config = write_config(
        &dir,
        &db.url,
        "",
        &relay_body(
            &http,
            &[TestSink::File(&out)],
            "schema-gate",
            "gate",
            "config = { sink = \"file\", topic = \"gate.orders\" }\nallow = { file = [\"gate.*\"] }",
        ),
    )?;
    db.migrate(&config)?;
    for i in 0..7 {
        let (version, payload) = if i < 3 {
            (
                1,
                serde_json::json!({"order_id": format!("o{i}"), "customer": "c", "total": 1.5}),
            )
        } else {
            (
                2,
                serde_json::json!({"order_id": format!("o{i}"), "customer_id": "c", "total_cents": 150, "currency": "EUR"}),
            )
        };
        sqlx::query("INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, event_version, payload) VALUES ($1::uuid, 'order', $2, 'order-created', $3, $4)")
            .bind(uuid::Uuid::new_v4().to_string())
            .bind(format!("o{i}"))
            .bind(version)
            .bind(payload)
            .execute(&db.pool)
            .await?;
    }
    let relay = Relay::start(&config, &[])?;
    let all = file_sink_reaches(&out, 7, Duration::from_secs(60)).await;
    assert!(all, "events routed by schema-gate: {}", relay.log_text());
    let (_, metrics) = http_get(&http, "/metrics").await?;
    assert_eq!(
        metric(
            &metrics,
            "outroute_plugin_count_total{name=\"upcast_v1\",plugin=\"schema-gate\",route=\"gate\"}"
        ),
        Some(3.0),
        "{metrics}"
    );
    drop(relay);
    db.drop_db().await;
    Ok(())
}

/// `host.count` as plugin authors see it in `outroute plugin test`: what was
/// counted, and an event failed with the rule it broke.
#[test]
fn plugin_test_shows_counts_and_counter_rules_fail_the_event() -> Result<()> {
    let dir = test_dir("contract-count-rules");
    let v1 = dir.join("v1.json");
    std::fs::write(
        &v1,
        r#"[{"aggregate_type": "order", "aggregate_id": "o1", "event_type": "order-created", "event_version": 1,
             "payload": {"order_id": "o1", "customer": "c", "total": 2.5}},
            {"aggregate_type": "order", "aggregate_id": "o2", "event_type": "order-created", "event_version": 1,
             "payload": {"order_id": "o2", "customer": "c", "total": 3.5}}]"#,
    )?;
    let gate = plugin("schema-gate").display().to_string();
    let (code, out, err) = cli(&[
        "plugin",
        "test",
        &gate,
        "--config",
        r#"{"sink": "kafka", "topic": "orders.v2"}"#,
        "--event",
        v1.to_str().unwrap_or_default(),
    ])?;
    assert_eq!(code, 0, "{out}{err}");
    assert!(err.contains("counted: upcast_v1 += 2"), "{err}");

    let hostile = plugin("hostile").display().to_string();
    let one = dir.join("one.json");
    std::fs::write(
        &one,
        r#"{"aggregate_type": "order", "aggregate_id": "o1", "event_type": "order-created", "payload": {}}"#,
    )?;
    for (mode, needle) in [
        (
            "counter-name",
            "counter name `Bad Name!` is not 1-64 characters of a-z, 0-9 and _",
        ),
        ("counter-flood", "a plugin may use at most 32"),
    ] {
        let (code, out, err) = cli(&[
            "plugin",
            "test",
            &hostile,
            "--config",
            &format!(r#"{{"mode": "{mode}"}}"#),
            "--event",
            one.to_str().unwrap_or_default(),
        ])?;
        assert_eq!(code, 3, "{mode}: the event is refused: {out}{err}");
        assert!(out.contains(needle), "{mode}: {out}{err}");
        assert!(
            err.contains("1 of 1 events rejected (exit status 3)"),
            "{mode}: stderr says why the status is 3: {err}"
        );
        assert!(
            !err.contains("counted:"),
            "{mode}: a failed call's counts are not kept: {err}"
        );
    }
    Ok(())
}

/// `outroute plugin test` shows the plugin's own log lines (here the
/// order router's `init` line), under the name `describe` gives.
#[test]
fn plugin_test_shows_the_plugins_log_lines() -> Result<()> {
    let dir = test_dir("contract-plugin-log");
    let one = dir.join("one.json");
    std::fs::write(
        &one,
        r#"{"aggregate_type": "order", "aggregate_id": "o1", "event_type": "order-created", "payload": {}}"#,
    )?;
    let router = plugin("order-router").display().to_string();
    let (code, out, err) = cli(&[
        "plugin",
        "test",
        &router,
        "--config",
        r#"{"sink": "file", "topic": "t.{event_type}"}"#,
        "--event",
        one.to_str().unwrap_or_default(),
    ])?;
    assert_eq!(code, 0, "{out}{err}");
    let init_lines: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("routing to file `t.{event_type}`"))
        .collect();
    assert_eq!(
        init_lines.len(),
        1,
        "init runs once, as in the relay: {err}"
    );
    assert!(init_lines[0].contains("plugin=\"order-router\""), "{err}");
    // Not a terminal: no colour codes in the log.
    assert!(!err.contains('\u{1b}'), "{err}");
    assert!(
        out.contains("\"topic\": \"t.order-created\""),
        "the outcome stays on stdout: {out}"
    );
    // Lines a plugin logs while routing one event carry the event's id.
    let named = dir.join("named.json");
    std::fs::write(
        &named,
        r#"{"id": "ev-logged", "aggregate_type": "order", "aggregate_id": "o1", "event_type": "order-created", "payload": {}}"#,
    )?;
    let (code, out, err) = cli(&[
        "plugin",
        "test",
        &plugin("hostile").display().to_string(),
        "--config",
        r#"{"mode": "log-flood"}"#,
        "--event",
        named.to_str().unwrap_or_default(),
    ])?;
    assert_eq!(code, 3, "100 lines, then the flood is stopped: {out}{err}");
    let first = err
        .lines()
        .find(|l| l.contains("hostile log line 0"))
        .unwrap_or_default();
    assert!(first.contains("event_id=\"ev-logged\""), "{err}");
    Ok(())
}
