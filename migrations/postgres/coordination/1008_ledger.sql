-- The publish ledger (`marking = { style = "ledger" }`): one narrow row per
-- published event, keyed by the outbox row's sequence number, instead of a
-- rewrite of the whole outbox row. A row of the source's table is published
-- when its sequence number is here; retention deletes both together.
CREATE TABLE IF NOT EXISTS outroute_ledger (
    source       text        NOT NULL,
    seq          bigint      NOT NULL,
    published_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (source, seq)
);

-- Under the ledger, published rows stay in the lane index, so a relay that
-- takes a lane over starts its claims at the floor the previous owner
-- recorded here (see host/src/store/postgres/floor.rs), not at the bottom
-- of the lane's history. `failed retry` lowers it to the rows it re-opens.
ALTER TABLE outroute_lanes ADD COLUMN IF NOT EXISTS floor bigint;
