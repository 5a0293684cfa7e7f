//! Assembling a source's relay: the sinks every source shares, the plugins
//! of the routes that read this source (loaded now, or waited for in the
//! background while the rest runs), and the [`Relay`] itself.

use super::*;

/// The sinks of `loaded`, shared by every source's relay.
pub async fn build_sinks(loaded: &Loaded) -> Result<Sinks> {
    let routes = Routes::compile(&loaded.config).map_err(anyhow::Error::msg)?;
    crate::sink::build_all(
        &loaded.config.sinks,
        &routes,
        &loaded.base_dir,
        loaded.config.relay.publish_timeout,
    )
    .await
}

/// The CloudEvents `source` of a source's messages: the table, and the
/// source's name when the relay serves named sources.
pub fn ce_source(config: &crate::config::Config, source: &str, table: &str) -> String {
    if config.store_shorthand {
        format!("/outroute/{table}")
    } else {
        format!("/outroute/{source}/{table}")
    }
}

/// The routes that read one source with their plugins loaded: the part of
/// a relay that needs no store or sink, so it is loaded while those connect.
pub struct RoutePlugins {
    routes: Routes,
    /// One handle per route (same index as `routes`).
    plugins: Vec<Arc<PluginHandle>>,
    shadows: Vec<Option<Shadow>>,
    reload: Vec<Option<Duration>>,
    /// Why a route's plugin could not be loaded (its handle waits for the
    /// file), per route; only [`RoutePlugins::load_or_wait`] leaves any.
    errors: Vec<Option<String>>,
}

impl RoutePlugins {
    /// Compile (or take from the cache) and `init` the plugin of every
    /// route that reads `source`, all routes at once; any that fails is an
    /// error (one-shot commands: `replay`, the quickstart).
    pub async fn load(loaded: &Loaded, source: &str, runtime: &Runtime) -> Result<Self> {
        let p = Self::load_or_wait(loaded, source, runtime).await?;
        if let Some((i, e)) = p
            .errors
            .iter()
            .enumerate()
            .find_map(|(i, e)| Some((i, e.as_ref()?)))
        {
            anyhow::bail!("route `{}`: {e}", p.routes.0[i].name());
        }
        Ok(p)
    }

    /// As [`RoutePlugins::load`], but a route whose plugin cannot be loaded
    /// (file missing, not a component, `init` refusing its config) gets a
    /// waiting handle and its error: `run` serves the other routes, and
    /// that one once its file loads. A shadow that cannot be loaded is left
    /// out, with a warning (the route runs its active plugin).
    /// `runtime` is the process's plugin engine: every source's routes
    /// share it (and the compiled code of a plugin they have in common).
    pub async fn load_or_wait(loaded: &Loaded, source: &str, runtime: &Runtime) -> Result<Self> {
        let config = &loaded.config;
        let mut routes = Routes::compile(config).map_err(anyhow::Error::msg)?;
        routes
            .0
            .retain(|r| crate::config::Config::route_reads(&r.config, source));
        // A team granted this source whose file is refused, with no last
        // known good copy running: a stand-in route holds its events.
        for refused in loaded.refused.iter().filter(|r| !r.last_good) {
            let Some(team) = refused.file.file_stem().map(|s| s.to_string_lossy()) else {
                continue;
            };
            let Some(grant) = config.grants.get(team.as_ref()) else {
                continue;
            };
            if !grant.sources.iter().any(|s| s == source) {
                continue;
            }
            if !grant.owns.is_empty() {
                routes
                    .0
                    .push(Route::waiting_for(&team, grant, true, 0).map_err(anyhow::Error::msg)?);
            }
            routes
                .0
                .push(Route::waiting_for(&team, grant, false, 0).map_err(anyhow::Error::msg)?);
        }
        // From here on a route's index is its place in this relay's list
        // (the plugin handles and quarantine slots follow it).
        for (i, r) in routes.0.iter_mut().enumerate() {
            r.index = i;
        }
        let loads = routes.0.iter().map(|r| {
            async move {
                if let Some(team) = r.waiting_team() {
                    let handle = PluginHandle::waiting(
                        runtime,
                        std::path::Path::new(""),
                        serde_json::Value::Null,
                        Limits::of(&r.config),
                    );
                    let why = format!(
                        "team `{team}`'s file is refused and no last known good copy of it runs: \
                         the events its grant selects wait for it"
                    );
                    return anyhow::Ok((Arc::new(handle), None, None, Some(why)));
                }
                let pc = config.plugins.get(&r.config.plugin).ok_or_else(|| {
                    anyhow::anyhow!("routes.{}: no plugin `{}`", r.name(), r.config.plugin)
                })?;
                let limits = Limits::of(&r.config);
                let path = loaded.resolve(&pc.path);
                let (handle, error) =
                    match load_plugin(runtime, path.clone(), r.config.config.clone(), limits).await
                    {
                        Ok(h) => (h, None),
                        Err(e) => (
                            PluginHandle::waiting(runtime, &path, r.config.config.clone(), limits),
                            Some(format!("plugin {}: {e:#}", path.display())),
                        ),
                    };
                let shadow = match &pc.shadow {
                    None => None,
                    Some(file) => {
                        let path = loaded.resolve(file);
                        let cfg = pc
                            .shadow_config
                            .clone()
                            .unwrap_or_else(|| r.config.config.clone());
                        match load_plugin(runtime, path.clone(), cfg, limits).await {
                            Ok(handle) => Some(Shadow {
                                plugin: Arc::new(handle),
                                file: path.display().to_string(),
                            }),
                            Err(e) => {
                                tracing::warn!(route = %r.name(), "shadow plugin {} not loaded, the route runs without it: {e:#}", path.display());
                                None
                            }
                        }
                    }
                };
                anyhow::Ok((Arc::new(handle), shadow, pc.reload_interval, error))
            }
        });
        let mut out = RoutePlugins {
            routes: Routes(Vec::new()),
            plugins: Vec::new(),
            shadows: Vec::new(),
            reload: Vec::new(),
            errors: Vec::new(),
        };
        for (handle, shadow, interval, error) in futures::future::try_join_all(loads).await? {
            out.plugins.push(handle);
            out.shadows.push(shadow);
            out.reload.push(interval);
            out.errors.push(error);
        }
        out.routes = routes;
        Ok(out)
    }
}

