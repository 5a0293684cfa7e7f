//! Cross-checks of a loaded config: every reference resolves (routes →
//! plugins, sinks and sources), names and identifiers are safe, budgets are
//! in range. Each problem is a `(key, reason)`; [`super::load`] turns them
//! into `file:key: reason` lines and refuses the config.

use super::*;

impl Loaded {
    /// What `run` needs beyond a valid file: at least one route. (`migrate`,
    /// `status` and `failed` need only the store.)
    pub fn check_runnable(&self) -> Result<(), String> {
        if self.config.routes.is_empty() {
            return Err("routes: no routes: the relay would route nothing".into());
        }
        Ok(())
    }

    /// The checks of one source (`key`: `store` or `sources.<name>`).
    fn validate_source(&self, key: &str, sc: &StoreConfig, err: &mut impl FnMut(String, String)) {
        if sc.max_connections == 0 {
            err(
                format!("{key}.max_connections"),
                "must be at least 1".into(),
            );
        }
        if sc.statement_timeout.is_zero() {
            err(
                format!("{key}.statement_timeout"),
                "must be positive (0 would give up every statement)".into(),
            );
        }
        if !(sc.is_pooled() || sc.url.starts_with("sqlite:")) {
            err(
                format!("{key}.url"),
                format!(
                    "`{}` is not a postgres://, mysql:// (or mariadb://) or sqlite: URL",
                    redact_url(&sc.url)
                ),
            );
        }
        if sc.is_mysql() {
            let t = sc.table();
            if let Marking::Queue { .. } = t.marking {
                err(
                    format!("{key}.table.marking"),
                    "`queue` fills its list by an insert trigger, on PostgreSQL only; a MySQL/MariaDB table is \
                     marked by `published_at`, `status` or `delete`"
                        .into(),
                );
            }
            // Constants become SQL literals; what a backslash means
            // depends on the server's sql_mode, so neither it nor a quote
            // is accepted.
            let mut constants = vec![("aggregate_type_value", t.aggregate_type_value.clone())];
            if let Marking::Status {
                pending,
                sent,
                failed,
                ..
            } = &t.marking
            {
                constants.push(("marking.pending", Some(pending.clone())));
                constants.push(("marking.sent", Some(sent.clone())));
                constants.push(("marking.failed", failed.clone()));
            }
            for (k, v) in constants {
                if let Some(v) = v
                    && v.contains(['\'', '\\'])
                {
                    err(
                        format!("{key}.table.{k}"),
                        format!(
                            "`{v}` holds a quote or a backslash, which MySQL/MariaDB sources do not take"
                        ),
                    );
                }
            }
            if sc.capture == CaptureMode::Logical {
                err(
                    format!("{key}.capture"),
                    "`logical` is PostgreSQL's replication slot; MySQL/MariaDB sources use `lease` or `binlog`"
                        .into(),
                );
            }
            if sc.tls.is_some() {
                err(
                    format!("{key}.tls"),
                    "is for PostgreSQL; a MySQL URL sets TLS itself (`?ssl-mode=VERIFY_IDENTITY&ssl-ca=…`)"
                        .into(),
                );
            }
        }
        let t = &sc.table();
        let cols = t.columns();
        if let Err(e) = check_identifier(&t.name, true) {
            err(format!("{key}.table.name"), e);
        }
        for (k, v) in cols {
            if let Err(e) = check_identifier(v, false) {
                err(format!("{key}.table.{k}"), e);
            }
        }
        match &t.marking {
            Marking::PublishedAt { column } | Marking::Status { column, .. } => {
                if let Err(e) = check_identifier(column, false) {
                    err(format!("{key}.table.marking.column"), e);
                }
            }
            Marking::Queue { column } => {
                if let Some(c) = column
                    && let Err(e) = check_identifier(c, false)
                {
                    err(format!("{key}.table.marking.column"), e);
                }
                if t.sequence.is_none() {
                    err(
                        format!("{key}.table.marking"),
                        "style `queue` lists pending rows by sequence number: set `sequence` to a unique \
                         column the database fills (`outroute migrate --table --add-sequence` adds one)"
                            .into(),
                    );
                }
                if t.failed_at.is_none() {
                    err(
                        format!("{key}.table.failed_at"),
                        "style `queue` takes an event that failed for good off the queue, so the row must \
                         say it failed: set `failed_at` to a nullable timestamp column (without it the row \
                         would count as published, be purged by retention and re-sent by replay)"
                            .into(),
                    );
                }
                if sc.url.starts_with("sqlite:") || sc.capture == CaptureMode::Logical {
                    err(
                        format!("{key}.table.marking"),
                        "style `queue` is for PostgreSQL sources in lease mode (`capture = \"lease\"`)"
                            .into(),
                    );
                }
            }
            Marking::Delete => {
                if self.config.relay.retention.is_some() {
                    err(
                        "relay.retention".into(),
                        "has no effect with marking style `delete` (published rows are already gone)".into(),
                    );
                }
            }
        }
        if t.aggregate_type.is_none() && t.aggregate_type_value.is_none() {
            err(
                format!("{key}.table.aggregate_type_value"),
                "the table has no aggregate_type column; set a constant aggregate type here".into(),
            );
        }

        if let Some(l) = sc.lanes
            && (l == 0 || l > 4096)
        {
            err(format!("{key}.lanes"), "must be between 1 and 4096".into());
        }
        if sc.capture == CaptureMode::Binlog && !sc.is_mysql() {
            err(
                format!("{key}.capture"),
                "`binlog` reads MySQL/MariaDB's binary log; PostgreSQL sources use `lease` or `logical`, SQLite `lease`"
                    .into(),
            );
        }
        if sc.capture != CaptureMode::Logical {
            if sc.logical.is_some() {
                err(
                    format!("{key}.logical"),
                    "is only read with `capture = \"logical\"`".into(),
                );
            }
            return;
        }
        if sc.url.starts_with("sqlite:") {
            err(
                format!("{key}.capture"),
                "`logical` needs PostgreSQL (a replication slot); SQLite sources use `lease`"
                    .into(),
            );
        }
        let l = sc.logical.clone().unwrap_or_default();
        for (k, v) in [("slot", &l.slot), ("publication", &l.publication)] {
            if let Some(v) = v
                && (v.is_empty()
                    || v.len() > 63
                    || !v
                        .chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
            {
                err(
                    format!("{key}.logical.{k}"),
                    format!("`{v}`: use 1 to 63 of a-z, 0-9 and _"),
                );
            }
        }
        if l.input == LogicalInput::Table
            && l.cleanup == Cleanup::Delete
            && sc.table().sequence.is_none()
        {
            err(
                format!("{key}.logical.cleanup"),
                "`delete` removes captured rows by ranges of the sequence column and this table maps none: \
                 map `table.sequence` (`outroute migrate --table --add-sequence`) or set `cleanup = \"keep\"`"
                    .into(),
            );
        }
        if l.input == LogicalInput::Messages && sc.table.is_some() {
            err(
                format!("{key}.table"),
                "has no effect with `logical.input = \"messages\"` (events come from logical messages)".into(),
            );
        }
    }

    /// Every cross-reference and value check; returns `(key, reason)` pairs.
    pub fn validate(&self) -> Vec<(String, String)> {
        let c = &self.config;
        let mut p: Vec<(String, String)> = Vec::new();
        let mut err = |k: String, r: String| p.push((k, r));

        if c.relay.batch_size == 0 || c.relay.batch_size > 10_000 {
            err(
                "relay.batch_size".into(),
                "must be between 1 and 10000".into(),
            );
        }
        if c.relay.concurrency == 0 || c.relay.concurrency > 64 {
            err(
                "relay.concurrency".into(),
                "must be between 1 and 64".into(),
            );
        }
        if c.relay.lanes == 0 || c.relay.lanes > 4096 {
            err("relay.lanes".into(), "must be between 1 and 4096".into());
        }
        if c.relay.lease_ttl < Duration::from_secs(1) {
            err("relay.lease_ttl".into(), "must be at least 1s".into());
        }
        if c.relay.max_batch_bytes == 0 {
            err(
                "relay.max_batch_bytes".into(),
                "must be positive (0 would hold every event)".into(),
            );
        }
        if c.relay.publish_timeout.is_zero() {
            err("relay.publish_timeout".into(), "must be positive".into());
        }
        if c.relay
            .reconcile_every
            .is_some_and(|d| d < Duration::from_secs(1))
        {
            err(
                "relay.reconcile_every".into(),
                "must be at least 1s (each check plans its window again and reads its topics back)"
                    .into(),
            );
        }
        if let Err(e) = check_log_level(&c.log.level) {
            err("log.level".into(), e);
        }
        let listen = &c.http.listen;
        if !listen.is_empty()
            && !listen
                .rsplit_once(':')
                .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok())
        {
            err(
                "http.listen".into(),
                format!("`{listen}` is not host:port (e.g. 127.0.0.1:9464; empty: no HTTP server)"),
            );
        }
        if let Some(console) = &c.http.console {
            console.check(listen.is_empty(), &mut err);
        }
        if c.relay.poll_min > c.relay.poll_max {
            err(
                "relay.poll_min".into(),
                "must not exceed relay.poll_max".into(),
            );
        }
        if let Some(ch) = &c.relay.notify_channel
            && let Err(e) = check_identifier(ch, false)
        {
            err("relay.notify_channel".into(), e);
        }

        for (source, sc) in &c.sources {
            let key = c.source_key(source);
            if !c.store_shorthand
                && (source.is_empty()
                    || !source
                        .chars()
                        .all(|ch| ch.is_ascii_alphanumeric() || ch == '_' || ch == '-'))
            {
                err(
                    key.clone(),
                    "source names use letters, digits, `_` and `-`".into(),
                );
            }
            self.validate_source(&key, sc, &mut err);
        }
        let postgres_sources = c.sources.values().filter(|s| s.is_pooled()).count() as u32;
        if let Some(n) = c.relay.max_connections
            && n < 3 * postgres_sources.max(1)
        {
            err(
                "relay.max_connections".into(),
                format!(
                    "{n} is under 3 per PostgreSQL or MySQL source ({postgres_sources} of them: 2 pooled, so \
                     marks never wait behind claims, and PostgreSQL's LISTEN one): at least {}",
                    3 * postgres_sources.max(1)
                ),
            );
        }
        // Two sources on one table would share its leases and mark each
        // other's rows: one outbox, one source.
        let mut seen: BTreeMap<(String, String), &str> = BTreeMap::new();
        for (source, sc) in &c.sources {
            if let Some(first) = seen.insert(table_identity(&sc.url, &sc.table().name), source) {
                err(
                    c.source_key(source),
                    format!("reads the same table as source `{first}`: one outbox, one source"),
                );
            }
        }
        for (i, r) in c.routes.iter().enumerate() {
            for s in &r.sources {
                if !c.sources.contains_key(s) {
                    err(
                        format!("routes[{i}].sources"),
                        format!(
                            "no source named `{s}` (sources: {})",
                            c.sources.keys().cloned().collect::<Vec<_>>().join(", ")
                        ),
                    );
                }
            }
        }

        for (name, sink) in &c.sinks {
            if name.is_empty()
                || !name
                    .chars()
                    .all(|ch| ch.is_ascii_alphanumeric() || ch == '-' || ch == '_')
            {
                err(
                    format!("sinks.{name}"),
                    "sink names use letters, digits, `-` and `_`".into(),
                );
            }
            if sink.max_message_bytes() == 0 {
                err(
                    format!("sinks.{name}.max_message_bytes"),
                    "must be positive".into(),
                );
            }
            if let SinkConfig::Kafka(k) = sink {
                for key in k.options.keys() {
                    if let Some((_, why)) = super::KAFKA_PROTECTED_OPTIONS
                        .iter()
                        .find(|(p, _)| p == key)
                    {
                        err(
                            format!("sinks.{name}.options.\"{key}\""),
                            format!("outroute sets this itself ({why}); remove it"),
                        );
                    }
                }
            }
            if let SinkConfig::Nats(n) = sink {
                if let Err(e) = check_nats_url(&n.url) {
                    err(format!("sinks.{name}.url"), e);
                }
                if n.tls.as_ref().is_some_and(|t| t.insecure_skip_verify) {
                    err(
                        format!("sinks.{name}.tls.insecure_skip_verify"),
                        "is for Kafka sinks only: a NATS server's certificate is always checked \
                         (give its authority with tls.ca_file)"
                            .into(),
                    );
                }
                if n.max_in_flight == 0 {
                    err(
                        format!("sinks.{name}.max_in_flight"),
                        "must be at least 1".into(),
                    );
                }
                if let Some(cs) = &n.create_stream {
                    if cs.subjects.is_empty() {
                        err(
                            format!("sinks.{name}.create_stream.subjects"),
                            "lists no subject: the stream would capture nothing".into(),
                        );
                    }
                    for subject in &cs.subjects {
                        if subject.is_empty()
                            || subject.chars().any(char::is_whitespace)
                            || subject.split('.').any(str::is_empty)
                        {
                            err(
                                format!("sinks.{name}.create_stream.subjects"),
                                format!(
                                    "`{subject}` is not a NATS subject (tokens separated by `.`, none empty, no whitespace; `*` and `>` as wildcards)"
                                ),
                            );
                        }
                    }
                }
            }
            if let SinkConfig::Kafka(k) = sink
                && k.max_in_flight == 0
            {
                err(
                    format!("sinks.{name}.max_in_flight"),
                    "must be at least 1".into(),
                );
            }
        }
        // A plugin file that is not there (yet) is no config error: `run`
        // serves the other routes and this one once the file loads, and
        // `config check` reports it.
        for (name, plugin) in &c.plugins {
            if plugin.shadow_config.is_some() && plugin.shadow.is_none() {
                err(
                    format!("plugins.{name}.shadow_config"),
                    "is set but `shadow` (the candidate plugin) is not".into(),
                );
            }
            if plugin
                .reload_interval
                .is_some_and(|d| d < Duration::from_millis(100))
            {
                err(
                    format!("plugins.{name}.reload_interval"),
                    "must be at least 100ms".into(),
                );
            }
        }
        let mut seen = std::collections::BTreeSet::new();
        for (i, r) in c.routes.iter().enumerate() {
            let key = |f: &str| format!("routes[{i}].{f}");
            if r.name.is_empty()
                || r.name.len() > 128
                || !r
                    .name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
            {
                // The name is a metric label, a log field and part of the
                // record of which routes delivered an event (`route:done`).
                err(
                    key("name"),
                    format!(
                        "route name {:?} must be 1–128 letters, digits, `-`, `_` or `.`",
                        r.name
                    ),
                );
            }
            if !seen.insert(r.name.clone()) {
                err(
                    key("name"),
                    format!("route name `{}` is used twice", r.name),
                );
            }
            if !c.plugins.contains_key(&r.plugin) {
                err(
                    key("plugin"),
                    format!("no plugin named `{}` in [plugins]", r.plugin),
                );
            }
            if r.allow.is_empty() {
                err(
                    key("allow"),
                    "allows no sink: every message would be rejected".into(),
                );
            }
            for (sink, patterns) in &r.allow {
                if !c.sinks.contains_key(sink) {
                    err(
                        key(&format!("allow.{sink}")),
                        format!("no sink named `{sink}` in [sinks]"),
                    );
                }
                for pat in patterns {
                    if let Err(e) = crate::pattern::topic_matcher(pat) {
                        err(key(&format!("allow.{sink}")), e);
                    } else if let Some(Err(e)) =
                        c.sinks.get(sink).map(|s| check_pattern_for(s, pat))
                    {
                        err(key(&format!("allow.{sink}")), e);
                    }
                }
            }
            for pat in r.aggregate_types.iter().chain(&r.event_types) {
                if let Err(e) = crate::pattern::name_matcher(pat) {
                    err(key("event_types"), e);
                }
            }
            if r.max_attempts == 0 {
                err(key("max_attempts"), "must be at least 1".into());
            }
            if r.max_messages_per_event == 0 {
                err(
                    key("max_messages_per_event"),
                    "must be at least 1 (an event with no messages needs none)".into(),
                );
            }
            if r.max_bytes_per_event == 0 {
                err(key("max_bytes_per_event"), "must be positive".into());
            }
            if r.memory_mib < 1 || r.memory_mib > 4096 {
                err(key("memory_mib"), "must be between 1 and 4096".into());
            }
            if r.cpu_budget.is_zero() {
                err(key("cpu_budget"), "must be positive".into());
            }
            if r.quarantine_probe_interval.is_zero() {
                err(key("quarantine_probe_interval"), "must be positive".into());
            }
            if r.backoff_min > r.backoff_max {
                err(key("backoff_min"), "must not exceed backoff_max".into());
            }
            for (field, reason) in super::route::owner_problems(r, &c.sinks) {
                err(key(field), reason);
            }
        }
        p
    }
}

