//! The local side of a comparison: what the service believes it asked the provider for ([`LocalSource`], [`EffectsSource`] over the effect store).

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use oncely_sql::{Effect, EffectState, EffectStore, Evidence, EvidenceKind, Settle, StoreError};

use crate::runner::{continue_outcome, verdict};
use crate::{Continue, EffectHandler, RemoteObject};

/// Where a local intent stands, as reconciliation reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum LocalStatus {
    /// We hold the effect as done, with the provider's object id when recorded.
    Succeeded {
        /// The provider's object id.
        provider_id: Option<String>,
    },
    /// Refused for good: the provider should hold nothing live.
    Failed,
    /// The outcome is unknown: a record found at the provider completes it.
    Unknown,
    /// Parked for a person.
    NeedsReview,
    /// Not attempted yet or being attempted (pending, in flight, absent): not compared.
    InProgress,
}

/// One local intent of a provider's operation, from a [`LocalSource`].
#[derive(Debug, Clone, PartialEq)]
pub struct LocalIntent {
    /// The source's name ([`LocalSource::name`]).
    pub source: String,
    /// Its id in that source (an effect id).
    pub id: String,
    /// The tenant it acts for.
    pub tenant: String,
    /// The stable business reference (invoice id, order id).
    pub reference: String,
    /// Where it stands.
    pub status: LocalStatus,
    /// The source's own state word (`succeeded`, `unknown`, …), for the report.
    pub state: String,
    /// The amount asked for, smallest currency unit, where the operation has one.
    pub amount: Option<i64>,
    /// ISO 4217, lower case, where the operation has one.
    pub currency: Option<String>,
}

/// What [`LocalSource::complete`] did with an unknown intent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Completion {
    /// Settled from the provider's record (succeeded, or failed when the record is not
    /// live).
    Completed,
    /// Still unknown; the run's finding is recorded as evidence.
    StillUnknown,
    /// Left alone: a runner holds it right now (it is resolving it).
    Busy,
}

/// A source of local intents to reconcile. [`EffectsSource`] reads the effect store; a
/// later source (the multi-phase idempotency records of oncely-http) implements the same
/// three questions, and [`Reconciler::with_source`](crate::Reconciler::with_source) adds it: sources are asked in order and
/// the first that knows a reference speaks for it.
pub trait LocalSource: Send + Sync + std::fmt::Debug {
    /// The source's name, for the report (`effects`).
    fn name(&self) -> &str;

    /// The intents of `provider`'s `operation` created at or after `since_ms` (Unix ms).
    ///
    /// # Errors
    /// [`StoreError`] when the source cannot be read.
    fn intents<'a>(
        &'a self,
        provider: &'a str,
        operation: &'a str,
        since_ms: i64,
    ) -> BoxFuture<'a, Result<Vec<LocalIntent>, StoreError>>;

    /// The intent for `reference`, created at any time (a provider record inside the
    /// window may belong to an intent created before it).
    ///
    /// # Errors
    /// [`StoreError`] when the source cannot be read.
    fn by_reference<'a>(
        &'a self,
        provider: &'a str,
        operation: &'a str,
        reference: &'a str,
    ) -> BoxFuture<'a, Result<Option<LocalIntent>, StoreError>>;

    /// Completes an [`LocalStatus::Unknown`] intent from the provider's `found` records
    /// (empty: none in the window), recording the evidence.
    ///
    /// # Errors
    /// [`StoreError`] when the source cannot be written.
    fn complete<'a>(
        &'a self,
        intent: &'a LocalIntent,
        found: &'a [RemoteObject],
        run_id: &'a str,
    ) -> BoxFuture<'a, Result<Completion, StoreError>>;
}

/// The effect store as a [`LocalSource`]: effects by provider, operation and creation time;
/// an unknown one completed under a lease, as the runner would, with its handler's business
/// update in the same transaction — or, without the service's handler
/// ([`EffectsSource::by_runner`]), with the mark its runner continues from
/// ([`Continue::ByRunner`]).
pub struct EffectsSource {
    store: EffectStore,
    handler: Option<Arc<dyn EffectHandler>>,
    runner_id: String,
    lease: Duration,
}

impl std::fmt::Debug for EffectsSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EffectsSource")
            .field("runner_id", &self.runner_id)
            .finish_non_exhaustive()
    }
}

impl EffectsSource {
    /// The effects in `store`; completions go through `handler` (as the runner's do).
    pub fn new(store: EffectStore, handler: Arc<dyn EffectHandler>) -> Self {
        Self::with(store, Some(handler))
    }

    /// The effects in `store`; completions are left to the service's runner
    /// ([`Continue::ByRunner`]).
    pub fn by_runner(store: EffectStore) -> Self {
        Self::with(store, None)
    }

    fn with(store: EffectStore, handler: Option<Arc<dyn EffectHandler>>) -> Self {
        Self {
            store,
            handler,
            runner_id: format!("reconcile-{}", uuid::Uuid::new_v4()),
            lease: Duration::from_secs(60),
        }
    }

