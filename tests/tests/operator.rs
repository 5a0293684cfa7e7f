//! Rough edges an operator hits first: several relays on one host, migrating
//! before any route exists, readable errors, the quickstart outside the
//! checkout, and background services that keep none of the caller's files.

use std::process::Command;
use std::time::Duration;

use outroute_e2e::*;

fn body(dir: &std::path::Path, http: &str, routes: bool) -> String {
    let route = if routes {
        format!(
            "[plugins.p]\npath = \"{}\"\n[[routes]]\nname = \"r\"\nplugin = \"p\"\n\
             config = {{ sink = \"file\", topic = \"orders.{{event_type}}\" }}\nallow = {{ file = [\"orders.*\"] }}\n",
            plugin("order-router").display()
        )
    } else {
        String::new()
    };
    format!(
        "[http]\nlisten = \"{http}\"\n[sinks.file]\nkind = \"file\"\npath = \"{}\"\n{route}",
        dir.join("out.jsonl").display()
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn a_second_relay_on_one_host_says_how_to_pick_another_port() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let dir = test_dir("two-relays");
    let http = free_addr();
    let config = write_config(&dir, &db.url, "", &body(&dir, &http, true))?;
    db.migrate(&config)?;
    let _first = Relay::start(&config, &[])?;
    assert!(
        eventually(Duration::from_secs(20), || async {
            http_get(&http, "/healthz").await.is_ok()
        })
        .await
    );
    let mut second = Relay::start(&config, &[])?;
    let status = second.wait_exit(Duration::from_secs(20));
    assert!(
        status.is_some_and(|s| !s.success()),
        "the second relay kept running"
    );
    let log = second.log_text();
    assert!(
        log.contains("address is in use") && log.contains("OUTROUTE_HTTP__LISTEN"),
        "{log}"
    );
    // Port 0: any free port, and the log says which.
    let mut third = Relay::start(&config, &[("OUTROUTE_HTTP__LISTEN", "127.0.0.1:0")])?;
    let mut bound = None;
    for _ in 0..200 {
        // The relay's stderr is not a terminal: plain text, no colour codes.
        let log = third.log_text();
        bound = log
            .split("listen=")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .map(str::to_string)
            .filter(|a| !a.ends_with(":0"));
        if bound.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let bound =
        bound.ok_or_else(|| anyhow::anyhow!("no bound port logged: {}", third.log_text()))?;
    let (code, _) = http_get(&bound, "/healthz").await?;
    assert_eq!(code, 200);
    third.terminate(Duration::from_secs(15));
    db.drop_db().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn migrate_needs_only_the_store_and_errors_say_things_once() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let dir = test_dir("no-routes");
    let config = write_config(&dir, &db.url, "", &body(&dir, "", false))?;
    let c = config.to_string_lossy().to_string();
    let (code, out, err) = cli(&["migrate", "-c", &c])?;
    assert_eq!(
        code, 0,
        "migrate refused a config without routes: {out}{err}"
    );
    let (code, _, err) = cli(&["status", "-c", &c])?;
    assert_eq!(code, 0, "{err}");
    // `run` and `config check` still want a route.
    let (code, _, err) = cli(&["config", "check", "-c", &c])?;
    assert_ne!(code, 0);
    assert!(err.contains(":routes: no routes"), "{err}");
    let (code, _, err) = cli(&["run", "-c", &c])?;
    assert_ne!(code, 0);
    assert!(err.contains("no routes"), "{err}");

    // A database error is said once, not twice.
    let bad = write_config(
        &dir,
        "postgres://no_such_role@127.0.0.1:5432/test",
        "",
        &body(&dir, "", false),
    )?;
    let (code, _, err) = cli(&["migrate", "-c", &bad.to_string_lossy()])?;
    assert_ne!(code, 0);
    assert_eq!(
        err.matches("role \"no_such_role\" does not exist").count(),
        1,
        "{err}"
    );
    // A database nobody listens on is named with the operating system's
    // reason, not only "pool timed out".
    let refused = write_config(
        &dir,
        "postgres://root@127.0.0.1:1/test",
        "",
        &body(&dir, "", false),
    )?;
    let (code, _, err) = cli(&["migrate", "-c", &refused.to_string_lossy()])?;
    assert_ne!(code, 0);
    assert!(
        err.contains("cannot connect to postgres://root@127.0.0.1:1/test")
            && err.to_lowercase().contains("connection refused"),
        "{err}"
    );
    db.drop_db().await;
    Ok(())
}

#[test]
fn the_quickstart_runs_from_any_directory() -> anyhow::Result<()> {
    let dir = test_dir("quickstart-anywhere");
    let out = Command::new(bin())
        .args(["quickstart", "--dir", "qs", "--orders", "5"])
        .current_dir(&dir)
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(dir.join("qs/messages.jsonl").is_file(), "{stdout}");
    Ok(())
}

#[test]
fn services_start_detached_without_the_callers_descriptors() -> anyhow::Result<()> {
    // A second tansu on its own port, started while the caller holds a file
    // open on descriptor 9 (as a lock file would be).
    let port = 19000 + (std::process::id() % 500) as u16;
    let held = test_dir("services-fd").join("held.lock");
    std::fs::write(&held, "")?;
    let out = Command::new("bash")
        .arg("-c")
        .arg(format!(
            "exec 9>>'{}'; '{}/scripts/services'",
            held.display(),
            workspace().display()
        ))
        .env("OUTROUTE_KAFKA_PORT", port.to_string())
        .output()?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let pids = Command::new("pgrep")
        .args(["-f", &format!("tcp://127.0.0.1:{port}")])
        .output()?;
    let pids: Vec<String> = String::from_utf8_lossy(&pids.stdout)
        .split_whitespace()
        .map(str::to_string)
        .collect();
    assert!(!pids.is_empty(), "no tansu on port {port}");
    let mut leaked = Vec::new();
    for pid in &pids {
        for fd in std::fs::read_dir(format!("/proc/{pid}/fd"))?.flatten() {
            if std::fs::read_link(fd.path()).is_ok_and(|t| t == held) {
                leaked.push(fd.path());
            }
        }
    }
    for pid in &pids {
        let _ = Command::new("kill").arg(pid).status();
    }
    assert!(
        leaked.is_empty(),
        "tansu holds the caller's file: {leaked:?}"
    );
    Ok(())
}

/// An event a plugin answers with no messages is marked published (nothing
/// to send) and counted per route where an operator sees it: `status`.
#[tokio::test(flavor = "multi_thread")]
async fn events_published_without_messages_are_counted_per_route_in_status() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let (config, out) = file_sink_config(&db, "no-messages", "", "hostile", "quiet", FILE_ROUTE)?;
    for (i, payload) in [
        r#"{"hostile":"nothing"}"#,
        "{}",
        r#"{"hostile":"nothing"}"#,
        r#"{"hostile":"nothing"}"#,
    ]
    .iter()
    .enumerate()
    {
        sqlx::query(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
             VALUES (gen_random_uuid(), 'order', $1, 'order-created', $2::jsonb)",
        )
        .bind(format!("o-{i}"))
        .bind(payload)
        .execute(&db.pool)
        .await?;
    }
    let mut relay = Relay::start(&config, &[])?;
    let done = eventually(Duration::from_secs(30), || async {
        db.unpublished("").await == 0
    })
    .await;
    relay.terminate(Duration::from_secs(15));
    assert!(done, "{}", relay.log_text());
    assert_eq!(std::fs::read_to_string(&out)?.lines().count(), 1);
    let (code, stdout, stderr) = cli(&["status", "-c", &config.to_string_lossy()])?;
    assert_eq!(code, 0, "{stderr}");
    assert!(
        stdout.contains("published without messages")
            && stdout
                .lines()
                .any(|l| l.trim_start().starts_with("quiet") && l.trim_end().ends_with(" 3")),
        "{stdout}"
    );
    db.drop_db().await;
    Ok(())
}

/// A config file `name` in `dir`: an embedded (SQLite) outbox, a file sink
/// and one route `orders` through the plugin at `plugin` with `config`.
fn sqlite_config(
    dir: &std::path::Path,
    name: &str,
    plugin: &str,
    config: &str,
) -> anyhow::Result<String> {
    let f = dir.join(name);
    std::fs::write(
        &f,
        format!(
            "[store]\nurl = \"sqlite://{db}\"\n[sinks.file]\nkind = \"file\"\npath = \"{out}\"\n\
             [plugins.p]\npath = \"{plugin}\"\n[[routes]]\nname = \"orders\"\nplugin = \"p\"\n\
             config = {config}\nallow = {{ file = [\"orders.*\"] }}\n",
            db = dir.join("outbox.db").display(),
            out = dir.join("out.jsonl").display(),
        ),
    )?;
    Ok(f.display().to_string())
}

/// `config check` loads every route's plugin as `run` would: a route config
/// the plugin's `init` refuses, a core module and a file that is no
/// WebAssembly at all each fail the check, naming the route and the file.
#[test]
fn config_check_loads_every_plugin_as_run_does() -> anyhow::Result<()> {
    let dir = test_dir("check-plugins");
    let core = dir.join("core.wasm");
    std::fs::write(&core, b"\0asm\x01\0\0\0")?;
    let text = dir.join("text.wasm");
    std::fs::write(&text, "not a plugin\n")?;
    let gate = plugin("schema-gate").display().to_string();
    let refused = sqlite_config(&dir, "refused.toml", &gate, "{ topik = 1 }")?;
    let (code, out, err) = cli(&["config", "check", "-c", &refused])?;
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.contains("routes[0] (route `orders`): plugin")
            && err.contains("refused its route config")
            && err.contains("topik"),
        "{err}"
    );
    for (name, path, why) in [
        (
            "core.toml",
            &core,
            "is a core WebAssembly module, not a component",
        ),
        ("text.toml", &text, "is not a WebAssembly file"),
    ] {
        let c = sqlite_config(
            &dir,
            name,
            &path.display().to_string(),
            "{ sink = \"file\" }",
        )?;
        let (code, out, err) = cli(&["config", "check", "-c", &c])?;
        assert_eq!(code, 1, "{name}: {out}{err}");
        assert!(err.contains(why), "{name}: {err}");
        assert!(!err.contains("0x61"), "{name}: no parser dump: {err}");
    }
    Ok(())
}