/// `log.level`: a level, or `tracing` filter directives whose bare words
/// are levels (a bare word is also a target name to `tracing`, so a typo
/// such as `verbose` would silently turn every log line off).
pub(super) fn check_log_level(level: &str) -> Result<(), String> {
    const LEVELS: [&str; 6] = ["trace", "debug", "info", "warn", "error", "off"];
    for directive in level.split(',').map(str::trim) {
        let lvl = directive.rsplit_once('=').map_or(directive, |(_, l)| l);
        if !LEVELS.contains(&lvl.to_ascii_lowercase().as_str()) {
            return Err(format!(
                "`{level}`: `{lvl}` is not a level (trace, debug, info, warn, error, off; \
                 or directives such as `info,outroute::plugin=debug`)"
            ));
        }
    }
    tracing_subscriber::EnvFilter::try_new(level)
        .map(|_| ())
        .map_err(|e| format!("`{level}`: {e}"))
}

/// A NATS server list: `nats://`, `tls://`, `ws://` or `wss://` URLs, or
/// `host:port`, comma-separated; each with a host.
pub(super) fn check_nats_url(urls: &str) -> Result<(), String> {
    for one in urls.split(',').map(str::trim) {
        let bad = |why: &str| Err(format!("`{one}` is not a NATS server address: {why}"));
        if let Some((scheme, _)) = one.split_once("://") {
            if !["nats", "tls", "ws", "wss"].contains(&scheme) {
                return bad("the scheme must be nats://, tls://, ws:// or wss://");
            }
            match url::Url::parse(one) {
                Ok(u) if u.host_str().is_some_and(|h| !h.is_empty()) => {}
                Ok(_) => return bad("no host"),
                Err(e) => return bad(&e.to_string()),
            }
        } else {
            let Some((host, port)) = one.rsplit_once(':') else {
                return bad("expected nats://host:port or host:port");
            };
            if host.is_empty() || host.contains('/') || port.parse::<u16>().is_err() {
                return bad("expected nats://host:port or host:port");
            }
        }
    }
    Ok(())
}

