//! Secured connections against real servers configured that way: a
//! TLS-only PostgreSQL with a scram-sha-256 password role (lease mode, and
//! log-based capture streaming its slot over TLS), nats-server with
//! TLS (client certificates required) and accounts (user + password, NKey),
//! a token-protected nats-server, and tansu behind stunnel (TLS with client
//! certificates). Each works end to end; a wrong password, an untrusted
//! certificate or a missing client certificate fails fast with an error
//! naming the store or sink — never a hang. Secrets come from `*_file` keys
//! and never appear in output.
//!
//! Not provable here: Kafka SASL against a server that speaks it (no Kafka
//! server here does); the test checks the settings reach librdkafka and the
//! error against a server that does not speak SASL.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Result;
use outroute::config::{self, SinkConfig};
use outroute::sink::{Outgoing, Sink, kafka::KafkaSink, nats::NatsSink};
use outroute_e2e::secure::{Pki, nats_operator, nats_server, pg_tls, stunnel};
use outroute_e2e::*;

/// Load `body` as a config file in `dir` (paths relative to it).
fn load(dir: &Path, body: &str) -> Result<config::Loaded> {
    let path = dir.join(format!("outroute-{}.toml", tag()));
    std::fs::write(&path, format!("[store]\nurl = \"sqlite::memory:\"\n{body}"))?;
    config::load(&path).map_err(|e| anyhow::anyhow!("{e}"))
}

fn sink_config(l: &config::Loaded, name: &str) -> Result<SinkConfig> {
    l.config
        .sinks
        .get(name)
        .cloned()
        .ok_or_else(|| anyhow::anyhow!("no sink {name}"))
}

async fn nats_sink(dir: &Path, body: &str, subject: &str) -> Result<NatsSink> {
    let l = load(dir, body)?;
    let SinkConfig::Nats(c) = sink_config(&l, "n")? else {
        anyhow::bail!("not a NATS sink")
    };
    NatsSink::build("n", &c, &[subject.to_string()], Duration::from_secs(5)).await
}

/// One message published and acknowledged through `sink`.
async fn publish(sink: &dyn Sink, topic: &str) -> Result<()> {
    let headers: Vec<outroute::sink::Header> = vec![("ce_id", tag().into())];
    let id = tag();
    let ack = sink
        .send(
            Outgoing {
                topic,
                key: Some(b"k"),
                partition: None,
                headers: &headers,
                payload: b"{\"secured\":true}",
                dedup_id: &id,
            },
            None,
        )
        .await?;
    ack.wait().await?;
    Ok(())
}

/// Build must fail, quickly, with every piece of `expected` in the message.
async fn refused<F, T>(what: &str, f: F, expected: &[&str]) -> String
where
    F: std::future::Future<Output = Result<T>>,
{
    let started = Instant::now();
    let r = tokio::time::timeout(Duration::from_secs(30), f).await;
    let msg = match r {
        Err(_) => panic!("{what}: hung for 30 s instead of failing"),
        Ok(Ok(_)) => panic!("{what}: was accepted"),
        Ok(Err(e)) => format!("{e:#}"),
    };
    eprintln!("{what}: {msg}");
    for piece in expected {
        assert!(msg.contains(piece), "{what}: `{piece}` not in: {msg}");
    }
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "{what}: took {:?} to fail",
        started.elapsed()
    );
    msg
}

