-- Log-based capture (`capture = "logical"`): an event that cannot go out when
-- the stream brings it (it failed, waits for a retry, or an earlier event of
-- its aggregate does) waits here with the event itself, because the slot's
-- position moves past it and the table row may be cleaned up. `commit_lsn`
-- orders these events across transactions (then `seq` within one).
ALTER TABLE outroute_event_state ADD COLUMN IF NOT EXISTS event jsonb;
ALTER TABLE outroute_event_state ADD COLUMN IF NOT EXISTS commit_lsn bigint;
-- The first waiting event of each aggregate, in order.
CREATE INDEX IF NOT EXISTS outroute_event_state_parked
    ON outroute_event_state (source, aggregate_type, aggregate_id, commit_lsn, seq)
    WHERE event IS NOT NULL AND discarded_at IS NULL;
