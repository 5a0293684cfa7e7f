-- A route whose plugin kept breaking its limits is quarantined: every relay
-- of the outbox defers its events until a probe gets through or an operator
-- runs `outroute route resume` (which clears these columns).
ALTER TABLE outroute_route_counts
    ADD COLUMN IF NOT EXISTS quarantined_since timestamptz,
    ADD COLUMN IF NOT EXISTS quarantine_reason text;
