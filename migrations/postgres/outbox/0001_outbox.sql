-- The canonical outbox table. Producers insert into it in the same
-- transaction as their business change:
--   INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
--   VALUES (gen_random_uuid(), 'order', '42', 'order-created', '{"total": 10}');
CREATE TABLE IF NOT EXISTS outbox (
    seq            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id             uuid        NOT NULL UNIQUE,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    event_type     text        NOT NULL,
    event_version  integer     NOT NULL DEFAULT 1,
    payload        jsonb       NOT NULL,
    headers        jsonb       NOT NULL DEFAULT '{}',
    created_at     timestamptz NOT NULL DEFAULT now(),
    published_at   timestamptz,
    attempts       integer     NOT NULL DEFAULT 0,
    last_error     text,
    failed_at      timestamptz
);

-- Pending rows only: stays small however much history the table keeps.
CREATE INDEX IF NOT EXISTS outbox_pending
    ON outbox (seq) WHERE published_at IS NULL AND failed_at IS NULL;
-- Retention deletes by publish time.
CREATE INDEX IF NOT EXISTS outbox_published_at
    ON outbox (published_at) WHERE published_at IS NOT NULL;