/// Problems an `OUTROUTE_…` variable caused are the environment's, not the
/// file's: an override of a list entry (`OUTROUTE_ROUTES__0__…`) is refused
/// with a reason that says lists live in the file, and a bad value names
/// the variable that set it (the file's own value was fine).
#[test]
fn problems_from_the_environment_are_blamed_on_it() -> anyhow::Result<()> {
    let dir = test_dir("env-blame");
    let f = sqlite_config(
        &dir,
        "outroute.toml",
        &plugin("order-router").display().to_string(),
        "{ sink = \"file\", topic = \"orders.{event_type}\" }",
    )?;
    let check = |var: &str, value: &str| -> anyhow::Result<(Option<i32>, String)> {
        let mut c = Command::new(bin());
        c.args(["config", "check", "-c", &f]);
        if !var.is_empty() {
            c.env(var, value);
        }
        let out = c.output()?;
        Ok((
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        ))
    };
    let (code, err) = check("", "")?;
    assert_eq!(code, Some(0), "{err}");

    let (code, err) = check("OUTROUTE_ROUTES__0__MAX_ATTEMPTS", "3")?;
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("environment:routes:")
            && err.contains("cannot be set or changed from the environment"),
        "{err}"
    );

    let (code, err) = check("OUTROUTE_STORE__URL", "")?;
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("environment:store.url:") && err.contains("(set by OUTROUTE_STORE__URL)"),
        "{err}"
    );
    assert!(!err.contains(&format!("{f}:store.url")), "{err}");

    // A table the file wrote stays the file's, even when a variable sets a
    // key inside it: `[store]` beside `[sources.…]` is the file's mistake.
    let mut text = std::fs::read_to_string(&f)?;
    text.push_str(&format!(
        "[sources.other]\nurl = \"sqlite://{}\"\n",
        dir.join("other.db").display()
    ));
    std::fs::write(&f, text)?;
    let (code, err) = check(
        "OUTROUTE_STORE__URL",
        &format!("sqlite://{}", dir.join("env.db").display()),
    )?;
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains(&format!("{f}:store: use either [store]"))
            && !err.contains("environment:store"),
        "{err}"
    );
    Ok(())
}

