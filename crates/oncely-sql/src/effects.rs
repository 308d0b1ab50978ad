use std::time::Duration;

use crate::backend::{with_store, with_tx};
use crate::driver::Store;
use crate::{query, Database, StoreError, Tx};

/// The states of an outgoing effect (docs/DESIGN.md "External effects"):
/// `pending` → `in_flight` (attempt n, under a lease) → `succeeded` | `failed` |
/// `unknown` → resolution by status check → `succeeded` | `absent` (sent again with the
/// same key) | still `unknown` → `needs_review`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum EffectState {
    /// Recorded, not attempted yet (or waiting out a provider's unavailability).
    Pending,
    /// An attempt was started under a lease: the request may be on its way.
    InFlight,
    /// The provider made the object (its id is recorded).
    Succeeded,
    /// The provider refused for good (a declined card, an undeliverable shipment).
    Failed,
    /// The request may have reached the provider: its status must be checked before
    /// anything is sent again.
    Unknown,
    /// A status check proved the provider has no such object: it may be sent again with
    /// the same key.
    Absent,
    /// The resolution budget is spent and the outcome is still not known: a person decides,
    /// with the evidence.
    NeedsReview,
}

impl EffectState {
    /// Every state, in the order above.
    pub const ALL: [EffectState; 7] = [
        Self::Pending,
        Self::InFlight,
        Self::Succeeded,
        Self::Failed,
        Self::Unknown,
        Self::Absent,
        Self::NeedsReview,
    ];

    /// The stored word: `pending`, `in_flight`, `succeeded`, `failed`, `unknown`, `absent`,
    /// `needs_review`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::InFlight => "in_flight",
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
            Self::Unknown => "unknown",
            Self::Absent => "absent",
            Self::NeedsReview => "needs_review",
        }
    }

    /// The state a stored word names.
    ///
    /// # Errors
    /// [`StoreError::Corrupt`] for another word.
    pub fn parse(s: &str) -> Result<Self, StoreError> {
        Self::ALL
            .into_iter()
            .find(|st| st.as_str() == s)
            .ok_or_else(|| StoreError::Corrupt(format!("unknown effect state {s:?}")))
    }

    /// `true` for the states no runner touches again (succeeded, failed; needs_review until
    /// a person acts).
    pub fn is_settled(self) -> bool {
        matches!(self, Self::Succeeded | Self::Failed | Self::NeedsReview)
    }
}

impl std::fmt::Display for EffectState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The intent of one outgoing call, recorded with [`EffectStore::enqueue`] in the caller's
/// business transaction.
#[derive(Debug, Clone, Copy)]
pub struct NewEffect<'a> {
    /// The tenant the effect acts for (never shown to another).
    pub tenant: &'a str,
    /// The provider's name (`payments`, `shipping`).
    pub provider: &'a str,
    /// The provider's operation (`charge`, `refund`, `book`, `cancel`).
    pub operation: &'a str,
    /// The stable reference of the business object (invoice id, order id): at most one
    /// effect per provider, operation and reference.
    pub reference: &'a str,
    /// The idempotency key, derived from the parent operation — never minted per attempt.
    pub key: &'a str,
    /// The operation's parameters (a JSON object).
    pub request: &'a serde_json::Value,
}

