//! Reconciliation (docs/DESIGN.md "Multi-phase idempotency, unknown outcomes,
//! reconciliation"): both sides compared by stable reference over a window — every local
//! intent against the provider's records and every provider record against the local
//! intents — and what disagrees stored as a typed discrepancy.

mod compare;
mod resolve;
mod source;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use oncely_sql::{
    Discrepancy, DiscrepancyKind, DiscrepancyStore, EffectStore, ReconcileRun, Recorded, StoreError,
};

use crate::metrics as metric;
use crate::{EffectHandler, Provider, ProviderError, RemoteObject};
use compare::{carry_business_ref, compare, duplicates_by_business, Finding};
pub use resolve::{resolve, ResolveAction};
pub use source::{Completion, EffectsSource, LocalIntent, LocalSource, LocalStatus};

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
    /// "One business effect per business role"): an order charged by two paths. Every
    /// discrepancy carries the value found there as `business_ref` in its details
    /// ([`oncely_sql::Discrepancy::business_ref`]), so a charge no local intent names still
    /// says which order it was for. Default `/metadata/order_id` (Stripe's metadata as
    /// oncely writes it); `None` turns both off.
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
    t.duration_since(UNIX_EPOCH).map_or(0, oncely_core::millis)
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

    /// A reconciler of `provider` against the effects in `effects` whose completions are
    /// left to the service's runner ([`crate::Continue::ByRunner`]): for a process that is
    /// not the service (`oncely reconcile`).
    pub fn by_runner(
        provider: Arc<dyn Provider>,
        effects: EffectStore,
        config: ReconcileConfig,
    ) -> Self {
        let store = DiscrepancyStore::new(effects.database().clone());
        Self {
            provider,
            sources: vec![Arc::new(EffectsSource::by_runner(effects))],
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
            for finding in &mut findings {
                if let Finding::Discrepancy(d) = finding {
                    carry_business_ref(d, pointer, &remote);
                }
            }
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
        // The provider's records are read and compared; nothing of this finding is written.
        oncely_core::failpoint::fail_point!("reconcile.before_apply");
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
        for &kind in DiscrepancyKind::ALL {
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