/// No secret reaches a command's output or the relay's log, in any of the
/// forms a config can carry one: a NATS token in the URL's userinfo, a
/// password in a URL's query, a numeric password and HTTP token from the
/// environment (which figment reads as numbers). The broker is unreachable
/// on purpose, so its URL shows up in errors and warnings.
#[tokio::test(flavor = "multi_thread")]
async fn no_command_or_log_line_prints_a_secret() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let dir = test_dir("secrets");
    let http = free_addr();
    let secrets = [
        "tok3n-in-the-url",
        "pw-in-the-query",
        "12345678",
        "987654321",
    ];
    let body = format!(
        "[http]\nlisten = \"{http}\"\n\
         [sinks.nats]\nkind = \"nats\"\nurl = \"nats://tok3n-in-the-url@127.0.0.1:1\"\n\
         [plugins.p]\npath = \"{}\"\n[[routes]]\nname = \"r\"\nplugin = \"p\"\n\
         config = {{ sink = \"nats\", topic = \"orders.{{event_type}}\" }}\nallow = {{ nats = [\"orders.*\"] }}\n",
        plugin("order-router").display()
    );
    let url = format!("{}?password=pw-in-the-query", db.url);
    let config = write_config(&dir, &url, "", &body)?;
    let c = config.display().to_string();
    let env = [
        ("OUTROUTE_STORE__PASSWORD", "12345678"),
        ("OUTROUTE_HTTP__TOKEN", "987654321"),
    ];
    let mut shown = String::new();
    for args in [
        vec!["migrate", "-c", &c],
        vec!["config", "check", "-c", &c],
        vec!["config", "check", "--store", "--sinks", "-c", &c],
        vec!["status", "-c", &c],
        vec!["failed", "list", "-c", &c],
    ] {
        let (code, out, err) = cli_env(&args, &env)?;
        shown.push_str(&format!("$ {args:?} → {code}\n{out}{err}\n"));
    }
    // The broker's error did reach the output, with its URL redacted.
    assert!(shown.contains("nats://****@127.0.0.1:1"), "{shown}");
    let mut relay = Relay::start(&config, &env)?;
    let started = eventually(Duration::from_secs(20), || async {
        relay.log_text().contains("sink not started")
    })
    .await;
    assert!(started, "{}", relay.log_text());
    let (_, ready) = http_get(&http, "/readyz").await?;
    shown.push_str(&ready);
    relay.terminate(Duration::from_secs(15));
    shown.push_str(&relay.log_text());
    for secret in secrets {
        assert!(!shown.contains(secret), "`{secret}` was printed:\n{shown}");
    }
    db.drop_db().await;
    Ok(())
}

/// `outroute … | head`: a command whose reader went away ends quietly (by
/// SIGPIPE, as `ls | head` does), never with a panic about a broken pipe.
#[test]
fn a_command_whose_reader_went_away_ends_quietly() -> anyhow::Result<()> {
    use std::os::unix::process::ExitStatusExt;
    // A pipe whose reading end is already closed: the first line printed
    // meets a broken pipe, whatever the timing.
    let (reader, writer) = std::io::pipe()?;
    drop(reader);
    let out = Command::new(bin())
        .args(["reference", "config"])
        .stdout(writer)
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("panicked"),
        "the command panicked: {stderr}"
    );
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGPIPE),
        "expected the end a closed pipe gives Unix tools, got {:?}; stderr: {stderr}",
        out.status
    );
    Ok(())
}
