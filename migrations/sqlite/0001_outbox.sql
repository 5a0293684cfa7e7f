-- Embedded default: the same table contract on SQLite, for one relay.
CREATE TABLE IF NOT EXISTS outbox (
    seq            INTEGER PRIMARY KEY AUTOINCREMENT,
    id             TEXT    NOT NULL UNIQUE,
    aggregate_type TEXT    NOT NULL,
    aggregate_id   TEXT    NOT NULL,
    event_type     TEXT    NOT NULL,
    event_version  INTEGER NOT NULL DEFAULT 1,
    payload        TEXT    NOT NULL,
    headers        TEXT    NOT NULL DEFAULT '{}',
    created_at     TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    published_at   TEXT,
    attempts       INTEGER NOT NULL DEFAULT 0,
    last_error     TEXT,
    failed_at      TEXT
);
CREATE INDEX IF NOT EXISTS outbox_pending ON outbox (seq)
    WHERE published_at IS NULL AND failed_at IS NULL;

-- Times are milliseconds since the Unix epoch.
CREATE TABLE IF NOT EXISTS outroute_event_state (
    source          TEXT    NOT NULL,
    event_id        TEXT    NOT NULL,
    aggregate_type  TEXT    NOT NULL,
    aggregate_id    TEXT    NOT NULL,
    seq             INTEGER NOT NULL,
    event_type      TEXT    NOT NULL DEFAULT '',
    attempts        INTEGER NOT NULL DEFAULT 0,
    next_attempt_at INTEGER NOT NULL,
    blocks_until    INTEGER NOT NULL,
    last_error      TEXT,
    route           TEXT,
    plugin          TEXT,
    plugin_version  TEXT,
    first_error_at  INTEGER NOT NULL,
    updated_at      INTEGER NOT NULL,
    failed_at       INTEGER,
    discarded_at    INTEGER,
    PRIMARY KEY (source, event_id)
);
CREATE INDEX IF NOT EXISTS outroute_event_state_aggregate
    ON outroute_event_state (source, aggregate_type, aggregate_id, seq);