/// An effect as stored.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Effect {
    /// Its id (UUIDv7).
    pub id: String,
    /// The tenant it acts for.
    pub tenant: String,
    /// The provider's name.
    pub provider: String,
    /// The provider's operation.
    pub operation: String,
    /// The business reference.
    pub reference: String,
    /// The idempotency key sent on every attempt.
    #[sqlx(rename = "idem_key")]
    pub key: String,
    /// Raised only when a status check proved a stored failure under the old key took no
    /// effect (see `oncely_effects::derive_key`).
    pub key_generation: i32,
    /// The parameters, JSON text.
    pub request: String,
    /// The state's stored word ([`Effect::state`] parses it).
    #[sqlx(rename = "state")]
    pub state_word: String,
    /// Calls started that counted (a provider being unavailable does not count).
    pub attempts: i32,
    /// Status checks made that reached the provider (one that found it unavailable does
    /// not count).
    pub checks: i32,
    /// Consecutive calls or status checks that found the provider unavailable (refused
    /// connection, 429, 503 — [`Settle::Unavailable`], or [`Settle::Retry`] that does not
    /// count): none of them is an attempt or a check, so this is what the outage backoff
    /// grows with. 0 after anything else.
    pub unavailable_streak: i32,
    /// When the effect is next due, Unix ms.
    pub available_at: i64,
    /// When its latest call was allowed out (the claim that made it `in_flight`), Unix ms;
    /// `None` before the first. A status check's settle time counts from it.
    pub sent_at: Option<i64>,
    /// The provider's object id, once known.
    pub provider_id: Option<String>,
    /// The provider's answer (JSON text), once known.
    pub response: Option<String>,
    /// What the latest attempt or check found, when it was not a success.
    pub last_error: Option<String>,
    /// The lease's version: every claim raises it, every settle names it.
    pub lease_version: i64,
    /// Unix ms.
    pub created_at: i64,
    /// Unix ms.
    pub updated_at: i64,
}

impl Effect {
    /// The effect's state.
    ///
    /// # Errors
    /// [`StoreError::Corrupt`] for a word no state has.
    pub fn state(&self) -> Result<EffectState, StoreError> {
        EffectState::parse(&self.state_word)
    }

    /// The parameters, parsed.
    ///
    /// # Errors
    /// [`StoreError::Corrupt`] when the stored text is not JSON.
    pub fn params(&self) -> Result<serde_json::Value, StoreError> {
        serde_json::from_str(&self.request)
            .map_err(|e| StoreError::Corrupt(format!("effect {} request: {e}", self.id)))
    }
}

/// What an operator found out about an effect ([`EffectStore::resolve`]).
#[derive(Debug, Clone, Copy)]
pub struct Resolution<'a> {
    /// [`EffectState::Succeeded`] or [`EffectState::Failed`].
    pub to: EffectState,
    /// The provider's object id (required for `Succeeded`).
    pub provider_id: Option<&'a str>,
    /// Who resolved it (for the audit row).
    pub actor: &'a str,
    /// Why (for the audit row).
    pub reason: &'a str,
}

/// What [`EffectStore::enqueue`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Enqueued {
    /// A new effect, with its id.
    Created(String),
    /// An effect for this provider, operation and reference (or key) already exists: a
    /// redelivered message or a retried request records nothing new.
    Existing,
}

/// The state an effect settles into, with what is known.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Settle {
    /// The provider's object exists.
    Succeeded {
        /// Its id.
        provider_id: String,
        /// The provider's answer, JSON text.
        response: String,
    },
    /// Refused for good.
    Failed {
        /// What was refused, and why.
        error: String,
        /// The provider's answer, when it left an object (a declined PaymentIntent).
        response: Option<String>,
    },
    /// Try the call again at `at` (Unix ms), same key. `counts`: whether the attempt just
    /// made counts toward the limit (`false` when the provider was unavailable: the attempt
    /// is taken back and [`Effect::unavailable_streak`] raised, as by
    /// [`Settle::Unavailable`]).
    Retry {
        /// When, Unix ms.
        at: i64,
        /// What failed.
        error: String,
        /// Whether the attempt counts.
        counts: bool,
    },
    /// The provider was unavailable (refused connection, 429, 503) for the call or the
    /// status check just made: neither counts (a call's attempt is taken back, a check is
    /// not added) and [`Effect::unavailable_streak`] is raised by one. A call goes back to
    /// `pending`, a status check leaves the effect `unknown`; either is due again at `at`
    /// (Unix ms).
    Unavailable {
        /// When, Unix ms.
        at: i64,
        /// What was seen.
        error: String,
    },
    /// The provider was unavailable for the call or status check just made, and the retry
    /// policy gave up (its deadline passed): neither counts, as with
    /// [`Settle::Unavailable`]. A call — never sent, or not acted upon — makes the effect
    /// `failed`; a status check leaves the outcome unknown, so the effect goes to
    /// `needs_review` (a person decides; never `failed`).
    GaveUpUnavailable {
        /// Why.
        error: String,
    },
    /// The outcome is unknown: check the status at `at` (Unix ms).
    Unknown {
        /// When, Unix ms.
        at: i64,
        /// What was seen.
        error: String,
    },
    /// A status check proved the provider has nothing: send again at `at` with key
    /// `key` (the same one, or — when a provider replays a stored failure under it — the
    /// next generation's).
    Absent {
        /// When, Unix ms.
        at: i64,
        /// The key of the next attempt.
        key: String,
        /// Its generation.
        key_generation: i32,
    },
    /// Park for a person, with the reason.
    NeedsReview {
        /// Why.
        error: String,
    },
}

