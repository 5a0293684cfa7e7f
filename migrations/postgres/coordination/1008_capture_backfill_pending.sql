-- `upto` NULL: `outroute migrate` recorded that it is about to create the
-- slot and has not yet recorded the rows written before it. Written before
-- the slot is created, so a migrate that stops in between is noticed: the
-- relay refuses to stream and the next migrate records the rows then.
ALTER TABLE outroute_capture_backfill ALTER COLUMN upto DROP NOT NULL;
