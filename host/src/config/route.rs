//! `[plugins.<name>]` and `[[routes]]`: which events a route selects, the
//! plugin it calls, where its messages may go, and what it may spend (its
//! limits, retries and quarantine). Grants and ceilings on team routes are
//! in `teams.rs`.

use super::*;

/// A WebAssembly routing plugin.
#[derive(PartialEq, Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PluginConfig {
    /// Path to the compiled component (`.wasm`), relative to the config file.
    pub path: PathBuf,
    /// Check the file for changes this often and switch to a new version
    /// without restart. Unset: no hot reload.
    #[serde(default, with = "humantime_serde")]
    #[schemars(with = "Option<String>")]
    pub reload_interval: Option<Duration>,
    /// A candidate version (`.wasm`, relative to the config file) run on the
    /// same live events as this one: its answers are compared with the
    /// active version's and never published (`outroute_shadow_events_total`,
    /// `outroute_shadow_differences_total`, `outroute plugin shadow-report`).
    /// `outroute plugin promote <plugin>` makes it the active version.
    #[serde(default)]
    pub shadow: Option<PathBuf>,
    /// The candidate's route config (JSON), when it differs from the
    /// route's `config`.
    #[serde(default)]
    pub shadow_config: Option<serde_json::Value>,
}

/// What a failed event does to the later events of its aggregate.
#[derive(Debug, Clone, Copy, Deserialize, Serialize, JsonSchema, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum OnFailure {
    /// Later events of the aggregate wait until an operator retries or
    /// discards the failed one.
    #[default]
    Block,
    /// Later events continue; the failure is recorded.
    Skip,
}

/// Selects events and names the plugin that routes them. Routes are
/// subscriptions: every route whose selection matches an event gets it,
/// with its own plugin call, messages, retries, failures and per-aggregate
/// order; the event is marked once every one of them delivered it.
#[derive(PartialEq, Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// Route name (metrics label, failed-event filter): 1–128 letters,
    /// digits, `-`, `_` or `.`.
    pub name: String,
    /// Glob patterns over the aggregate type (default: all).
    #[serde(default = "match_all")]
    pub aggregate_types: Vec<String>,
    /// Glob patterns over the event type (default: all).
    #[serde(default = "match_all")]
    pub event_types: Vec<String>,
    /// Sources (`[sources.<name>]`) whose events this route selects.
    /// Unset: every source.
    #[serde(default)]
    pub sources: Vec<String>,
    /// This route alone gets the events it selects: routes that are not
    /// exclusive do not get them, though they select them too (every
    /// exclusive route that selects an event gets it). A team route may be
    /// exclusive only over aggregate types its grant `owns`.
    #[serde(default)]
    pub exclusive: bool,
    /// The team that answers for this route's failed events: shown by
    /// `failed list`/`show` and `status`, on the failed-events gauge and in
    /// every dead letter. A team route's owner is its team (the file's
    /// name says which; a team file may not name another); a route of the
    /// main file names one, or is the platform team's (`platform`).
    #[serde(default)]
    pub owner: Option<String>,
    /// How to reach the owner when its events fail: a channel, an on-call
    /// alias (free text, at most 256 characters, one line).
    #[serde(default)]
    pub owner_contact: Option<String>,
    /// Where a failed event of this route is told about: one message on
    /// this sink and topic/subject when the event enters the failed state —
    /// its payload and headers, the reason, attempts, route, plugin,
    /// owner and first error time (`outroute-failure-*` headers; see the
    /// operations guide). Acknowledged like any message: until the dead
    /// letter is, the event is not recorded failed but retried (holding its
    /// aggregate). A team route's dead-letter topic must lie within its
    /// grant. Unset: failed events are only recorded.
    #[serde(default)]
    pub dead_letter: Option<DeadLetter>,
    /// Name of a plugin in `[plugins]`.
    pub plugin: String,
    /// Static configuration handed to the plugin's `init` (any JSON).
    #[serde(default)]
    pub config: serde_json::Value,
    /// Sinks this route may publish to, each with the topic/subject glob
    /// patterns allowed (`*` any run of characters but `.`, `**` anything).
    pub allow: BTreeMap<String, Vec<String>>,
    /// CPU time one event may use in the plugin, measured as the CPU time of
    /// the thread running it (so a busy host does not eat the budget); a
    /// call is also stopped at 10× this in wall time. A batch call gets this
    /// times its size. Plugins cannot block: sleeps and clock waits return
    /// at once.
    #[serde(default = "default_cpu_budget", with = "humantime_serde")]
    #[schemars(with = "String")]
    pub cpu_budget: Duration,
    /// Memory cap per plugin instance, in MiB: all its linear memories and
    /// tables together.
    #[serde(default = "default_memory_mib")]
    pub memory_mib: u32,
    /// Idle plugin instances are kept warm for reuse up to this many MiB of
    /// their memory together; the rest are dropped after use.
    #[serde(default = "default_max_idle_memory_mib")]
    pub max_idle_memory_mib: u32,
    /// Most `host.log` lines one event may write; one more fails the event
    /// (guest stderr is not counted: it is kept as a small ring buffer of
    /// the last bytes and quoted in failure reasons).
    #[serde(default = "default_max_log_lines_per_event")]
    pub max_log_lines_per_event: u32,
    /// Most `host.log` bytes one event may write.
    #[serde(default = "default_max_log_bytes_per_event")]
    pub max_log_bytes_per_event: u64,
    /// After this many events in a row break a limit of the route (CPU
    /// budget, memory, messages, bytes or log lines per event), the route is
    /// quarantined: its plugin is no longer called and its events wait
    /// (no attempt counted) while other routes flow, until a probe event
    /// gets through or `outroute route resume`. 0: never quarantine.
    #[serde(default = "default_quarantine_after")]
    pub quarantine_after: u32,
    /// How often a quarantined route lets one event through as a probe.
    #[serde(
        default = "default_quarantine_probe_interval",
        with = "humantime_serde"
    )]
    #[schemars(with = "String")]
    pub quarantine_probe_interval: Duration,
    /// Attempts before an event goes to the failed state. Counts plugin
    /// rejections, traps and permanent broker refusals; a broker that is
    /// merely unavailable is retried with backoff until it is back.
    #[serde(default = "default_max_attempts")]
    pub max_attempts: u32,
    /// First retry delay; doubles each attempt, with jitter.
    #[serde(default = "default_backoff_min", with = "humantime_serde")]
    #[schemars(with = "String")]
    pub backoff_min: Duration,
    /// Largest retry delay.
    #[serde(default = "default_backoff_max", with = "humantime_serde")]
    #[schemars(with = "String")]
    pub backoff_max: Duration,
    /// `block` (default) or `skip`.
    #[serde(default)]
    pub on_failure: OnFailure,
    /// Most messages one event may produce (a fan-out bomb fails its event
    /// with the reason instead of flooding the sinks).
    #[serde(default = "default_max_messages_per_event")]
    pub max_messages_per_event: u32,
    /// Most payload bytes all messages of one event may carry together.
    #[serde(default = "default_max_bytes_per_event")]
    pub max_bytes_per_event: u64,
    /// Kafka key of a message whose plugin set neither key nor partition:
    /// `aggregate-id` (default; one aggregate stays on one partition, so in
    /// order) or `none` (spread over partitions; no per-aggregate order).
    #[serde(default)]
    pub default_key: DefaultKey,
}

