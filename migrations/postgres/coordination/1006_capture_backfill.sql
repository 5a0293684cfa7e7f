-- Log-based capture (`capture = "logical"`, table input): rows committed
-- before the slot existed are never in its stream. `outroute migrate`
-- records, when it creates the slot, the highest order value (`upto`) of the
-- rows then in the table; the relay that takes the capture lease publishes
-- the pending rows up to it from the table before it starts streaming,
-- recording how far it got (`done_seq`, `done_id`) after every batch.
CREATE TABLE IF NOT EXISTS outroute_capture_backfill (
    source      text        PRIMARY KEY,
    upto        bigint      NOT NULL,
    done_seq    bigint,
    done_id     text,
    created_at  timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz
);