#[tokio::test(flavor = "multi_thread")]
async fn nats_over_tls_with_password_nkey_and_token() -> Result<()> {
    let dir = test_dir("nats-tls");
    let pki = Pki::new(&dir.join("pki"))?;
    let nkey = nkeys::KeyPair::new_user();
    let seed = nkey.seed()?;
    std::fs::write(dir.join("password"), "relay-secret\n")?;
    std::fs::write(dir.join("wrong-password"), "not-it\n")?;
    std::fs::write(dir.join("seed"), format!("{seed}\n"))?;
    let server = nats_server(
        &dir,
        &format!(
            "tls {{ cert_file: \"{}\", key_file: \"{}\", ca_file: \"{}\", verify: true, timeout: 3 }}\n\
             accounts {{ APP {{ jetstream: enabled, users: [ {{user: relay, password: \"relay-secret\"}}, {{nkey: {}}} ] }} }}\n",
            pki.path("server.crt"),
            pki.path("server.key"),
            pki.path("ca.crt"),
            nkey.public_key()
        ),
    )
    .await?;
    let url = format!("tls://{}", server.addr);
    let stream =
        |s: &str| format!("create_stream = {{ name = \"S{s}\", subjects = [\"sec{s}.>\"] }}\n");
    let tls = "[sinks.n.tls]\nca_file = \"pki/ca.crt\"\ncert_file = \"pki/client.crt\"\nkey_file = \"pki/client.key\"\n";

    // User + password (from a file), over mutual TLS: published and acked.
    let t = tag();
    let sink = nats_sink(
        &dir,
        &format!(
            "[sinks.n]\nkind = \"nats\"\nurl = \"{url}\"\n{}{tls}[sinks.n.auth]\nuser = \"relay\"\npassword_file = \"password\"\n",
            stream(&t)
        ),
        &format!("sec{t}.*"),
    )
    .await?;
    publish(&sink, &format!("sec{t}.password")).await?;

    // NKey seed (from a file).
    let t = tag();
    let sink = nats_sink(
        &dir,
        &format!(
            "[sinks.n]\nkind = \"nats\"\nurl = \"{url}\"\n{}{tls}[sinks.n.auth]\nnkey_seed_file = \"seed\"\n",
            stream(&t)
        ),
        &format!("sec{t}.*"),
    )
    .await?;
    publish(&sink, &format!("sec{t}.nkey")).await?;

    // Wrong password: refused at start, naming the sink; the secret is not shown.
    let msg = refused(
        "wrong password",
        nats_sink(
            &dir,
            &format!("[sinks.n]\nkind = \"nats\"\nurl = \"{url}\"\n{tls}[sinks.n.auth]\nuser = \"relay\"\npassword_file = \"wrong-password\"\n"),
            "x.*",
        ),
        &["sinks.n", "refused the credentials"],
    )
    .await;
    assert!(!msg.contains("not-it"), "secret in the error: {msg}");

    // No credentials at all.
    refused(
        "no credentials",
        nats_sink(
            &dir,
            &format!("[sinks.n]\nkind = \"nats\"\nurl = \"{url}\"\n{tls}"),
            "x.*",
        ),
        &["sinks.n", "requires credentials"],
    )
    .await;

    // The server's certificate signed by an authority we do not trust.
    refused(
        "untrusted server certificate",
        nats_sink(
            &dir,
            &format!(
                "[sinks.n]\nkind = \"nats\"\nurl = \"{url}\"\n[sinks.n.tls]\nca_file = \"pki/other-ca.crt\"\ncert_file = \"pki/client.crt\"\nkey_file = \"pki/client.key\"\n[sinks.n.auth]\nuser = \"relay\"\npassword_file = \"password\"\n"
            ),
            "x.*",
        ),
        &["sinks.n", "not trusted", "other-ca.crt"],
    )
    .await;

    // Token: a server protected by a single token.
    let token_server = nats_server(&dir, "authorization { token: \"t0ken-secret\" }\n").await?;
    std::fs::write(dir.join("token"), "t0ken-secret")?;
    let t = tag();
    let sink = nats_sink(
        &dir,
        &format!(
            "[sinks.n]\nkind = \"nats\"\nurl = \"nats://{}\"\n{}[sinks.n.auth]\ntoken_file = \"token\"\n",
            token_server.addr,
            stream(&t)
        ),
        &format!("sec{t}.*"),
    )
    .await?;
    publish(&sink, &format!("sec{t}.token")).await?;
    let msg = refused(
        "wrong token",
        nats_sink(
            &dir,
            &format!(
                "[sinks.n]\nkind = \"nats\"\nurl = \"nats://{}\"\n[sinks.n.auth]\ntoken = \"guess\"\n",
                token_server.addr
            ),
            "x.*",
        ),
        &["sinks.n", "refused the credentials"],
    )
    .await;
    assert!(!msg.contains("guess"), "secret in the error: {msg}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn nats_with_a_creds_file_in_operator_mode() -> Result<()> {
    let dir = test_dir("nats-creds");
    let (server, creds) = nats_operator(&dir).await?;
    let body = |auth: &str| {
        format!(
            "[sinks.n]\nkind = \"nats\"\nurl = \"nats://{}\"\nmode = \"core\"\n{auth}",
            server.addr
        )
    };
    let sink = nats_sink(
        &dir,
        &body(&format!(
            "[sinks.n.auth]\ncreds_file = \"{}\"\n",
            creds.display()
        )),
        "creds.*",
    )
    .await?;
    publish(&sink, "creds.ok").await?;
    refused(
        "operator mode without credentials",
        nats_sink(&dir, &body(""), "creds.*"),
        &["sinks.n", "requires credentials"],
    )
    .await;
    std::fs::write(dir.join("garbage.creds"), "not a creds file")?;
    refused(
        "an unreadable creds file",
        nats_sink(
            &dir,
            &body("[sinks.n.auth]\ncreds_file = \"garbage.creds\"\n"),
            "creds.*",
        ),
        &["sinks.n.auth.creds_file"],
    )
    .await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn kafka_over_tls_through_a_terminator() -> Result<()> {
    let dir = test_dir("kafka-tls");
    let pki = Pki::new(&dir.join("pki"))?;
    let (plain, tls_addr) = (free_addr(), free_addr());
    // tansu advertises the TLS port, so every connection goes through stunnel.
    let _tansu = Tansu::start(&plain, &tls_addr).await?;
    let _stunnel = stunnel(&pki, &plain, &tls_addr).await?;
    let tls_client = |pki: &Pki| {
        let mut c = rdkafka::ClientConfig::new();
        c.set("bootstrap.servers", &tls_addr)
            .set("security.protocol", "ssl")
            .set("ssl.ca.location", pki.path("ca.crt"))
            .set("ssl.certificate.location", pki.path("client.crt"))
            .set("ssl.key.location", pki.path("client.key"));
        c
    };
    {
        use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
        let admin: AdminClient<rdkafka::client::DefaultClientContext> =
            tls_client(&pki).create()?;
        let topic = NewTopic::new("secured", 1, TopicReplication::Fixed(1));
        for r in admin.create_topics(&[topic], &AdminOptions::new()).await? {
            r.map_err(|(t, e)| anyhow::anyhow!("creating topic {t}: {e}"))?;
        }
    }

    let kafka =
        |extra: &str| format!("[sinks.k]\nkind = \"kafka\"\nbrokers = \"{tls_addr}\"\n{extra}");
    let tls = "[sinks.k.tls]\nca_file = \"pki/ca.crt\"\ncert_file = \"pki/client.crt\"\nkey_file = \"pki/client.key\"\n";
    let build = |body: String| {
        let dir = dir.clone();
        async move {
            let l = load(&dir, &body)?;
            let SinkConfig::Kafka(c) = sink_config(&l, "k")? else {
                anyhow::bail!("not a Kafka sink")
            };
            let sink = KafkaSink::build("k", &c, Duration::from_secs(10))?;
            sink.verify().await?;
            Ok(sink)
        }
    };

    // Mutual TLS: published, acknowledged, and readable from the broker.
    let sink = build(kafka(tls)).await?;
    publish(&sink, "secured").await?;
    {
        use rdkafka::consumer::{BaseConsumer, Consumer};
        use rdkafka::{Message, Offset, TopicPartitionList};
        let consumer: BaseConsumer = tls_client(&pki)
            .set("group.id", format!("secured-{}", tag()))
            .set("enable.auto.commit", "false")
            .create()?;
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset("secured", 0, Offset::Beginning)?;
        consumer.assign(&tpl)?;
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut payload = None;
        while payload.is_none() && Instant::now() < deadline {
            if let Some(Ok(m)) = consumer.poll(Duration::from_millis(100)) {
                payload = m.payload().map(|p| p.to_vec());
            }
        }
        assert_eq!(
            payload.as_deref(),
            Some(&b"{\"secured\":true}"[..]),
            "the message went through TLS to tansu and reads back through TLS"
        );
    }

    refused(
        "untrusted broker certificate",
        build(kafka(
            "[sinks.k.tls]\nca_file = \"pki/other-ca.crt\"\ncert_file = \"pki/client.crt\"\nkey_file = \"pki/client.key\"\n",
        )),
        // librdkafka words it `SSL handshake failed: …certificate verify
        // failed` or `…SSL routines::certificate verify failed`, by timing.
        &["sinks.k", "certificate verify failed", "sinks.k.tls"],
    )
    .await;
    refused(
        "no client certificate",
        build(kafka("[sinks.k.tls]\nca_file = \"pki/ca.crt\"\n")),
        &["sinks.k", "cannot use the Kafka brokers"],
    )
    .await;

    // SASL: the settings reach librdkafka; this server does not speak SASL,
    // which is a clear start-up error, not a silent retry loop.
    std::fs::write(dir.join("sasl-password"), "scram-secret")?;
    let msg = refused(
        "SASL against a server without SASL",
        build(kafka(&format!(
            "{tls}[sinks.k.sasl]\nmechanism = \"scram-sha-512\"\nusername = \"relay\"\npassword_file = \"sasl-password\"\n"
        ))),
        &["sinks.k", "cannot use the Kafka brokers"],
    )
    .await;
    assert!(!msg.contains("scram-secret"), "secret in the error: {msg}");

    // Setting TLS or SASL through `options` is refused (one name per setting).
    let err = load(&dir, &kafka("options = { \"sasl.password\" = \"x\" }\n"))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("sinks.k.options.\"sasl.password\""), "{err}");
    Ok(())
}

/// The relay body both PostgreSQL-over-TLS tests use: route `r` through
/// the order router to a file sink at `out`.
fn orders_to_file(out: &Path) -> String {
    relay_body(
        "",
        &[TestSink::File(out)],
        "order-router",
        "r",
        "config = { sink = \"file\", topic = \"orders.{event_type}\" }\nallow = { file = [\"orders.*\"] }",
    )
}

/// A database of our own (`<prefix>_<tag>`, with the producers' `orders`
/// table) on the TLS cluster, reached over verify-full TLS: (admin pool on
/// `postgres`, pool on the database, its name).
async fn tls_database(
    pg: &outroute_e2e::secure::PgTls,
    prefix: &str,
) -> Result<(sqlx::PgPool, sqlx::PgPool, String)> {
    let admin_opts = sqlx::postgres::PgConnectOptions::new()
        .host("127.0.0.1")
        .port(pg.port)
        .username(pg.user)
        .password(pg.password)
        .database("postgres")
        .ssl_mode(sqlx::postgres::PgSslMode::VerifyFull)
        .ssl_root_cert(&pg.ca);
    let admin = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_with(admin_opts.clone())
        .await?;
    let db = format!("{prefix}_{}", tag());
    sqlx::query(&format!("CREATE DATABASE {db}"))
        .execute(&admin)
        .await?;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect_with(admin_opts.database(&db))
        .await?;
    sqlx::query("CREATE TABLE orders (id text PRIMARY KEY, version integer NOT NULL)")
        .execute(&pool)
        .await?;
    Ok((admin, pool, db))
}

#[tokio::test(flavor = "multi_thread")]
async fn logical_capture_streams_over_verified_tls() -> Result<()> {
    let pg = pg_tls()?;
    let dir = test_dir("pg-tls-logical");
    std::fs::write(dir.join("password"), format!("{}\n", pg.password))?;
    let (admin, pool, db) = tls_database(&pg, "outroute_tlslog").await?;
    let out = dir.join("out.jsonl");
    let config = dir.join("outroute.toml");
    std::fs::write(
        &config,
        format!(
            "[store]\nurl = \"postgres://{}@127.0.0.1:{}/{db}\"\npassword_file = \"password\"\n\
             capture = \"logical\"\n[store.tls]\nmode = \"verify-full\"\nca_file = \"{}\"\n\
             [relay]\ncache_dir = \"{}\"\nlease_ttl = \"2s\"\n\n{}",
            pg.user,
            pg.port,
            pg.ca.display(),
            std::env::temp_dir().join("outroute-test-cache").display(),
            orders_to_file(&out)
        ),
    )?;
    let cfg = config.display().to_string();
    let (code, o, e) = cli(&["migrate", "-c", &cfg])?;
    assert_eq!(code, 0, "migrate over TLS: {o}{e}");
    let mut relay = Relay::start(&config, &[])?;
    let w = produce(&pool, "tlslog", 4, 5, 0).await?;
    assert!(
        file_sink_reaches(&out, w.committed.len(), Duration::from_secs(30)).await,
        "events streamed over TLS: {}",
        relay.log_text()
    );
    // The slot's reader (a walsender) is on TLS, verified against our CA.
    let (walsenders, ssl): (i64, Option<bool>) = sqlx::query_as(
        "SELECT count(*), bool_and(s.ssl) FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) \
         WHERE a.backend_type = 'walsender' AND a.datname = current_database()",
    )
    .fetch_one(&pool)
    .await?;
    assert_eq!((walsenders, ssl), (1, Some(true)), "{}", relay.log_text());
    relay.terminate(Duration::from_secs(10));
    pool.close().await;
    let _ = sqlx::query(
        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = $1",
    )
    .bind(&db)
    .execute(&admin)
    .await;
    let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
        .execute(&admin)
        .await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn postgres_over_tls_with_a_password_role() -> Result<()> {
    let pg = pg_tls()?;
    let dir = test_dir("pg-tls");
    std::fs::write(dir.join("password"), format!("{}\n", pg.password))?;
    std::fs::write(dir.join("wrong"), "nope\n")?;
    let pki = Pki::new(&dir.join("pki"))?;

    // A database of our own on the TLS cluster, reached over verify-full TLS.
    let (admin, pool, db) = tls_database(&pg, "outroute_tls").await?;

    let out = dir.join("out.jsonl");
    let store = |password: &str, tls: &str| {
        format!(
            "[store]\nurl = \"postgres://{}@127.0.0.1:{}/{db}\"\n{password}\n{tls}\n[relay]\ncache_dir = \"{}\"\n\n{}",
            pg.user,
            pg.port,
            std::env::temp_dir().join("outroute-test-cache").display(),
            orders_to_file(&out)
        )
    };
    let write = |name: &str, body: String| -> Result<String> {
        let p = dir.join(name);
        std::fs::write(&p, body)?;
        Ok(p.display().to_string())
    };
    let good = write(
        "good.toml",
        store(
            "password_file = \"password\"",
            &format!(
                "[store.tls]\nmode = \"verify-full\"\nca_file = \"{}\"",
                pg.ca.display()
            ),
        ),
    )?;

    // Migrate and relay over TLS with the password role.
    let (code, o, e) = cli(&["migrate", "-c", &good])?;
    assert_eq!(code, 0, "migrate over TLS: {o}{e}");
    let mut relay = Relay::start(Path::new(&good), &[])?;
    let w = produce(&pool, "tls", 10, 5, 0).await?;
    let all = file_sink_reaches(&out, w.committed.len(), Duration::from_secs(30)).await;
    assert!(all, "events relayed over TLS: {}", relay.log_text());
    // The sink wrote them; the mark follows the ack.
    let marked = eventually(Duration::from_secs(10), || async {
        sqlx::query_scalar::<_, i64>(&format!(
            "SELECT count(*) FROM outbox o WHERE NOT ({})",
            outroute_e2e::UNPUBLISHED
        ))
        .fetch_one(&pool)
        .await
        .is_ok_and(|n| n as usize == w.committed.len())
    })
    .await;
    assert!(marked, "all marked published: {}", relay.log_text());
    let ssl: bool = sqlx::query_scalar(
        "SELECT bool_and(s.ssl) FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) \
         WHERE a.application_name = 'outroute'",
    )
    .fetch_one(&pool)
    .await?;
    assert!(ssl, "the relay's connections use TLS");
    relay.terminate(Duration::from_secs(10));

    // Each misconfiguration: a clear error naming what to fix, fast, and
    // the password never shown.
    let cases = [
        (
            "wrong password",
            store(
                "password_file = \"wrong\"",
                &format!("[store.tls]\nca_file = \"{}\"", pg.ca.display()),
            ),
            "wrong password",
        ),
        (
            "untrusted certificate",
            store(
                "password_file = \"password\"",
                &format!("[store.tls]\nca_file = \"{}\"", pki.path("other-ca.crt")),
            ),
            "not trusted",
        ),
        (
            "TLS off against a TLS-only server",
            store(
                "password_file = \"password\"",
                "[store.tls]\nmode = \"disable\"",
            ),
            "TLS may be required",
        ),
    ];
    for (what, body, expected) in cases {
        let f = write(&format!("{}.toml", tag()), body)?;
        let started = Instant::now();
        let (code, o, e) = cli(&["config", "check", "--store", "-c", &f])?;
        let text = format!("{o}{e}");
        assert_ne!(code, 0, "{what}: accepted: {text}");
        assert!(
            text.contains("store: cannot connect") && text.contains(expected),
            "{what}: {text}"
        );
        assert!(
            !text.contains(pg.password) && !text.contains("nope"),
            "{what}: secret shown: {text}"
        );
        assert!(started.elapsed() < Duration::from_secs(15), "{what}: slow");
    }

    // Both the password and a file for it: refused at load.
    let f = write(
        "both.toml",
        store("password = \"x\"\npassword_file = \"password\"", ""),
    )?;
    let (code, o, e) = cli(&["config", "check", "-c", &f])?;
    assert_ne!(code, 0);
    assert!(format!("{o}{e}").contains("store.password"), "{o}{e}");

    pool.close().await;
    let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
        .execute(&admin)
        .await;
    Ok(())
}

/// At run time, a source whose database refuses the relay's password keeps
/// only that source waiting: the other source relays, `/readyz` and
/// `outroute_source_up` name the one that waits and why (the password
/// itself never shown). With the password fixed and the config reloaded,
/// the source joins and its backlog goes out, without a restart.
#[tokio::test(flavor = "multi_thread")]
async fn a_source_whose_password_is_refused_waits_alone_at_run_time() -> Result<()> {
    let pg = pg_tls()?;
    let dir = test_dir("pg-tls-run");
    std::fs::write(dir.join("password"), "nope-not-it\n")?;
    let (admin, pool, db) = tls_database(&pg, "outroute_tlsrun").await?;
    let open = TestDb::new().await?;
    let out = dir.join("out.jsonl");
    let http = free_addr();
    let mut body = format!(
        "[relay]\ncache_dir = \"{}\"\npoll_max = \"200ms\"\n[http]\nlisten = \"{http}\"\n\
         [sinks.file]\nkind = \"file\"\npath = \"{}\"\n[plugins.p]\npath = \"{}\"\n\
         [sources.open]\nurl = \"{}\"\n\
         [sources.locked]\nurl = \"postgres://{}@127.0.0.1:{}/{db}\"\npassword_file = \"password\"\n\
         [sources.locked.tls]\nmode = \"verify-full\"\nca_file = \"{}\"\n",
        std::env::temp_dir().join("outroute-test-cache").display(),
        out.display(),
        plugin("order-router").display(),
        open.url,
        pg.user,
        pg.port,
        pg.ca.display(),
    );
    for name in ["open", "locked"] {
        body.push_str(&format!(
            "[[routes]]\nname = \"r{name}\"\nplugin = \"p\"\nsources = [\"{name}\"]\n\
             config = {{ sink = \"file\", topic = \"{name}.{{event_type}}\" }}\nallow = {{ file = [\"{name}.*\"] }}\n"
        ));
    }
    let config = dir.join("outroute.toml");
    std::fs::write(&config, body)?;
    let cfg = config.display().to_string();
    // The locked source's tables, made with the right password.
    std::fs::write(dir.join("password"), format!("{}\n", pg.password))?;
    let (code, o, e) = cli(&["migrate", "-c", &cfg])?;
    assert_eq!(code, 0, "{o}{e}");
    let locked_backlog = produce(&pool, "locked", 4, 5, 0).await?;
    std::fs::write(dir.join("password"), "nope-not-it\n")?;

    let mut relay = Relay::start(&config, &[])?;
    let w = produce(&open.pool, "open", 4, 5, 0).await?;
    let of = |source: &str| -> Vec<Delivered> {
        file_sink_deliveries(&out)
            .into_iter()
            .filter(|d| d.topic.starts_with(&format!("{source}.")))
            .collect()
    };
    let flowed = eventually(Duration::from_secs(30), || async {
        check(&w, &of("open")).lost == 0
    })
    .await;
    assert!(
        flowed,
        "the open source relays beside the locked one: {}",
        relay.log_text()
    );
    let named = eventually(Duration::from_secs(20), || async {
        http_get(&http, "/readyz").await.is_ok_and(|(code, body)| {
            code == 200 && body.contains("source `locked`") && body.contains("wrong password")
        })
    })
    .await;
    let (_, ready) = http_get(&http, "/readyz").await?;
    assert!(named, "{ready}");
    let (_, metrics) = http_get(&http, "/metrics").await?;
    assert_eq!(
        metric(&metrics, "outroute_source_up{source=\"locked\"}"),
        Some(0.0),
        "{metrics}"
    );
    assert!(of("locked").is_empty());
    assert!(relay.child.try_wait()?.is_none(), "{}", relay.log_text());
    let log = relay.log_text();
    assert!(
        !log.contains(pg.password) && !ready.contains(pg.password),
        "secret shown"
    );

    std::fs::write(dir.join("password"), format!("{}\n", pg.password))?;
    relay.reload();
    let joined = eventually(Duration::from_secs(30), || async {
        check(&locked_backlog, &of("locked")).lost == 0
    })
    .await;
    assert!(
        joined,
        "fixed and reloaded, the source joins: {}",
        relay.log_text()
    );
    relay.terminate(Duration::from_secs(10));
    open.drop_db().await;
    pool.close().await;
    let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
        .execute(&admin)
        .await;
    Ok(())
}
