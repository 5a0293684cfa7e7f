//! Loading: the main file, environment overrides (`OUTROUTE_<TABLE>__<KEY>`),
//! included team files and secrets, into a validated [`Loaded`] config or
//! every problem as `file:key: reason` ([`ConfigErrors`]); and the JSON
//! Schema of the file.

use super::*;

/// One configuration problem: where and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub file: String,
    pub key: String,
    pub reason: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}: {}", self.file, self.key, self.reason)
    }
}

/// All problems found in a configuration file.
#[derive(Debug)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

/// A loaded, validated configuration plus the directory relative paths are
/// resolved against.
#[derive(Debug, Clone)]
pub struct Loaded {
    pub config: Config,
    pub base_dir: PathBuf,
    /// The files read: the config file, then its includes.
    pub files: Vec<PathBuf>,
    /// What `relay.config_watch_interval` watches: the files, and the
    /// directories includes are looked for in (a new team file).
    pub watched: Vec<PathBuf>,
    /// Team files refused: each costs only its team, which runs its last
    /// known good copy or not at all (`config/teams.rs`).
    pub refused: Vec<teams::Refused>,
    /// Team files accepted, `(team, file, text)`: the last known good
    /// copies `outroute run` keeps.
    pub accepted_teams: Vec<(String, PathBuf, String)>,
}

impl Loaded {
    /// Who answers for the failed events of `route` (its config's owner; a
    /// refused team's stand-in route `team:<team>`, that team) and how to
    /// reach them; `-` for no route or one no longer configured.
    pub fn owner_of(&self, route: Option<&str>) -> (String, Option<String>) {
        let Some(route) = route else {
            return ("-".into(), None);
        };
        if let Some(team) = route.strip_prefix("team:") {
            return (team.to_string(), None);
        }
        self.config
            .routes
            .iter()
            .find(|r| r.name == route)
            .map_or(("-".into(), None), |r| {
                (r.owner().to_string(), r.owner_contact.clone())
            })
    }

    /// A path from the config, resolved relative to the config file.
    pub fn resolve(&self, p: &Path) -> PathBuf {
        if p.is_absolute() {
            p.to_path_buf()
        } else {
            self.base_dir.join(p)
        }
    }

    /// Where each team's last known good team file is kept: beside the
    /// compiled plugins, one directory per main file. `None` without a
    /// plugin cache on disk.
    pub fn last_good_dir(&self) -> Option<PathBuf> {
        use sha2::Digest;
        let main = self.files.first()?;
        let main = main.canonicalize().unwrap_or_else(|_| main.clone());
        let hash = sha2::Sha256::digest(main.to_string_lossy().as_bytes());
        let key: String = hash[..8].iter().map(|b| format!("{b:02x}")).collect();
        Some(self.cache_dir()?.join("last-good").join(key))
    }

    /// Connections that would cross a network unverified, one line each.
    pub fn transport_warnings(&self) -> Vec<String> {
        security::transport_warnings(&self.config)
    }

    /// One line per refused team file: what runs instead and why.
    pub fn refused_lines(&self) -> Vec<String> {
        self.refused
            .iter()
            .map(|r| {
                format!(
                    "team file {} refused ({}): {}",
                    r.file.display(),
                    if r.last_good {
                        "its last known good copy runs"
                    } else {
                        "its routes do not run, their events wait"
                    },
                    r.problems
                        .iter()
                        .map(|p| format!("{}: {}", p.key, p.reason))
                        .collect::<Vec<_>>()
                        .join("; ")
                )
            })
            .collect()
    }

    /// Log the refused team files, count them, and keep the accepted ones
    /// as last known good (`outroute run`, at start and after a reload).
    pub fn report_teams(&self) {
        for line in self.refused_lines() {
            tracing::error!("{line}");
        }
        metrics::gauge!(crate::metrics::TEAM_FILES_REFUSED).set(self.refused.len() as f64);
        self.remember_good_teams();
    }

    /// Keep every accepted team file as its team's last known good copy
    /// (`outroute run`, at start and after each reload).
    pub fn remember_good_teams(&self) {
        let Some(dir) = self.last_good_dir() else {
            return;
        };
        if let Err(e) = teams::remember(&dir, &self.accepted_teams) {
            tracing::warn!(
                "could not keep the team files as last known good under {}: {e}",
                dir.display()
            );
        }
    }

    /// Where compiled plugins are cached; `None`: not on disk (disabled, or
    /// no `HOME` — never a shared temporary directory).
    pub fn cache_dir(&self) -> Option<PathBuf> {
        if !self.config.relay.plugin_cache {
            return None;
        }
        match &self.config.relay.cache_dir {
            Some(d) => Some(self.resolve(d)),
            None => default_plugin_cache(),
        }
    }
}

/// `$HOME/.cache/outroute/plugins`, or `None` without `HOME` (plugins are
/// then compiled in memory; a shared `/tmp` would let others plant code).
pub fn default_plugin_cache() -> Option<PathBuf> {
    let dir = std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .map(|h| PathBuf::from(h).join(".cache/outroute/plugins"));
    if dir.is_none() {
        tracing::warn!("HOME is not set: compiled plugins are not cached on disk");
    }
    dir
}

