//! Team files: a platform team owns the main file (sources, sinks, and a
//! grant per team); each service team owns a file of its plugins and routes,
//! pulled in with `include = ["teams/*.toml"]`.
//!
//! A grant says what a team's routes may do: which sources (and, if it
//! says so, which aggregate/event types) they may read, which topic/subject
//! patterns on which sinks they may publish to, which directories their
//! plugin files may be in, and how much they may spend (ceilings). A
//! team file is named after its team (`teams/payments.toml` is team
//! `payments`): who a file speaks for is the platform's to say, never the
//! file's. A team file is refused — naming the file and key — when its
//! name is not its team's; when it declares anything but `team`,
//! `plugins` and `routes`; when its team has no grant; when a route reads a
//! source or allows a sink or pattern outside the grant; when it uses a
//! plugin it does not declare; when a route or plugin name is already taken
//! by another file (a team cannot replace another team's routes); or when
//! the config's checks fail on something it declares. A team route without
//! `sources` reads the grant's sources. Plugin paths are relative to the
//! team file and must stay in its directory or a grant's `plugin_dirs`
//! (after `..` and symlinks).
//!
//! **A refused team file costs only its team.** The other teams' files are
//! merged as usual; the refused team runs its last known good copy (kept
//! beside the plugin cache each time its file is accepted, so a restart has
//! it too) or, without one, does not run: its events wait.
//!
//! Files: this one merges the team files into the config; `grants.rs` (beside
//! it) holds the grants and the checks of a team's routes against them,
//! `teams/last_good.rs` the copies of accepted files, `teams/paths.rs`
//! where a team's files may be.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use figment::Figment;
use figment::providers::{Format, Toml};
use serde::Deserialize;

use super::grants::*;
use super::{Config, ConfigError, PluginConfig, RouteConfig};

mod last_good;
mod paths;
pub use last_good::remember;
use last_good::*;
use paths::*;

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

/// A team file that was refused: its problems (file, key, reason), and
/// whether its team runs its last known good copy instead.
#[derive(Debug, Clone)]
pub struct Refused {
    /// The team file (or, for a team whose file is missing, where it was
    /// last read from).
    pub file: PathBuf,
    pub problems: Vec<ConfigError>,
    /// The team's last known good copy runs in its place; `false`: the
    /// team's routes do not run (their events wait).
    pub last_good: bool,
}

/// What merging the team files gave.
#[derive(Debug, Default)]
pub struct Merged {
    /// Every team file read.
    pub files: Vec<PathBuf>,
    pub origins: Origins,
    /// Problems of the main file (`include`, `grants`): the configuration
    /// is refused.
    pub problems: Vec<ConfigError>,
    /// Team files refused: each costs only its own team.
    pub refused: Vec<Refused>,
    /// Team files accepted as they are, with their text: the copies
    /// [`remember`] keeps as each team's last known good.
    pub accepted: Vec<(String, PathBuf, String)>,
}

/// Everything merged so far; a team file is tried on a copy and kept only
/// if it brings no problem.
#[derive(Clone)]
struct State {
    config: Config,
    origins: Origins,
    /// Route and plugin names → the file that declared them.
    route_files: BTreeMap<String, String>,
    plugin_files: BTreeMap<String, String>,
    /// Team → its file.
    teams: BTreeMap<String, PathBuf>,
    /// The main file's directory (grants' `plugin_dirs` are relative to it).
    base: PathBuf,
}

