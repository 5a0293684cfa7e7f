-- Binlog capture (`capture = "binlog"`): where a source's stream resumes.
-- `position` is a MariaDB GTID position (`domain-server-sequence`, one per
-- replication domain, comma-separated), recorded only past transactions
-- whose events were all published and marked, or recorded as waiting or
-- failed (`outroute_event_state`); written only by the holder of the
-- source's capture lease (lane -1 in `outroute_lanes`) at `epoch`.
-- `backfilled` = 0 while the rows written before `position` are still being
-- read from the table (first start, or after the binlog lost the position).
CREATE TABLE IF NOT EXISTS outroute_binlog (
    source     VARCHAR(191)  NOT NULL,
    position   VARCHAR(1024) NOT NULL,
    backfilled TINYINT       NOT NULL DEFAULT 0,
    epoch      BIGINT        NOT NULL DEFAULT 0,
    updated_at DATETIME(6)   NOT NULL,
    PRIMARY KEY (source)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
