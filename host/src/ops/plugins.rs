//! `outroute plugin new|test|inspect|try|shadow-report|promote`: what a
//! plugin author and the operator rolling it out run, outside `run`.

use super::*;

#[derive(Subcommand)]
pub enum PluginAction {
    /// Route sample events through a plugin and print the messages or the
    /// rejection as JSON. Exit status: 0 when every event was routed, 3
    /// when at least one was rejected (stderr says how many), 1 on an error
    /// (a plugin that does not load or refuses its config, a bad event
    /// file). The route's allow-list is not checked here: `plugin try`
    /// checks it on real events.
    Test {
        /// The compiled plugin (.wasm).
        plugin: PathBuf,
        /// Route config handed to the plugin's init (JSON text or @file).
        #[arg(long, default_value = "null")]
        config: String,
        /// Event file (one JSON event or an array); `-` for standard input.
        #[arg(long, default_value = "-")]
        event: String,
        /// CPU budget per event (a route's `cpu_budget` defaults to 50 ms:
        /// pass that to see whether the plugin fits it).
        #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
        cpu_budget: Duration,
        /// Memory cap in MiB.
        #[arg(long, default_value_t = 64)]
        memory_mib: u32,
    },
    /// Print the plugin's world, imports, exports, name and version.
    Inspect { plugin: PathBuf },
    /// Try a candidate plugin on a route's recent real events (read from
    /// the store, nothing published) and print what it would do
    /// differently from the route's active plugin: messages, topics, keys,
    /// headers, payloads, rejections.
    Try {
        /// The candidate plugin (.wasm).
        candidate: PathBuf,
        #[command(flatten)]
        config: ConfigArg,
        /// The route whose plugin the candidate would replace.
        #[arg(long)]
        route: String,
        /// How many of the route's newest published events, per source.
        #[arg(long, default_value_t = 100)]
        last: usize,
        /// Route config for the candidate (JSON text or @file); default:
        /// the route's own `config`.
        #[arg(long)]
        candidate_config: Option<String>,
    },
    /// What the shadow (candidate) plugins of the running relay would have
    /// done differently so far: per route, events compared, differing, and
    /// the latest differing events (read from the relay's `/shadow`).
    ShadowReport {
        #[command(flatten)]
        config: ConfigArg,
    },
    /// Make plugin PLUGIN's shadow the active version: its `path` becomes
    /// the `shadow` file, in the config file that declares it (comments and
    /// layout kept). The running relay applies it without a restart on
    /// SIGHUP or at its next `relay.config_watch_interval` check.
    Promote {
        /// The plugin (`[plugins.<name>]`).
        plugin: String,
        #[command(flatten)]
        config: ConfigArg,
    },
    /// Start a plugin project that builds and tests as it is: a router, a
    /// test, a sample event, and the commands to build, test and try it.
    New {
        /// Plugin name: lowercase letters, digits and `-`.
        name: String,
        #[arg(long, value_enum, default_value = "rust")]
        lang: crate::scaffold::Lang,
        /// Where to create it (default: ./NAME); must be empty or new.
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Rust: the outroute-guest crate (default: the one this relay was
        /// built from).
        #[arg(long)]
        sdk: Option<PathBuf>,
    },
}

pub(super) fn plugin_runtime() -> Result<Runtime> {
    Runtime::new(config::default_plugin_cache())
}

/// A sample event as `plugin test` reads it; everything but the type and
/// payload has a default.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct SampleEvent {
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    sequence: i64,
    aggregate_type: String,
    aggregate_id: String,
    event_type: String,
    #[serde(default = "one")]
    event_version: u32,
    payload: serde_json::Value,
    #[serde(default)]
    headers: std::collections::BTreeMap<String, String>,
    #[serde(default)]
    created_at: Option<DateTime<Utc>>,
}

pub(super) fn one() -> u32 {
    1
}

pub(super) fn read_text(arg: &str) -> Result<String> {
    if arg == "-" {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .context("reading standard input")?;
        Ok(s)
    } else {
        let p = arg.strip_prefix('@').unwrap_or(arg);
        std::fs::read_to_string(p).with_context(|| format!("reading {p}"))
    }
}

