//! `[relay]`, `[http]` and `[log]`: the settings of the relay process
//! itself (batching, leases, ordering, polling, shutdown, plugin cache; its
//! HTTP endpoints; its log). A reload that changes any of them is refused:
//! they need a restart.

use super::*;

/// Per-aggregate ordering mode. What each guarantees, per sink, is in the
/// docs/src/concepts/ordering.md; `pipeline.rs` is the code that keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, JsonSchema, Default)]
#[serde(rename_all = "lowercase")]
pub enum Ordering {
    /// Events of one aggregate are sent in outbox order, many in flight at
    /// once; a failing event holds back only the later events of its own
    /// aggregate. A broker that loses an earlier message after storing a
    /// later one (ack-time failure) is counted in
    /// `outroute_order_risk_total`; the later event is re-sent after it.
    #[default]
    Aggregate,
    /// At most one unacknowledged event per aggregate: the next event of an
    /// aggregate is sent only after the previous one was acknowledged, so
    /// first deliveries are always in order. Costs a broker round trip per
    /// repeated aggregate within a batch.
    Strict,
    /// No ordering: every event is independent (maximum parallelism).
    None,
}

#[derive(PartialEq, Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct RelayConfig {
    /// Identity of this relay instance (lease owner). Default: host-pid-random.
    pub id: Option<String>,
    /// Most events claimed per batch. Each worker starts at an eighth of it
    /// and doubles after every full batch (the first events after a start
    /// go out sooner).
    pub batch_size: u32,
    /// Most payload bytes one batch holds and publishes: a claim (and a
    /// captured batch) stops at the event whose payload reaches it, and
    /// the messages after the one that reaches it wait for the next batch
    /// (a batch is split, never failed, so large payloads or a
    /// fan-out-heavy route cannot balloon the relay's memory). Under
    /// `capture = "logical"` the relay holds at most
    /// `(concurrency × 2 + 1) × max_batch_bytes` of captured events, plus
    /// 16 messages read ahead.
    pub max_batch_bytes: u64,
    /// Batches worked on at once (a worker claims from the owned lanes no
    /// other worker has a batch in flight from;
    /// under `capture = "logical"`, a share of the aggregates).
    pub concurrency: u32,
    /// Number of ordering lanes (aggregates are hashed onto lanes; each lane
    /// has one owner at a time). Must be the same for every relay of a table.
    pub lanes: u32,
    /// How long a lane lease lasts without renewal.
    #[serde(with = "humantime_serde")]
    #[schemars(with = "String")]
    pub lease_ttl: Duration,
    /// Shortest pause between polls while events keep arriving.
    #[serde(with = "humantime_serde")]
    #[schemars(with = "String")]
    pub poll_min: Duration,
    /// Longest pause between polls when the outbox is idle, and between a
    /// slow source's polls (its worker 0 alone polls it, about once per gap
    /// between its events, up to this). A source on the pending queue falls
    /// asleep from there after a second or two without events (it polls no
    /// more until an insert notifies it); one that cannot sleep backs off
    /// further, to `poll_idle_max`.
    #[serde(with = "humantime_serde")]
    #[schemars(with = "String")]
    pub poll_max: Duration,
    /// Longest pause between polls of an idle source that cannot sleep: a
    /// table on a lane index (`published_at`, `status` or `delete` marking)
    /// has no trigger to wake it. Its pause keeps doubling past `poll_max`
    /// up to this, so an idle one costs each worker one claim per
    /// `poll_idle_max`, and its first event after a quiet spell waits up
    /// to that long (at once, with `notify_channel`). Never below
    /// `poll_max`.
    #[serde(with = "humantime_serde")]
    #[schemars(with = "String")]
    pub poll_idle_max: Duration,
    /// The most connections this relay opens to its PostgreSQL sources'
    /// databases together: each source's pool gets an equal share (less
    /// one for its LISTEN connection; never more than the source's own
    /// `max_connections`), so many sources cannot exhaust a server between
    /// them. At least 3 per PostgreSQL source (2 pooled, so marks never
    /// wait behind claims, and the LISTEN one). A sleeping source holds
    /// one; pools open connections on demand and close them after 5 s
    /// unused. Unset: no relay-wide ceiling (each source up to its own
    /// `max_connections`, plus LISTEN).
    pub max_connections: Option<u32>,
    /// Also LISTEN on this channel (producers must `NOTIFY` it; this taxes
    /// producer commits, see the guide, "Deploying and running"). Off by default.
    pub notify_channel: Option<String>,
    /// Ordering mode: `aggregate` (default), `strict` or `none`.
    pub ordering: Ordering,
    /// How long SIGTERM (or a reload that changes a source) waits for
    /// in-flight batches; then they are stopped, their rows left pending.
    #[serde(with = "humantime_serde")]
    #[schemars(with = "String")]
    pub shutdown_timeout: Duration,
    /// How long a broker may take to acknowledge before the event is retried.
    #[serde(with = "humantime_serde")]
    #[schemars(with = "String")]
    pub publish_timeout: Duration,
    /// The relay reports not-ready when the backlog is non-empty and nothing
    /// was published for this long.
    #[serde(with = "humantime_serde")]
    #[schemars(with = "String")]
    pub stall_after: Duration,
    /// Delete published rows after this long (aged by `published_at`, or by
    /// `created_at` under `status` and `queue` marking; nothing to delete
    /// under `delete`). Unset: keep them.
    #[serde(default, with = "humantime_serde")]
    #[schemars(with = "Option<String>")]
    pub retention: Option<Duration>,
    /// Reconcile continuously: this often, the relay holding the source's
    /// first lane checks the events published since its last check (up to
    /// `reconcile_settle` ago) against what their topics hold, as
    /// `outroute reconcile` does, and exports `outroute_reconcile_missing`
    /// and friends. Each check plans the window's events again and reads
    /// its topics back (memory and plugin time in proportion to the
    /// window's events). Unset: off.
    #[serde(default, with = "humantime_serde")]
    #[schemars(with = "Option<String>")]
    pub reconcile_every: Option<Duration>,
    /// How old an event must be before the scheduled reconciliation checks
    /// it: younger ones may still be on their way or unmarked.
    #[serde(with = "humantime_serde")]
    #[schemars(with = "String")]
    pub reconcile_settle: Duration,
    /// Directory for compiled plugin artifacts (native code, verified by a
    /// MAC before use; must be private to the relay's user). Default:
    /// `$HOME/.cache/outroute/plugins`.
    pub cache_dir: Option<PathBuf>,
    /// Keep compiled plugins on disk. `false`: compile in memory at every
    /// start (slower starts, nothing on disk).
    pub plugin_cache: bool,
    /// Check the config file and its includes this often and reload when
    /// one changed (as SIGHUP does). Unset: only on SIGHUP.
    #[serde(default, with = "humantime_serde")]
    #[schemars(with = "Option<String>")]
    pub config_watch_interval: Option<Duration>,
    /// The most a team file's route may set for each of its limits (CPU
    /// budget, memory, log volume, messages, bytes, quarantine threshold);
    /// a grant may lower them for its team, never raise them. Unset fields:
    /// the built-in maxima.
    pub route_ceilings: grants::Ceilings,
}

