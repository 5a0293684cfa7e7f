//! The plugin author's workflow. `outroute plugin new`: each scaffold
//! builds and passes its own test as created — the Rust one with `cargo
//! test` and a wasm32-wasip2 build tried through the relay's sandbox
//! (`outroute plugin test`), the Python and TypeScript ones with their
//! `test.sh` (componentize-py or tsc + componentize-js, then `outroute
//! plugin test`). `outroute plugin try`: a
//! candidate compared with the active plugin on recent real events.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{Result, bail};
use outroute_e2e::*;

fn run(cmd: &mut Command, what: &str) -> Result<String> {
    let out = cmd.output()?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        bail!(
            "{what} failed ({}):\n{stdout}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // Standard output only: the plugin's log lines (`outroute plugin
    // test` writes them to stderr) may come in any order around it.
    Ok(stdout)
}

/// A build cache of its own for scaffolds (kept across runs like the
/// workspace's).
fn scaffold_target() -> String {
    std::env::var("HOME")
        .map(|h| format!("{h}/.cache/outroute/scaffold-target"))
        .unwrap_or_else(|_| {
            std::env::temp_dir()
                .join("scaffold-target")
                .display()
                .to_string()
        })
}

#[test]
fn the_rust_scaffold_builds_and_passes_its_test() -> Result<()> {
    let dir = test_dir("scaffold-rust").join("my-router");
    let d = dir.display().to_string();
    let (code, out, err) = cli(&["plugin", "new", "my-router", "--dir", &d])?;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("cargo test"), "{out}");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let test = run(
        Command::new(&cargo)
            .args(["test", "--quiet"])
            .current_dir(&dir)
            .env("CARGO_TARGET_DIR", scaffold_target()),
        "cargo test of the scaffold",
    )?;
    assert!(test.contains("2 passed"), "{test}");
    run(
        Command::new(&cargo)
            .args(["build", "--quiet", "--release", "--target", "wasm32-wasip2"])
            .current_dir(&dir)
            .env("CARGO_TARGET_DIR", scaffold_target()),
        "wasm build of the scaffold",
    )?;
    let wasm = Path::new(&scaffold_target()).join("wasm32-wasip2/release/my_router.wasm");
    let sample = dir.join("sample-event.json");
    let (code, out, err) = cli(&[
        "plugin",
        "test",
        wasm.to_str().unwrap_or_default(),
        "--event",
        sample.to_str().unwrap_or_default(),
    ])?;
    assert_eq!(
        code, 3,
        "one of the two sample events is refused: {out}{err}"
    );
    let v: serde_json::Value = serde_json::from_str(&out)?;
    assert_eq!(v[0]["messages"][0]["topic"], "order.order-created", "{out}");
    assert_eq!(v[1]["rejection"]["kind"], "invalid", "{out}");

    // Not over an existing project, not with a name that is no crate name.
    let (code, _, err) = cli(&["plugin", "new", "my-router", "--dir", &d])?;
    assert_ne!(code, 0);
    assert!(err.contains("is not empty"), "{err}");
    let (code, _, err) = cli(&["plugin", "new", "My_Router"])?;
    assert_ne!(code, 0);
    assert!(err.contains("lowercase letters"), "{err}");
    Ok(())
}

#[test]
fn the_python_scaffold_builds_and_passes_its_test() -> Result<()> {
    let dir = test_dir("scaffold-python").join("py-router");
    let d = dir.display().to_string();
    let (code, out, err) = cli(&[
        "plugin",
        "new",
        "py-router",
        "--lang",
        "python",
        "--dir",
        &d,
    ])?;
    assert_eq!(code, 0, "{out}{err}");
    // componentize-py as scripts/build-plugins installs it (maybe off PATH).
    let scripts = Command::new("python3")
        .args([
            "-c",
            "import sysconfig; print(sysconfig.get_path('scripts'))",
        ])
        .output()?;
    let path = format!(
        "{}:{}",
        std::env::var("PATH").unwrap_or_default(),
        String::from_utf8_lossy(&scripts.stdout).trim()
    );
    let out = run(
        Command::new(dir.join("test.sh"))
            .env("OUTROUTE", bin())
            .env("PATH", path),
        "the scaffold's test.sh",
    )?;
    assert!(out.trim_end().ends_with("ok"), "{out}");
    assert!(dir.join("py_router.wasm").is_file());
    Ok(())
}

#[test]
fn the_typescript_scaffold_builds_and_passes_its_test() -> Result<()> {
    let dir = test_dir("scaffold-js").join("ts-router");
    let d = dir.display().to_string();
    let (code, out, err) = cli(&["plugin", "new", "ts-router", "--lang", "js", "--dir", &d])?;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("./test.sh"), "{out}");
    let out = run(
        Command::new(dir.join("test.sh")).env("OUTROUTE", bin()),
        "the scaffold's test.sh",
    )?;
    assert!(out.trim_end().ends_with("ok"), "{out}");
    assert!(dir.join("ts_router.wasm").is_file());
    Ok(())
}

