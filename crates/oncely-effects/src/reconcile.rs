//! Reconciliation (docs/DESIGN.md "Multi-phase idempotency, unknown outcomes,
//! reconciliation"): both sides compared by stable reference over a window — every local
//! intent against the provider's records and every provider record against the local
//! intents — and what disagrees stored as a typed discrepancy.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures_util::future::BoxFuture;
use oncely_sql::{
    Discrepancy, DiscrepancyKind, DiscrepancyStore, Effect, EffectState, EffectStore, Enqueued,
    Evidence, EvidenceKind, NewDiscrepancy, NewEffect, ReconcileRun, Recorded, Resolution, Settle,
    StoreError,
};
use serde_json::json;

use crate::metrics as metric;
use crate::{EffectHandler, ObjectState, Provider, ProviderError, RemoteObject, Settled};

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
/// three questions, and [`Reconciler::with_source`] adds it: sources are asked in order and
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
/// update in the same transaction.
pub struct EffectsSource {
    store: EffectStore,
    handler: Arc<dyn EffectHandler>,
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
        let first_in = |state| found.iter().find(|o| o.state == state);
        let object = first_in(ObjectState::Live)
            .or_else(|| first_in(ObjectState::Pending))
            .or_else(|| first_in(ObjectState::Unrecognised))
            .unwrap_or(&found[0]);
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
        // vocabularies"): pending stays unknown for the runner's next check; a word nobody
        // listed is parked for a person; only an ended object fails the effect.
        let (settle, settled_error) = match object.state {
            ObjectState::Live => (
                Settle::Succeeded {
                    provider_id: object.id.clone(),
                    response: object.raw.to_string(),
                },
                None,
            ),
            ObjectState::Pending => return Ok(()),
            ObjectState::Ended => {
                let error = format!("found {} {}", object.id, object.status);
                (
                    Settle::Failed {
                        error: error.clone(),
                        response: Some(object.raw.to_string()),
                    },
                    Some((false, error)),
                )
            }
            _ => {
                let error = format!(
                    "found {} in a status the vocabulary does not list ({:?})",
                    object.id, object.status
                );
                (
                    Settle::NeedsReview {
                        error: error.clone(),
                    },
                    Some((true, error)),
                )
            }
        };
        let mut tx = self.store.database().begin().await?;
        EffectStore::settle(&mut tx, effect, &settle, &evidence, now).await?;
        let settled = match &settled_error {
            None => Settled::Succeeded(object),
            Some((false, error)) => Settled::Failed { error },
            Some((true, error)) => Settled::NeedsReview { error },
        };
        self.handler.settled(&mut tx, effect, settled).await?;
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

/// Settings of a [`Reconciler`].
#[derive(Debug, Clone)]
pub struct ReconcileConfig {
    /// The provider operation whose intents and records are compared (`charge` for
    /// payments, `book` for shipping: [`default_operation`]).
    pub operation: String,
    /// Clock skew allowed between us and the provider: its records are listed from the
    /// window's start minus this. Default 5 min.
    pub skew: Duration,
    /// Most pages read per run; a longer listing fails the run rather than report
    /// discrepancies from half a window. Default 10 000.
    pub max_pages: u32,
    /// Where a provider record carries the business object it acts for, as a JSON pointer
    /// (RFC 6901) into its raw answer. Two live records naming one business object under
    /// different references are a `duplicate_remote` whatever their keys (docs/DESIGN.md
    /// "One business effect per business role"): an order charged by two paths. Default
    /// `/metadata/order_id` (Stripe's metadata as oncely writes it); `None` turns it off.
    pub business_pointer: Option<String>,
}

impl ReconcileConfig {
    /// The settings for `operation`, defaults otherwise.
    pub fn new(operation: impl Into<String>) -> Self {
        Self {
            operation: operation.into(),
            skew: Duration::from_secs(300),
            max_pages: 10_000,
            business_pointer: Some("/metadata/order_id".to_owned()),
        }
    }
}

/// The operation reconciled by default for a provider name: `charge` for `payments`,
/// `book` for `shipping`; `None` for another name.
pub fn default_operation(provider: &str) -> Option<&'static str> {
    match provider {
        "payments" => Some("charge"),
        "shipping" => Some("book"),
        _ => None,
    }
}

