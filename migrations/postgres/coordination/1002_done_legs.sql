-- Fan-out legs (sink/topic#n) already acknowledged for an event that is
-- waiting to be retried: a retry re-sends only the legs that did not go.
ALTER TABLE outroute_event_state ADD COLUMN IF NOT EXISTS done_legs text[] NOT NULL DEFAULT '{}';