/// An allow-list pattern that no name the sink accepts could match: a
/// Kafka pattern with a character topics cannot have, a NATS pattern with
/// whitespace or a NATS wildcard (`>`; patterns use `*` and `**`).
pub(super) fn check_pattern_for(sink: &SinkConfig, pattern: &str) -> Result<(), String> {
    match sink {
        SinkConfig::Kafka(_) => {
            if let Some(ch) = pattern
                .chars()
                // Names: letters, digits, `.`, `_`, `-`; the rest: glob syntax.
                .find(|ch| {
                    !(ch.is_ascii_alphanumeric()
                        || matches!(
                            ch,
                            '.' | '_'
                                | '-'
                                | '*'
                                | '?'
                                | '['
                                | ']'
                                | '{'
                                | '}'
                                | ','
                                | '!'
                                | '^'
                                | '\\'
                        ))
                })
            {
                return Err(format!(
                    "pattern `{pattern}` can never match: Kafka topics have no `{ch}` \
                     (letters, digits, `.`, `_`, `-`)"
                ));
            }
        }
        SinkConfig::Nats(_) => {
            if pattern.chars().any(char::is_whitespace) {
                return Err(format!(
                    "pattern `{pattern}` can never match: NATS subjects have no whitespace"
                ));
            }
            if pattern.split('.').any(|t| t == ">") {
                return Err(format!(
                    "pattern `{pattern}`: `>` is a NATS wildcard, which allow patterns do not use \
                     (`*` is one token, `**` any number of them)"
                ));
            }
        }
        _ => {}
    }
    Ok(())
}