/// A reconciliation run failed; nothing it found was recorded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReconcileError {
    /// The provider's records could not be read (unavailable, or an answer this adapter
    /// cannot read).
    #[error("listing the provider's records: {0}")]
    Provider(#[from] ProviderError),
    /// The local side could not be read or written.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The listing did not end within [`ReconcileConfig::max_pages`].
    #[error("the provider's listing did not end within {0} pages")]
    TooManyPages(u32),
}

/// What one run found.
#[derive(Debug, Clone, PartialEq)]
pub struct ReconcileReport {
    /// The run, as recorded.
    pub run: ReconcileRun,
    /// Pages of the provider's listing read.
    pub pages: u32,
    /// The discrepancies found, as stored (new ones and open ones refreshed), by kind then
    /// reference.
    pub discrepancies: Vec<Discrepancy>,
    /// How many found ones an operator had acknowledged or refunded before (not reported
    /// again).
    pub acknowledged: usize,
    /// Unknown intents completed from the provider's record (their ids).
    pub completed: Vec<String>,
    /// Unknown intents with no record in the window: still unknown, with evidence.
    pub still_unknown: Vec<String>,
}

/// The reconciler of one provider: pages through **all** of the provider's records of one
/// operation over a window, loads the local intents of that window, matches both by stable
/// reference ([`RemoteObject::reference`]: metadata `invoice_id` for payments,
/// `merchant_reference` for shipping — as the status check does), completes unknown intents
/// whose record exists, and records the rest as typed discrepancies (a re-run refreshes an
/// open one, never duplicates it). Sets the gauges of [`crate::metrics`] after each run.
pub struct Reconciler {
    provider: Arc<dyn Provider>,
    sources: Vec<Arc<dyn LocalSource>>,
    store: DiscrepancyStore,
    config: ReconcileConfig,
}

impl std::fmt::Debug for Reconciler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reconciler")
            .field("provider", &self.provider.name())
            .field("sources", &self.sources)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// Unix ms of `t` (0 before the epoch).
