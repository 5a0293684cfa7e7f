//! Team files: a platform team owns the main file (sources, sinks, and a
//! grant per team); each service team owns a file of its plugins and routes,
//! pulled in with `include = ["teams/*.toml"]`.
//!
//! A grant says what a team's routes may do: which sources they may read
//! and which topic/subject patterns on which sinks they may publish to. A
//! team file is refused — naming the file and key — when it declares
//! anything but `team`, `plugins` and `routes`; when its team has no grant;
//! when a route reads a source or allows a sink or pattern outside the
//! grant; when it uses a plugin it does not declare; or when a route or
//! plugin name is already taken by another file (a team cannot replace
//! another team's routes). A team route without `sources` reads the
//! grant's sources. Plugin paths are relative to the team file.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use figment::Figment;
use figment::providers::{Format, Toml};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{Config, ConfigError, PluginConfig, RouteConfig};

/// What one team's routes may do (`[grants.<team>]` in the main file).
#[derive(Debug, Clone, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Grant {
    /// Sources the team's routes may read.
    #[serde(default)]
    pub sources: Vec<String>,
    /// Per sink, the topic/subject patterns the team's routes may allow
    /// (a route's pattern must lie within one of them).
    #[serde(default)]
    pub allow: BTreeMap<String, Vec<String>>,
}

/// A team file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct TeamFile {
    team: String,
    #[serde(default)]
    plugins: BTreeMap<String, PluginConfig>,
    #[serde(default)]
    routes: Vec<RouteConfig>,
}

/// Where a merged route or plugin was declared.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Origins {
    /// Per merged route index: (file, index in that file) for team routes.
    pub routes: Vec<Option<(PathBuf, usize)>>,
    /// Per plugin name declared in a team file: that file.
    pub plugins: BTreeMap<String, PathBuf>,
    /// The directories `include` looks in (a file added there is a change).
    pub dirs: Vec<PathBuf>,
}

impl Origins {
    /// The file and key a problem with merged `key` belongs to.
    pub fn locate(&self, main: &str, key: &str) -> (String, String) {
        if let Some(rest) = key.strip_prefix("routes[")
            && let Some((n, tail)) = rest.split_once(']')
            && let Ok(i) = n.parse::<usize>()
            && let Some(Some((file, local))) = self.routes.get(i)
        {
            return (file.display().to_string(), format!("routes[{local}]{tail}"));
        }
        if let Some(rest) = key.strip_prefix("plugins.") {
            let name = rest.split('.').next().unwrap_or(rest);
            if let Some(file) = self.plugins.get(name) {
                return (file.display().to_string(), key.to_string());
            }
        }
        (main.to_string(), key.to_string())
    }
}

/// The files `include` names, in order (`dir/*.toml` style: wildcards in
/// the file name only), relative to `base`.
fn expand(base: &Path, pattern: &str) -> Result<Vec<PathBuf>, String> {
    let full = if Path::new(pattern).is_absolute() {
        PathBuf::from(pattern)
    } else {
        base.join(pattern)
    };
    let (Some(dir), Some(name)) = (full.parent(), full.file_name()) else {
        return Err(format!("`{pattern}` names no file"));
    };
    let name = name.to_string_lossy();
    if dir.to_string_lossy().contains(['*', '?', '[']) {
        return Err(format!(
            "`{pattern}`: wildcards are allowed in the file name only"
        ));
    }
    if !name.contains(['*', '?', '[']) {
        return if full.is_file() {
            Ok(vec![full])
        } else {
            Err(format!("{} does not exist", full.display()))
        };
    }
    let glob = globset::Glob::new(&name)
        .map_err(|e| format!("`{pattern}`: {e}"))?
        .compile_matcher();
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut out: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && p.file_name().is_some_and(|n| glob.is_match(n)))
        .collect();
    out.sort();
    Ok(out)
}