/// Where a source's table lives, the same for every way of writing it:
/// `postgres://` or `postgresql://`, with or without user, password, the
/// default port or query options, `outbox` or `public.outbox` (the default
/// schema). Host names compare without case; table names as written (they
/// are quoted). `localhost` and `127.0.0.1` still count as two servers.
fn table_identity(url: &str, table: &str) -> (String, String) {
    let table = if table.contains('.') {
        table.to_string()
    } else {
        format!("public.{table}")
    };
    let place = match url::Url::parse(url) {
        Ok(u) if u.scheme().starts_with("postgres") => format!(
            "postgres://{}:{}/{}",
            u.host_str().unwrap_or_default().to_ascii_lowercase(),
            u.port().unwrap_or(5432),
            u.path().trim_start_matches('/')
        ),
        _ => url.split('?').next().unwrap_or(url).to_string(),
    };
    (place, table)
}

#[cfg(test)]
mod tests {
    use super::table_identity;

    #[test]
    fn one_table_written_two_ways_is_one_table() {
        let canonical = table_identity("postgres://relay:pw@Orders-DB/orders", "outbox");
        for (url, table) in [
            (
                "postgresql://orders-db:5432/orders?sslmode=require",
                "public.outbox",
            ),
            ("postgres://other@orders-db/orders", "outbox"),
        ] {
            assert_eq!(table_identity(url, table), canonical, "{url} {table}");
        }
        for (url, table) in [
            ("postgres://orders-db/billing", "outbox"),
            ("postgres://orders-db:5433/orders", "outbox"),
            ("postgres://orders-db/orders", "audit.outbox"),
            ("postgres://orders-db/orders", "Outbox"),
        ] {
            assert_ne!(table_identity(url, table), canonical, "{url} {table}");
        }
    }
}