/// A route's dead-letter destination (`dead_letter = { sink, topic }`).
#[derive(PartialEq, Eq, Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DeadLetter {
    /// A sink in `[sinks]`.
    pub sink: String,
    /// The Kafka topic or NATS subject (a name, no wildcards).
    pub topic: String,
}

/// The owner of a main-file route that names none: the platform team,
/// which owns the main file.
pub const PLATFORM_OWNER: &str = "platform";

impl RouteConfig {
    /// Who answers for this route's failed events (see [`RouteConfig::owner`]).
    pub fn owner(&self) -> &str {
        self.owner.as_deref().unwrap_or(PLATFORM_OWNER)
    }
}

/// The Kafka key a route gives messages the plugin left without one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, JsonSchema, Default)]
#[serde(rename_all = "kebab-case")]
pub enum DefaultKey {
    /// The event's aggregate id.
    #[default]
    AggregateId,
    /// No key: librdkafka's partitioner spreads the messages.
    None,
}

fn default_max_messages_per_event() -> u32 {
    100
}

fn default_max_idle_memory_mib() -> u32 {
    64
}

fn default_max_log_lines_per_event() -> u32 {
    100
}

fn default_max_log_bytes_per_event() -> u64 {
    64 << 10
}

fn default_quarantine_after() -> u32 {
    5
}

fn default_quarantine_probe_interval() -> Duration {
    Duration::from_secs(30)
}

fn default_max_bytes_per_event() -> u64 {
    16 << 20
}

fn match_all() -> Vec<String> {
    vec!["*".into()]
}

fn default_cpu_budget() -> Duration {
    Duration::from_millis(50)
}

fn default_memory_mib() -> u32 {
    64
}

fn default_max_attempts() -> u32 {
    10
}

fn default_backoff_min() -> Duration {
    Duration::from_millis(500)
}

fn default_backoff_max() -> Duration {
    Duration::from_secs(300)
}

/// What is wrong with a route's `owner`, `owner_contact` and
/// `dead_letter`: (field, reason).
pub(super) fn owner_problems(
    r: &RouteConfig,
    sinks: &BTreeMap<String, SinkConfig>,
) -> Vec<(&'static str, String)> {
    let mut out = Vec::new();
    if let Some(owner) = &r.owner
        && (owner.trim().is_empty()
            || owner.chars().count() > 128
            || owner.chars().any(char::is_control))
    {
        // A metric label and a message header (a team's name is its
        // owner, so no stricter than a team name).
        out.push((
            "owner",
            format!("owner {owner:?} must be one line of 1–128 characters"),
        ));
    }
    if let Some(contact) = &r.owner_contact
        && (contact.chars().count() > 256 || contact.chars().any(char::is_control))
    {
        out.push((
            "owner_contact",
            "must be one line of at most 256 characters".into(),
        ));
    }
    if let Some(dl) = &r.dead_letter {
        match sinks.get(&dl.sink) {
            None => out.push((
                "dead_letter.sink",
                format!("no sink named `{}` in [sinks]", dl.sink),
            )),
            Some(sink) => {
                let wild = dl.topic.contains(['*', '?', '[', ']', '{', '}', '>']);
                if dl.topic.is_empty() || wild {
                    out.push((
                        "dead_letter.topic",
                        format!(
                            "`{}` is not a topic/subject name (one name, no wildcards)",
                            dl.topic
                        ),
                    ));
                } else if let Err(e) = super::validate::check_pattern_for(sink, &dl.topic) {
                    out.push(("dead_letter.topic", e));
                }
            }
        }
    }
    out
}