/// The evidence of one call or status check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Evidence {
    /// `call` or `status`.
    pub kind: EvidenceKind,
    /// The key sent (or asked about).
    pub key: String,
    /// Unix ms.
    pub started_at: i64,
    /// Unix ms.
    pub finished_at: i64,
    /// The outcome class or finding (`succeeded`, `not_sent`, `unknown`, `retryable`,
    /// `failed`, `found`, `absent`, `not_yet_visible`, `unavailable`).
    pub outcome: String,
    /// The HTTP status, when there was an answer.
    pub http_status: Option<u16>,
    /// The provider ids seen.
    pub provider_ids: Vec<String>,
    /// What else was seen (the error, the reason).
    pub detail: String,
}

/// Whether [`Evidence`] is of a call or of a status check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EvidenceKind {
    /// A call to the provider.
    Call,
    /// A status check.
    Status,
}

/// One row of an effect's evidence, as stored.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct EvidenceRow {
    /// 1, 2, … in the order they were recorded.
    pub n: i32,
    /// `call` or `status`.
    pub kind: String,
    /// The key sent.
    #[sqlx(rename = "idem_key")]
    pub key: String,
    /// Unix ms.
    pub started_at: i64,
    /// Unix ms.
    pub finished_at: i64,
    /// See [`Evidence::outcome`].
    pub outcome: String,
    /// HTTP status.
    pub http_status: Option<i32>,
    /// Provider ids seen, comma-separated.
    pub provider_ids: String,
    /// See [`Evidence::detail`].
    pub detail: String,
}

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

