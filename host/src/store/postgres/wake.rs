//! Sleeping while idle, the database's side: a lease-mode source on the
//! pending queue whose relay found nothing to claim stops polling and waits
//! for the insert trigger's notification, so an idle source costs its
//! database next to nothing and busy producers pay no notification (the
//! relay's side is `relay/sleep.rs`).
//!
//! The protocol, and why it loses no wake-up:
//! 1. The relay records itself asleep in `outroute_wake` (a row per table
//!    and relay). From then on every insert's trigger sees it and sends
//!    `pg_notify('outroute_wake', <table>)`, delivered at its commit to every
//!    relay listening.
//! 2. A producer transaction whose trigger ran *before* that record
//!    committed saw no sleeper and sends nothing. Such a transaction
//!    already had its id, so it is in the in-progress list of a snapshot
//!    taken after the record committed ([`PgStore::fall_asleep`] returns
//!    it). The relay keeps polling until every transaction of that list
//!    has ended ([`PgStore::settled`]), then claims once more: whatever
//!    they committed is found by that claim, whatever commits later
//!    notifies.
//! 3. Woken by events, the relay records itself awake
//!    ([`PgStore::wake_up`]) and polls again.
//!
//! Every lease round renews the record (`claim.rs`, `LEASE_ROUND_WAKES`);
//! the trigger ignores records older than two minutes, so producers of a
//! table whose relay died asleep stop notifying.
//! A source with events retrying or deferred never sleeps: their retry
//! times come from the clock, not from inserts. Events failed for good
//! change only by `failed retry|discard`, which notify.

use super::*;

impl PgStore {
    /// Whether this source can sleep: the pending queue, with a trigger
    /// that notifies (set up or refreshed by this version's `migrate`).
    pub fn wakes(&self) -> bool {
        self.wakes && self.logical.is_none()
    }

    /// Record this relay asleep on the source and return the transactions
    /// in progress right after (see the module comment); `None` when it
    /// must not sleep (events retrying or deferred: they come due by the
    /// clock).
    pub async fn fall_asleep(&self) -> Result<Option<Vec<i64>>> {
        let due_later: bool = self
            .bounded("checking for retrying events", async {
                Ok(sqlx::query_scalar(
                    "SELECT EXISTS (SELECT 1 FROM outroute_event_state \
                     WHERE source = $1 AND failed_at IS NULL)",
                )
                .bind(&self.source)
                .fetch_one(&self.pool)
                .await?)
            })
            .await?;
        if due_later {
            return Ok(None);
        }
        self.bounded("recording the relay asleep", async {
            // Also forgets records of relays long gone (a relay id is new
            // at every start).
            sqlx::query(
                "WITH gone AS (DELETE FROM outroute_wake WHERE source = $1 AND relay <> $2 \
                   AND since < now() - interval '1 hour') \
                 INSERT INTO outroute_wake (source, relay, asleep, since) VALUES ($1, $2, true, now()) \
                 ON CONFLICT (source, relay) DO UPDATE SET asleep = true, since = now()",
            )
            .bind(&self.source)
            .bind(&self.relay_id)
            .execute(&self.pool)
            .await?;
            Ok(())
        })
        .await?;
        let running: Vec<i64> = self
            .bounded("reading the transactions in progress", async {
                Ok(sqlx::query_scalar(
                    "SELECT coalesce(array_agg(x::text::bigint), '{}') \
                     FROM pg_snapshot_xip(pg_current_snapshot()) x",
                )
                .fetch_one(&self.pool)
                .await?)
            })
            .await?;
        Ok(Some(running))
    }

    /// Whether every transaction of `running` has ended (committed or
    /// rolled back).
    pub async fn settled(&self, running: &[i64]) -> Result<bool> {
        if running.is_empty() {
            return Ok(true);
        }
        self.bounded("checking the transactions in progress", async {
            Ok(sqlx::query_scalar(
                "SELECT NOT EXISTS (SELECT 1 FROM unnest($1::bigint[]) x \
                 WHERE pg_xact_status(x::text::xid8) = 'in progress')",
            )
            .bind(running)
            .fetch_one(&self.pool)
            .await?)
        })
        .await
    }

    /// Record this relay awake on the source.
    pub async fn wake_up(&self) -> Result<()> {
        self.bounded("recording the relay awake", async {
            sqlx::query(
                "UPDATE outroute_wake SET asleep = false, since = now() \
                 WHERE source = $1 AND relay = $2 AND asleep",
            )
            .bind(&self.source)
            .bind(&self.relay_id)
            .execute(&self.pool)
            .await?;
            Ok(())
        })
        .await
    }

    /// Wake this source's relays whatever they do (events put back or
    /// released by an operator: `failed retry`, `failed discard`).
    pub async fn notify_wake(&self) -> Result<()> {
        self.bounded("waking the source's relays", async {
            sqlx::query("SELECT pg_notify('outroute_wake', $1)")
                .bind(&self.source)
                .execute(&self.pool)
                .await?;
            Ok(())
        })
        .await
    }
}
