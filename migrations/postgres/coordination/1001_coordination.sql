-- outroute's own coordination tables. They sit beside any outbox table
-- (canonical or existing) and never require changing it.

-- Ordering lanes: aggregates hash onto lanes; one relay owns a lane at a time.
CREATE TABLE IF NOT EXISTS outroute_lanes (
    source      text        NOT NULL,            -- outbox table name
    lane        integer     NOT NULL,
    owner       text,                            -- relay id holding the lease
    lease_until timestamptz NOT NULL DEFAULT '-infinity',
    epoch       bigint      NOT NULL DEFAULT 0,  -- bumped on every hand-over
    PRIMARY KEY (source, lane)
);

-- Live relays (heartbeats), for fair lane shares and `outroute status`.
CREATE TABLE IF NOT EXISTS outroute_relays (
    source       text        NOT NULL,
    relay_id     text        NOT NULL,
    hostname     text        NOT NULL,
    pid          integer     NOT NULL,
    started_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (source, relay_id)
);

-- Retry and failure state of events that did not go through on the first
-- try. Rows exist only for troubled events, so the table stays small.
-- `blocks_until` holds back later events of the same aggregate until then:
-- next_attempt_at while retrying, 'infinity' for a failed event under the
-- `block` policy, '-infinity' otherwise.
CREATE TABLE IF NOT EXISTS outroute_event_state (
    source          text        NOT NULL,
    event_id        text        NOT NULL,
    aggregate_type  text        NOT NULL,
    aggregate_id    text        NOT NULL,
    seq             bigint      NOT NULL,
    event_type      text        NOT NULL DEFAULT '',
    attempts        integer     NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    blocks_until    timestamptz NOT NULL DEFAULT '-infinity',
    last_error      text,
    route           text,
    plugin          text,
    plugin_version  text,
    first_error_at  timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    failed_at       timestamptz,
    discarded_at    timestamptz,
    PRIMARY KEY (source, event_id)
);
CREATE INDEX IF NOT EXISTS outroute_event_state_aggregate
    ON outroute_event_state (source, aggregate_type, aggregate_id, seq);
CREATE INDEX IF NOT EXISTS outroute_event_state_failed
    ON outroute_event_state (source, failed_at) WHERE failed_at IS NOT NULL;
