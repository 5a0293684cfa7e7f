//! The real `outroute` binary as a child process: configs written for it,
//! relays started and stopped, its commands run, its HTTP endpoints and
//! metrics read, and what /proc says of it.

use super::*;

/// Write `outroute.toml`: the store, `[relay]` settings (`relay` is added
/// to that table) and the rest (`body`: sinks, plugins, routes, http).
pub fn write_config(dir: &Path, db_url: &str, relay: &str, body: &str) -> Result<PathBuf> {
    write_config_with(dir, db_url, "", relay, body)
}

/// The route of the tests that publish to a file sink: topic
/// `orders.{event_type}`.
pub const FILE_ROUTE: &str = "config = { sink = \"file\", topic = \"orders.{event_type}\" }\nallow = { file = [\"orders.*\"] }";

/// The usual file-sink relay: `order-router` routing `orders` through
/// [`FILE_ROUTE`] to a file sink writing `out`.
pub fn file_route_body(out: &Path) -> String {
    relay_body(
        "",
        &[TestSink::File(out)],
        "order-router",
        "orders",
        FILE_ROUTE,
    )
}

/// A relay publishing to a file, set up and migrated: in test folder
/// `name`, `[relay]` keys `relay`, one route `route_name` through plugin
/// `plugin` with keys `route` (often [`FILE_ROUTE`]). Returns the config and
/// the file the sink writes (`out.jsonl`).
pub fn file_sink_config(
    db: &TestDb,
    name: &str,
    relay: &str,
    plugin: &str,
    route_name: &str,
    route: &str,
) -> Result<(PathBuf, PathBuf)> {
    let dir = test_dir(name);
    let out = dir.join("out.jsonl");
    let config = write_config(
        &dir,
        &db.url,
        relay,
        &relay_body("", &[TestSink::File(&out)], plugin, route_name, route),
    )?;
    db.migrate(&config)?;
    Ok((config, out))
}

/// [`write_config`] with more `[store]` keys (`store`: TOML lines), e.g.
/// `capture = "logical"`.
pub fn write_config_with(
    dir: &Path,
    db_url: &str,
    store: &str,
    relay: &str,
    body: &str,
) -> Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let path = dir.join("outroute.toml");
    std::fs::write(
        &path,
        format!(
            "[store]\nurl = \"{db_url}\"\n{store}\n\n[relay]\ncache_dir = \"{cache}\"\n{relay}\n\n{body}\n",
            cache = std::env::temp_dir().join("outroute-test-cache").display()
        ),
    )?;
    Ok(path)
}

pub fn test_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("outroute-e2e-{name}-{}", tag()));
    let _ = std::fs::create_dir_all(&d);
    d
}

/// A running `outroute run` process.
pub struct Relay {
    pub child: Child,
    pub log: PathBuf,
}

impl Relay {
    pub fn start(config: &Path, env: &[(&str, &str)]) -> Result<Relay> {
        let log = config.with_file_name(format!("relay-{}.log", tag()));
        let file = std::fs::File::create(&log)?;
        let mut cmd = Command::new(bin());
        cmd.args(["run", "-c"])
            .arg(config)
            .stdout(Stdio::null())
            .stderr(file);
        cmd.env("RUST_LOG", "info");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {}", bin().display()))?;
        Ok(Relay { child, log })
    }

    fn signal(&self, sig: i32) {
        // SAFETY: plain kill(2) on our own child's pid.
        unsafe {
            libc::kill(self.child.id() as i32, sig);
        }
    }

    /// SIGHUP: read the configuration again (as `outroute reload` does).
    pub fn reload(&self) {
        self.signal(libc::SIGHUP);
    }

    /// kill -9: no cleanup at all.
    pub fn kill(&mut self) {
        self.signal(libc::SIGKILL);
        let _ = self.child.wait();
    }

    /// SIGTERM, then wait up to `timeout` for the exit status.
    pub fn terminate(&mut self, timeout: Duration) -> Option<ExitStatus> {
        self.signal(libc::SIGTERM);
        self.wait_exit(timeout)
    }

    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Ok(Some(s)) = self.child.try_wait() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.kill();
        }
    }
}

/// GET a path from the relay's HTTP endpoint; returns (status, body).
pub async fn http_get(addr: &str, path: &str) -> Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).await?;
    let status = buf
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = buf
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((status, body))
}

/// Is this process stopped (SIGSTOP)? Linux: state `T` in /proc/<pid>/stat.
pub fn stopped(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, rest)| rest.trim_start().starts_with('T'))
        })
        .unwrap_or(false)
}

/// A memory figure of process `pid` from `/proc/PID/status` in KiB
/// (`field`: `VmRSS` now, `VmHWM` peak); 0 when unreadable.
pub fn proc_memory_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.split(':').next() == Some(field))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|n| n.parse().ok())
        })
        .unwrap_or(0)
}

