-- Routes are subscriptions: an event several routes select is delivered on
-- each of them on its own. `waiting_routes` lists the routes an event with a
-- state row has not delivered yet (retrying, failed, deferred, or waiting
-- behind an earlier event of its aggregate on that route); NULL means every
-- route (a row that could not become an event, one no route takes, or a
-- state row written before routes were subscriptions). A blocking event
-- holds back later events of its aggregate only on these routes, and a
-- claim skips an event while every route it waits for is held.
ALTER TABLE outroute_event_state ADD COLUMN IF NOT EXISTS waiting_routes text[];
