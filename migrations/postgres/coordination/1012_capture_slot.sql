-- Where a log-capture source's slot was last seen, on which timeline of the
-- server, and how far the relay had confirmed it: after a promotion (a new
-- timeline) a slot that did not survive it is re-created, and what may have
-- been missed is named from this record (it fails over with the database).
CREATE TABLE IF NOT EXISTS outroute_capture_slot (
    source        text        PRIMARY KEY,
    slot          text        NOT NULL,
    timeline      bigint      NOT NULL,
    confirmed_lsn text,
    updated_at    timestamptz NOT NULL DEFAULT now()
);
