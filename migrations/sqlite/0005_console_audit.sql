-- The operator console's audit log (`console/audit.rs`): every action taken
-- from the console (retry, discard, resume), who took it (the token's name),
-- what it named and what came of it. Only ever appended to.
CREATE TABLE IF NOT EXISTS outroute_audit (
    id      INTEGER PRIMARY KEY AUTOINCREMENT,
    at      TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    source  TEXT NOT NULL,
    who     TEXT NOT NULL,
    action  TEXT NOT NULL,
    subject TEXT NOT NULL,
    outcome TEXT NOT NULL
);
