-- A route whose plugin kept breaking its limits is quarantined until a probe
-- gets through or an operator runs `outroute route resume`.
ALTER TABLE outroute_route_counts ADD COLUMN quarantined_since TEXT;
ALTER TABLE outroute_route_counts ADD COLUMN quarantine_reason TEXT;
