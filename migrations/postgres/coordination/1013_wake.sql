-- Sleeping while idle (`store/postgres/wake.rs`): a relay that found
-- nothing to do on a source records itself asleep there, and the pending
-- queue's insert trigger sends one notification (`pg_notify('outroute_wake',
-- <table>)`) while any relay of the table is asleep — so busy producers never
-- pay a notification and idle relays never poll. A sleeping relay renews
-- `since`; a record older than two minutes (a relay that died asleep) no
-- longer makes producers notify.
CREATE TABLE IF NOT EXISTS outroute_wake (
    source text        NOT NULL,
    relay  text        NOT NULL,
    asleep boolean     NOT NULL DEFAULT false,
    since  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (source, relay)
);
