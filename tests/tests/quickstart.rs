//! The README's first command, as a newcomer runs it: the embedded default
//! (SQLite outbox, example plugin, file sink) end to end.

use std::time::Duration;

use outroute_e2e::*;

#[test]
fn quickstart_routes_every_committed_event_and_fails_the_malformed_one() -> anyhow::Result<()> {
    let dir = test_dir("quickstart");
    let plugin = plugin("order-router");
    let (code, out, err) = cli(&[
        "quickstart",
        "--dir",
        dir.to_str().unwrap_or_default(),
        "--plugin",
        plugin.to_str().unwrap_or_default(),
    ])?;
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        out.contains("wrote 40 events in business transactions (+1 rolled back, +1 malformed)"),
        "{out}"
    );
    assert!(out.contains("routed 40 messages"), "{out}");
    assert!(
        out.contains("topic orders.order-created   20 messages"),
        "{out}"
    );
    assert!(
        out.contains("failed events: 1") && out.contains("payload is not valid JSON"),
        "{out}"
    );
    let lines = std::fs::read_to_string(dir.join("messages.jsonl"))?;
    assert_eq!(lines.lines().count(), 40);
    assert!(
        !lines.contains("order-rolled-back"),
        "a rolled-back event was published"
    );
    // Per-aggregate order in the output file.
    let mut last: std::collections::HashMap<String, i64> = std::collections::HashMap::new();
    for l in lines.lines() {
        let v: serde_json::Value = serde_json::from_str(l)?;
        let agg = v["headers"]["ce_aggregateid"]
            .as_str()
            .unwrap_or("")
            .to_string();
        let seq: i64 = v["headers"]["ce_sequence"]
            .as_str()
            .and_then(|s| s.parse().ok())
            .unwrap_or(-1);
        let prev = last.insert(agg.clone(), seq).unwrap_or(i64::MIN);
        assert!(seq > prev, "{agg} out of order");
    }
    // Running it again starts from scratch.
    let (code, out, _) = cli(&[
        "quickstart",
        "--dir",
        dir.to_str().unwrap_or_default(),
        "--plugin",
        plugin.to_str().unwrap_or_default(),
    ])?;
    assert_eq!(code, 0);
    assert!(out.contains("routed 40 messages"), "{out}");
    Ok(())
}

#[test]
fn config_check_names_file_key_and_reason_and_schema_prints() -> anyhow::Result<()> {
    let dir = test_dir("configcheck");
    let file = dir.join("bad.toml");
    std::fs::write(
        &file,
        "[store]\nurl = \"mongodb://x\"\n[relay]\nbatch_size = 0\n[[routes]]\nname = \"r\"\nplugin = \"nope\"\nallow = { kafka = [\"a.*\"] }\n",
    )?;
    let (code, _, err) = cli(&["config", "check", "-c", file.to_str().unwrap_or_default()])?;
    assert_ne!(code, 0);
    let f = file.display();
    for needle in [
        format!(
            "{f}:store.url: `mongodb://x` is not a postgres://, mysql:// (or mariadb://) or sqlite: URL"
        ),
        format!("{f}:relay.batch_size: must be between 1 and 10000"),
        format!("{f}:routes[0].plugin: no plugin named `nope` in [plugins]"),
        format!("{f}:routes[0].allow.kafka: no sink named `kafka` in [sinks]"),
    ] {
        assert!(err.contains(&needle), "missing `{needle}` in:\n{err}");
    }
    // `run` refuses the same file before touching anything.
    let (code, _, err) = cli(&["run", "-c", file.to_str().unwrap_or_default()])?;
    assert_ne!(code, 0);
    assert!(err.contains("invalid configuration"), "{err}");
    // An environment override that breaks a value names the environment.
    let out = std::process::Command::new(bin())
        .args(["config", "check", "-c", file.to_str().unwrap_or_default()])
        .env("OUTROUTE_RELAY__LANES", "many")
        .output()?;
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("relay.lanes"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let (code, schema, _) = cli(&["config", "schema"])?;
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&schema)?;
    assert!(v["properties"]["routes"].is_object() && v["properties"]["store"].is_object());
    Ok(())
}