/// A free TCP port on loopback for the relay's HTTP endpoint.
pub fn free_addr() -> String {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "127.0.0.1:0".into())
}

/// The value of a Prometheus series: the first line of `name` that has
/// every label given (`name{a="x",b="y"}`; other labels may be there too).
pub fn metric(text: &str, name_and_labels: &str) -> Option<f64> {
    let (name, labels) = match name_and_labels.split_once('{') {
        Some((n, l)) => (n, l.trim_end_matches('}')),
        None => (name_and_labels, ""),
    };
    let wanted: Vec<&str> = labels.split(',').filter(|l| !l.is_empty()).collect();
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| {
            let series = l.rsplit_once(' ').map(|(s, _)| s).unwrap_or(l);
            let (n, ls) = match series.split_once('{') {
                Some((n, ls)) => (n, ls.trim_end_matches('}')),
                None => (series, ""),
            };
            n == name && wanted.iter().all(|w| ls.split(',').any(|x| x == *w))
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// Run the `outroute` binary with arguments; returns (status, stdout, stderr).
pub fn cli(args: &[&str]) -> Result<(i32, String, String)> {
    cli_env(args, &[])
}

/// [`cli`] with extra environment variables (e.g. a failpoint).
pub fn cli_env(args: &[&str], env: &[(&str, &str)]) -> Result<(i32, String, String)> {
    let out = Command::new(bin())
        .args(args)
        .envs(env.iter().copied())
        .output()?;
    Ok((
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

/// The fan-out relay of the tests that publish to both brokers: Kafka and
/// NATS sinks and one route `fanout` (the fanout plugin) sending each event
/// to Kafka topic `<prefix>.<event type>` and NATS subject
/// `<prefix>.<aggregate id>.<event type>`.
pub fn fanout_body(prefix: &str) -> String {
    format!(
        r#"
[http]
listen = ""
[sinks.kafka]
kind = "kafka"
brokers = "{KAFKA}"
[sinks.nats]
kind = "nats"
url = "{NATS}"
[plugins.fanout]
path = "{plugin}"
[[routes]]
name = "fanout"
plugin = "fanout"
config = {{ targets = [ {{ sink = "kafka", topic = "{prefix}.{{event_type}}" }}, {{ sink = "nats", topic = "{prefix}.{{aggregate_id}}.{{event_type}}" }} ] }}
allow = {{ kafka = ["{prefix}.*"], nats = ["{prefix}.**"] }}
"#,
        plugin = plugin("fanout").display()
    )
}

/// A sink section for test configs.
pub enum TestSink<'a> {
    Kafka,
    Nats,
    /// NATS with extra keys (e.g. `max_in_flight = 3`).
    NatsWith(&'a str),
    File(&'a Path),
}

/// A config on `db_url` (`store`: extra `[store]` keys, e.g. the capture
/// mode) whose route publishes through `order-router` to Kafka topic
/// `t<t>.<event type>`.
pub fn kafka_topic_config(
    dir: &Path,
    db_url: &str,
    store: &str,
    t: &str,
    relay: &str,
) -> Result<PathBuf> {
    let route = format!(
        "config = {{ sink = \"kafka\", topic = \"t{t}.{{event_type}}\" }}\nallow = {{ kafka = [\"t{t}.*\"] }}"
    );
    write_config_with(
        dir,
        db_url,
        store,
        relay,
        &relay_body("", &[TestSink::Kafka], "order-router", "orders", &route),
    )
}

/// The rest of a test config after `[relay]`: the HTTP endpoint (`""` for
/// none), the sinks, one plugin, and one route `name` using it; `route`
/// adds the route's keys (`config = …`, `allow = …`, budgets, policies).
pub fn relay_body(
    http: &str,
    sinks: &[TestSink],
    plugin_name: &str,
    name: &str,
    route: &str,
) -> String {
    let mut s = format!("[http]\nlisten = \"{http}\"\n");
    for sink in sinks {
        s.push_str(&match sink {
            TestSink::Kafka => format!("[sinks.kafka]\nkind = \"kafka\"\nbrokers = \"{KAFKA}\"\n"),
            TestSink::Nats => format!("[sinks.nats]\nkind = \"nats\"\nurl = \"{NATS}\"\n"),
            TestSink::NatsWith(extra) => {
                format!("[sinks.nats]\nkind = \"nats\"\nurl = \"{NATS}\"\n{extra}\n")
            }
            TestSink::File(p) => format!(
                "[sinks.file]\nkind = \"file\"\npath = \"{}\"\n",
                p.display()
            ),
        });
    }
    format!(
        "{s}[plugins.p]\npath = \"{}\"\n[[routes]]\nname = \"{name}\"\nplugin = \"p\"\n{route}\n",
        plugin(plugin_name).display()
    )
}
