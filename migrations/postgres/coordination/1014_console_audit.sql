-- The operator console's audit log (`console/audit.rs`): every action taken
-- from the console (retry, discard, resume), who took it (the token's name),
-- on which source, what it named and what came of it. Only ever appended to.
CREATE TABLE IF NOT EXISTS outroute_audit (
    id      bigserial   PRIMARY KEY,
    at      timestamptz NOT NULL DEFAULT now(),
    source  text        NOT NULL,
    who     text        NOT NULL,
    action  text        NOT NULL,
    subject text        NOT NULL,
    outcome text        NOT NULL
);
CREATE INDEX IF NOT EXISTS outroute_audit_source_at ON outroute_audit (source, at);