fn unix_ms(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

impl Reconciler {
    /// A reconciler of `provider` against the effects in `effects` (completions through
    /// `handler`), storing into the same database.
    pub fn new(
        provider: Arc<dyn Provider>,
        effects: EffectStore,
        handler: Arc<dyn EffectHandler>,
        config: ReconcileConfig,
    ) -> Self {
        let store = DiscrepancyStore::new(effects.database().clone());
        Self {
            provider,
            sources: vec![Arc::new(EffectsSource::new(effects, handler))],
            store,
            config,
        }
    }

    /// Adds a second source of local intents (asked after the ones before it).
    #[must_use]
    pub fn with_source(mut self, source: Arc<dyn LocalSource>) -> Self {
        self.sources.push(source);
        self
    }

    /// The discrepancy store.
    pub fn store(&self) -> &DiscrepancyStore {
        &self.store
    }

    /// Every record of the provider's operation created at or after `since`, all pages.
    async fn remote(&self, since: SystemTime) -> Result<(Vec<RemoteObject>, u32), ReconcileError> {
        let mut objects = Vec::new();
        let mut cursor: Option<String> = None;
        let mut pages = 0;
        loop {
            if pages >= self.config.max_pages {
                return Err(ReconcileError::TooManyPages(pages));
            }
            let page = self
                .provider
                .list(&self.config.operation, since, cursor.as_deref())
                .await?;
            pages += 1;
            objects.extend(page.objects);
            match page.next {
                Some(next) => cursor = Some(next),
                None => return Ok((objects, pages)),
            }
        }
    }

    /// The local intents of the window, then those the provider's records name from before
    /// it; the first source that knows a reference speaks for it.
    async fn local(
        &self,
        since_ms: i64,
        remote: &[RemoteObject],
    ) -> Result<BTreeMap<String, LocalIntent>, StoreError> {
        let (provider, op) = (self.provider.name(), self.config.operation.as_str());
        let mut local = BTreeMap::new();
        for source in &self.sources {
            for intent in source.intents(provider, op, since_ms).await? {
                local.entry(intent.reference.clone()).or_insert(intent);
            }
        }
        for reference in remote.iter().filter_map(|o| o.reference.as_deref()) {
            if local.contains_key(reference) {
                continue;
            }
            for source in &self.sources {
                if let Some(intent) = source.by_reference(provider, op, reference).await? {
                    local.insert(reference.to_owned(), intent);
                    break;
                }
            }
        }
        Ok(local)
    }

    /// One run over the window from `since`: see [`Reconciler`]. The run and what it found
    /// are recorded; the gauges set.
    ///
    /// # Errors
    /// [`ReconcileError`] when the provider cannot be listed or the store fails; a failed
    /// listing records nothing.
    pub async fn run(&self, since: SystemTime) -> Result<ReconcileReport, ReconcileError> {
        let started_at = oncely_core::now_ms();
        let run_id = uuid::Uuid::now_v7().to_string();
        let (remote, pages) = self.remote(since - self.config.skew).await?;
        let since_ms = unix_ms(since);
        let local = self.local(since_ms, &remote).await?;
        let mut findings = compare(self.provider.name(), &local, &remote);
        if let Some(pointer) = &self.config.business_pointer {
            findings.extend(duplicates_by_business(
                self.provider.name(),
                pointer,
                &remote,
            ));
        }
        let mut report = ReconcileReport {
            run: ReconcileRun {
                id: run_id.clone(),
                provider: self.provider.name().to_owned(),
                since_ms,
                started_at,
                finished_at: started_at,
                objects: remote.len() as i64,
                intents: local.len() as i64,
                discrepancies: 0,
                completed: 0,
            },
            pages,
            discrepancies: Vec::new(),
            acknowledged: 0,
            completed: Vec::new(),
            still_unknown: Vec::new(),
        };
        for finding in findings {
            self.apply(&run_id, finding, &mut report).await?;
        }
        report.run.finished_at = oncely_core::now_ms();
        report.run.discrepancies = report.discrepancies.len() as i64;
        report.run.completed = report.completed.len() as i64;
        self.store.record_run(&report.run).await?;
        self.record_gauges().await?;
        Ok(report)
    }

    async fn apply(
        &self,
        run_id: &str,
        finding: Finding<'_>,
        report: &mut ReconcileReport,
    ) -> Result<(), StoreError> {
        match finding {
            Finding::Discrepancy(new) => {
                match self
                    .store
                    .record(run_id, &new, oncely_core::now_ms())
                    .await?
                {
                    Recorded::New(d) | Recorded::Refreshed(d) => report.discrepancies.push(d),
                    Recorded::Acknowledged => report.acknowledged += 1,
                    _ => {}
                }
            }
            Finding::Unknown(intent, found) => {
                let Some(source) = self.sources.iter().find(|s| s.name() == intent.source) else {
                    return Ok(());
                };
                match source.complete(intent, &found, run_id).await? {
                    Completion::Completed => report.completed.push(intent.id.clone()),
                    Completion::StillUnknown => report.still_unknown.push(intent.id.clone()),
                    Completion::Busy => {}
                }
            }
        }
        Ok(())
    }

    /// Sets `oncely_reconcile_discrepancies{provider,kind}` (open ones) and
    /// `oncely_reconcile_last_run_timestamp_seconds{provider}` from the store.
    ///
    /// # Errors
    /// [`StoreError`] when the store cannot be read.
    pub async fn record_gauges(&self) -> Result<(), StoreError> {
        let provider = self.provider.name().to_owned();
        let counts = self.store.open_counts(&provider).await?;
        for kind in DiscrepancyKind::ALL {
            let n = counts.iter().find(|(k, _)| *k == kind).map_or(0, |c| c.1);
            metrics::gauge!(metric::RECONCILE_DISCREPANCIES, "provider" => provider.clone(), "kind" => kind.as_str())
                .set(n as f64);
        }
        if let Some((_, at)) = self
            .store
            .last_runs()
            .await?
            .into_iter()
            .find(|(p, _)| *p == provider)
        {
            metrics::gauge!(metric::RECONCILE_LAST_RUN_TIMESTAMP_SECONDS, "provider" => provider)
                .set(at as f64 / 1000.0);
        }
        Ok(())
    }
}

/// What comparing one reference found.
#[derive(Debug)]
enum Finding<'a> {
    Discrepancy(NewDiscrepancy),
    /// An unknown intent, with the records found for it (maybe none).
    Unknown(&'a LocalIntent, Vec<RemoteObject>),
}

/// Compares both sides by reference: every local intent against the records of its
/// reference, and every record against the local intents.
fn compare<'a>(
    provider: &str,
    local: &'a BTreeMap<String, LocalIntent>,
    remote: &[RemoteObject],
) -> Vec<Finding<'a>> {
    let mut by_reference: BTreeMap<String, Vec<RemoteObject>> = BTreeMap::new();
    for object in remote {
        // A record without a reference stands for itself, under its id.
        let key = object
            .reference
            .clone()
            .unwrap_or_else(|| object.id.clone());
        by_reference.entry(key).or_default().push(object.clone());
    }
    let mut findings = Vec::new();
    for (reference, intent) in local {
        let found = by_reference.remove(reference).unwrap_or_default();
        findings.extend(against_local(provider, intent, found));
    }
    for (reference, found) in by_reference {
        findings.push(Finding::Discrepancy(discrepancy(
            provider,
            DiscrepancyKind::MissingLocal,
            &reference,
            None,
            &found,
            None,
            "the provider has records no local intent names",
        )));
    }
    findings
}