/// The columns of [`Effect`], for `SELECT`s and `RETURNING`.
pub(crate) const EFFECT_COLUMNS: &str = "id, tenant, provider, operation, reference, \
    idem_key, key_generation, request, state, attempts, checks, unavailable_streak, \
    available_at, provider_id, response, last_error, lease_version, created_at, updated_at, \
    sent_at";

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

    /// Settles `effect` (as claimed, lease version included) into `settle` and records
    /// `evidence`, in `tx` — the caller adds the business update and the next outbox event
    /// to the same transaction and commits. [`EffectStore::settle_batch`] of one.
    ///
    /// # Errors
    /// [`StoreError::NotHeld`] when the lease was lost (another runner claimed the effect
    /// since): the caller rolls back. Other [`StoreError`]s when the database fails.
    pub async fn settle(
        tx: &mut Tx,
        effect: &Effect,
        settle: &Settle,
        evidence: &Evidence,
        now_ms: i64,
    ) -> Result<(), StoreError> {
        let item = SettleItem {
            effect,
            settle,
            evidence,
        };
        let held = Self::settle_batch(tx, &[item], now_ms).await?;
        if held.first() == Some(&true) {
            Ok(())
        } else {
            Err(StoreError::NotHeld)
        }
    }

    /// Settles every item of `items` in `tx` (a group commit): each effect's update fenced
    /// by the lease version it was claimed with, and the evidence of those still held —
    /// one multi-row update on SQLite and PostgreSQL (a fenced update per effect on MySQL),
    /// one grouped count of the evidence already recorded and one multi-row insert, instead
    /// of three statements per effect. Returns, per item in order, whether its lease was
    /// still held: an item whose lease was lost (another runner claimed the effect since)
    /// is `false` and writes nothing; the others are unaffected. The caller adds each held
    /// effect's business update to `tx` and commits.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails; the caller rolls back (nothing is settled).
    pub async fn settle_batch(
        tx: &mut Tx,
        items: &[SettleItem<'_>],
        now_ms: i64,
    ) -> Result<Vec<bool>, StoreError> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let rows: Vec<SettleRow> = items.iter().map(SettleRow::of).collect();
        let mut held = Vec::with_capacity(rows.len());
        for chunk in rows.chunks(SETTLE_CHUNK) {
            let done = with_tx!(&mut *tx, |t: S| S::settle_rows(t, chunk, now_ms).await)?;
            held.extend(match done {
                Some(done) => done,
                None => Self::settle_rows_one_by_one(tx, chunk, now_ms).await?,
            });
        }
        let kept: Vec<&SettleItem<'_>> = items
            .iter()
            .zip(&held)
            .filter_map(|(item, held)| held.then_some(item))
            .collect();
        for chunk in kept.chunks(SETTLE_CHUNK) {
            Self::record_evidence(tx, chunk).await?;
        }
        Ok(held)
    }

    /// The portable settle: one fenced `UPDATE` per row (its rows affected say whether the
    /// lease was held).
    async fn settle_rows_one_by_one(
        tx: &mut Tx,
        rows: &[SettleRow],
        now_ms: i64,
    ) -> Result<Vec<bool>, StoreError> {
        let mut held = Vec::with_capacity(rows.len());
        for r in rows {
            let n = tx
                .execute(
                    query(
                        "UPDATE oncely_effects SET attempts = attempts - $1, \
                         checks = checks + $2, state = $3, available_at = $4, provider_id = $5, \
                         response = $6, last_error = $7, idem_key = $8, key_generation = $9, \
                         locked_by = NULL, locked_until = NULL, updated_at = $10, \
                         unavailable_streak = $11 WHERE id = $12 AND lease_version = $13",
                    )
                    .bind(r.uncount)
                    .bind(r.checks)
                    .bind(r.state)
                    .bind(r.available_at)
                    .bind(r.provider_id.clone())
                    .bind(r.response.clone())
                    .bind(r.error.clone())
                    .bind(r.key.as_str())
                    .bind(r.key_generation)
                    .bind(now_ms)
                    .bind(r.streak)
                    .bind(r.id.as_str())
                    .bind(r.lease_version),
                )
                .await?;
            held.push(n > 0);
        }
        Ok(held)
    }

    /// Records the evidence of `items` (their leases held): each numbered after the rows
    /// its effect already has — one grouped `COUNT` for all of them (only the lease holder
    /// records, so counting cannot race) — in one multi-row `INSERT`.
    async fn record_evidence(tx: &mut Tx, items: &[&SettleItem<'_>]) -> Result<(), StoreError> {
        if items.is_empty() {
            return Ok(());
        }
        let placeholders: Vec<String> = (1..=items.len()).map(|i| format!("${i}")).collect();
        let mut counting = query(format!(
            "SELECT effect_id, COUNT(*) FROM oncely_effect_attempts \
             WHERE effect_id IN ({}) GROUP BY effect_id",
            placeholders.join(", ")
        ));
        for item in items {
            counting = counting.bind(item.effect.id.as_str());
        }
        // COUNT is a 64-bit integer on every backend (MAX(n) keeps n's own width).
        let counts: Vec<(String, i64)> = tx.fetch_all(counting).await?;
        let mut last: std::collections::HashMap<&str, i64> =
            counts.iter().map(|(id, n)| (id.as_str(), *n)).collect();
        let values: Vec<String> = (0..items.len())
            .map(|i| {
                let p = |k: usize| format!("${}", i * 10 + k);
                format!(
                    "({}, {}, {}, {}, {}, {}, {}, NULLIF({}, 0), {}, {})",
                    p(1),
                    p(2),
                    p(3),
                    p(4),
                    p(5),
                    p(6),
                    p(7),
                    p(8),
                    p(9),
                    p(10)
                )
            })
            .collect();
        let mut insert = query(format!(
            "INSERT INTO oncely_effect_attempts (effect_id, n, kind, idem_key, started_at, \
             finished_at, outcome, http_status, provider_ids, detail) VALUES {}",
            values.join(", ")
        ));
        for item in items {
            let e = item.evidence;
            let n = last.entry(item.effect.id.as_str()).or_insert(0);
            *n += 1;
            insert = insert
                .bind(item.effect.id.as_str())
                .bind(*n)
                .bind(match e.kind {
                    EvidenceKind::Call => "call",
                    EvidenceKind::Status => "status",
                })
                .bind(e.key.as_str())
                .bind(e.started_at)
                .bind(e.finished_at)
                .bind(e.outcome.as_str())
                // No status is bound as 0 and stored NULL: a bound NULL is text on
                // PostgreSQL, which an integer column refuses.
                .bind(e.http_status.map_or(0, i64::from))
                .bind(e.provider_ids.join(","))
                .bind(e.detail.as_str());
        }
        tx.execute(insert).await?;
        Ok(())
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

    /// The evidence of effect `id`, in order.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn evidence(&self, id: &str) -> Result<Vec<EvidenceRow>, StoreError> {
        self.db
            .fetch_all(
                query(
                    "SELECT n, kind, idem_key, started_at, finished_at, outcome, http_status, \
                     provider_ids, detail FROM oncely_effect_attempts WHERE effect_id = $1 \
                     ORDER BY n",
                )
                .bind(id),
            )
            .await
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

    /// An operator's retry of effect `id` (`oncely effects retry`), audited: a
    /// `needs_review` or `unknown` effect goes back to `unknown` with its status checks
    /// reset — the runner asks the provider's status before anything is sent, never a blind
    /// call; a `failed` effect becomes `absent` under `next_key` (its old key would replay
    /// the stored refusal), so the runner sends it again.
    ///
    /// # Errors
    /// [`StoreError::NotFound`] for an unknown id; [`StoreError::Conflict`] for an effect
    /// in another state (pending, in flight, succeeded, absent); other [`StoreError`]s
    /// when the database fails.
    pub async fn retry(
        &self,
        id: &str,
        next_key: &str,
        actor: &str,
        now_ms: i64,
    ) -> Result<Effect, StoreError> {
        let mut tx = self.db.begin().await?;
        self.retry_in(&mut tx, id, |_| next_key.to_owned(), actor, now_ms)
            .await?;
        tx.commit().await?;
        self.get(id)
            .await?
            .ok_or_else(|| StoreError::NotFound(id.to_owned()))
    }

    /// [`EffectStore::retry`] in the caller's transaction `tx`, so a change that depends
    /// on it (a saga step put back to wait for the effect) commits with it; `next_key`
    /// builds a failed effect's next key from the effect as locked. Returns the state the
    /// effect was in and the one it is in now.
    ///
    /// # Errors
    /// As [`EffectStore::retry`]; the caller rolls back.
    pub async fn retry_in(
        &self,
        tx: &mut Tx,
        id: &str,
        next_key: impl FnOnce(&Effect) -> String,
        actor: &str,
        now_ms: i64,
    ) -> Result<(EffectState, EffectState), StoreError> {
        let effect = self.locked(tx, id).await?;
        let next_key = next_key(&effect);
        let from = effect.state()?;
        let (to, sql) = match from {
            EffectState::NeedsReview | EffectState::Unknown => (
                EffectState::Unknown,
                "UPDATE oncely_effects SET state = 'unknown', checks = 0, \
                 unavailable_streak = 0, available_at = $1, updated_at = $2, \
                 lease_version = lease_version + 1 WHERE id = $3",
            ),
            EffectState::Failed => (
                EffectState::Absent,
                "UPDATE oncely_effects SET state = 'absent', unavailable_streak = 0, \
                 available_at = $1, updated_at = $2, lease_version = lease_version + 1, \
                 key_generation = key_generation + 1, idem_key = $3 WHERE id = $4",
            ),
            other => {
                return Err(StoreError::Conflict(format!(
                "effect {id} is {other}; only needs_review, unknown or failed effects are retried"
            )))
            }
        };
        let q = query(sql).bind(now_ms).bind(now_ms);
        let q = if to == EffectState::Absent {
            q.bind(next_key.as_str()).bind(id)
        } else {
            q.bind(id)
        };
        tx.execute(q).await?;
        let detail = format!("retry: {from} -> {to}");
        Self::audit(tx, id, now_ms, actor, "retry", from, to, &detail).await?;
        Ok((from, to))
    }

    /// An operator's resolution of effect `id` (`oncely effects resolve`), audited: a
    /// person who checked the provider records what happened — `succeeded` with the
    /// provider's object id, or `failed` — for an effect in `needs_review`, `unknown` or
    /// `absent`. Runs in the caller's `tx`, so the business update that follows (an invoice
    /// marked paid) commits with it.
    ///
    /// # Errors
    /// [`StoreError::NotFound`] for an unknown id; [`StoreError::Conflict`] for an effect
    /// in another state or `succeeded` without a provider id; other [`StoreError`]s when
    /// the database fails.
    pub async fn resolve(
        &self,
        tx: &mut Tx,
        id: &str,
        resolution: &Resolution<'_>,
        now_ms: i64,
    ) -> Result<Effect, StoreError> {
        let Resolution {
            to,
            provider_id,
            actor,
            reason,
        } = *resolution;
        let effect = self.locked(tx, id).await?;
        let from = effect.state()?;
        if !matches!(
            from,
            EffectState::NeedsReview | EffectState::Unknown | EffectState::Absent
        ) {
            return Err(StoreError::Conflict(format!(
                "effect {id} is {from}; only needs_review, unknown or absent effects are resolved"
            )));
        }
        match (to, provider_id) {
            (EffectState::Succeeded, Some(pid)) => {
                tx.execute(
                    query(
                        "UPDATE oncely_effects SET state = 'succeeded', provider_id = $1, \
                         last_error = NULL, updated_at = $2, lease_version = lease_version + 1 \
                         WHERE id = $3",
                    )
                    .bind(pid)
                    .bind(now_ms)
                    .bind(id),
                )
                .await?;
            }
            (EffectState::Failed, _) => {
                tx.execute(
                    query(
                        "UPDATE oncely_effects SET state = 'failed', last_error = $1, \
                         updated_at = $2, lease_version = lease_version + 1 WHERE id = $3",
                    )
                    .bind(format!("resolved by {actor}: {reason}"))
                    .bind(now_ms)
                    .bind(id),
                )
                .await?;
            }
            (EffectState::Succeeded, None) => {
                return Err(StoreError::Conflict(
                    "resolving as succeeded needs the provider's object id".to_owned(),
                ))
            }
            (other, _) => {
                return Err(StoreError::Conflict(format!(
                    "an effect is resolved as succeeded or failed, not {other}"
                )))
            }
        }
        let detail = match provider_id {
            Some(pid) => format!("resolve: {from} -> {to} ({pid}): {reason}"),
            None => format!("resolve: {from} -> {to}: {reason}"),
        };
        Self::audit(tx, id, now_ms, actor, "resolve", from, to, &detail).await?;
        let columns = self.columns();
        tx.fetch_one(
            query(format!(
                "SELECT {columns} FROM oncely_effects WHERE id = $1"
            ))
            .bind(id),
        )
        .await
    }

    /// The audit rows of effect `id`, oldest first: `(at, actor, action, from, to, detail)`.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn audit_trail(
        &self,
        id: &str,
    ) -> Result<Vec<(i64, String, String, String, String, String)>, StoreError> {
        self.db
            .fetch_all(
                query(
                    "SELECT at, actor, action, from_state, to_state, detail \
                     FROM oncely_effect_audit WHERE effect_id = $1 ORDER BY id",
                )
                .bind(id),
            )
            .await
    }

    /// Effect `id`, its row locked by `tx` (`SELECT … FOR UPDATE`; SQLite's writer holds
    /// the whole database) so a runner's settle cannot interleave with the operator's
    /// change — the lease version the change raises fences the runner off afterwards.
    async fn locked(&self, tx: &mut Tx, id: &str) -> Result<Effect, StoreError> {
        let columns = self.columns();
        let lock = if self.db.backend().supports_row_locks() {
            " FOR UPDATE"
        } else {
            ""
        };
        tx.fetch_optional(
            query(format!(
                "SELECT {columns} FROM oncely_effects WHERE id = $1{lock}"
            ))
            .bind(id),
        )
        .await?
        .ok_or_else(|| StoreError::NotFound(id.to_owned()))
    }

    #[allow(clippy::too_many_arguments)] // one audit row's columns, each named at the call
    async fn audit(
        tx: &mut Tx,
        id: &str,
        at: i64,
        actor: &str,
        action: &str,
        from: EffectState,
        to: EffectState,
        detail: &str,
    ) -> Result<(), StoreError> {
        tx.execute(
            query(
                "INSERT INTO oncely_effect_audit (effect_id, at, actor, action, from_state, \
                 to_state, detail) VALUES ($1, $2, $3, $4, $5, $6, $7)",
            )
            .bind(id)
            .bind(at)
            .bind(actor)
            .bind(action)
            .bind(from.as_str())
            .bind(to.as_str())
            .bind(detail),
        )
        .await?;
        Ok(())
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

/// One effect's settle in [`EffectStore::settle_batch`]: the effect as claimed (its lease
/// version fences the update), the state it settles into and the evidence of the call or
/// status check.
#[derive(Debug, Clone, Copy)]
pub struct SettleItem<'a> {
    /// The effect as claimed.
    pub effect: &'a Effect,
    /// What it settles into.
    pub settle: &'a Settle,
    /// The evidence of the call or status check just made.
    pub evidence: &'a Evidence,
}

/// Rows per settle statement (each row binds 13 values, each evidence row 10: far below
/// every backend's placeholder limit).
const SETTLE_CHUNK: usize = 500;

/// One effect's fenced settle update, as every backend binds it.
pub(crate) struct SettleRow {
    pub(crate) id: String,
    /// The version the effect was claimed with: the update applies only while it holds.
    pub(crate) lease_version: i64,
    /// Subtracted from `attempts`.
    pub(crate) uncount: i64,
    /// Added to `checks`.
    pub(crate) checks: i64,
    pub(crate) state: &'static str,
    pub(crate) available_at: i64,
    pub(crate) provider_id: Option<String>,
    pub(crate) response: Option<String>,
    pub(crate) error: Option<String>,
    pub(crate) key: String,
    pub(crate) key_generation: i64,
    /// The new `unavailable_streak`.
    pub(crate) streak: i64,
}

impl SettleRow {
    fn of(item: &SettleItem<'_>) -> Self {
        let (effect, evidence) = (item.effect, item.evidence);
        let f = SettleFields::of(effect, item.settle);
        Self {
            id: effect.id.clone(),
            lease_version: effect.lease_version,
            uncount: f.uncount,
            checks: i64::from(evidence.kind == EvidenceKind::Status && f.counts_check),
            state: f.state.as_str(),
            available_at: f.available_at.unwrap_or(effect.available_at),
            provider_id: f.provider_id,
            response: f.response,
            error: f.error,
            key: f.key,
            key_generation: f.key_generation,
            streak: if f.raise_streak {
                i64::from(effect.unavailable_streak).saturating_add(1)
            } else {
                0
            },
        }
    }
}

/// The column values a [`Settle`] writes.
struct SettleFields {
    state: EffectState,
    available_at: Option<i64>,
    provider_id: Option<String>,
    response: Option<String>,
    error: Option<String>,
    key: String,
    key_generation: i64,
    /// 1 when the attempt the claim counted is taken back (the provider was unavailable).
    uncount: i64,
    /// The provider was unavailable and will be tried again: the streak is raised (else it
    /// is reset).
    raise_streak: bool,
    /// `false` when the provider was unavailable: a status check made is not counted.
    counts_check: bool,
}

impl SettleFields {
    fn of(effect: &Effect, settle: &Settle) -> Self {
        let mut f = Self {
            state: EffectState::Pending,
            available_at: None,
            provider_id: effect.provider_id.clone(),
            response: effect.response.clone(),
            error: None,
            key: effect.key.clone(),
            key_generation: i64::from(effect.key_generation),
            uncount: 0,
            raise_streak: false,
            counts_check: true,
        };
        match settle {
            Settle::Succeeded {
                provider_id,
                response,
            } => {
                f.state = EffectState::Succeeded;
                f.provider_id = Some(provider_id.clone());
                f.response = Some(response.clone());
            }
            Settle::Failed { error, response } => {
                f.state = EffectState::Failed;
                f.error = Some(error.clone());
                if response.is_some() {
                    f.response.clone_from(response);
                }
            }
            Settle::Retry { at, error, counts } => {
                f.available_at = Some(*at);
                f.error = Some(error.clone());
                f.uncount = i64::from(!counts && effect.state_word == "in_flight");
                f.raise_streak = !counts;
                f.counts_check = *counts;
            }
            Settle::Unavailable { at, error } => {
                if effect.state_word == "unknown" {
                    f.state = EffectState::Unknown;
                }
                f.available_at = Some(*at);
                f.error = Some(error.clone());
                f.uncount = i64::from(effect.state_word == "in_flight");
                f.raise_streak = true;
                f.counts_check = false;
            }
            Settle::GaveUpUnavailable { error } => {
                f.state = if effect.state_word == "unknown" {
                    EffectState::NeedsReview
                } else {
                    EffectState::Failed
                };
                f.error = Some(error.clone());
                f.uncount = i64::from(effect.state_word == "in_flight");
                f.counts_check = false;
            }
            Settle::Unknown { at, error } => {
                f.state = EffectState::Unknown;
                f.available_at = Some(*at);
                f.error = Some(error.clone());
            }
            Settle::Absent {
                at,
                key,
                key_generation,
            } => {
                f.state = EffectState::Absent;
                f.available_at = Some(*at);
                f.key.clone_from(key);
                f.key_generation = i64::from(*key_generation);
            }
            Settle::NeedsReview { error } => {
                f.state = EffectState::NeedsReview;
                f.error = Some(error.clone());
            }
        }
        f
    }
}

/// A claim's parameters, handed to each backend.
pub(crate) struct Claim<'a> {
    pub(crate) provider: &'a str,
    pub(crate) runner: &'a str,
    pub(crate) limit: i64,
    pub(crate) lease_until: i64,
    pub(crate) now_ms: i64,
}