#[test]
fn python_plugin_runs_in_the_same_host() -> anyhow::Result<()> {
    let wasm = plugin("python-router");
    let events = r#"[
      {"aggregate_type":"order","aggregate_id":"o1","event_type":"order-created","payload":{"order_id":"o1","total_cents":250000}},
      {"aggregate_type":"order","aggregate_id":"o2","event_type":"order-created","payload":{"order_id":"o2","total_cents":5}},
      {"aggregate_type":"order","aggregate_id":"o3","event_type":"order-created","payload":{"nothing":true}}
    ]"#;
    let dir = test_dir("python");
    let file = dir.join("events.json");
    std::fs::write(&file, events)?;
    let (code, out, err) = cli(&[
        "plugin",
        "test",
        wasm.to_str().unwrap_or_default(),
        "--config",
        r#"{"sink": "kafka", "prefix": "shop"}"#,
        "--event",
        file.to_str().unwrap_or_default(),
    ])?;
    assert_eq!(
        code, 3,
        "one event is rejected, so the exit code says so: {err}"
    );
    let v: serde_json::Value = serde_json::from_str(&out)?;
    assert_eq!(v[0]["messages"][0]["topic"], "shop.order-created");
    assert_eq!(v[0]["messages"][0]["key"], "o1");
    assert_eq!(v[0]["messages"][0]["headers"]["priority"], "high");
    assert!(v[1]["messages"][0]["headers"].get("priority").is_none());
    assert_eq!(v[2]["rejection"]["kind"], "invalid");
    assert_eq!(v[2]["rejection"]["reason"], "payload has no order_id");

    let (code, out, _) = cli(&["plugin", "inspect", wasm.to_str().unwrap_or_default()])?;
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&out)?;
    assert_eq!(v["name"], "python-router");
    assert_eq!(v["world"], "outroute:router/router");
    // Built just now against wit/router.wit: the contract the relay speaks.
    assert_eq!(v["contract"], v["host_contract"], "{out}");
    Ok(())
}

#[test]
fn shipped_example_configs_pass_config_check() -> anyhow::Result<()> {
    let _ = plugin("order-router"); // built by scripts/build-plugins
    for name in [
        "outroute.toml",
        "outbox_events.toml",
        "t_outbox.toml",
        "outbox-delete.toml",
        "outbox-published-at.toml",
        "mysql.toml",
        "mysql-t_outbox.toml",
        "mysql-binlog.toml",
    ] {
        let path = workspace().join("examples").join(name);
        let (code, out, err) = cli(&["config", "check", "-c", path.to_str().unwrap_or_default()])?;
        assert_eq!(code, 0, "{name}: {out}{err}");
        assert!(out.contains(": ok ("), "{out}");
    }
    // The platform example: three sources, three team files; its secrets
    // come from the environment, and without them it says which are missing.
    let platform = workspace().join("examples/platform/outroute.toml");
    let p = platform.to_str().unwrap_or_default();
    let (code, _, err) = cli(&["config", "check", "-c", p])?;
    assert_ne!(code, 0);
    assert!(
        err.contains("sinks.kafka.sasl.password") && err.contains("sinks.nats.auth"),
        "{err}"
    );
    let out = std::process::Command::new(bin())
        .args(["config", "check", "-c", p])
        .env("OUTROUTE_SINKS__KAFKA__SASL__PASSWORD", "kafka-s3cr3t")
        .env("OUTROUTE_SINKS__NATS__AUTH__PASSWORD", "nats-s3cr3t")
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("(3 sources, 5 routes, 2 sinks, 4 plugins, 3 included files)"),
        "{text}"
    );
    assert!(!text.contains("s3cr3t"), "a secret was printed: {text}");
    Ok(())
}

