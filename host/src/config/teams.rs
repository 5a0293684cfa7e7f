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
    /// The events the team's routes may read, by aggregate type (name
    /// patterns, `*` any run of characters). Unset: every event of the
    /// granted sources. A team route that leaves `aggregate_types` at its
    /// default (`["*"]`) selects exactly these; one that names its own must
    /// stay within them.
    #[serde(default)]
    pub aggregate_types: Option<Vec<String>>,
    /// The same, by event type.
    #[serde(default)]
    pub event_types: Option<Vec<String>>,
    /// The aggregate types the team owns (name patterns): its routes may be
    /// `exclusive` over them, so that no other team's route gets a copy.
    /// An aggregate type has one owner: two grants' patterns may not be
    /// the same or one within the other.
    #[serde(default)]
    pub owns: Vec<String>,
    /// Directories besides the team file's own that the team's plugin and
    /// shadow files may be in (relative to the main file), e.g. a shared
    /// directory of reviewed builds. A team plugin path that leads anywhere
    /// else, after `..` and symlinks are resolved, is refused.
    #[serde(default)]
    #[schemars(with = "Vec<String>")]
    pub plugin_dirs: Vec<PathBuf>,
    /// The most the team's routes may set for each limit (unset: the
    /// relay's `route_ceilings`; never above them).
    #[serde(default)]
    pub ceilings: Ceilings,
}

/// An aggregate/event type pattern in [`within`]'s terms: there `*` stops
/// at `.`, in a name pattern it does not.
fn name_pattern(p: &str) -> String {
    p.replace("**", "*").replace('*', "**")
}

/// The most a team's route may set for each of its limits, so that no
/// team can hold a shared source's batches (a minute of CPU per event) or
/// escape quarantine (`quarantine_after = 4000000000`). Set platform-wide in
/// `[relay.route_ceilings]` (unset fields: the built-in maxima below) and per
/// team in `[grants.<team>.ceilings]` (unset fields: the relay's), never
/// above the relay's. A team route above its ceiling is refused; routes of
/// the main file are the platform's own and are not bounded.
#[derive(Debug, Clone, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Ceilings {
    /// Highest `cpu_budget` (built-in: 1s).
    #[serde(default, with = "humantime_serde")]
    #[schemars(with = "Option<String>")]
    pub cpu_budget: Option<std::time::Duration>,
    /// Highest `memory_mib` (built-in: 512).
    #[serde(default)]
    pub memory_mib: Option<u32>,
    /// Highest `max_idle_memory_mib` (built-in: 512).
    #[serde(default)]
    pub max_idle_memory_mib: Option<u32>,
    /// Highest `max_log_lines_per_event` (built-in: 1000).
    #[serde(default)]
    pub max_log_lines_per_event: Option<u32>,
    /// Highest `max_log_bytes_per_event` (built-in: 1 MiB).
    #[serde(default)]
    pub max_log_bytes_per_event: Option<u64>,
    /// Highest `quarantine_after`; a team route cannot set 0 (never
    /// quarantine) either (built-in: 100).
    #[serde(default)]
    pub quarantine_after: Option<u32>,
    /// Highest `max_messages_per_event` (built-in: 1000).
    #[serde(default)]
    pub max_messages_per_event: Option<u32>,
    /// Highest `max_bytes_per_event` (built-in: 64 MiB).
    #[serde(default)]
    pub max_bytes_per_event: Option<u64>,
}