/// `outroute plugin try`: a candidate run on the route's newest published
/// events, compared with the active plugin, nothing published; a message
/// the route may not send shows as the rejection the relay would make.
#[tokio::test(flavor = "multi_thread")]
async fn a_candidate_is_tried_on_recent_real_events() -> Result<()> {
    let db = TestDb::new().await?;
    let dir = test_dir("plugin-try");
    let out = dir.join("out.jsonl");
    let config = write_config(
        &dir,
        &db.url,
        "",
        &relay_body(
            "",
            &[TestSink::File(&out)],
            "order-router",
            "orders",
            "aggregate_types = [\"order\"]\nconfig = { sink = \"file\", topic = \"orders.{event_type}\" }\nallow = { file = [\"orders.*\", \"v2.*\"] }",
        ),
    )?;
    db.migrate(&config)?;
    produce(&db.pool, "try", 4, 3, 0).await?;
    // As if published: off the pending queue.
    sqlx::query("DELETE FROM outroute_queue WHERE source = 'outbox'")
        .execute(&db.pool)
        .await?;
    let c = config.display().to_string();
    let wasm = plugin("order-router").display().to_string();
    let (code, o, e) = cli(&[
        "plugin", "try", &wasm, "-c", &c, "--route", "orders", "--last", "5",
    ])?;
    assert_eq!(code, 0, "{o}{e}");
    assert!(
        o.contains("5 recent events") && o.contains("same       5") && o.contains("different  0"),
        "{o}"
    );
    // The candidate with another topic template in its route config.
    let try_topic = |topic: &str| -> Result<String> {
        let candidate = format!("{{\"sink\": \"file\", \"topic\": \"{topic}\"}}");
        let (code, o, e) = cli(&[
            "plugin",
            "try",
            &wasm,
            "-c",
            &c,
            "--route",
            "orders",
            "--candidate-config",
            &candidate,
        ])?;
        assert_eq!(code, 0, "{o}{e}");
        Ok(o)
    };
    let o = try_topic("v2.{event_type}")?;
    assert!(
        o.contains("12 recent events") && o.contains("different  12"),
        "{o}"
    );
    assert!(
        o.contains("file/orders.order-updated → file/v2.order-updated"),
        "{o}"
    );
    // A topic outside the route's allow-list: refused, as live.
    let o = try_topic("audit.{event_type}")?;
    assert!(o.contains("different  12"), "{o}");
    assert!(
        o.contains(
            "now refused: route `orders` may not publish to `audit.order-updated` on sink `file`"
        ),
        "{o}"
    );
    assert!(!out.exists(), "nothing was published");
    let (code, _, e) = cli(&["plugin", "try", &wasm, "-c", &c, "--route", "nope"])?;
    assert_ne!(code, 0);
    assert!(e.contains("no route named `nope`"), "{e}");
    db.drop_db().await;
    Ok(())
}

/// The TypeScript example plugin (componentize-js) routes events end to
/// end: relay, plugin, file sink, every event once, in order per aggregate.
#[tokio::test(flavor = "multi_thread")]
async fn the_typescript_plugin_routes_events_end_to_end() -> Result<()> {
    let db = TestDb::new().await?;
    let dir = test_dir("js-router");
    let out = dir.join("out.jsonl");
    let config = write_config(
        &dir,
        &db.url,
        "",
        &relay_body(
            "",
            &[TestSink::File(&out)],
            "js-router",
            "orders",
            "config = { sink = \"file\", prefix = \"ts\", priority_cents = 0 }\nallow = { file = [\"ts.*\"] }",
        ),
    )?;
    db.migrate(&config)?;
    let w = produce(&db.pool, "js", 5, 4, 0).await?;
    let relay = Relay::start(&config, &[])?;
    let all = file_sink_reaches(&out, w.committed.len(), std::time::Duration::from_secs(60)).await;
    assert!(
        all,
        "events routed by the TypeScript plugin: {}",
        relay.log_text()
    );
    let delivered = file_sink_deliveries(&out);
    for d in &delivered {
        assert_eq!(d.topic, "ts.order-updated");
        // priority_cents = 0 from the route config: every order is high.
        assert_eq!(d.headers.get("priority").map(String::as_str), Some("high"));
    }
    check(&w, &delivered).assert_clean();
    drop(relay);
    db.drop_db().await;

    // One event at a time goes through the plugin's `route` export (a
    // batch through `route-batch`): both answer, both refuse bad payloads.
    let js = plugin("js-router").display().to_string();
    for (payload, want) in [
        (
            "{\"order_id\": \"o-1\", \"total_cents\": 5}",
            "\"topic\": \"orders.order-created\"",
        ),
        ("[1, 2]", "\"kind\": \"invalid\""),
    ] {
        let one = dir.join(format!("one-{}.json", tag()));
        std::fs::write(
            &one,
            format!(
                "{{\"aggregate_type\": \"order\", \"aggregate_id\": \"o-1\", \"event_type\": \"order-created\", \"payload\": {payload}}}"
            ),
        )?;
        let (_, o, e) = cli(&[
            "plugin",
            "test",
            &js,
            "--event",
            one.to_str().unwrap_or_default(),
        ])?;
        assert!(o.contains(want), "{payload}: {o}{e}");
    }
    Ok(())
}

