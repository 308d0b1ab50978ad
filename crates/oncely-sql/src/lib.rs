//! SQL stores for oncely on [`sqlx`]: SQLite (the embedded default), PostgreSQL and
//! MySQL 8.0+ / MariaDB 10.6+.
//!
//! Every guarantee rests on a UNIQUE constraint checked by the database, never on
//! SELECT-then-INSERT or a lock with a TTL. All writes can run inside the caller's
//! transaction ([`Tx`]), so a business write, its idempotency record and its stored
//! response commit together or not at all.
//!
//! # Features
//! One per backend, each gating its module and sqlx's driver: `sqlite` (default),
//! `postgres`, `mysql`. [`Database`] and [`Tx`] have a variant per enabled backend; a URL
//! of a backend compiled out is [`StoreError::UnsupportedUrl`].
//!
//! # Layout
//! Portable modules (no backend named):
//! - `db` — [`Database`]'s and [`Tx`]'s methods (connect, migrate, begin, commit, ping) and
//!   [`DbOptions`].
//! - `query` — [`query`], [`Query`], [`Value`]: a user's own SQL with `$n` placeholders on
//!   any backend ([`Tx::execute`], [`Tx::insert_ignoring_duplicate`],
//!   [`Tx::fetch_optional`], [`Database::fetch_all`], …) into any `T: sqlx::FromRow`
//!   ([`FromBackendRow`]).
//! - `dialect` — [`sql_text`]: one SQL text with `$n` placeholders for every backend
//!   (rewritten to `?` on MySQL), for [`on_tx!`] bodies.
//! - `idempotency` — [`IdempotencyStore`]: atomic reservation, lookup, completion and
//!   the retention collector over table `oncely_idempotency`.
//! - `idempotency_lease` — the multi-phase half of [`IdempotencyStore`]: a reservation
//!   committed as `processing` under a [`Lease`] with a fencing token, fenced completion,
//!   release and take-over, the lease sweep, [`LeaseReport`] and [`RecordSummary`].
//! - `outbox` — [`OutboxStore`]: the transactional outbox over table `oncely_outbox`
//!   (enqueue in the caller's transaction, claim by state with per-partition leases, settle,
//!   dead rows, stats, retention); a folder: `types` (its values), `batch` (settling a
//!   claimed batch) and `driver` (`OutboxBackend`, the contract the backends implement,
//!   which names no backend).
//! - `inbox` — [`InboxStore`]: the consumer inbox over table `oncely_inbox` (record a
//!   message id in the effect's transaction, retention collector).
//! - `effects` — [`EffectStore`]: outgoing effects over table `oncely_effects` (the intent
//!   recorded in the caller's transaction, claims under a fenced lease, settle with the
//!   evidence in `oncely_effect_attempts`); a folder: `types` (its values), `settle`
//!   (settles and evidence), `resolve` (operator resolutions and their audit) and `driver`
//!   (`EffectsBackend`, the contract the backends implement, which names no backend).
//! - `reconcile` — [`DiscrepancyStore`], [`DiscrepancyKind`]: what reconciliation runs
//!   found over tables `oncely_discrepancies` (one open row per provider, kind and
//!   reference), `oncely_reconcile_runs` and `oncely_discrepancy_audit`; and the effect
//!   queries a run needs ([`EffectStore::created_since`], [`EffectStore::lease_unknown`]).
//! - `operator_audit` — [`OperatorAudit`]: the audit rows of operator actions without a
//!   table of their own (the console's dead-letter requeue), `oncely_operator_audit`.
//! - `error` — [`StoreError`], which tells "unreachable" (fail closed: 503) from other
//!   failures, and [`is_lock_conflict`].
//! - `outage` — [`is_outage`]: does an error (chain) say the database could not be reached
//!   (not "refused this transaction")? Consumers hold a message through an outage instead
//!   of counting an attempt.
//! - `retention` — [`Retention`], [`RetentionSweep`]: the one runner of background
//!   retention sweeps (old rows deleted or turned on an interval, one outage backoff, stopped
//!   by a `CancellationToken`).
//! - `queue` — [`QueueStore`]: the SQL transport's queue over tables `oncely_queue`,
//!   `oncely_subscriptions` and `oncely_deliveries` (enqueue with fan-out to consumer
//!   groups, take, claim with a lease, settle, dead deliveries, collection).
//! - `plan` — [`PINNED_PLAN`], [`execute_pinned`], [`fetch_all_pinned`]: PostgreSQL claims
//!   and sweeps whose plans do not change when the statistics say the table is empty.
//!
//! The driver contract, which names no backend:
//! - `driver` — [`Backend`] (a backend's name and capabilities), [`Migrations`], and the
//!   internal `Store` trait every backend implements (begin, finish, migrations, the
//!   batched retention `Sweep`), with the shared connection probe.
//!
//! The one module that chooses a backend:
//! - `backend` — the [`Database`] and [`Tx`] enums, connecting by URL scheme, and the
//!   dispatch macros:
//!   [`on_tx!`], [`on_pool!`], [`on_writer!`] (public, the escape hatch for SQL the
//!   portable API does not cover) and the internal `with_store!` / `with_tx!`, which reach
//!   each store's per-backend trait (`IdempotencyBackend`, `OutboxBackend`, `QueueBackend`) and the
//!   operations every backend spells once (`Store`: begin, finish, migrations, the batched
//!   retention `sweep`).
//!
//! Per backend, as sqlx's drivers: `sqlite/`, `postgres/`, `mysql/`, each a `mod.rs` with
//! the store and transaction types ([`SqliteStore`] / [`SqliteTx`], [`PgStore`],
//! [`MySqlStore`] / [`MySqlTx`]), connecting, migrations and the sweep, and one file per
//! store with backend-specific SQL (`idempotency.rs`, `outbox.rs`, `queue.rs`,
//! `effects.rs`, `reconcile.rs`) implementing
//! its trait.
//! The inbox has none left: its insert is [`Tx::insert_ignoring_duplicate`] and its
//! collector the sweep.

