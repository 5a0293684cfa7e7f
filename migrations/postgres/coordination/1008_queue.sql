-- The pending queue (`marking = { style = "queue" }`): one narrow row per
-- pending event of a source's table, added by the insert trigger that
-- `outroute migrate --table` puts on the table and deleted when the event
-- is published or fails for good. Claims walk it by lane.
CREATE TABLE IF NOT EXISTS outroute_queue (
    source text   NOT NULL,
    lane   int    NOT NULL,
    seq    bigint NOT NULL,
    PRIMARY KEY (source, lane, seq)
);
