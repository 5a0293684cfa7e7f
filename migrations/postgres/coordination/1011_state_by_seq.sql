-- The live state rows of a source by sequence number: a claim that skips a
-- held aggregate's backlog checks the state rows inside the skipped range
-- (and the holder's own) with a range read, not a read of every state row
-- of the source.
CREATE INDEX IF NOT EXISTS outroute_event_state_seq
    ON outroute_event_state (source, seq) WHERE discarded_at IS NULL;
