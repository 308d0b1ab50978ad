//! SQL stores for oncely on [`sqlx`]: SQLite (the embedded default), PostgreSQL and
//! MySQL 8.0+ / MariaDB 10.6+.
//!
//! Every guarantee rests on a UNIQUE constraint checked by the database, never on
//! SELECT-then-INSERT or a lock with a TTL. All writes can run inside the caller's
//! transaction ([`Tx`]), so a business write, its idempotency record and its stored
//! response commit together or not at all.
//!
//! # Layout
//! - `db` — [`Database`] (a pool per backend: [`SqliteStore`], [`PgStore`],
//!   [`MySqlStore`]), [`Tx`] (a transaction on any of them), [`DbOptions`], connection and
//!   embedded migrations.
//! - `dialect` — [`sql_text`]: one SQL text with `$n` placeholders for every backend
//!   (rewritten to `?` on MySQL).
//! - `idempotency` — [`IdempotencyStore`]: atomic reservation, lookup, completion and
//!   the retention collector over table `oncely_idempotency`.
//! - `outbox` — [`OutboxStore`]: the transactional outbox over table `oncely_outbox`
//!   (enqueue in the caller's transaction, claim by state with per-partition leases, settle,
//!   dead rows, stats, retention).
//! - `inbox` — [`InboxStore`]: the consumer inbox over table `oncely_inbox` (record a
//!   message id in the effect's transaction, retention collector).
//! - `error` — [`StoreError`], which tells "unreachable" (fail closed: 503) from other
//!   failures.
//! - `outage` — [`is_outage`]: does an error (chain) say the database could not be reached
//!   (not "refused this transaction")? Consumers hold a message through an outage instead
//!   of counting an attempt.
//! - `plan` — [`PINNED_PLAN`], [`execute_pinned`], [`fetch_all_pinned`]: PostgreSQL claims
//!   and sweeps whose plans do not change when the statistics say the table is empty.

mod db;
mod dialect;
mod error;
mod idempotency;
mod inbox;
mod outage;
mod outbox;
mod outbox_mysql;
mod plan;

pub use db::{
    Backend, Database, DbOptions, MySqlStore, MySqlTx, PgStore, SqliteStore, SqliteTx, Tx,
};
pub use dialect::{in_list, sql_text, Dialect};
pub use error::StoreError;
pub use idempotency::{IdempotencyStore, Record, Reservation, ReservationToken};
pub use inbox::{InboxOutcome, InboxStore};
pub use outage::is_outage;
pub use outbox::{
    ClaimedBatch, OutboxEvent, OutboxRow, OutboxState, OutboxStats, OutboxStore, PublishFailure,
    RequeueTarget, Rescheduled, Settled,
};
pub use plan::{execute_pinned, fetch_all_pinned, PINNED_PLAN};

/// Re-exported so dependants name the same `sqlx` version.
pub use sqlx;