// SQL texts and helpers shared by some backends are unused when those are compiled out.
#![cfg_attr(
    not(all(feature = "sqlite", feature = "postgres", feature = "mysql")),
    allow(dead_code)
)]

mod backend;
mod db;
mod dialect;
mod driver;
mod effects;
mod error;
mod idempotency;
mod idempotency_lease;
mod inbox;
#[cfg(feature = "mysql")]
mod mysql;
mod operator_audit;
mod outage;
mod outbox;
#[cfg(feature = "postgres")]
mod plan;
#[cfg(feature = "postgres")]
mod postgres;
mod query;
mod queue;
mod reconcile;
mod retention;
#[cfg(feature = "sqlite")]
mod sqlite;

pub use backend::{Database, Tx};
pub use db::DbOptions;
pub use dialect::{in_list, sql_text, Dialect};
pub use driver::{Backend, Migrations};
pub use effects::{
    Continuation, Effect, EffectState, EffectStore, Enqueued, Evidence, EvidenceKind, EvidenceRow,
    NewEffect, Resolution, Settle, SettleItem,
};
pub use error::{is_lock_conflict, StoreError};
pub use idempotency::{IdempotencyStore, Record, Reservation, ReservationToken};
pub use idempotency_lease::{
    Lease, LeaseReport, LeaseReservation, RecordSummary, UNKNOWN_AGE_BUCKETS,
};
pub use inbox::{InboxOutcome, InboxStore};
#[cfg(feature = "mysql")]
pub use mysql::{MySqlStore, MySqlTx};
pub use operator_audit::{OperatorAction, OperatorAudit};
pub use outage::is_outage;
pub use outbox::{
    ClaimedBatch, OutboxEvent, OutboxRow, OutboxState, OutboxStats, OutboxStore, PublishFailure,
    RequeueTarget, Rescheduled, Settled,
};
#[cfg(feature = "postgres")]
pub use plan::{execute_pinned, fetch_all_pinned, PINNED_PLAN};
#[cfg(feature = "postgres")]
pub use postgres::PgStore;
#[doc(hidden)]
pub use query::row as __row;
pub use query::{query, FromBackendRow, Query, Value};
pub use queue::{
    ClaimedDelivery, DeadQueueDelivery, DeliverySummary, NewQueueMessage, QueueMessage, QueueStore,
    TakenMessage, DEAD_PREVIEW_BYTES,
};
pub use reconcile::{
    Discrepancy, DiscrepancyAudit, DiscrepancyKind, DiscrepancyStore, NewDiscrepancy, ReconcileRun,
    Recorded, ACKNOWLEDGE, REFUND,
};
pub use retention::{BatchFuture, Retention, RetentionSweep, SweepError};
#[cfg(feature = "sqlite")]
pub use sqlite::{SqliteStore, SqliteTx};

/// Re-exported so dependants name the same `sqlx` version.
pub use sqlx;
