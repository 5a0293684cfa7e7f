-- outroute's own coordination tables on MySQL/MariaDB. They sit beside the
-- outbox table and never require changing it. Times are UTC DATETIME(6);
-- '1000-01-01' stands for "never" and '9999-12-31' for "for ever".

-- Ordering lanes: aggregates hash onto lanes; one relay owns a lane at a time.
CREATE TABLE IF NOT EXISTS outroute_lanes (
    source      VARCHAR(191) NOT NULL,
    lane        INT          NOT NULL,
    owner       VARCHAR(255) NULL,
    lease_until DATETIME(6)  NOT NULL DEFAULT '1000-01-01 00:00:00',
    epoch       BIGINT       NOT NULL DEFAULT 0,
    PRIMARY KEY (source, lane)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

-- Live relays (heartbeats), for fair lane shares and `outroute status`.
CREATE TABLE IF NOT EXISTS outroute_relays (
    source       VARCHAR(191) NOT NULL,
    relay_id     VARCHAR(191) NOT NULL,
    hostname     VARCHAR(255) NOT NULL,
    pid          INT          NOT NULL,
    started_at   DATETIME(6)  NOT NULL,
    heartbeat_at DATETIME(6)  NOT NULL,
    PRIMARY KEY (source, relay_id)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

-- Retry and failure state of events that did not go through on the first
-- try; rows exist only for troubled events. `blocks_until` holds back later
-- events of the same aggregate until then: next_attempt_at while retrying,
-- '9999-12-31' for a failed event under the `block` policy, '1000-01-01'
-- otherwise. `done_legs`: fan-out legs already acknowledged (JSON array).
CREATE TABLE IF NOT EXISTS outroute_event_state (
    source          VARCHAR(191) NOT NULL,
    event_id        VARCHAR(255) NOT NULL,
    aggregate_type  VARCHAR(255) NOT NULL,
    aggregate_id    VARCHAR(255) NOT NULL,
    seq             BIGINT       NOT NULL,
    event_type      VARCHAR(255) NOT NULL DEFAULT '',
    attempts        INT          NOT NULL DEFAULT 0,
    next_attempt_at DATETIME(6)  NOT NULL,
    blocks_until    DATETIME(6)  NOT NULL,
    last_error      TEXT         NULL,
    route           VARCHAR(255) NULL,
    plugin          VARCHAR(255) NULL,
    plugin_version  VARCHAR(255) NULL,
    first_error_at  DATETIME(6)  NOT NULL,
    updated_at      DATETIME(6)  NOT NULL,
    failed_at       DATETIME(6)  NULL,
    discarded_at    DATETIME(6)  NULL,
    done_legs       LONGTEXT     NOT NULL DEFAULT ('[]'),
    PRIMARY KEY (source, event_id),
    KEY outroute_event_state_aggregate (source, aggregate_type, aggregate_id, seq),
    KEY outroute_event_state_failed (source, failed_at),
    -- "Does anything hold back or defer events now?" (one probe per claim).
    KEY outroute_event_state_blocks (source, blocks_until)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

-- Per-route counts `outroute status` shows (events a plugin answered with
-- no messages), and quarantined routes.
CREATE TABLE IF NOT EXISTS outroute_route_counts (
    source                  VARCHAR(191) NOT NULL,
    route                   VARCHAR(191) NOT NULL,
    events_without_messages BIGINT       NOT NULL DEFAULT 0,
    quarantined_since       DATETIME(6)  NULL,
    quarantine_reason       TEXT         NULL,
    PRIMARY KEY (source, route)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