impl Default for RelayConfig {
    fn default() -> Self {
        RelayConfig {
            id: None,
            batch_size: 500,
            max_batch_bytes: 64 << 20,
            concurrency: 2,
            lanes: 64,
            lease_ttl: Duration::from_secs(10),
            poll_min: Duration::from_millis(1),
            poll_max: Duration::from_millis(100),
            poll_idle_max: Duration::from_secs(1),
            max_connections: None,
            notify_channel: None,
            ordering: Ordering::Aggregate,
            shutdown_timeout: Duration::from_secs(10),
            publish_timeout: Duration::from_secs(30),
            stall_after: Duration::from_secs(60),
            retention: None,
            reconcile_every: None,
            reconcile_settle: Duration::from_secs(60),
            cache_dir: None,
            plugin_cache: true,
            config_watch_interval: None,
            route_ceilings: grants::Ceilings::default(),
        }
    }
}

#[derive(PartialEq, Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct HttpConfig {
    /// Address for `/metrics`, `/healthz`, `/readyz`. Empty: no server.
    pub listen: String,
    /// Bearer token for the endpoints that show event content (`/shadow`):
    /// a request must send `Authorization: Bearer <token>`. Unset: those
    /// endpoints answer 401 to everyone. `/metrics`, `/healthz` and
    /// `/readyz` stay open. Better from `OUTROUTE_HTTP__TOKEN` or
    /// `token_file` than in the file.
    pub token: Option<Secret>,
    /// A file holding `token` (a mounted secret).
    pub token_file: Option<PathBuf>,
    /// The operator console at `/console` (`console/mod.rs`): off unless
    /// this section names at least one token.
    pub console: Option<ConsoleConfig>,
}