/// Live records that name one business object (at `pointer` in their raw answers) under
/// more than one reference: one `duplicate_remote` per business object, its reference
/// `<pointer>=<value>`. Duplicates under one reference are `against_local`'s.
fn duplicates_by_business<'a>(
    provider: &str,
    pointer: &str,
    remote: &[RemoteObject],
) -> Vec<Finding<'a>> {
    let mut by_business: BTreeMap<String, Vec<RemoteObject>> = BTreeMap::new();
    for object in remote.iter().filter(|o| o.is_live()) {
        if let Some(value) = object.raw.pointer(pointer).and_then(|v| v.as_str()) {
            by_business
                .entry(value.to_owned())
                .or_default()
                .push(object.clone());
        }
    }
    by_business
        .into_iter()
        .filter(|(_, found)| {
            let references: std::collections::BTreeSet<_> =
                found.iter().map(|o| o.reference.as_deref()).collect();
            references.len() > 1
        })
        .map(|(value, found)| {
            Finding::Discrepancy(discrepancy(
                provider,
                DiscrepancyKind::DuplicateRemote,
                &format!("{pointer}={value}"),
                None,
                &found,
                None,
                &format!(
                    "{} live records for one business object under different references",
                    found.len()
                ),
            ))
        })
        .collect()
}

fn against_local<'a>(
    provider: &str,
    intent: &'a LocalIntent,
    found: Vec<RemoteObject>,
) -> Vec<Finding<'a>> {
    if intent.status == LocalStatus::Unknown {
        return vec![Finding::Unknown(intent, found)];
    }
    let live: Vec<&RemoteObject> = found.iter().filter(|o| o.is_live()).collect();
    let mut out = Vec::new();
    let mut report = |kind, object: Option<&RemoteObject>, detail: String| {
        out.push(Finding::Discrepancy(discrepancy(
            provider,
            kind,
            &intent.reference,
            Some(intent),
            &found,
            object,
            &detail,
        )));
    };
    match &intent.status {
        LocalStatus::InProgress | LocalStatus::Unknown => {}
        LocalStatus::Succeeded { provider_id } => {
            let matched = match provider_id {
                Some(id) => found.iter().find(|o| &o.id == id),
                None => live.first().copied(),
            };
            match matched {
                None => report(
                    DiscrepancyKind::MissingRemote,
                    None,
                    format!(
                        "recorded as succeeded with {}, the provider has no such record",
                        provider_id.as_deref().unwrap_or("no id")
                    ),
                ),
                Some(m) if !m.is_live() => report(
                    DiscrepancyKind::StatusMismatch,
                    Some(m),
                    format!("succeeded here, {} at the provider", m.status),
                ),
                Some(m) if amounts_differ(intent, m) => report(
                    DiscrepancyKind::AmountMismatch,
                    Some(m),
                    format!(
                        "{} {} here, {} {} at the provider",
                        intent.amount.unwrap_or_default(),
                        intent.currency.as_deref().unwrap_or("?"),
                        m.amount.unwrap_or_default(),
                        m.currency.as_deref().unwrap_or("?")
                    ),
                ),
                Some(_) => {}
            }
        }
        LocalStatus::Failed | LocalStatus::NeedsReview => {
            if let Some(m) = live.first() {
                report(
                    DiscrepancyKind::StatusMismatch,
                    Some(m),
                    format!(
                        "{} here, {} {} at the provider",
                        intent.state, m.id, m.status
                    ),
                );
            }
        }
    }
    if live.len() > 1 {
        report(
            DiscrepancyKind::DuplicateRemote,
            None,
            format!(
                "{} live records at the provider for one reference",
                live.len()
            ),
        );
    }
    out
}

