-- The canonical outbox table on MySQL 8.0.16+ / MariaDB 10.6+. Producers
-- insert into it in the same transaction as their business change:
--   INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
--   VALUES (UUID(), 'order', '42', 'order-created', '{"total": 10}');
--
-- * `seq` (AUTO_INCREMENT, the clustered key): outbox order, and inserts
--   append to the end of the table.
-- * Text columns use a binary collation: ids and aggregate ids compare
--   byte for byte (`utf8mb4_general_ci` would make `A-1` and `a-1` one id).
-- * `payload` and `headers` are LONGTEXT checked as JSON, not MySQL's JSON
--   type: MySQL stores JSON in a binary form and gives it back
--   re-serialised (keys sorted, spacing changed); the relay passes the
--   producer's bytes on exactly as written. (On MariaDB JSON is LONGTEXT
--   with this same check.)
-- * Times are UTC (`created_at` defaults to UTC_TIMESTAMP): DATETIME has
--   no time zone and TIMESTAMP ends in 2038.
-- * A pending row's `published_at` is '1000-01-01 00:00:00' ("never"), not
--   NULL: InnoDB cannot change a NULL to a value in place (the record grows,
--   so the whole row is rewritten); a fixed-size value is overwritten where
--   it is. Measured on MariaDB 10.11, 1,000 rows of 1 KB: 15-26 ms to mark
--   from NULL, 6.5-9.4 ms from the sentinel.
--
-- The claim's lane column and index are not here: `outroute migrate` adds
-- `outroute_lane<N>` (a virtual column: no storage, no rewrite) and the
-- index `outbox_outroute_lanes<N>` for the configured lane count N.
CREATE TABLE IF NOT EXISTS outbox (
    seq            BIGINT       NOT NULL AUTO_INCREMENT PRIMARY KEY,
    id             VARCHAR(255) NOT NULL,
    aggregate_type VARCHAR(255) NOT NULL,
    aggregate_id   VARCHAR(255) NOT NULL,
    event_type     VARCHAR(255) NOT NULL,
    event_version  INT          NOT NULL DEFAULT 1,
    payload        LONGTEXT     NOT NULL CHECK (JSON_VALID(payload)),
    headers        LONGTEXT     NOT NULL DEFAULT ('{}') CHECK (JSON_VALID(headers)),
    created_at     DATETIME(6)  NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    published_at   DATETIME(6)  NOT NULL DEFAULT '1000-01-01 00:00:00',
    attempts       INT          NOT NULL DEFAULT 0,
    last_error     TEXT         NULL,
    failed_at      DATETIME(6)  NULL,
    UNIQUE KEY outbox_id (id),
    -- Retention deletes by publish time; the backlog gauge reads pending
    -- rows (published_at '1000-01-01') in order through it.
    KEY outbox_published_at (published_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
