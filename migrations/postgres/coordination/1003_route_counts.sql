-- Per-route counts `outroute status` shows: events a plugin answered with
-- no messages (marked published, nothing sent).
CREATE TABLE IF NOT EXISTS outroute_route_counts (
    source                  text        NOT NULL,
    route                   text        NOT NULL,
    events_without_messages bigint      NOT NULL DEFAULT 0,
    updated_at              timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (source, route)
);
