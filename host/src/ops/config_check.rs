//! `outroute config check` (every problem as `file:key: reason`, plugins
//! loaded as `run` would, `--store`/`--sinks` reached) and `config diff`.

use super::*;

pub async fn config_check(arg: &ConfigArg, store: bool, sinks: bool) -> Result<ExitCode> {
    let path = arg.config.as_path();
    let l = match config::load(path) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("{e}");
            return Ok(ExitCode::FAILURE);
        }
    };
    if let Err(e) = l.check_runnable() {
        eprintln!("{}:{e}", path.display());
        return Ok(ExitCode::FAILURE);
    }
    // A refused team file costs `run` only its team, but fails the check.
    let mut refused = false;
    for r in &l.refused {
        for p in &r.problems {
            eprintln!("{p}");
        }
        eprintln!(
            "{}: refused; `run` {}",
            r.file.display(),
            if r.last_good {
                "runs the team's last known good copy instead"
            } else {
                "runs the other teams; this team's routes do not run and their events wait"
            }
        );
        refused = true;
    }
    let l = arg.load()?;
    // Every route's plugin (and shadow) as `run` loads it: compiled, and
    // `init` with the route's config, so a file that is no component or a
    // config the plugin refuses fails here, not at start-up.
    let runtime = Runtime::new(l.cache_dir())?;
    for (i, r) in l.config.routes.iter().enumerate() {
        let Some(pc) = l.config.plugins.get(&r.plugin) else {
            continue; // refused by the load above
        };
        let limits = Limits::of(r);
        let mut plugins = vec![("plugin", pc.path.clone(), r.config.clone())];
        if let Some(shadow) = &pc.shadow {
            let cfg = pc.shadow_config.clone().unwrap_or_else(|| r.config.clone());
            plugins.push(("shadow plugin", shadow.clone(), cfg));
        }
        for (what, file, cfg) in plugins {
            if let Err(e) = crate::relay::load_plugin(&runtime, l.resolve(&file), cfg, limits).await
            {
                eprintln!(
                    "{}:routes[{i}] (route `{}`): {what} {}: {e:#}",
                    path.display(),
                    r.name,
                    l.resolve(&file).display()
                );
                refused = true;
            }
        }
    }
    if refused {
        return Ok(ExitCode::FAILURE);
    }
    println!(
        "{}: ok ({} sources, {} routes, {} sinks, {} plugins{})",
        path.display(),
        l.config.sources.len(),
        l.config.routes.len(),
        l.config.sinks.len(),
        l.config.plugins.len(),
        match l.files.len() {
            1 => String::new(),
            n => format!(", {} included files", n - 1),
        }
    );
    let mut store_failures = Failures::new(&l);
    for w in l.transport_warnings() {
        println!("warning: {w}");
    }
    for source in sources(&l) {
        let sc = l.config.source(&source)?;
        let key = l.config.source_key(&source);
        let table = sc.table();
        if table.sequence.is_none()
            && l.config.relay.ordering != config::Ordering::None
            && sc.url.starts_with("postgres")
        {
            println!(
                "warning: {key}.table.sequence is unset: `{}` is ordered by ({}, id); ordering = \"{}\" orders \
                 events across transactions, but two events of one aggregate with the same timestamp (one \
                 transaction using now()) go out in id order. `outroute migrate --table --add-sequence -c {}` \
                 adds a sequence column that keeps insert order.",
                table.name,
                table.created_at,
                serde_json::to_value(l.config.relay.ordering)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_string))
                    .unwrap_or_default(),
                path.display()
            );
        }
        if store {
            let name = table.name;
            let opened = async {
                let mut s = Store::connect(&l.config, &source, "config-check").await?;
                s.check_table().await?;
                anyhow::Ok(s)
            }
            .await;
            let s = match opened {
                Ok(s) => s,
                Err(e) => {
                    store_failures.add(&source, e)?;
                    continue;
                }
            };
            if let Some(off) = s.postgres().and_then(|p| p.floors_off()) {
                println!("warning: {off}");
            }
            match s.missing_index() {
                None if s.queue_marking() => {
                    println!("{key}: table `{name}` ok, pending queue and its trigger present")
                }
                Some(_) if s.queue_marking() => println!(
                    "{key}: table `{name}` ok\nwarning: {key}.table: `{name}` has no pending-queue trigger yet: \
                     the relay refuses to start. Run `outroute migrate --table -c {}`",
                    path.display()
                ),
                None => println!("{key}: table `{name}` ok, lane index usable"),
                Some(ddl) => println!(
                    "{key}: table `{name}` ok\nwarning: {key}.table: `{name}` has no usable lane index: every claim \
                     would scan and sort the whole backlog. Run `outroute migrate --table -c {}`, or:\n  {ddl}",
                    path.display()
                ),
            }
        }
    }
    store_failures.finish()?;
    if sinks {
        let routes = crate::routing::Routes::compile(&l.config).map_err(anyhow::Error::msg)?;
        let mut failed = false;
        for found in crate::sink::check_all(
            &l.config.sinks,
            &routes,
            &l.base_dir,
            l.config.relay.publish_timeout,
        )
        .await
        {
            match found {
                Ok(line) => println!("{line}"),
                Err(e) => {
                    eprintln!("{}:{e:#}", path.display());
                    failed = true;
                }
            }
        }
        if failed {
            return Ok(ExitCode::FAILURE);
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `outroute config diff OLD NEW`: what loading NEW over a relay running
/// OLD would change (both must be valid).
pub fn config_diff(old: &Path, new: &Path) -> Result<ExitCode> {
    let a = load(old)?;
    let b = load(new)?;
    print!("{}", config::diff(&a.config, &b.config));
    Ok(ExitCode::SUCCESS)
}
