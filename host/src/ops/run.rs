//! `outroute run`: bring the topology up, serve HTTP, reload on SIGHUP or a
//! changed file (a refused reload leaves the running config), and stop
//! cleanly on SIGTERM/SIGINT.

use super::*;

/// `outroute run`: every source of the config (or `--source`), until
/// SIGTERM/SIGINT; SIGHUP (or a changed file, with
/// `relay.config_watch_interval`) reloads the config.
pub async fn run(arg: &ConfigArg) -> Result<ExitCode> {
    let path = arg.config.as_path();
    let loaded = arg.load()?;
    if let Err(e) = loaded.check_runnable() {
        bail!("invalid configuration:\n{}:{e}", path.display());
    }
    init_logging(loaded.config.log.format, &loaded.config.log.level);
    let prom = metrics::install()?;
    let id = relay_id(&loaded);
    let ready = health::Readiness::default();
    let watch = loaded.config.relay.config_watch_interval;
    let mut stamp = files_stamp(&loaded);
    let http_listen = loaded.config.http.listen.clone();
    // Listen for SIGHUP before anything else: its default action ends the
    // process.
    let mut hup = reload_signal();
    // Health first: `/readyz` says what is still coming up.
    let shutdown = CancellationToken::new();
    let http = if http_listen.is_empty() {
        None
    } else {
        Some(
            crate::http::serve(
                &http_listen,
                prom,
                ready.clone(),
                loaded.config.http.token.clone(),
                loaded.config.http.console.clone(),
                shutdown.clone(),
            )
            .await?,
        )
    };
    loaded.report_teams();
    for w in loaded.transport_warnings() {
        tracing::warn!("insecure transport: {w}");
    }
    let mut topology = Topology::start(loaded, id.clone(), ready).await?;
    tokio::spawn(signal_shutdown(shutdown.clone()));
    tracing::info!(relay = %id, routes = topology.route_count(), "outroute relay started");
    loop {
        let reason = tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = next_hup(&mut hup) => "SIGHUP",
            _ = tokio::time::sleep(watch.unwrap_or(Duration::from_secs(3600))) => {
                let now = files_stamp_of(&stamp.0);
                if watch.is_none() || now == stamp.1 {
                    continue;
                }
                "a config file changed"
            }
        };
        reload(&mut topology, arg, reason).await;
        stamp = files_stamp(topology.loaded());
    }
    topology.stop().await;
    if let Some(h) = http {
        let _ = tokio::time::timeout(Duration::from_secs(2), h).await;
    }
    tracing::info!("outroute relay stopped");
    Ok(ExitCode::SUCCESS)
}

/// Load, validate and apply the config again; a refused change leaves the
/// running one as it was.
pub(super) async fn reload(topology: &mut Topology, arg: &ConfigArg, reason: &str) {
    tracing::info!("{reason}: reloading {}", arg.config.display());
    let started = std::time::Instant::now();
    let outcome = match arg.load() {
        Err(e) => Err(e),
        Ok(new) => match new.check_runnable() {
            Err(e) => Err(anyhow::anyhow!("{}:{e}", arg.config.display())),
            Ok(()) => topology.reload(new).await,
        },
    };
    if outcome.is_ok() {
        topology.loaded().report_teams();
    }
    let result = match &outcome {
        Ok(d) if d.is_empty() => "unchanged",
        Ok(_) => "applied",
        Err(_) => "rejected",
    };
    ::metrics::counter!(metrics::CONFIG_RELOADS, "result" => result).increment(1);
    crate::console::note_reload(
        result,
        match &outcome {
            Ok(d) => d.to_string(),
            Err(e) => describe(e),
        },
    );
    match outcome {
        Ok(d) => tracing::info!(
            result,
            "config reload {result} in {} ms:\n{d}",
            started.elapsed().as_millis()
        ),
        Err(e) => tracing::error!(
            result,
            "config reload rejected; the running config is unchanged: {}",
            describe(&e)
        ),
    }
}

/// The config's files and their modification times.
pub(super) fn files_stamp(loaded: &Loaded) -> (Vec<PathBuf>, Vec<Option<std::time::SystemTime>>) {
    let files = loaded.watched.clone();
    let stamps = files_stamp_of(&files);
    (files, stamps)
}

pub(super) fn files_stamp_of(files: &[PathBuf]) -> Vec<Option<std::time::SystemTime>> {
    files
        .iter()
        .map(|f| std::fs::metadata(f).and_then(|m| m.modified()).ok())
        .collect()
}

#[cfg(unix)]
pub(super) type Hup = Option<tokio::signal::unix::Signal>;
#[cfg(not(unix))]
pub(super) type Hup = Option<()>;

pub(super) fn reload_signal() -> Hup {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::hangup()) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!("cannot listen for SIGHUP (config reload): {e}");
                None
            }
        }
    }
    #[cfg(not(unix))]
    None
}

pub(super) async fn next_hup(hup: &mut Hup) {
    #[cfg(unix)]
    if let Some(s) = hup {
        s.recv().await;
        return;
    }
    let _ = hup;
    std::future::pending::<()>().await
}

pub(super) async fn signal_shutdown(token: CancellationToken) {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {},
                    _ = tokio::signal::ctrl_c() => {},
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
    tracing::info!("signal received");
    token.cancel();
}