/// `[http.console]`: who may sign in to the operator console, with what
/// role, and for which team. Changing it needs a restart, like the rest
/// of `[http]`.
#[derive(PartialEq, Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct ConsoleConfig {
    /// Sign-in tokens by name (the name is who the audit log records):
    /// `[http.console.tokens.payments] role = "operator", team = "payments",
    /// token_file = "/run/secrets/console-payments"`. A token from the
    /// environment: `OUTROUTE_HTTP__CONSOLE__TOKENS__PAYMENTS__TOKEN`.
    pub tokens: BTreeMap<String, ConsoleToken>,
    /// How long a sign-in lasts before the token is asked for again.
    #[serde(with = "humantime_serde")]
    #[schemars(with = "String")]
    pub session_ttl: Duration,
}

impl Default for ConsoleConfig {
    fn default() -> Self {
        ConsoleConfig {
            tokens: BTreeMap::new(),
            session_ttl: Duration::from_secs(8 * 3600),
        }
    }
}

/// `[http.console]`: a console with no token would be off though asked
/// for; a short token is guessable; one token under two names would make
/// its role a matter of chance.
impl ConsoleConfig {
    pub(super) fn check(&self, no_listener: bool, err: &mut impl FnMut(String, String)) {
        let console = self;
        if no_listener {
            err(
                "http.console".into(),
                "needs an HTTP listener: http.listen is empty".into(),
            );
        }
        if console.tokens.is_empty() {
            err(
                "http.console.tokens".into(),
                "names no token, so nobody could sign in: add one (e.g. [http.console.tokens.ops] \
             role = \"operator\", token_file = \"…\") or remove [http.console]"
                    .into(),
            );
        }
        if console.session_ttl < Duration::from_secs(60) {
            err(
                "http.console.session_ttl".into(),
                "must be at least 1m".into(),
            );
        }
        let mut seen: BTreeMap<&str, &str> = BTreeMap::new();
        for (name, t) in &console.tokens {
            let key = format!("http.console.tokens.{name}");
            let name_ok = !name.is_empty()
                && name.len() <= 64
                && name
                    .chars()
                    .all(|ch| ch.is_ascii_alphanumeric() || ch == '_' || ch == '-');
            if !name_ok {
                err(
                    key.clone(),
                    "token names use letters, digits, `_` and `-` (at most 64)".into(),
                );
            }
            if let Some(team) = &t.team
                && (!team.starts_with(|ch: char| ch.is_ascii_alphanumeric())
                    || team.len() > 64
                    || !team.chars().all(|ch| {
                        ch.is_ascii_alphanumeric() || ch == '_' || ch == '-' || ch == '.'
                    }))
            {
                err(
                    format!("{key}.team"),
                    "is not a team name (a letter or digit, then letters, digits, `_`, `-`, `.`)"
                        .into(),
                );
            }
            match &t.token {
                None => err(
                    format!("{key}.token"),
                    "is not set (set token_file, or OUTROUTE_HTTP__CONSOLE__TOKENS__<NAME>__TOKEN)"
                        .into(),
                ),
                Some(s) if s.expose().chars().count() < 16 => err(
                    format!("{key}.token"),
                    "is shorter than 16 characters: too easy to guess".into(),
                ),
                Some(s) => {
                    if let Some(other) = seen.insert(s.expose(), name) {
                        err(
                            format!("{key}.token"),
                            format!("is the same as tokens.{other}'s: give each its own"),
                        );
                    }
                }
            }
        }
    }
}

/// One console token: its role and, for a team's token, its team.
#[derive(PartialEq, Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ConsoleToken {
    pub role: ConsoleRole,
    /// Only this team's routes and their events (the routes whose `owner`
    /// it is). Unset: every route.
    #[serde(default)]
    pub team: Option<String>,
    /// The token itself (at least 16 characters); better from the
    /// environment or `token_file`.
    #[serde(default)]
    pub token: Option<Secret>,
    /// A file holding `token` (a mounted secret).
    #[serde(default)]
    pub token_file: Option<PathBuf>,
}

/// What a console token may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ConsoleRole {
    /// Sees state, counts and failure reasons; never a payload or header
    /// value; acts on nothing.
    Viewer,
    /// Sees payloads and headers; retries and discards failed events,
    /// resumes quarantined routes (within its team, if it has one).
    Operator,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            listen: "127.0.0.1:9464".into(),
            token: None,
            token_file: None,
            console: None,
        }
    }
}

#[derive(Debug, Clone, Copy, Deserialize, Serialize, JsonSchema, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Human,
    Json,
}

#[derive(PartialEq, Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    pub format: LogFormat,
    /// `tracing` filter, e.g. `info,outroute=debug`. `RUST_LOG` wins.
    pub level: String,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            format: LogFormat::Human,
            level: "info".into(),
        }
    }
}