/// Shadow rollout: a candidate runs beside the active plugin on live
/// traffic — its differences counted and sampled, nothing of it published —
/// then `plugin promote` makes it active in the running relay: no restart,
/// nothing lost, every event once.
#[tokio::test(flavor = "multi_thread")]
async fn a_shadow_plugin_is_compared_on_live_traffic_then_promoted_without_restart() -> Result<()> {
    let db = TestDb::new().await?;
    let dir = test_dir("shadow");
    let out = dir.join("out.jsonl");
    let http = free_addr();
    let wasm = plugin("order-router").display().to_string();
    // The candidate: the same component with another topic.
    let body = relay_body(
        &http,
        &[TestSink::File(&out)],
        "order-router",
        "orders",
        "config = { sink = \"file\", topic = \"orders.{event_type}\" }\nallow = { file = [\"orders.*\", \"v2.*\"] }",
    )
    .replace(
        "[[routes]]",
        &format!(
            "shadow = \"{wasm}\"\nshadow_config = {{ sink = \"file\", topic = \"v2.{{event_type}}\" }}\n[[routes]]"
        ),
    );
    // /shadow shows event content: only with the bearer token.
    let body = body.replace("[http]\n", "[http]\ntoken_file = \"shadow.token\"\n");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("shadow.token"), "t0ken-for-the-shadow-report\n")?;
    let config = write_config(&dir, &db.url, "config_watch_interval = \"200ms\"", &body)?;
    let c = config.display().to_string();
    db.migrate(&config)?;
    let before = produce(&db.pool, "shadow", 4, 3, 0).await?;
    let mut relay = Relay::start(&config, &[])?;
    let n = before.committed.len();
    assert!(
        eventually(Duration::from_secs(30), || async {
            file_sink_deliveries(&out).len() >= n
        })
        .await,
        "the active plugin's messages did not arrive"
    );
    let delivered = file_sink_deliveries(&out);
    assert!(
        delivered.iter().all(|d| d.topic.starts_with("orders.")),
        "the candidate's output was published: {:?}",
        delivered.iter().map(|d| &d.topic).collect::<Vec<_>>()
    );
    let (_, m) = http_get(&http, "/metrics").await?;
    assert_eq!(
        metric(&m, "outroute_shadow_events_total{route=\"orders\"}"),
        Some(n as f64),
        "{m}"
    );
    assert_eq!(
        metric(&m, "outroute_shadow_differences_total{route=\"orders\"}"),
        Some(n as f64)
    );
    // Without the token: 401 and not a byte of the events; with it, the
    // report (`shadow-report` sends the configured token).
    let (code, body) = http_get(&http, "/shadow").await?;
    assert_eq!(code, 401, "{body}");
    assert!(!body.contains("order") && !body.contains("v2."), "{body}");
    let (code, o, e) = cli(&["plugin", "shadow-report", "-c", &c])?;
    assert_eq!(code, 0, "{o}{e}");
    assert!(
        o.contains(&format!("{n} events compared, {n} different"))
            && o.contains("file/orders.order-updated → file/v2.order-updated"),
        "{o}"
    );

    // Promote: the config file now runs the candidate; the relay reloads.
    let (code, o, e) = cli(&["plugin", "promote", "p", "-c", &c])?;
    assert_eq!(code, 0, "{o}{e}");
    let text = std::fs::read_to_string(&config)?;
    assert!(
        !text.contains("shadow =")
            && !text.contains("shadow_config")
            && text.contains("config = { sink = \"file\", topic = \"v2.{event_type}\" }"),
        "{text}"
    );
    assert!(
        eventually(Duration::from_secs(20), || async {
            let (_, m) = http_get(&http, "/metrics").await.unwrap_or_default();
            metric(&m, "outroute_config_reloads_total{result=\"applied\"}").unwrap_or(0.0) >= 1.0
        })
        .await,
        "the relay did not apply the promotion"
    );
    let after = produce(&db.pool, "promoted", 4, 3, 0).await?;
    let total = n + after.committed.len();
    assert!(
        eventually(Duration::from_secs(30), || async {
            file_sink_deliveries(&out).len() >= total
        })
        .await,
        "events after the promotion did not arrive"
    );
    let delivered = file_sink_deliveries(&out);
    let mut ids: Vec<&str> = delivered
        .iter()
        .filter_map(|d| d.headers.get("ce_id").map(String::as_str))
        .collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), total, "an event was lost");
    assert_eq!(delivered.len(), total, "an event was published twice");
    let promoted: Vec<&str> = after.committed.iter().map(|e| e.id.as_str()).collect();
    for d in &delivered {
        let id = d.headers.get("ce_id").map(String::as_str).unwrap_or("");
        let want = if promoted.contains(&id) {
            "v2."
        } else {
            "orders."
        };
        assert!(d.topic.starts_with(want), "{id} went to {}", d.topic);
    }
    relay.terminate(Duration::from_secs(15));
    db.drop_db().await;
    Ok(())
}