/// Does route pattern `inner` only ever match what grant pattern `outer`
/// matches? (`*`: a run of characters without `.`; `**`: anything.)
pub fn within(inner: &str, outer: &str) -> bool {
    #[derive(Clone, Copy, PartialEq)]
    enum T {
        Lit(char),
        Star,
        DoubleStar,
    }
    fn tokens(p: &str) -> Vec<T> {
        let mut out = Vec::new();
        let mut it = p.chars().peekable();
        while let Some(c) = it.next() {
            if c == '*' {
                if it.peek() == Some(&'*') {
                    it.next();
                    out.push(T::DoubleStar);
                } else {
                    out.push(T::Star);
                }
            } else {
                out.push(T::Lit(c));
            }
        }
        out
    }
    fn m(outer: &[T], inner: &[T]) -> bool {
        match outer.first() {
            None => inner.is_empty(),
            Some(T::Lit(c)) => inner.first() == Some(&T::Lit(*c)) && m(&outer[1..], &inner[1..]),
            Some(T::Star) => {
                // Consume a run of inner tokens that never cross a `.`.
                for k in 0..=inner.len() {
                    if m(&outer[1..], &inner[k..]) {
                        return true;
                    }
                    match inner.get(k) {
                        Some(T::Lit('.')) | Some(T::DoubleStar) | None => return false,
                        _ => {}
                    }
                }
                false
            }
            Some(T::DoubleStar) => (0..=inner.len()).any(|k| m(&outer[1..], &inner[k..])),
        }
    }
    m(&tokens(outer), &tokens(inner))
}