fn amounts_differ(intent: &LocalIntent, object: &RemoteObject) -> bool {
    let amount = matches!((intent.amount, object.amount), (Some(a), Some(b)) if a != b);
    let currency = matches!(
        (&intent.currency, &object.currency),
        (Some(a), Some(b)) if !a.eq_ignore_ascii_case(b)
    );
    amount || currency
}

/// A discrepancy of `kind` on `reference`: the local side from `intent`, the remote side
/// from `object` (or the first record found).
fn discrepancy(
    provider: &str,
    kind: DiscrepancyKind,
    reference: &str,
    intent: Option<&LocalIntent>,
    found: &[RemoteObject],
    object: Option<&RemoteObject>,
    detail: &str,
) -> NewDiscrepancy {
    let remote = object.or(found.first());
    NewDiscrepancy {
        provider: provider.to_owned(),
        kind,
        reference: reference.to_owned(),
        tenant: intent.map(|i| i.tenant.clone()),
        effect_id: intent.map(|i| i.id.clone()),
        provider_ids: found.iter().map(|o| o.id.clone()).collect(),
        details: json!({
            "detail": detail,
            "source": intent.map(|i| i.source.clone()),
            "local_status": intent.map(|i| i.state.clone()),
            "local_amount": intent.and_then(|i| i.amount),
            "local_currency": intent.and_then(|i| i.currency.clone()),
            "remote_status": remote.map(|o| o.status.clone()),
            "remote_amount": remote.and_then(|o| o.amount),
            "remote_currency": remote.and_then(|o| o.currency.clone()),
            "remote_statuses": found.iter().map(|o| json!({"id": o.id, "status": o.status})).collect::<Vec<_>>(),
        }),
    }
}

/// An operator's action on a discrepancy ([`resolve`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ResolveAction {
    /// Any kind: a person looked and accepts it; the same provider, kind and reference is
    /// not reported again.
    Acknowledge,
    /// `status_mismatch` of an effect in `needs_review` (or `unknown`, `absent`) whose
    /// record is live at the provider: the effect is resolved as succeeded with that record
    /// (`provider_id`, or the one live record the run found).
    MarkSucceeded {
        /// The provider's object id; needed when the run found more than one.
        provider_id: Option<String>,
    },
    /// `duplicate_remote` or `missing_local` on payments: a refund of one PaymentIntent is
    /// enqueued as an effect (reference `refund:<id>`, its key derived from it, so asking
    /// twice refunds once); the effect runner sends it. Never the PaymentIntent a local
    /// effect recorded as its charge. Not reported again afterwards.
    Refund {
        /// The PaymentIntent to refund; needed when more than one could be meant.
        provider_id: Option<String>,
    },
}

impl ResolveAction {
    /// The action's word in the audit row: `acknowledge`, `mark-succeeded`, `refund`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Acknowledge => oncely_sql::ACKNOWLEDGE,
            Self::MarkSucceeded { .. } => "mark-succeeded",
            Self::Refund { .. } => oncely_sql::REFUND,
        }
    }
}

/// Resolves open discrepancy `id` by `action`, audited (actor, reason, what was done) — the
/// action's change and the discrepancy's closing commit together.
///
/// # Errors
/// [`StoreError::NotFound`] for an unknown id; [`StoreError::Conflict`] when it is resolved
/// already, or the action does not apply to its kind or state (the message says why);
/// other [`StoreError`]s when the database fails.
pub async fn resolve(
    store: &DiscrepancyStore,
    id: &str,
    action: &ResolveAction,
    actor: &str,
    reason: &str,
) -> Result<Discrepancy, StoreError> {
    let d = store
        .get(id)
        .await?
        .ok_or_else(|| StoreError::NotFound(id.to_owned()))?;
    let kind = d.kind()?;
    let now = oncely_core::now_ms();
    let effects = EffectStore::new(store.database().clone());
    let mut tx = store.database().begin().await?;
    let detail = match action {
        ResolveAction::Acknowledge => format!("{kind} acknowledged"),
        ResolveAction::MarkSucceeded { provider_id } => {
            mark_succeeded(
                &effects,
                &mut tx,
                &d,
                provider_id.as_deref(),
                actor,
                reason,
                now,
            )
            .await?
        }
        ResolveAction::Refund { provider_id } => {
            enqueue_refund(&effects, &mut tx, &d, provider_id.as_deref(), now).await?
        }
    };
    let resolved = store
        .resolve(&mut tx, id, action.as_str(), actor, reason, &detail, now)
        .await?;
    tx.commit().await?;
    Ok(resolved)
}

