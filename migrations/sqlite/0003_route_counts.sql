-- Per-route counts `outroute status` shows: events a plugin answered with
-- no messages (marked published, nothing sent).
CREATE TABLE IF NOT EXISTS outroute_route_counts (
    source                  TEXT    NOT NULL,
    route                   TEXT    NOT NULL,
    events_without_messages INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (source, route)
);