/// Read the includes of `config` and merge their plugins and routes into
/// it. Returns the files read, where each merged item came from, and the
/// problems (file, key, reason) of the team files.
pub fn merge(config: &mut Config, base: &Path) -> (Vec<PathBuf>, Origins, Vec<ConfigError>) {
    let mut files = Vec::new();
    let mut dirs = Vec::new();
    let mut origins = Origins {
        routes: vec![None; config.routes.len()],
        plugins: BTreeMap::new(),
        dirs: Vec::new(),
    };
    let mut problems = Vec::new();
    let mut route_files: BTreeMap<String, String> = config
        .routes
        .iter()
        .map(|r| (r.name.clone(), "the main file".to_string()))
        .collect();
    let mut plugin_files: BTreeMap<String, String> = config
        .plugins
        .keys()
        .map(|p| (p.clone(), "the main file".to_string()))
        .collect();
    let mut teams_seen: BTreeMap<String, PathBuf> = BTreeMap::new();
    for (n, pattern) in config.include.clone().iter().enumerate() {
        if let Some(dir) = base.join(pattern).parent() {
            dirs.push(dir.to_path_buf());
        }
        let found = match expand(base, pattern) {
            Ok(f) => f,
            Err(reason) => {
                problems.push(ConfigError {
                    file: "-".into(),
                    key: format!("include[{n}]"),
                    reason,
                });
                continue;
            }
        };
        for file in found {
            let shown = file.display().to_string();
            let mut bad = |key: String, reason: String| {
                problems.push(ConfigError {
                    file: shown.clone(),
                    key,
                    reason,
                })
            };
            let team: TeamFile = match Figment::new().merge(Toml::file_exact(&file)).extract() {
                Ok(t) => t,
                Err(e) => {
                    for e in e {
                        let key = if e.path.is_empty() {
                            "-".into()
                        } else {
                            e.path.join(".")
                        };
                        let reason = match e.kind {
                            figment::error::Kind::UnknownField(f, _) => format!(
                                "unknown field `{f}`: a team file declares `team`, `plugins` and `routes` only \
                                 (sources, sinks and grants belong to the main file)"
                            ),
                            k => k.to_string(),
                        };
                        bad(key, reason);
                    }
                    files.push(file);
                    continue;
                }
            };
            let dir = file.parent().map(Path::to_path_buf).unwrap_or_default();
            if let Some(other) = teams_seen.insert(team.team.clone(), file.clone()) {
                bad(
                    "team".into(),
                    format!(
                        "team `{}` is already declared by {}",
                        team.team,
                        other.display()
                    ),
                );
            }
            let Some(grant) = config.grants.get(&team.team).cloned() else {
                bad(
                    "team".into(),
                    format!(
                        "team `{}` has no grant: the main file needs [grants.{}]",
                        team.team, team.team
                    ),
                );
                files.push(file);
                continue;
            };
            for (name, mut plugin) in team.plugins {
                if let Some(owner) = plugin_files.get(&name) {
                    bad(
                        format!("plugins.{name}"),
                        format!("plugin name `{name}` is already declared by {owner}"),
                    );
                    continue;
                }
                if plugin.path.is_relative() {
                    plugin.path = dir.join(&plugin.path);
                }
                plugin_files.insert(name.clone(), shown.clone());
                origins.plugins.insert(name.clone(), file.clone());
                config.plugins.insert(name, plugin);
            }
            for (i, mut route) in team.routes.into_iter().enumerate() {
                let key = |f: &str| format!("routes[{i}].{f}");
                if let Some(owner) = route_files.get(&route.name) {
                    bad(
                        key("name"),
                        format!(
                            "route `{}` is already declared by {owner}: a team file cannot replace another file's route",
                            route.name
                        ),
                    );
                    continue;
                }
                if origins.plugins.get(&route.plugin) != Some(&file) {
                    bad(
                        key("plugin"),
                        format!(
                            "plugin `{}` is not declared in this file (a team's routes use the team's own plugins)",
                            route.plugin
                        ),
                    );
                }
                if route.sources.is_empty() {
                    if grant.sources.is_empty() {
                        bad(
                            key("sources"),
                            format!(
                                "team `{}`'s grant names no sources: its routes can read none",
                                team.team
                            ),
                        );
                        continue;
                    }
                    route.sources = grant.sources.clone();
                }
                for s in &route.sources {
                    if !grant.sources.contains(s) {
                        bad(
                            key("sources"),
                            format!(
                                "source `{s}` is outside team `{}`'s grant (sources: {})",
                                team.team,
                                grant.sources.join(", ")
                            ),
                        );
                    }
                }
                for (sink, patterns) in &route.allow {
                    let Some(granted) = grant.allow.get(sink) else {
                        bad(
                            format!("routes[{i}].allow.{sink}"),
                            format!("sink `{sink}` is outside team `{}`'s grant", team.team),
                        );
                        continue;
                    };
                    for p in patterns {
                        if !granted.iter().any(|g| within(p, g)) {
                            bad(
                                format!("routes[{i}].allow.{sink}"),
                                format!(
                                    "pattern `{p}` reaches outside team `{}`'s grant on `{sink}` ({})",
                                    team.team,
                                    granted.join(", ")
                                ),
                            );
                        }
                    }
                }
                route_files.insert(route.name.clone(), shown.clone());
                origins.routes.push(Some((file.clone(), i)));
                config.routes.push(route);
            }
            files.push(file);
        }
    }
    for (team, grant) in &config.grants {
        for s in &grant.sources {
            let shorthand = config.store.is_some() && s == super::DEFAULT_SOURCE;
            if !(config.sources.contains_key(s) || shorthand) {
                problems.push(ConfigError {
                    file: "-".into(),
                    key: format!("grants.{team}.sources"),
                    reason: format!("no source named `{s}`"),
                });
            }
        }
        for sink in grant.allow.keys() {
            if !config.sinks.contains_key(sink) {
                problems.push(ConfigError {
                    file: "-".into(),
                    key: format!("grants.{team}.allow.{sink}"),
                    reason: format!("no sink named `{sink}`"),
                });
            }
        }
    }
    origins.dirs = dirs;
    (files, origins, problems)
}

#[cfg(test)]
mod tests {
    use super::within;

    #[test]
    fn route_patterns_within_grants() {
        assert!(within("payments.*", "payments.*"));
        assert!(within("payments.refund", "payments.*"));
        assert!(within("payments.a.b", "payments.**"));
        assert!(within("payments.**", "payments.**"));
        assert!(within("payments.*", "payments.**"));
        assert!(!within("payments.**", "payments.*"), "** crosses dots");
        assert!(!within("payments.a.b", "payments.*"));
        assert!(!within("*", "payments.*"));
        assert!(!within("orders.x", "payments.*"));
        assert!(!within("payments.*.x", "payments.*"));
        assert!(within("pay*", "pay*"));
        assert!(!within("p*", "pay*"));
    }
}