impl Ceilings {
    /// Each limit: its name, the ceiling this sets (if any) and what a
    /// route sets, as comparable numbers (durations in nanoseconds; a
    /// route's `quarantine_after = 0`, never, as infinite).
    fn fields(&self) -> [(&'static str, Option<u128>); 8] {
        [
            ("cpu_budget", self.cpu_budget.map(|d| d.as_nanos())),
            ("memory_mib", self.memory_mib.map(u128::from)),
            (
                "max_idle_memory_mib",
                self.max_idle_memory_mib.map(u128::from),
            ),
            (
                "max_log_lines_per_event",
                self.max_log_lines_per_event.map(u128::from),
            ),
            (
                "max_log_bytes_per_event",
                self.max_log_bytes_per_event.map(u128::from),
            ),
            ("quarantine_after", self.quarantine_after.map(u128::from)),
            (
                "max_messages_per_event",
                self.max_messages_per_event.map(u128::from),
            ),
            (
                "max_bytes_per_event",
                self.max_bytes_per_event.map(u128::from),
            ),
        ]
    }

    /// The built-in maxima.
    fn builtin() -> [u128; 8] {
        [
            std::time::Duration::from_secs(1).as_nanos(),
            512,
            512,
            1000,
            1 << 20,
            100,
            1000,
            64 << 20,
        ]
    }
}

fn route_limits(r: &RouteConfig) -> [u128; 8] {
    [
        r.cpu_budget.as_nanos(),
        u128::from(r.memory_mib),
        u128::from(r.max_idle_memory_mib),
        u128::from(r.max_log_lines_per_event),
        u128::from(r.max_log_bytes_per_event),
        match r.quarantine_after {
            0 => u128::MAX,
            n => u128::from(n),
        },
        u128::from(r.max_messages_per_event),
        u128::from(r.max_bytes_per_event),
    ]
}

/// A limit as the config writes it (durations in humantime).
fn shown(name: &str, v: u128) -> String {
    match name {
        "cpu_budget" => format!(
            "\"{}\"",
            humantime::format_duration(std::time::Duration::from_nanos(
                u64::try_from(v).unwrap_or(u64::MAX)
            ))
        ),
        "quarantine_after" if v == u128::MAX => "0 (never)".into(),
        _ => v.to_string(),
    }
}

/// What the relay allows at most, per limit: `[relay.route_ceilings]`, then
/// the built-in maxima.
fn relay_ceilings(config: &Config) -> [u128; 8] {
    let mut out = Ceilings::builtin();
    for (slot, (_, set)) in out.iter_mut().zip(config.relay.route_ceilings.fields()) {
        if let Some(v) = set {
            *slot = v;
        }
    }
    out
}

/// Grant problems: a ceiling above the relay's.
fn grant_ceiling_problems(config: &Config, team: &str, grant: &Grant) -> Vec<(String, String)> {
    let relay = relay_ceilings(config);
    grant
        .ceilings
        .fields()
        .iter()
        .zip(relay)
        .filter_map(|((name, set), max)| {
            let v = (*set)?;
            (v > max).then(|| {
                (
                    format!("grants.{team}.ceilings.{name}"),
                    format!(
                        "{} is above the relay's ceiling {} (relay.route_ceilings.{name})",
                        shown(name, v),
                        shown(name, max)
                    ),
                )
            })
        })
        .collect()
}

/// Grants whose `owns` overlap another's (an aggregate type has one
/// owner) or reach outside what the team may read: (key, reason).
fn ownership_problems(grants: &BTreeMap<String, Grant>) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let overlap = |a: &str, b: &str| {
        within(&name_pattern(a), &name_pattern(b)) || within(&name_pattern(b), &name_pattern(a))
    };
    for (i, (team, grant)) in grants.iter().enumerate() {
        let key = format!("grants.{team}.owns");
        for p in &grant.owns {
            if let Some(readable) = &grant.aggregate_types
                && !readable
                    .iter()
                    .any(|r| within(&name_pattern(p), &name_pattern(r)))
            {
                out.push((
                    key.clone(),
                    format!(
                        "`{p}` is outside what team `{team}` may read (grants.{team}.aggregate_types: {})",
                        readable.join(", ")
                    ),
                ));
            }
            for (other, theirs) in grants.iter().take(i) {
                if let Some(q) = theirs.owns.iter().find(|q| overlap(p, q)) {
                    out.push((
                        key.clone(),
                        format!(
                            "`{p}` overlaps `{q}`, owned by team `{other}`: an aggregate type has one owner"
                        ),
                    ));
                }
            }
        }
    }
    out
}