/// The `SET` list of a claim, shared by every backend. `attempts` comes first: MySQL
/// evaluates assignments left to right, so a later one would see the new `state`.
pub(crate) const CLAIM_SET: &str = "attempts = CASE WHEN state IN ('pending', 'absent') \
    THEN attempts + 1 ELSE attempts END, \
    sent_at = CASE WHEN state IN ('pending', 'absent') THEN $3 ELSE sent_at END, \
    state = CASE WHEN state IN ('pending', 'absent') THEN 'in_flight' ELSE 'unknown' END, \
    locked_by = $1, locked_until = $2, lease_version = lease_version + 1, updated_at = $3";

/// The due-rows condition of a claim (`$4` provider, `$3` now).
pub(crate) const CLAIM_DUE: &str = "provider = $4 AND state IN ('pending', 'absent', 'unknown', \
    'in_flight') AND available_at <= $3 AND (locked_until IS NULL OR locked_until < $3)";

/// The effect store's per-backend half: the claim (its locking differs per backend).
pub(crate) trait EffectsBackend: Store {
    /// The select list that decodes into [`Effect`] on this backend.
    const COLUMNS: &'static str = EFFECT_COLUMNS;

    /// Claims as [`EffectStore::claim`] documents, returning the claimed rows as updated.
    async fn claim(&self, claim: &Claim<'_>) -> Result<Vec<Effect>, StoreError>;

    /// Applies `rows` in `tx` in one statement, each fenced by its lease version, setting
    /// `updated_at` to `now_ms`; per row whether it was held. `None` (the default) where
    /// the backend has no multi-row update with `RETURNING`: the portable one-by-one
    /// update runs instead.
    async fn settle_rows(
        tx: &mut Self::Tx,
        rows: &[SettleRow],
        now_ms: i64,
    ) -> Result<Option<Vec<bool>>, StoreError> {
        let _ = (tx, rows, now_ms);
        Ok(None)
    }
}

/// Per row of `rows`, whether `updated` (the `(id, lease_version)` pairs a multi-row
/// settle returned) holds it.
pub(crate) fn held_rows(rows: &[SettleRow], updated: &[(String, i64)]) -> Vec<bool> {
    let updated: std::collections::HashSet<(&str, i64)> =
        updated.iter().map(|(id, v)| (id.as_str(), *v)).collect();
    rows.iter()
        .map(|r| updated.contains(&(r.id.as_str(), r.lease_version)))
        .collect()
}
