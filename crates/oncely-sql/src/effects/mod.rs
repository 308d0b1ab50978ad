//! [`EffectStore`]: outgoing effects over table `oncely_effects`.
//!
//! - `types` — the values: [`EffectState`], [`NewEffect`], [`Effect`], [`Settle`],
//!   [`Evidence`], [`EvidenceRow`], [`SettleItem`], [`Resolution`], [`Enqueued`].
//! - this module — the store, recording an intent, claiming, and the reads.
//! - `settle` — settling claimed effects, with the evidence of each attempt in
//!   `oncely_effect_attempts`.
//! - `resolve` — operator resolutions (retry, resolve by hand) and their audit trail.
//! - `continuation` — [`Continuation`]: an outcome decided outside the service's runner,
//!   marked for the service's runner to continue (migration 0031).
//! - `driver` — `EffectsBackend`, what `sqlite/`, `postgres/` and `mysql/` implement, with
//!   the columns and SQL texts they share; it names no backend.

pub(crate) mod continuation;
pub(crate) mod driver;
mod resolve;
mod settle;
pub(crate) mod types;

use std::time::Duration;

use crate::backend::with_store;
use crate::{query, Database, StoreError, Tx};
pub use continuation::Continuation;
use driver::{Claim, EffectsBackend};
pub use types::{
    Effect, EffectState, Enqueued, Evidence, EvidenceKind, EvidenceRow, NewEffect, Resolution,
    Settle, SettleItem,
};

/// The effect store over tables `oncely_effects` (one row per intent: `UNIQUE(provider,
/// operation, reference)` and `UNIQUE(provider, idem_key)`), `oncely_effect_attempts` (the
/// evidence) and `oncely_effect_audit` (operators' actions). Timestamps are Unix ms.
///
/// Runners claim due effects with a lease ([`EffectStore::claim`]: SKIP LOCKED on
/// PostgreSQL and MySQL, the single writer on SQLite); the claim that starts a call commits
/// `in_flight` *before* the call goes out, so a runner that dies mid-call leaves an
/// `in_flight` row whose lease runs out — the next claim turns it `unknown`, never
/// `pending`. Every settle names the lease's version, so a runner that lost its lease
/// cannot overwrite its successor's work.
#[derive(Debug, Clone)]
pub struct EffectStore {
    db: Database,
}

const INSERT_EFFECT: &str = "INSERT INTO oncely_effects (id, tenant, provider, operation, \
    reference, idem_key, request, available_at, created_at, updated_at) \
    VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)";

impl EffectStore {
    /// The store on `db` (migrated with [`Database::migrate`]).
    pub fn new(db: Database) -> Self {
        Self { db }
    }

    /// The database.
    pub fn database(&self) -> &Database {
        &self.db
    }