/// Read `file`, apply `OUTROUTE_*` environment overrides, validate.
pub fn load(file: &Path) -> Result<Loaded, ConfigErrors> {
    let shown = file.display().to_string();
    if !file.exists() {
        return Err(ConfigErrors(vec![ConfigError {
            file: shown,
            key: "-".into(),
            reason: "file not found".into(),
        }]));
    }
    let figment = Figment::new()
        .merge(Toml::file_exact(file))
        // Only `OUTROUTE_<TABLE>__<KEY>` names are config overrides; other
        // OUTROUTE_* variables (OUTROUTE_CONFIG, test hooks) are not.
        .merge(
            Env::prefixed("OUTROUTE_")
                .filter(|k| k.as_str().contains("__"))
                .split("__"),
        );
    let mut config: Config = figment.extract().map_err(|e| {
        ConfigErrors(
            e.into_iter()
                .map(|e| {
                    let from_env = matches!(
                        e.metadata.as_ref().map(|m| m.name.as_ref()),
                        Some(n) if n.contains("environment")
                    );
                    ConfigError {
                        file: if from_env {
                            "environment".into()
                        } else {
                            shown.clone()
                        },
                        key: if e.path.is_empty() {
                            "-".into()
                        } else {
                            key_of(&e.path)
                        },
                        reason: {
                            let reason = e.kind.to_string();
                            // `OUTROUTE_ROUTES__0__…` makes a map, never a list.
                            if from_env && reason.contains("expected a sequence") {
                                format!(
                                    "{reason}: lists (such as `routes`) cannot be set or changed \
                                     from the environment, only in the file"
                                )
                            } else {
                                reason
                            }
                        },
                    }
                })
                .collect(),
        )
    })?;
    let base_dir = file
        .canonicalize()
        .ok()
        .and_then(|p| p.parent().map(Path::to_path_buf))
        .unwrap_or_else(|| PathBuf::from("."));
    let mut problems = Vec::new();
    match (config.store.take(), config.sources.is_empty()) {
        (Some(store), true) => {
            config.sources.insert(DEFAULT_SOURCE.into(), store);
            config.store_shorthand = true;
        }
        (Some(_), false) => problems.push((
            "store".to_string(),
            "use either [store] (one source) or [sources.<name>], not both".to_string(),
        )),
        (None, false) => {}
        (None, true) => problems.push((
            "store".to_string(),
            "no outbox configured: set [store] or [sources.<name>]".to_string(),
        )),
    }
    problems.extend(security::resolve(&mut config, &base_dir));
    // Each team file is merged on its own, checked with the config's own
    // checks; a refused one costs only its team (see `config/teams.rs`).
    let mut loaded = Loaded {
        config,
        files: vec![file.to_path_buf()],
        watched: Vec::new(),
        base_dir,
        refused: Vec::new(),
        accepted_teams: Vec::new(),
    };
    let last_good = loaded.last_good_dir();
    let validate = |c: &Config| {
        Loaded {
            config: c.clone(),
            files: Vec::new(),
            watched: Vec::new(),
            base_dir: loaded.base_dir.clone(),
            refused: Vec::new(),
            accepted_teams: Vec::new(),
        }
        .validate()
    };
    let mut config = loaded.config.clone();
    let merged = teams::merge(
        &mut config,
        &loaded.base_dir,
        &shown,
        last_good.as_deref(),
        &validate,
    );
    loaded.config = config;
    loaded.files.extend(merged.files);
    loaded.watched = loaded.files.clone();
    loaded.watched.extend(merged.origins.dirs.iter().cloned());
    loaded.refused = merged.refused;
    loaded.accepted_teams = merged.accepted;
    problems.extend(loaded.validate());
    let mut errors: Vec<ConfigError> = merged.problems;
    for (key, reason) in problems {
        let (file, key) = merged.origins.locate(&shown, &key);
        // A value an `OUTROUTE_…` variable set is the environment's fault,
        // not the file's.
        let (file, reason) = match env_var_of(&figment, &key) {
            Some(var) if file == shown => (
                "environment".to_string(),
                format!("{reason} (set by {var})"),
            ),
            _ => (file, reason),
        };
        if !errors.iter().any(|e| e.file == file && e.key == key) {
            errors.push(ConfigError { file, key, reason });
        }
    }
    if errors.is_empty() {
        Ok(loaded)
    } else {
        // The main file's problems, and with them every refused team
        // file's, so one run of `config check` shows them all.
        errors.extend(loaded.refused.into_iter().flat_map(|r| r.problems));
        Err(ConfigErrors(errors))
    }
}

/// The JSON Schema of the configuration file.
pub fn schema() -> serde_json::Value {
    serde_json::to_value(schemars::schema_for!(Config)).unwrap_or_default()
}

/// The `OUTROUTE_…` variable that set config `key` (`store.url`,
/// `routes[0].x`), if the environment set it.
fn env_var_of(figment: &Figment, key: &str) -> Option<String> {
    let dotted = key.replace('[', ".").replace(']', "");
    // Only a value, not a table: a table the file and a variable both set
    // keys of carries the variable's tag, though the file wrote the table.
    let is_table = matches!(
        figment.find_value(&dotted),
        Ok(figment::value::Value::Dict(..))
    );
    let from_env = !is_table
        && figment
            .find_metadata(&dotted)
            .is_some_and(|m| m.name.contains("environment"));
    from_env.then(|| format!("OUTROUTE_{}", dotted.to_uppercase().replace('.', "__")))
}

/// A key path as the other messages spell it: `routes[0].plugin`, not
/// `routes.0.plugin`.
pub(super) fn key_of(path: &[String]) -> String {
    let mut key = String::new();
    for part in path {
        if !key.is_empty() && part.parse::<usize>().is_ok() {
            key.push_str(&format!("[{part}]"));
        } else {
            if !key.is_empty() {
                key.push('.');
            }
            key.push_str(part);
        }
    }
    key
}
