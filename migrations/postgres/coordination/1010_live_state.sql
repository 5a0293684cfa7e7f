-- The state rows that can still skip or hold back a pending row of a table
-- whose rows say they failed: retrying or waiting (failed_at NULL) and
-- holding for good (blocks_until infinity). A claim asks once whether the
-- source has any (`NO_LIVE_STATE`); failed-and-skipped and discarded events,
-- which stay for ever, no longer make every later claim probe each row.
CREATE INDEX IF NOT EXISTS outroute_event_state_live
    ON outroute_event_state (source) WHERE failed_at IS NULL OR blocks_until = 'infinity';