    /// The backend's select list for [`Effect`].
    fn columns(&self) -> &'static str {
        fn of<S: EffectsBackend>(_: &S) -> &'static str {
            S::COLUMNS
        }
        with_store!(&self.db, |s| of(s))
    }

    /// Records the intent in the caller's transaction `tx`, due at once. A second intent
    /// with the same provider, operation and reference — or the same key — records nothing
    /// ([`Enqueued::Existing`]): the unique keys, not a lookup, decide.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails (the caller rolls back).
    pub async fn enqueue(
        tx: &mut Tx,
        new: &NewEffect<'_>,
        now_ms: i64,
    ) -> Result<Enqueued, StoreError> {
        let id = uuid::Uuid::now_v7().to_string();
        let inserted = tx
            .insert_ignoring_duplicate(
                query(INSERT_EFFECT)
                    .bind(id.as_str())
                    .bind(new.tenant)
                    .bind(new.provider)
                    .bind(new.operation)
                    .bind(new.reference)
                    .bind(new.key)
                    .bind(new.request.to_string())
                    .bind(now_ms)
                    .bind(now_ms)
                    .bind(now_ms),
                "",
            )
            .await?;
        Ok(if inserted {
            Enqueued::Created(id)
        } else {
            Enqueued::Existing
        })
    }

    /// Claims up to `limit` due effects of `provider` for `runner`, each under a lease of
    /// `lease`, in one transaction:
    /// - `pending` and `absent` effects become `in_flight` with one more attempt: the call
    ///   may go out once this returns;
    /// - `unknown` effects are leased for a status check;
    /// - `in_flight` effects whose lease ran out (their runner died or hung mid-call)
    ///   become `unknown`: the call may have reached the provider.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails; nothing is claimed then.
    pub async fn claim(
        &self,
        provider: &str,
        runner: &str,
        limit: u32,
        lease: Duration,
        now_ms: i64,
    ) -> Result<Vec<Effect>, StoreError> {
        let lease_until =
            now_ms.saturating_add(i64::try_from(lease.as_millis()).unwrap_or(i64::MAX));
        let claim = Claim {
            provider,
            runner,
            limit: i64::from(limit.max(1)),
            lease_until,
            now_ms,
        };
        let rows = with_store!(&self.db, |s| s.claim(&claim).await)?;
        Ok(rows)
    }

    /// Renews the claim of `effect` (claimed `in_flight` by `runner`) at the moment its
    /// call leaves: `sent_at = now_ms` and the lease `now_ms + lease`, fenced by the
    /// claim's lease version. `false` when the claim is no longer this runner's (its lease
    /// ran out while the effect waited for a call slot and another runner took it): the
    /// call must not leave then. The effect runner runs it only for a call that leaves
    /// later than its send bound after the claim (`oncely_effects::SEND_BOUND`).
    ///
    /// The settle window and the lease then count from the send, not the claim: without
    /// this, an effect that waited for a slot past its lease could be sent while another
    /// runner, having checked after the window and found nothing, sends it again — two
    /// objects at a provider without idempotency keys (found by the effect protocol's
    /// model, `oncely-effects`' `model`).
    ///
    /// # Errors
    /// [`StoreError`] when the database fails; the call must not leave then either.
    pub async fn stamp_send(
        &self,
        effect: &Effect,
        runner: &str,
        lease: Duration,
        now_ms: i64,
    ) -> Result<bool, StoreError> {
        let lease_until =
            now_ms.saturating_add(i64::try_from(lease.as_millis()).unwrap_or(i64::MAX));
        let updated = self
            .db
            .execute(
                query(
                    "UPDATE oncely_effects SET sent_at = $1, locked_until = $2, updated_at = $3 \
                     WHERE id = $4 AND lease_version = $5 AND locked_by = $6 \
                     AND state = 'in_flight'",
                )
                .bind(now_ms)
                .bind(lease_until)
                .bind(now_ms)
                .bind(effect.id.as_str())
                .bind(effect.lease_version)
                .bind(runner),
            )
            .await?;
        Ok(updated == 1)
    }

    /// The effect with `id`, if any.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn get(&self, id: &str) -> Result<Option<Effect>, StoreError> {
        let columns = self.columns();
        self.db
            .fetch_optional(
                query(format!(
                    "SELECT {columns} FROM oncely_effects WHERE id = $1"
                ))
                .bind(id),
            )
            .await
    }

    /// The effect of `provider`'s `operation` for `reference`, if any.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn find(
        &self,
        provider: &str,
        operation: &str,
        reference: &str,
    ) -> Result<Option<Effect>, StoreError> {
        let columns = self.columns();
        self.db
            .fetch_optional(
                query(format!(
                    "SELECT {columns} FROM oncely_effects \
                     WHERE provider = $1 AND operation = $2 AND reference = $3"
                ))
                .bind(provider)
                .bind(operation)
                .bind(reference),
            )
            .await
    }

    /// Up to `limit` effects, in `state` when given, oldest first.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn list(
        &self,
        state: Option<EffectState>,
        limit: u32,
    ) -> Result<Vec<Effect>, StoreError> {
        let columns = self.columns();
        let q = match state {
            Some(st) => query(format!(
                "SELECT {columns} FROM oncely_effects WHERE state = $1 \
                 ORDER BY created_at, id LIMIT $2"
            ))
            .bind(st.as_str()),
            None => query(format!(
                "SELECT {columns} FROM oncely_effects ORDER BY created_at, id LIMIT $1"
            )),
        };
        self.db.fetch_all(q.bind(i64::from(limit))).await
    }

    /// Per provider, the `updated_at` (Unix ms) of its longest-waiting effect in `state`
    /// (for the age of the oldest `unknown` effect).
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn oldest(&self, state: EffectState) -> Result<Vec<(String, i64)>, StoreError> {
        self.db
            .fetch_all(
                query(format!(
                    "SELECT {}, MIN(updated_at) FROM oncely_effects WHERE state = $1 \
                     GROUP BY provider ORDER BY provider",
                    self.db.backend().text_column("provider")
                ))
                .bind(state.as_str()),
            )
            .await
    }

    /// Effects per provider and state.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn counts(&self) -> Result<Vec<(String, String, i64)>, StoreError> {
        self.db
            .fetch_all(query(format!(
                "SELECT {}, state, COUNT(*) FROM oncely_effects GROUP BY provider, state \
                 ORDER BY provider, state",
                self.db.backend().text_column("provider")
            )))
            .await
    }
}
