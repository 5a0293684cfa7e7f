-- The operator console's audit log (`console/audit.rs`): every action taken
-- from the console (retry, discard, resume), who took it (the token's name),
-- on which source, what it named and what came of it. Only ever appended to.
CREATE TABLE IF NOT EXISTS outroute_audit (
    id      BIGINT       NOT NULL AUTO_INCREMENT,
    at      DATETIME(6)  NOT NULL,
    source  VARCHAR(191) NOT NULL,
    who     VARCHAR(191) NOT NULL,
    action  VARCHAR(64)  NOT NULL,
    subject TEXT         NOT NULL,
    outcome TEXT         NOT NULL,
    PRIMARY KEY (id),
    KEY outroute_audit_source_at (source, at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