pub async fn plugin(action: PluginAction) -> Result<ExitCode> {
    match action {
        PluginAction::Try {
            candidate,
            config,
            route,
            last,
            candidate_config,
        } => try_candidate(candidate, &config, &route, last, candidate_config).await,
        PluginAction::New {
            name,
            lang,
            dir,
            sdk,
        } => {
            let (dir, next) = crate::scaffold::new(&name, lang, dir, sdk)?;
            println!(
                "created plugin `{name}` in {}; next, in that directory:",
                dir.display()
            );
            for cmd in next {
                println!("  {cmd}");
            }
            Ok(ExitCode::SUCCESS)
        }
        PluginAction::ShadowReport { config } => {
            let loaded = config.load()?;
            let listen = &loaded.config.http.listen;
            if listen.is_empty() {
                bail!("http.listen is empty: the relay serves no /shadow report");
            }
            let token = loaded.config.http.token.as_ref().map(|t| t.expose());
            let body = http_get(listen, "/shadow", token)
                .await
                .with_context(|| format!("asking the relay at {listen} for /shadow"))?;
            let routes: Vec<serde_json::Value> = serde_json::from_str(&body)
                .with_context(|| format!("the relay's /shadow answer is not JSON: {body}"))?;
            if routes.is_empty() {
                println!("no shadow plugin has answered an event yet");
            }
            for r in routes {
                println!(
                    "source {} route {} (candidate {}): {} events compared, {} different",
                    r["source"].as_str().unwrap_or("?"),
                    r["route"].as_str().unwrap_or("?"),
                    r["candidate"].as_str().unwrap_or("?"),
                    r["compared"],
                    r["differing"]
                );
                for sample in r["samples"].as_array().into_iter().flatten() {
                    let d: Vec<&str> = sample["differences"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|d| d.as_str())
                        .collect();
                    println!(
                        "  {} {}: {}",
                        sample["at"].as_str().unwrap_or(""),
                        sample["event_id"].as_str().unwrap_or("?"),
                        d.join("; ")
                    );
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        PluginAction::Promote { plugin, config } => {
            let loaded = config.load()?;
            let pc = loaded.config.plugins.get(&plugin).ok_or_else(|| {
                anyhow!("no plugin named `{plugin}` in {}", config.config.display())
            })?;
            if pc.shadow.is_none() {
                bail!("plugins.{plugin}.shadow is not set: there is no candidate to promote");
            }
            let file = crate::shadow::promote(&loaded.files, &plugin, pc.shadow_config.as_ref())?;
            println!(
                "plugins.{plugin}: the shadow is now the active version ({}). A running relay applies it \
                 on SIGHUP or at its next config check (relay.config_watch_interval).",
                file.display()
            );
            Ok(ExitCode::SUCCESS)
        }
        PluginAction::Inspect { plugin } => {
            let rt = plugin_runtime()?;
            let info = tokio::task::spawn_blocking(move || plugin::inspect(&rt, &plugin)).await??;
            println!("{}", serde_json::to_string_pretty(&info)?);
            Ok(ExitCode::SUCCESS)
        }
        PluginAction::Test {
            plugin,
            config,
            event,
            cpu_budget,
            memory_mib,
        } => {
            // The plugin's own `log` lines (every level) and the host's
            // warnings, on stderr beside the outcomes on stdout; RUST_LOG
            // overrides.
            init_logging(LogFormat::Human, "warn,outroute::plugin::sandbox=trace");
            let config_text = if config.starts_with('@') {
                read_text(&config)?
            } else {
                config
            };
            let config: serde_json::Value =
                serde_json::from_str(&config_text).context("--config is not JSON")?;
            let text = read_text(&event)?;
            let value: serde_json::Value =
                serde_json::from_str(&text).context("--event is not JSON")?;
            let samples: Vec<SampleEvent> = match value {
                serde_json::Value::Array(_) => serde_json::from_value(value),
                other => serde_json::from_value(other).map(|e| vec![e]),
            }
            .context("--event: expected {aggregate_type, aggregate_id, event_type, payload, …} or a list of them")?;
            let events: Vec<Event> = samples
                .into_iter()
                .enumerate()
                .map(|(i, s)| Event {
                    id: s.id.unwrap_or_else(|| uuid::Uuid::new_v4().to_string()),
                    sequence: if s.sequence == 0 {
                        i as i64 + 1
                    } else {
                        s.sequence
                    },
                    aggregate_type: s.aggregate_type,
                    aggregate_id: s.aggregate_id,
                    event_type: s.event_type,
                    event_version: s.event_version,
                    payload: s.payload.to_string().into_bytes(),
                    headers: s.headers.into_iter().collect(),
                    created_at: s.created_at.unwrap_or_else(Utc::now),
                    attempts: 0,
                })
                .collect();
            let rt = plugin_runtime()?;
            let limits = Limits {
                cpu_budget,
                memory_bytes: (memory_mib as usize) << 20,
                log_lines_per_event: 100,
                log_bytes_per_event: 64 << 10,
                // The instance that answered `describe` and `init` routes
                // the events, as in the relay (`init` runs once).
                max_idle_bytes: (memory_mib as usize) << 20,
            };
            let (outcomes, counts) = tokio::task::spawn_blocking(move || -> Result<_> {
                let handle = PluginHandle::load(&rt, &plugin, config, limits)?;
                let p = handle.current().context("plugin unavailable")?;
                let outcomes = events
                    .iter()
                    .zip(p.route_batch(&events))
                    .map(|(e, a)| (e.id.clone(), a.into_outcome()))
                    .collect::<Vec<_>>();
                Ok((outcomes, p.take_counts()))
            })
            .await??;
            // What the plugin counted (`host.count`): on stderr, so the
            // JSON on stdout keeps its shape.
            for (name, n) in &counts {
                eprintln!("counted: {name} += {n}");
            }
            let mut rejected = 0usize;
            let out: Vec<serde_json::Value> = outcomes
                .into_iter()
                .map(|(id, o)| match o {
                    Ok(msgs) => serde_json::json!({
                        "event_id": id,
                        "messages": msgs.iter().map(|m| serde_json::json!({
                            "sink": m.sink,
                            "topic": m.topic,
                            "key": m.key.as_ref().map(|k| String::from_utf8_lossy(k).into_owned()),
                            "partition": m.partition,
                            "headers": m.headers.iter().cloned().collect::<std::collections::BTreeMap<_, _>>(),
                            "payload": serde_json::from_slice::<serde_json::Value>(&m.payload)
                                .unwrap_or_else(|_| serde_json::json!(String::from_utf8_lossy(&m.payload))),
                        })).collect::<Vec<_>>(),
                    }),
                    Err(r) => {
                        rejected += 1;
                        let kind = match r {
                            Rejection::Retryable(_) => "retryable",
                            Rejection::Invalid(_) => "invalid",
                        };
                        serde_json::json!({"event_id": id, "rejection": {"kind": kind, "reason": r.reason()}})
                    }
                })
                .collect();
            println!("{}", serde_json::to_string_pretty(&out)?);
            if rejected > 0 {
                eprintln!(
                    "{rejected} of {} events rejected (exit status 3)",
                    out.len()
                );
            }
            Ok(if rejected == 0 {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(3)
            })
        }
    }
}

/// `outroute plugin try`: the route's newest published events through the
/// active plugin and the candidate, side by side.
pub(super) async fn try_candidate(
    candidate: PathBuf,
    arg: &ConfigArg,
    route: &str,
    last: usize,
    candidate_config: Option<String>,
) -> Result<ExitCode> {
    let loaded = arg.load()?;
    let routes = crate::routing::Routes::compile(&loaded.config).map_err(anyhow::Error::msg)?;
    let Some(r) = routes.0.iter().find(|r| r.name() == route) else {
        bail!("no route named `{route}` in {}", arg.config.display());
    };
    let active = loaded
        .config
        .plugins
        .get(&r.config.plugin)
        .map(|p| loaded.resolve(&p.path))
        .ok_or_else(|| anyhow::anyhow!("route `{route}`: no plugin `{}`", r.config.plugin))?;
    let candidate_config: serde_json::Value = match candidate_config {
        Some(text) => {
            let text = if text.starts_with('@') {
                read_text(&text)?
            } else {
                text
            };
            serde_json::from_str(&text).context("--candidate-config is not JSON")?
        }
        None => r.config.config.clone(),
    };
    let mut events: Vec<Event> = Vec::new();
    for source in sources(&loaded) {
        if !config::Config::route_reads(&r.config, &source) {
            continue;
        }
        let store = open_for_command(&loaded, &source, "plugin-try").await?;
        events.extend(crate::trial::recent_events(&store, r, last).await?);
    }
    if events.is_empty() {
        println!("route `{route}`: no published events to try the candidate on");
        return Ok(ExitCode::SUCCESS);
    }
    let trial = crate::trial::run(
        plugin_runtime()?,
        r,
        active.clone(),
        candidate.clone(),
        candidate_config,
        events,
    )
    .await?;
    let differing = trial.differing();
    let different = differing.len();
    let events = &trial.events;
    let lines: Vec<String> = differing
        .iter()
        .take(50)
        .map(|(i, d)| {
            let e = &events[*i];
            format!(
                "{} ({} {} / {}): {}",
                e.id,
                e.aggregate_type,
                e.aggregate_id,
                e.event_type,
                d.join("; ")
            )
        })
        .collect();
    println!(
        "route `{route}`: {} recent events; candidate {} vs active {}\n  same       {}\n  different  {different}",
        events.len(),
        candidate.display(),
        active.display(),
        events.len() - different
    );
    for l in lines {
        println!("  {l}");
    }
    Ok(ExitCode::SUCCESS)
}