    fn intent(effect: &Effect) -> Result<LocalIntent, StoreError> {
        let state = effect.state()?;
        let status = match state {
            EffectState::Succeeded => LocalStatus::Succeeded {
                provider_id: effect.provider_id.clone(),
            },
            EffectState::Failed => LocalStatus::Failed,
            EffectState::Unknown => LocalStatus::Unknown,
            EffectState::NeedsReview => LocalStatus::NeedsReview,
            _ => LocalStatus::InProgress,
        };
        let params = effect.params()?;
        Ok(LocalIntent {
            source: "effects".to_owned(),
            id: effect.id.clone(),
            tenant: effect.tenant.clone(),
            reference: effect.reference.clone(),
            status,
            state: state.as_str().to_owned(),
            amount: params["amount"].as_i64(),
            currency: params["currency"].as_str().map(str::to_ascii_lowercase),
        })
    }

    async fn settle_found(
        &self,
        effect: &Effect,
        found: &[RemoteObject],
        run_id: &str,
    ) -> Result<(), StoreError> {
        let now = oncely_core::now_ms();
        let object = RemoteObject::deciding(found).unwrap_or(&found[0]);
        let evidence = Evidence {
            kind: EvidenceKind::Status,
            key: effect.key.clone(),
            started_at: now,
            finished_at: now,
            outcome: "found".to_owned(),
            http_status: None,
            provider_ids: found.iter().map(|o| o.id.clone()).collect(),
            detail: format!("reconciliation run {run_id}"),
        };
        // Three-valued, as the runner reads a status (docs/DESIGN.md "Status
        // vocabularies"): pending stays unknown for the runner's next check.
        let Some((settle, outcome)) = verdict(object) else {
            return Ok(());
        };
        let mut tx = self.store.database().begin().await?;
        EffectStore::settle(&mut tx, effect, &settle, &evidence, now).await?;
        let how = match &self.handler {
            Some(handler) => Continue::Here(&**handler),
            None => Continue::ByRunner,
        };
        continue_outcome(&mut tx, effect, &outcome, how, now).await?;
        tx.commit().await
    }

    async fn note_absent(&self, effect: &Effect, run_id: &str) -> Result<(), StoreError> {
        let now = oncely_core::now_ms();
        let detail =
            format!("reconciliation run {run_id}: no object at the provider in the window");
        let evidence = Evidence {
            kind: EvidenceKind::Status,
            key: effect.key.clone(),
            started_at: now,
            finished_at: now,
            outcome: "absent".to_owned(),
            http_status: None,
            provider_ids: Vec::new(),
            detail: detail.clone(),
        };
        // Stays unknown, due when it was: the runner's own status checks decide.
        let settle = Settle::Unknown {
            at: effect.available_at,
            error: effect.last_error.clone().unwrap_or(detail),
        };
        let mut tx = self.store.database().begin().await?;
        EffectStore::settle(&mut tx, effect, &settle, &evidence, now).await?;
        tx.commit().await
    }
}

impl LocalSource for EffectsSource {
    fn name(&self) -> &'static str {
        "effects"
    }

    fn intents<'a>(
        &'a self,
        provider: &'a str,
        operation: &'a str,
        since_ms: i64,
    ) -> BoxFuture<'a, Result<Vec<LocalIntent>, StoreError>> {
        Box::pin(async move {
            self.store
                .created_since(provider, operation, since_ms)
                .await?
                .iter()
                .map(Self::intent)
                .collect()
        })
    }

    fn by_reference<'a>(
        &'a self,
        provider: &'a str,
        operation: &'a str,
        reference: &'a str,
    ) -> BoxFuture<'a, Result<Option<LocalIntent>, StoreError>> {
        Box::pin(async move {
            self.store
                .find(provider, operation, reference)
                .await?
                .as_ref()
                .map(Self::intent)
                .transpose()
        })
    }

    fn complete<'a>(
        &'a self,
        intent: &'a LocalIntent,
        found: &'a [RemoteObject],
        run_id: &'a str,
    ) -> BoxFuture<'a, Result<Completion, StoreError>> {
        Box::pin(async move {
            let leased = self
                .store
                .lease_unknown(
                    &intent.id,
                    &self.runner_id,
                    self.lease,
                    oncely_core::now_ms(),
                )
                .await?;
            let Some(effect) = leased else {
                return Ok(Completion::Busy);
            };
            // An ended object of an earlier key says nothing of this key's attempt.
            let found = if effect.key_generation == 0 {
                found.to_vec()
            } else {
                let trail = self.store.evidence(&effect.id).await?;
                crate::runner::of_this_key(&effect, &trail, found.to_vec())
            };
            let found = found.as_slice();
            if found.is_empty() {
                self.note_absent(&effect, run_id).await?;
                Ok(Completion::StillUnknown)
            } else {
                self.settle_found(&effect, found, run_id).await?;
                Ok(Completion::Completed)
            }
        })
    }
}
