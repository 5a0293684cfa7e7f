-- Where the slot began (its creation LSN, as a number): the rows published
-- from the table stand in the parked queue at this position — after every
-- event an earlier slot parked, before every event the new slot streams.
ALTER TABLE outroute_capture_backfill ADD COLUMN IF NOT EXISTS slot_lsn bigint NOT NULL DEFAULT 0;