impl Relay {
    /// Build the relay of source `source`: the routes that read it, their
    /// plugins, over the process's shared `sinks` (see [`build_sinks`]).
    pub async fn build(
        loaded: &Loaded,
        source: &str,
        store: Arc<Store>,
        sinks: Sinks,
        health: Arc<Health>,
    ) -> Result<Self> {
        let runtime = Runtime::new(loaded.cache_dir())?;
        let plugins = RoutePlugins::load(loaded, source, &runtime).await?;
        Self::assemble(loaded, source, store, sinks, health, plugins)
    }

    /// [`Relay::build`] from plugins already loaded.
    pub fn assemble(
        loaded: &Loaded,
        source: &str,
        store: Arc<Store>,
        sinks: Sinks,
        health: Arc<Health>,
        loaded_routes: RoutePlugins,
    ) -> Result<Self> {
        let config = &loaded.config;
        let RoutePlugins {
            routes,
            plugins,
            shadows,
            reload,
            errors,
        } = loaded_routes;
        let plugin_parts = routes
            .0
            .iter()
            .zip(&errors)
            .map(|(r, error)| {
                let part = health.plugin_part(r.name());
                match error {
                    None => {
                        part.set_up();
                    }
                    Some(e) => {
                        tracing::error!(route = %r.name(), "plugin not loaded, the route's events wait until its file loads: {e}");
                        part.set_down(e.clone());
                    }
                }
                part
            })
            .collect();
        let routes = Arc::new(routes);
        store.set_routes(routes.0.iter().map(|r| r.name().to_string()).collect());
        let store_config = config.source(source)?.clone();
        let relay_id = store.relay_id().to_string();
        let table = store_config.table().name;
        let pipeline = Pipeline {
            routes: routes.clone(),
            sinks: sinks.clone(),
            ordering: config.relay.ordering,
            publish_timeout: config.relay.publish_timeout,
            source: ce_source(config, source, &table),
        };
        Ok(Relay {
            source: source.to_string(),
            quarantine: Quarantine::new(&routes),
            store,
            routes,
            plugins,
            plugin_parts,
            shadows,
            reload,
            sinks,
            pipeline,
            config: config.relay.clone(),
            health,
            handing_over: std::sync::atomic::AtomicBool::new(false),
            asleep: watch::Sender::new(false),
            recorded_asleep: std::sync::atomic::AtomicBool::new(false),
            recording: tokio::sync::Mutex::new(()),
            pace: Default::default(),
            hurry: Notify::new(),
            failed_changed: Notify::new(),
            listening: std::sync::atomic::AtomicBool::new(false),
            leads: std::sync::atomic::AtomicBool::new(false),
            planning_only: false,
            capture: store_config.logical(source),
            store_key: config.source_key(source),
            store_table: store_config.table(),
            relay_id,
            store_config,
            in_flight: InFlight::default(),
        })
    }
}

impl Relay {
    /// A relay that only plans (reconciliation): this one's store, routes
    /// and plugins (a plugin reloaded here is reloaded there), no sinks, no
    /// shadows, a quarantine of its own; its plugin calls count in no
    /// metric and quarantine nothing.
    pub fn planner(&self) -> Relay {
        let sinks: Sinks = Arc::new(std::collections::BTreeMap::new());
        Relay {
            source: self.source.clone(),
            quarantine: Quarantine::new(&self.routes),
            store: self.store.clone(),
            routes: self.routes.clone(),
            plugins: self.plugins.clone(),
            plugin_parts: self.plugin_parts.clone(),
            shadows: self.routes.0.iter().map(|_| None).collect(),
            reload: self.reload.clone(),
            pipeline: Pipeline {
                routes: self.routes.clone(),
                sinks: sinks.clone(),
                ordering: self.pipeline.ordering,
                publish_timeout: self.pipeline.publish_timeout,
                source: self.pipeline.source.clone(),
            },
            sinks,
            config: self.config.clone(),
            health: self.health.clone(),
            handing_over: std::sync::atomic::AtomicBool::new(false),
            asleep: watch::Sender::new(false),
            recorded_asleep: std::sync::atomic::AtomicBool::new(false),
            recording: tokio::sync::Mutex::new(()),
            pace: Default::default(),
            hurry: Notify::new(),
            failed_changed: Notify::new(),
            listening: std::sync::atomic::AtomicBool::new(false),
            leads: std::sync::atomic::AtomicBool::new(false),
            planning_only: true,
            capture: self.capture.clone(),
            store_key: self.store_key.clone(),
            store_table: self.store_table.clone(),
            relay_id: self.relay_id.clone(),
            store_config: self.store_config.clone(),
            in_flight: InFlight::default(),
        }
    }

    /// Whether this relay holds the source's first lane (see [`Relay::leads`]).
    pub fn leads(&self) -> bool {
        self.leads.load(std::sync::atomic::Ordering::Acquire)
    }
}