/// A team route's limits above its grant's ceilings: (field, reason).
fn route_ceiling_problems(
    config: &Config,
    team: &str,
    grant: &Grant,
    r: &RouteConfig,
) -> Vec<(String, String)> {
    let mut ceilings = relay_ceilings(config);
    for (slot, (_, set)) in ceilings.iter_mut().zip(grant.ceilings.fields()) {
        if let Some(v) = set {
            *slot = (*slot).min(v);
        }
    }
    let names = grant.ceilings.fields().map(|(n, _)| n);
    route_limits(r)
        .iter()
        .zip(ceilings)
        .zip(names)
        .filter(|((v, max), _)| **v > *max)
        .map(|((v, max), name)| {
            (
                name.to_string(),
                format!(
                    "{} is above team `{team}`'s ceiling {} (grants.{team}.ceilings.{name}, within relay.route_ceilings)",
                    shown(name, *v),
                    shown(name, max)
                ),
            )
        })
        .collect()
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

/// `path` as the file system resolves it: symlinks and `..` followed as
/// far as the path exists (a plugin file may not be there yet), the rest
/// taken as written.
fn resolved(path: &Path) -> PathBuf {
    if let Ok(p) = std::fs::canonicalize(path) {
        return p;
    }
    let mut rest = Vec::new();
    let mut at = path;
    while let Some(parent) = at.parent() {
        if let Some(name) = at.file_name() {
            rest.push(name.to_os_string());
        } else {
            // `..` or a root: cannot be taken apart without resolving.
            break;
        }
        if let Ok(p) = std::fs::canonicalize(parent) {
            return rest.iter().rev().fold(p, |p, n| p.join(n));
        }
        at = parent;
    }
    path.to_path_buf()
}

/// Is `path` (resolved) inside one of `dirs` (resolved)? A path with a
/// `..` left after resolving is never inside.
fn confined(path: &Path, dirs: &[PathBuf]) -> bool {
    let p = resolved(path);
    if p.components()
        .any(|c| matches!(c, std::path::Component::ParentDir))
    {
        return false;
    }
    dirs.iter().any(|d| p.starts_with(resolved(d)))
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

/// Run team `team`'s last known good copy, if there is one and it still
/// passes (the grant may have changed since). Whether it runs.
fn run_last_good(
    state: &mut State,
    team: &str,
    last_good: Option<&Path>,
    main: &str,
    validate: &dyn Fn(&Config) -> Vec<(String, String)>,
) -> bool {
    let Some((file, text)) = last_good.and_then(|d| read_last_good(d, team)) else {
        return false;
    };
    let problems = try_file(state, &file, &text, main, validate);
    if !problems.is_empty() {
        tracing::warn!(
            %team,
            "the last known good copy of team `{team}`'s file no longer passes either: {}",
            problems
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; ")
        );
    }
    problems.is_empty()
}

/// The first line of a last known good copy names the file it was read from.
const LAST_GOOD_HEADER: &str = "# outroute: last known good copy of ";

/// Team `team`'s last known good copy under `dir`: the file it was read
/// from (plugin paths resolve against its directory) and its text.
fn read_last_good(dir: &Path, team: &str) -> Option<(PathBuf, String)> {
    let text = std::fs::read_to_string(dir.join(format!("{team}.toml"))).ok()?;
    let (first, _) = text.split_once('\n')?;
    let file = PathBuf::from(first.strip_prefix(LAST_GOOD_HEADER)?);
    Some((file, text))
}

/// Keep each accepted team file as its team's last known good copy under
/// `dir` (written only when it changed; atomically).
pub fn remember(dir: &Path, accepted: &[(String, PathBuf, String)]) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    for (team, file, text) in accepted {
        let copy = format!("{LAST_GOOD_HEADER}{}\n{text}", file.display());
        let path = dir.join(format!("{team}.toml"));
        if std::fs::read_to_string(&path).is_ok_and(|old| old == copy) {
            continue;
        }
        let tmp = dir.join(format!(".{team}.toml.tmp"));
        std::fs::write(&tmp, copy)?;
        std::fs::rename(&tmp, &path)?;
    }
    Ok(())
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