/// Read the includes of `config` and merge their plugins and routes into
/// it. Each team file is merged on its own: one with a problem — unreadable,
/// invalid, claiming another team's name, reaching outside its grant, or
/// failing `validate` (the whole config's checks, run with it merged; only
/// problems located in that file count) — is refused, and its team runs the
/// last known good copy kept under `last_good` (see [`remember`]) if that
/// copy still passes, or not at all. A team with a grant and no file runs
/// its last known good copy too.
pub fn merge(
    config: &mut Config,
    base: &Path,
    main: &str,
    last_good: Option<&Path>,
    validate: &dyn Fn(&Config) -> Vec<(String, String)>,
) -> Merged {
    let mut merged = Merged::default();
    let mut state = State {
        route_files: config
            .routes
            .iter()
            .map(|r| (r.name.clone(), "the main file".to_string()))
            .collect(),
        plugin_files: config
            .plugins
            .keys()
            .map(|p| (p.clone(), "the main file".to_string()))
            .collect(),
        origins: Origins {
            routes: vec![None; config.routes.len()],
            plugins: BTreeMap::new(),
            dirs: Vec::new(),
        },
        teams: BTreeMap::new(),
        base: base.to_path_buf(),
        config: config.clone(),
    };
    let mut dirs = Vec::new();
    for (n, pattern) in config.include.clone().iter().enumerate() {
        if let Some(dir) = base.join(pattern).parent() {
            dirs.push(dir.to_path_buf());
        }
        let found = match expand(base, pattern) {
            Ok(f) => f,
            Err(reason) => {
                merged.problems.push(ConfigError {
                    file: main.into(),
                    key: format!("include[{n}]"),
                    reason,
                });
                continue;
            }
        };
        for file in found {
            let text = std::fs::read_to_string(&file);
            let problems = match &text {
                Ok(text) => try_file(&mut state, &file, text, main, validate),
                Err(e) => vec![ConfigError {
                    file: file.display().to_string(),
                    key: "-".into(),
                    reason: format!("cannot read the file: {e}"),
                }],
            };
            match text {
                Ok(text) if problems.is_empty() => {
                    let team = state
                        .teams
                        .iter()
                        .find(|(_, f)| **f == file)
                        .map(|(t, _)| t.clone())
                        .unwrap_or_default();
                    merged.accepted.push((team, file.clone(), text));
                }
                _ => {
                    let team = file
                        .file_stem()
                        .map(|s| s.to_string_lossy().into_owned())
                        .unwrap_or_default();
                    let last_good = run_last_good(&mut state, &team, last_good, main, validate);
                    merged.refused.push(Refused {
                        file: file.clone(),
                        problems,
                        last_good,
                    });
                }
            }
            merged.files.push(file);
        }
    }
    // A team with a grant and no file (deleted, or a deploy that lost it):
    // its last known good copy, if any.
    let missing: Vec<String> = config
        .grants
        .keys()
        .filter(|t| !state.teams.contains_key(*t))
        .filter(|t| {
            !merged
                .refused
                .iter()
                .any(|r| r.file.file_stem().is_some_and(|s| s == t.as_str()))
        })
        .cloned()
        .collect();
    for team in missing {
        // A team never onboarded has no copy either: nothing to say.
        let Some((file, _)) = last_good.and_then(|d| read_last_good(d, &team)) else {
            continue;
        };
        let ran = run_last_good(&mut state, &team, last_good, main, validate);
        merged.refused.push(Refused {
            problems: vec![ConfigError {
                file: file.display().to_string(),
                key: "-".into(),
                reason: if ran {
                    format!(
                        "team `{team}` has a grant but no team file: its last known good copy runs \
                         (remove [grants.{team}] to retire the team)"
                    )
                } else {
                    format!(
                        "team `{team}` has a grant but no team file, and its last known good copy no longer \
                         passes: its routes do not run"
                    )
                },
            }],
            file,
            last_good: ran,
        });
    }
    for (key, reason) in ownership_problems(&config.grants) {
        merged.problems.push(ConfigError {
            file: main.into(),
            key,
            reason,
        });
    }
    for (team, grant) in &config.grants {
        for (key, reason) in grant_ceiling_problems(config, team, grant) {
            merged.problems.push(ConfigError {
                file: main.into(),
                key,
                reason,
            });
        }
        for s in &grant.sources {
            let shorthand = config.store.is_some() && s == super::DEFAULT_SOURCE;
            if !(config.sources.contains_key(s) || shorthand) {
                merged.problems.push(ConfigError {
                    file: main.into(),
                    key: format!("grants.{team}.sources"),
                    reason: format!("no source named `{s}`"),
                });
            }
        }
        for sink in grant.allow.keys() {
            if !config.sinks.contains_key(sink) {
                merged.problems.push(ConfigError {
                    file: main.into(),
                    key: format!("grants.{team}.allow.{sink}"),
                    reason: format!("no sink named `{sink}`"),
                });
            }
        }
    }
    state.origins.dirs = dirs;
    *config = state.config;
    merged.origins = state.origins;
    merged
}