fn conflict(why: String) -> StoreError {
    StoreError::Conflict(why)
}

/// The one id of `ids` meant: `chosen` (which must be among them), or the only one.
fn one_of(ids: &[String], chosen: Option<&str>, what: &str) -> Result<String, StoreError> {
    match chosen {
        Some(c) if ids.iter().any(|i| i == c) => Ok(c.to_owned()),
        Some(c) => Err(conflict(format!(
            "{c} is not among the records found ({})",
            ids.join(", ")
        ))),
        None if ids.len() == 1 => Ok(ids[0].clone()),
        None => Err(conflict(format!(
            "more than one {what} could be meant ({}): name one with --provider-id",
            ids.join(", ")
        ))),
    }
}

async fn mark_succeeded(
    effects: &EffectStore,
    tx: &mut oncely_sql::Tx,
    d: &Discrepancy,
    provider_id: Option<&str>,
    actor: &str,
    reason: &str,
    now: i64,
) -> Result<String, StoreError> {
    let kind = d.kind()?;
    let Some(effect_id) = d
        .effect_id
        .as_deref()
        .filter(|_| kind == DiscrepancyKind::StatusMismatch)
    else {
        return Err(conflict(format!(
            "mark-succeeded applies to a status_mismatch of a local effect, not {kind}"
        )));
    };
    let live: Vec<String> = d.details_json()?["remote_statuses"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter(|o| {
                    matches!(
                        o["status"].as_str(),
                        Some("succeeded" | "booked" | "requires_capture")
                    )
                })
                .filter_map(|o| o["id"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    let pid = one_of(&live, provider_id, "live record")?;
    let resolution = Resolution {
        to: EffectState::Succeeded,
        provider_id: Some(&pid),
        actor,
        reason,
    };
    let effect = effects.resolve(tx, effect_id, &resolution, now).await?;
    Ok(format!(
        "effect {} resolved as succeeded with {pid}",
        effect.id
    ))
}

async fn enqueue_refund(
    effects: &EffectStore,
    tx: &mut oncely_sql::Tx,
    d: &Discrepancy,
    provider_id: Option<&str>,
    now: i64,
) -> Result<String, StoreError> {
    let kind = d.kind()?;
    if d.provider != "payments"
        || !matches!(
            kind,
            DiscrepancyKind::DuplicateRemote | DiscrepancyKind::MissingLocal
        )
    {
        return Err(conflict(format!(
            "refund applies to a payments duplicate_remote or missing_local, not {} {kind}",
            d.provider
        )));
    }
    // Never the charge a local effect recorded.
    let recorded = match d.effect_id.as_deref() {
        Some(id) => effects.get(id).await?.and_then(|e| e.provider_id),
        None => None,
    };
    let candidates: Vec<String> = d
        .provider_id_list()
        .into_iter()
        .filter(|i| Some(i) != recorded.as_ref())
        .collect();
    let pid = one_of(&candidates, provider_id, "PaymentIntent to refund")?;
    let reference = format!("refund:{pid}");
    let key = crate::next_key(&reference, 0);
    let request = json!({ "payment_intent": pid });
    let new = NewEffect {
        tenant: d.tenant.as_deref().unwrap_or("reconciliation"),
        provider: "payments",
        operation: "refund",
        reference: &reference,
        key: &key,
        request: &request,
    };
    Ok(match EffectStore::enqueue(tx, &new, now).await? {
        Enqueued::Created(effect) => format!("refund of {pid} enqueued as effect {effect}"),
        _ => format!("a refund of {pid} was enqueued before"),
    })
}