/// The embedded store beyond the quickstart's happy path: a failing event
/// holds only its own aggregate (others flow), `failed list` names it with
/// its reason, `failed discard` lets the held one go in order; and a relay
/// killed (-9) while it drains a backlog loses nothing when restarted.
#[tokio::test(flavor = "multi_thread")]
async fn the_embedded_store_holds_failures_and_survives_a_kill() -> anyhow::Result<()> {
    let dir = test_dir("sqlite-store");
    let db = dir.join("outbox.db");
    let out = dir.join("out.jsonl");
    let config = dir.join("outroute.toml");
    std::fs::write(
        &config,
        format!(
            "[store]\nurl = \"sqlite://{}\"\n[relay]\ncache_dir = \"{}\"\nbatch_size = 20\n\
             [sinks.file]\nkind = \"file\"\npath = \"{}\"\n\
             [plugins.p]\npath = \"{}\"\n[[routes]]\nname = \"orders\"\nplugin = \"p\"\n{FILE_ROUTE}\nmax_attempts = 1\n",
            db.display(),
            std::env::temp_dir().join("outroute-test-cache").display(),
            out.display(),
            plugin("hostile").display(),
        ),
    )?;
    let cfg = config.display().to_string();
    let (code, o, e) = cli(&["migrate", "-c", &cfg])?;
    assert_eq!(code, 0, "{o}{e}");
    let pool = sqlx::sqlite::SqlitePool::connect(&format!("sqlite://{}", db.display())).await?;
    let insert = |agg: String, payload: serde_json::Value| {
        let pool = pool.clone();
        async move {
            let id = uuid::Uuid::new_v4().to_string();
            sqlx::query("INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES (?1, 'order', ?2, 'order-updated', ?3)")
                .bind(&id)
                .bind(agg)
                .bind(payload.to_string())
                .execute(&pool)
                .await
                .map(|_| id)
        }
    };
    let bad = insert("a".into(), serde_json::json!({"hostile": "reject"})).await?;
    let held = insert("a".into(), serde_json::json!({})).await?;
    let other = insert("b".into(), serde_json::json!({})).await?;
    let relay = Relay::start(&config, &[])?;
    let failed = eventually(Duration::from_secs(30), || async {
        cli(&["failed", "list", "--json", "-c", &cfg]).is_ok_and(|(_, o, _)| {
            o.contains(&bad) && o.contains("hostile plugin rejects this event")
        }) && file_sink_deliveries(&out).iter().any(|d| d.id() == other)
    })
    .await;
    assert!(failed, "{}", relay.log_text());
    assert!(
        !file_sink_deliveries(&out).iter().any(|d| d.id() == held),
        "an event behind a failed one of its aggregate went out"
    );
    let (code, o, e) = cli(&["failed", "discard", "--id", &bad, "-c", &cfg])?;
    assert_eq!(code, 0, "{o}{e}");
    let released = eventually(Duration::from_secs(30), || async {
        file_sink_deliveries(&out).iter().any(|d| d.id() == held)
    })
    .await;
    assert!(released, "{}", relay.log_text());
    drop(relay);

    // A backlog, a kill -9 while it drains, a restart: nothing lost, each
    // aggregate in order.
    let mut ids = Vec::new();
    for i in 0..600 {
        ids.push(insert(format!("k{}", i % 30), serde_json::json!({"n": i})).await?);
    }
    let before = file_sink_deliveries(&out).len();
    let mut relay = Relay::start(&config, &[])?;
    let started = eventually(Duration::from_secs(30), || async {
        file_sink_deliveries(&out).len() > before
    })
    .await;
    assert!(started, "{}", relay.log_text());
    relay.kill();
    let relay = Relay::start(&config, &[])?;
    let all = eventually(Duration::from_secs(60), || async {
        let got: std::collections::HashSet<String> = file_sink_deliveries(&out)
            .iter()
            .map(|d| d.id().to_string())
            .collect();
        ids.iter().all(|id| got.contains(id))
    })
    .await;
    assert!(all, "{}", relay.log_text());
    let mut last: std::collections::HashMap<String, i64> = std::collections::HashMap::new();
    let mut seen = std::collections::HashSet::new();
    for d in file_sink_deliveries(&out).iter().skip(before) {
        if !seen.insert(d.id().to_string()) {
            continue; // a re-send after the kill: allowed, not a first delivery
        }
        if let Some(prev) = last.insert(d.aggregate().to_string(), d.number()) {
            assert!(
                prev < d.number(),
                "{}: {} after {prev}",
                d.aggregate(),
                d.number()
            );
        }
    }
    drop(relay);
    pool.close().await;
    Ok(())
}