/// Merge team file `file` (its `text`) on a copy of `state` and check the
/// result; keep it only without problems. Returns the problems.
fn try_file(
    state: &mut State,
    file: &Path,
    text: &str,
    main: &str,
    validate: &dyn Fn(&Config) -> Vec<(String, String)>,
) -> Vec<ConfigError> {
    let mut trial = state.clone();
    let mut problems = merge_one(&mut trial, file, text);
    if problems.is_empty() {
        let shown = file.display().to_string();
        for (key, reason) in validate(&trial.config) {
            let (f, key) = trial.origins.locate(main, &key);
            if f == shown {
                problems.push(ConfigError {
                    file: f,
                    key,
                    reason,
                });
            }
        }
    }
    if problems.is_empty() {
        *state = trial;
    }
    problems
}

/// Merge one team file's `text` into `state`; the problems found.
fn merge_one(state: &mut State, file: &Path, text: &str) -> Vec<ConfigError> {
    let shown = file.display().to_string();
    let mut problems = Vec::new();
    let mut bad = |key: String, reason: String| {
        problems.push(ConfigError {
            file: shown.clone(),
            key,
            reason,
        })
    };
    let team: TeamFile = match Figment::new().merge(Toml::string(text)).extract() {
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
            return problems;
        }
    };
    // Who a file speaks for is the platform's to say: a team file is named
    // after its team, so `teams/payments.toml` can only be team payments.
    let stem = file
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    if stem != team.team {
        bad(
            "team".into(),
            format!(
                "this file says team `{}`, but a team file must be named after its team (`{}.toml`): \
                 a file can never speak for another team",
                team.team, team.team
            ),
        );
        return problems;
    }
    let dir = file.parent().map(Path::to_path_buf).unwrap_or_default();
    if let Some(other) = state.teams.get(&team.team) {
        bad(
            "team".into(),
            format!(
                "team `{}` is already declared by {}",
                team.team,
                other.display()
            ),
        );
        return problems;
    }
    let Some(grant) = state.config.grants.get(&team.team).cloned() else {
        bad(
            "team".into(),
            format!(
                "team `{}` has no grant: the main file needs [grants.{}]",
                team.team, team.team
            ),
        );
        return problems;
    };
    state.teams.insert(team.team.clone(), file.to_path_buf());
    for (name, mut plugin) in team.plugins {
        if let Some(owner) = state.plugin_files.get(&name) {
            bad(
                format!("plugins.{name}"),
                format!("plugin name `{name}` is already declared by {owner}"),
            );
            continue;
        }
        // Relative to the team file, the shadow too (`plugin promote`
        // moves the shadow's value into `path` of this same file).
        if plugin.path.is_relative() {
            plugin.path = dir.join(&plugin.path);
        }
        if let Some(shadow) = plugin.shadow.as_mut()
            && shadow.is_relative()
        {
            *shadow = dir.join(&*shadow);
        }
        // Only the team's own directory, and those its grant names: a team
        // cannot run (or point a promote at) a file it does not own.
        let allowed: Vec<PathBuf> = std::iter::once(dir.clone())
            .chain(grant.plugin_dirs.iter().map(|d| state.base.join(d)))
            .collect();
        let shown_dirs = || {
            allowed
                .iter()
                .map(|d| d.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        };
        for (field, path) in [
            ("path", Some(&plugin.path)),
            ("shadow", plugin.shadow.as_ref()),
        ] {
            let Some(path) = path else { continue };
            if !confined(path, &allowed) {
                bad(
                    format!("plugins.{name}.{field}"),
                    format!(
                        "{} is outside team `{}`'s directories ({}; more only through grants.{}.plugin_dirs)",
                        path.display(),
                        team.team,
                        shown_dirs(),
                        team.team
                    ),
                );
            }
        }
        state.plugin_files.insert(name.clone(), shown.clone());
        state
            .origins
            .plugins
            .insert(name.clone(), file.to_path_buf());
        state.config.plugins.insert(name, plugin);
    }
    for (i, mut route) in team.routes.into_iter().enumerate() {
        let key = |f: &str| format!("routes[{i}].{f}");
        if let Some(owner) = state.route_files.get(&route.name) {
            bad(
                key("name"),
                format!(
                    "route `{}` is already declared by {owner}: a team file cannot replace another file's route",
                    route.name
                ),
            );
            continue;
        }
        if state
            .origins
            .plugins
            .get(&route.plugin)
            .map(PathBuf::as_path)
            != Some(file)
        {
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
        // What the team may read: a route at the default selection reads
        // exactly the grant's; one of its own must stay inside it.
        for (field, granted, patterns) in [
            (
                "aggregate_types",
                &grant.aggregate_types,
                &mut route.aggregate_types,
            ),
            ("event_types", &grant.event_types, &mut route.event_types),
        ] {
            let Some(granted) = granted else { continue };
            if patterns.as_slice() == ["*"] {
                patterns.clone_from(granted);
                continue;
            }
            for p in patterns.iter() {
                if !granted
                    .iter()
                    .any(|g| within(&name_pattern(p), &name_pattern(g)))
                {
                    bad(
                        key(field),
                        format!(
                            "pattern `{p}` selects events outside team `{}`'s grant ({field}: {})",
                            team.team,
                            granted.join(", ")
                        ),
                    );
                }
            }
        }
        // Keeping a copy from other teams is the owner's right only.
        if route.exclusive {
            for p in &route.aggregate_types {
                if !grant
                    .owns
                    .iter()
                    .any(|o| within(&name_pattern(p), &name_pattern(o)))
                {
                    bad(
                        key("exclusive"),
                        if grant.owns.is_empty() {
                            format!(
                                "team `{}` owns no aggregate types (grants.{}.owns): its routes cannot be exclusive",
                                team.team, team.team
                            )
                        } else {
                            format!(
                                "aggregate type pattern `{p}` is not owned by team `{}` (grants.{}.owns: {}): \
                                 a route can be exclusive only over what its team owns",
                                team.team,
                                team.team,
                                grant.owns.join(", ")
                            )
                        },
                    );
                }
            }
        }
        for (field, reason) in route_ceiling_problems(&state.config, &team.team, &grant, &route) {
            bad(key(&field), reason);
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
        // A dead letter is a message like any other: only where the grant
        // lets the team publish.
        if let Some(dl) = &route.dead_letter {
            let granted = grant.allow.get(&dl.sink);
            if !granted.is_some_and(|g| g.iter().any(|g| within(&dl.topic, g))) {
                bad(
                    key("dead_letter"),
                    format!(
                        "`{}` on sink `{}` is outside team `{}`'s grant ({})",
                        dl.topic,
                        dl.sink,
                        team.team,
                        granted.map_or("no patterns on that sink".to_string(), |g| g.join(", "))
                    ),
                );
            }
        }
        // Who answers for the route's failures is the team the file is
        // named after, never what the file says.
        match &route.owner {
            Some(owner) if owner != &team.team => bad(
                key("owner"),
                format!(
                    "owner `{owner}` is not team `{}`: a team's routes are owned by the team",
                    team.team
                ),
            ),
            _ => route.owner = Some(team.team.clone()),
        }
        state.route_files.insert(route.name.clone(), shown.clone());
        state.origins.routes.push(Some((file.to_path_buf(), i)));
        state.config.routes.push(route);
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::within;

    #[test]
    fn name_patterns_within_grants() {
        use super::name_pattern as n;
        assert!(within(&n("order"), &n("order*")));
        assert!(
            within(&n("order.v2"), &n("order*")),
            "`*` spans dots in names"
        );
        assert!(within(&n("order*"), &n("*")));
        assert!(!within(&n("*"), &n("order*")));
        assert!(!within(&n("payment"), &n("order*")));
        assert!(
            !within(&n("ord?r"), &n("order")),
            "unknown syntax is refused"
        );
    }

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
