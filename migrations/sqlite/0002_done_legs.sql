-- Fan-out legs (sink/topic#n) already acknowledged for an event that is
-- waiting to be retried (a JSON array): a retry re-sends only the rest.
ALTER TABLE outroute_event_state ADD COLUMN done_legs TEXT NOT NULL DEFAULT '[]';
