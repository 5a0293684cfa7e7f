-- Claims walk the lane index instead: `outroute migrate` creates
-- `outbox_outroute_lanes<N>` on (lane, seq, id) over pending rows for the
-- configured lane count (it depends on `relay.lanes`, so it is not a static
-- migration). This index is no longer read and would only cost producers
-- one more index insert per event.
DROP INDEX IF EXISTS outbox_pending;
