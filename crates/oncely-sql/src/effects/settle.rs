//! Settling claimed effects: the fenced updates, in chunks, with the evidence of each attempt in `oncely_effect_attempts`.

use super::driver::{EffectsBackend, SettleRow};
use super::types::{Effect, EffectState, Evidence, EvidenceKind, EvidenceRow, Settle, SettleItem};
use super::EffectStore;
use crate::backend::with_tx;
use crate::{query, StoreError, Tx};

/// Rows per settle statement (each row binds 13 values, each evidence row 10: far below
/// every backend's placeholder limit).
pub(crate) const SETTLE_CHUNK: usize = 500;

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
pub(crate) struct SettleFields {
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

impl EffectStore {
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
    /// one multi-row update on every backend (see `EffectsBackend::settle_rows`), one
    /// grouped count of the evidence already recorded and one multi-row insert, instead
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
            held.extend(with_tx!(&mut *tx, |t: S| S::settle_rows(t, chunk, now_ms).await)?);
        }
        let kept: Vec<&SettleItem<'_>> = items
            .iter()
            .zip(&held)
            .filter_map(|(item, held)| held.then_some(item))
            .collect();
        for chunk in kept.chunks(SETTLE_CHUNK) {
            let rows: Vec<(&str, &Evidence)> = chunk
                .iter()
                .map(|item| (item.effect.id.as_str(), item.evidence))
                .collect();
            Self::record_evidence(tx, &rows).await?;
        }
        Ok(held)
    }

    /// Adds `evidence` to effect `effect_id` without changing the effect, in `tx`: what a
    /// provider said of an effect already settled (`succeeded`, `failed`, `needs_review`),
    /// which nobody settles any more. Numbered after the rows the effect has; a concurrent
    /// writer of the same effect's evidence makes this fail on the primary key
    /// `(effect_id, n)` rather than overwrite (the caller rolls back and may try again).
    ///
    /// # Errors
    /// [`StoreError`] when the database fails or the number was taken meanwhile.
    pub async fn note(tx: &mut Tx, effect_id: &str, evidence: &Evidence) -> Result<(), StoreError> {
        Self::record_evidence(tx, &[(effect_id, evidence)]).await
    }

    /// Records the evidence of `items` (effect id, evidence; their leases held): each
    /// numbered after the rows its effect already has — one grouped `COUNT` for all of them (only the lease holder
    /// records, so counting cannot race) — in one multi-row `INSERT`.
    pub(crate) async fn record_evidence(
        tx: &mut Tx,
        items: &[(&str, &Evidence)],
    ) -> Result<(), StoreError> {
        if items.is_empty() {
            return Ok(());
        }
        let placeholders: Vec<String> = (1..=items.len()).map(|i| format!("${i}")).collect();
        let mut counting = query(format!(
            "SELECT effect_id, COUNT(*) FROM oncely_effect_attempts \
             WHERE effect_id IN ({}) GROUP BY effect_id",
            placeholders.join(", ")
        ));
        for (id, _) in items {
            counting = counting.bind(*id);
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
        for (id, e) in items {
            let n = last.entry(*id).or_insert(0);
            *n += 1;
            insert = insert
                .bind(*id)
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
}
