use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use futures_util::future::BoxFuture;
use oncely_core::{Failure, GiveUpReason, OutcomeClass, RetryBudget, RetryDecision, RetryPolicy};
use oncely_sql::{
    Effect, EffectState, EffectStore, Evidence, EvidenceKind, Settle, SettleItem, StoreError, Tx,
};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::metrics as metric;
use crate::next_key;
use crate::{
    CallOutcome, EffectRequest, ObjectState, Provider, RemoteObject, StatusOutcome, StatusQuery,
};

/// How an effect ended, handed to [`EffectHandler::settled`].
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum Settled<'a> {
    /// The provider's object exists (made by the call, or found by the status check).
    Succeeded(&'a RemoteObject),
    /// Refused for good.
    Failed {
        /// Why.
        error: &'a str,
    },
    /// Parked for a person: the outcome could not be determined within the budget.
    NeedsReview {
        /// Why.
        error: &'a str,
    },
}

/// The service's part of an effect's completion: runs in the transaction that settles the
/// effect, so the effect's result, the business update (an invoice marked paid) and the
/// next outbox event commit together — or, on an error, none of them (the effect is then
/// checked again after its lease, never called blindly).
pub trait EffectHandler: Send + Sync {
    /// Called once per settled effect, inside `tx`.
    ///
    /// # Errors
    /// A [`StoreError`] rolls the settle back.
    fn settled<'a>(
        &'a self,
        tx: &'a mut Tx,
        effect: &'a Effect,
        outcome: Settled<'a>,
    ) -> BoxFuture<'a, Result<(), StoreError>>;
}

/// A handler that does nothing beyond settling the effect.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoHandler;

impl EffectHandler for NoHandler {
    fn settled<'a>(
        &'a self,
        _tx: &'a mut Tx,
        _effect: &'a Effect,
        _outcome: Settled<'a>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async { Ok(()) })
    }
}

/// Settings of an [`EffectRunner`].
#[derive(Debug, Clone)]
pub struct RunnerConfig {
    /// This runner's name in leases (unique per process). Default a UUIDv4.
    pub runner_id: String,
    /// How long a claimed effect stays this runner's; must exceed the provider's timeout.
    /// Default 60 s.
    pub lease: Duration,
    /// Pause between claims when nothing was due. Default 200 ms.
    pub poll: Duration,
    /// Effects claimed per provider per claim, at most; also how many claimed effects may
    /// wait for a free call slot (so a call that returns is followed at once by the next,
    /// without a claim in between). A busy runner claims again once half a batch has room.
    /// Default 16.
    pub batch: u32,
    /// Calls (or status checks) in flight per provider, at most. A call's slot is freed as
    /// soon as the provider answers: recording the outcome happens in the settle stage,
    /// under the effect's lease. Default 8.
    pub concurrency: usize,
    /// Outcomes settled together in one transaction, at most (a group commit): the settle
    /// stage takes every outcome that is ready, up to this many, and commits their fenced
    /// updates, evidence and business updates ([`EffectHandler::settled`]) at once. An
    /// effect whose lease was lost is skipped without affecting the others; when the group's
    /// transaction fails (a handler's error, a database error), each outcome is settled
    /// again in a transaction of its own, so one bad effect never holds back the rest.
    /// Default 64; 1 settles every outcome alone.
    pub settle_batch: usize,
    /// Calls whose attempt counts (a call whose outcome a status check proved absent is
    /// sent again after this backoff): backoff, attempt limit, and the deadline, measured
    /// from the intent's creation — it also bounds the waits of [`RunnerConfig::outage`]
    /// and the status checks of an unknown outcome. Past the limit or the deadline an
    /// effect that provably did not happen is `failed`; one whose outcome is unknown goes
    /// to `needs_review`. Default: 500 ms base, 5 min cap, 10 attempts, no deadline.
    pub retry: RetryPolicy,
    /// Waits while a provider is unavailable (refused connections, 429, 503): full jitter
    /// over the effect's consecutive-unavailable streak ([`Effect::unavailable_streak`]),
    /// `Retry-After` honoured up to `retry_after_ceiling`, `cap` once the provider's retry
    /// budget is spent. These never count as attempts; `max_attempts` and `deadline` are
    /// ignored (the deadline is [`RunnerConfig::retry`]'s). Default: 1 s base, 1 min cap.
    pub outage: RetryPolicy,
    /// Tokens of each provider's [`RetryBudget`] (every retry of a call or of a status
    /// check that found the provider unavailable withdraws
    /// [`RetryBudget::RETRY_COST`]; successes refill it). Default
    /// [`RetryBudget::DEFAULT_CAPACITY`] (500).
    pub budget_capacity: u32,
    /// First status check after an unknown outcome. Default 1 s.
    pub check_delay: Duration,
    /// Status checks after which a still-unknown effect goes to `needs_review` (a check that
    /// found the provider unavailable does not count). Default 20.
    pub max_checks: u32,
    /// Fault injection (crash tests and chaos drills only): abort the process
    /// (`std::process::abort`) right after a provider call returned and before its outcome
    /// is handed to the settle stage — the crash window in which the effect may have happened while the store
    /// still says `in_flight`. The `oncely` binary sets it from
    /// `ONCELY_FAULT=runner-abort-after-call`. Default `false`.
    pub abort_after_call: bool,
}

impl Default for RunnerConfig {
    fn default() -> Self {
        Self {
            runner_id: uuid::Uuid::new_v4().to_string(),
            lease: Duration::from_secs(60),
            poll: Duration::from_millis(200),
            batch: 16,
            concurrency: 8,
            settle_batch: 64,
            retry: RetryPolicy::default(),
            outage: RetryPolicy {
                base: Duration::from_secs(1),
                cap: Duration::from_secs(60),
                max_attempts: u32::MAX,
                ..RetryPolicy::default()
            },
            check_delay: Duration::from_secs(1),
            max_checks: 20,
            budget_capacity: RetryBudget::DEFAULT_CAPACITY,
            abort_after_call: false,
        }
    }
}

/// One provider as the runner holds it: the adapter, its retry budget, and the three limits
/// of its pipeline (claim → call → settle).
struct Lane {
    provider: Arc<dyn Provider>,
    budget: Arc<RetryBudget>,
    /// Calls or status checks in flight: [`RunnerConfig::concurrency`].
    calls: Arc<Semaphore>,
    /// Claimed effects not yet answered (in flight or waiting for a call slot):
    /// `concurrency + batch`, so at most a batch waits for a slot.
    claimed: Arc<Semaphore>,
    /// Claimed effects not yet settled: `concurrency + batch + settle_batch`, so outcomes
    /// never pile up faster than they are settled.
    unsettled: Arc<Semaphore>,
    /// Not claimed again before this instant: the last claim came back short (nothing
    /// more is due), so a busy lane polls instead of claiming on every freed slot.
    next_claim: std::sync::Mutex<std::time::Instant>,
}

impl Lane {
    /// How many effects a claim may take now.
    fn room(&self, batch: usize) -> usize {
        self.claimed
            .available_permits()
            .min(self.unsettled.available_permits())
            .min(batch)
    }

    /// `true` while any claimed effect is not settled yet.
    fn busy(&self, capacity: usize) -> bool {
        self.unsettled.available_permits() < capacity
    }
}

/// An outcome waiting in the settle stage: what the call or check found, to be committed
/// under the effect's lease; `permit` holds the effect's place in the lane's
/// [`Lane::unsettled`] until then.
struct Pending {
    effect: Effect,
    settle: Settle,
    evidence: Evidence,
    outcome: Option<Outcome>,
}

/// [`Settled`], owned, while its outcome waits in the settle stage.
enum Outcome {
    Succeeded(RemoteObject),
    Failed(String),
    NeedsReview(String),
}

impl Pending {
    fn settled(&self) -> Option<Settled<'_>> {
        self.outcome.as_ref().map(|o| match o {
            Outcome::Succeeded(object) => Settled::Succeeded(object),
            Outcome::Failed(error) => Settled::Failed { error },
            Outcome::NeedsReview(error) => Settled::NeedsReview { error },
        })
    }

    fn item(&self) -> SettleItem<'_> {
        SettleItem {
            effect: &self.effect,
            settle: &self.settle,
            evidence: &self.evidence,
        }
    }
}

/// A [`Pending`] outcome with the effect's place in its lane.
struct Done {
    pending: Pending,
    _unsettled: OwnedSemaphorePermit,
}

/// The effect runner, a library runtime like the outbox relay: claims due effects per
/// provider, calls or checks each once, and settles it with its evidence — the effect's
/// result, the handler's business update and its next event in one transaction. Any number
/// of runners may share a store: leases keep each effect with one of them.
///
/// Each provider's lane is a pipeline: claims (in batches, up to [`RunnerConfig::batch`]
/// ahead of the calls), calls or status checks ([`RunnerConfig::concurrency`] at a time, a
/// slot freed as soon as the provider answers), and one settle stage that commits the
/// outcomes ready together ([`RunnerConfig::settle_batch`], a group commit). Between the
/// answer and the commit the effect is still `in_flight` or `unknown` under its lease, as
/// while the call was out: a runner that dies there leaves it to be checked by status, never
/// called blindly.
///
/// Per claimed effect:
/// - `in_flight` (a call may go out): call once with the recorded key. Success or a final
///   refusal settles it; an unknown outcome makes it `unknown`; an unavailable provider
///   (refused, 429, 503) waits (`Retry-After` honoured) without counting an attempt, the
///   wait growing with the effect's consecutive-unavailable streak, and the provider's
///   [`RetryBudget`] spaces the waits out when it fails broadly.
/// - `unknown`: ask the status by reference — never call. Found: settled from the
///   provider's object. Absent: sent again with the same key (a provider that replays a
///   stored 500 under it gets the key's next generation, which cannot duplicate: nothing
///   exists), after [`RunnerConfig::retry`]'s backoff — or `failed` once its attempt limit
///   or deadline is reached (nothing happened at the provider). Not yet visible: asked
///   again when the lookup settles. Unavailable: asked again after the outage wait. After
///   `max_checks`, or past the deadline: `needs_review`.
///
/// Every retry-or-give-up choice goes through [`RetryPolicy::decide`]: one decision for a
/// provider that was unavailable, one for a call proven absent, one for an unknown outcome.
pub struct EffectRunner {
    store: EffectStore,
    lanes: HashMap<String, Lane>,
    handler: Arc<dyn EffectHandler>,
    config: RunnerConfig,
    /// Signalled when a call or check returns or an outcome is settled: room to claim.
    freed: tokio::sync::Notify,
}

impl std::fmt::Debug for EffectRunner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EffectRunner")
            .field("providers", &self.lanes.keys().collect::<Vec<_>>())
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

fn now_ms() -> i64 {
    oncely_core::now_ms()
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

impl EffectRunner {
    /// A runner over `store` for `providers` (by [`Provider::name`]), completing effects
    /// through `handler`.
    pub fn new(
        store: EffectStore,
        providers: Vec<Arc<dyn Provider>>,
        handler: Arc<dyn EffectHandler>,
        config: RunnerConfig,
    ) -> Self {
        let concurrency = config.concurrency.max(1);
        let batch = config.batch.max(1) as usize;
        let lanes = providers
            .into_iter()
            .map(|p| {
                let lane = Lane {
                    provider: p.clone(),
                    budget: Arc::new(RetryBudget::new(config.budget_capacity)),
                    calls: Arc::new(Semaphore::new(concurrency)),
                    claimed: Arc::new(Semaphore::new(concurrency + batch)),
                    unsettled: Arc::new(Semaphore::new(
                        concurrency + batch + config.settle_batch.max(1),
                    )),
                    next_claim: std::sync::Mutex::new(std::time::Instant::now()),
                };
                (p.name().to_owned(), lane)
            })
            .collect();
        Self {
            store,
            lanes,
            handler,
            config,
            freed: tokio::sync::Notify::new(),
        }
    }

    /// The retry budget of `provider` (by [`Provider::name`]), `None` for a provider this
    /// runner does not hold.
    pub fn budget(&self, provider: &str) -> Option<&RetryBudget> {
        self.lanes.get(provider).map(|l| &*l.budget)
    }

    /// Sets the gauges from the store: effects per provider and state, those in
    /// `needs_review`, and the age of the oldest `unknown` one (see [`crate::metrics`]).
    ///
    /// # Errors
    /// [`StoreError`] when the store cannot be read.
    pub async fn record_gauges(&self) -> Result<(), StoreError> {
        let counts = self.store.counts().await?;
        for name in self.lanes.keys() {
            for state in EffectState::ALL {
                let n = counts
                    .iter()
                    .find(|(p, s, _)| p == name && s == state.as_str())
                    .map_or(0, |c| c.2);
                metrics::gauge!(metric::EFFECTS, "provider" => name.clone(), "state" => state.as_str())
                    .set(n as f64);
                if state == EffectState::NeedsReview {
                    metrics::gauge!(metric::NEEDS_REVIEW, "provider" => name.clone()).set(n as f64);
                }
            }
        }
        let oldest = self.store.oldest(EffectState::Unknown).await?;
        let now = now_ms();
        for name in self.lanes.keys() {
            let age = oldest
                .iter()
                .find(|(p, _)| p == name)
                .map_or(0.0, |(_, at)| (now - at).max(0) as f64 / 1000.0);
            metrics::gauge!(metric::OLDEST_UNKNOWN_AGE_SECONDS, "provider" => name.clone())
                .set(age);
        }
        Ok(())
    }

    /// Runs until `shutdown` is cancelled, then waits for the calls in flight and settles
    /// their outcomes. Refreshes the gauges every 5 s.
    pub async fn run(self: Arc<Self>, shutdown: CancellationToken) {
        let tasks = tokio_util::task::TaskTracker::new();
        let (settle_tx, settler) = self.start_settler();
        let mut gauges_at = std::time::Instant::now();
        while !shutdown.is_cancelled() {
            if gauges_at.elapsed() >= Duration::from_secs(5) {
                gauges_at = std::time::Instant::now();
                if let Err(e) = self.record_gauges().await {
                    tracing::warn!(error = %e, "effect gauges not refreshed");
                }
            }
            let started = match self.claim_round(&tasks, &settle_tx, true).await {
                Ok(n) => n,
                Err(e) => {
                    tracing::warn!(error = %e, "effect claim failed; the store may be down");
                    0
                }
            };
            if started == 0 {
                // Effects in hand: claim again as soon as one is answered or settled, not
                // after a whole poll interval (which capped a busy runner at `concurrency`
                // calls per poll).
                let busy = self.lanes.values().any(|l| l.busy(self.capacity()));
                tokio::select! {
                    () = shutdown.cancelled() => break,
                    () = self.freed.notified(), if busy => {}
                    () = tokio::time::sleep(self.config.poll) => {}
                }
            }
        }
        tasks.close();
        tasks.wait().await;
        drop(settle_tx);
        if let Err(e) = settler.await {
            tracing::warn!(error = %e, "the effect settle stage ended abnormally");
        }
    }

    /// One round: claims what each provider has room for and runs it to completion, its
    /// outcomes settled. Returns how many effects were processed (for tests and one-shot
    /// operator runs).
    ///
    /// # Errors
    /// [`StoreError`] when a claim fails.
    pub async fn run_once(self: &Arc<Self>) -> Result<usize, StoreError> {
        let tasks = tokio_util::task::TaskTracker::new();
        let (settle_tx, settler) = self.start_settler();
        let claimed = self.claim_round(&tasks, &settle_tx, false).await;
        tasks.close();
        tasks.wait().await;
        drop(settle_tx);
        if let Err(e) = settler.await {
            tracing::warn!(error = %e, "the effect settle stage ended abnormally");
        }
        claimed
    }

    /// The most effects a lane holds unsettled.
    fn capacity(&self) -> usize {
        self.config.concurrency.max(1) + self.config.batch.max(1) as usize + self.settle_batch()
    }

    fn settle_batch(&self) -> usize {
        self.config.settle_batch.max(1)
    }

    /// Claims for every lane with room — in `run`, only once half a batch has room (or
    /// nothing is in hand), so that a busy lane claims in batches rather than one effect
    /// per freed slot — and starts each claimed effect: it waits for a call slot, is called
    /// or checked, and its outcome goes to the settle stage (`settle_tx`).
    async fn claim_round(
        self: &Arc<Self>,
        tasks: &tokio_util::task::TaskTracker,
        settle_tx: &mpsc::UnboundedSender<Done>,
        batched: bool,
    ) -> Result<usize, StoreError> {
        let batch = self.config.batch.max(1) as usize;
        let mut started = 0;
        for (name, lane) in &self.lanes {
            let room = lane.room(batch);
            let threshold = if batched && lane.busy(self.capacity()) {
                batch.div_ceil(2)
            } else {
                1
            };
            if room < threshold
                || (batched
                    && *lane.next_claim.lock().expect("lane lock") > std::time::Instant::now())
            {
                continue;
            }
            let (Ok(mut claimed), Ok(mut unsettled)) = (
                lane.claimed.clone().try_acquire_many_owned(room as u32),
                lane.unsettled.clone().try_acquire_many_owned(room as u32),
            ) else {
                continue;
            };
            let effects = self
                .store
                .claim(
                    name,
                    &self.config.runner_id,
                    room as u32,
                    self.config.lease,
                    now_ms(),
                )
                .await?;
            if effects.len() < room {
                *lane.next_claim.lock().expect("lane lock") =
                    std::time::Instant::now() + self.config.poll;
            }
            for effect in effects {
                let (Some(claimed), Some(unsettled)) = (claimed.split(1), unsettled.split(1))
                else {
                    break;
                };
                started += 1;
                tasks.spawn(self.clone().start(
                    lane.calls.clone(),
                    effect,
                    claimed,
                    unsettled,
                    settle_tx.clone(),
                ));
            }
        }
        Ok(started)
    }

    /// Waits for a call slot, calls or checks `effect`, frees the slot as soon as the
    /// provider answered, and hands the outcome to the settle stage.
    async fn start(
        self: Arc<Self>,
        calls: Arc<Semaphore>,
        effect: Effect,
        claimed: OwnedSemaphorePermit,
        unsettled: OwnedSemaphorePermit,
        settle_tx: mpsc::UnboundedSender<Done>,
    ) {
        let Ok(slot) = calls.acquire_owned().await else {
            return;
        };
        let pending = self.process(effect).await;
        drop(slot);
        drop(claimed);
        self.freed.notify_one();
        if let Some(pending) = pending {
            // The settle stage outlives every call task (it ends when the last sender does).
            let _ = settle_tx.send(Done {
                pending,
                _unsettled: unsettled,
            });
        }
    }

    /// Calls or checks one claimed effect; its outcome, to be settled. A failure before
    /// that (a corrupt row, the evidence unreadable) leaves the effect leased; after the
    /// lease it is checked again, so nothing is lost or repeated.
    async fn process(&self, effect: Effect) -> Option<Pending> {
        let lane = self.lanes.get(&effect.provider)?;
        let result = match effect.state() {
            Ok(EffectState::InFlight) => self.call(lane, &effect).await,
            Ok(EffectState::Unknown) => self.check(lane, &effect).await,
            Ok(other) => {
                tracing::warn!(effect = %effect.id, state = %other, "claimed in an unexpected state");
                return None;
            }
            Err(e) => Err(e),
        };
        match result {
            Ok(pending) => Some(pending),
            Err(e) => {
                tracing::warn!(effect = %effect.id, error = %e, "effect not settled; checked again after its lease");
                None
            }
        }
    }

    /// The settle stage: a task that takes every outcome ready (up to
    /// [`RunnerConfig::settle_batch`]) and settles them together, until every sender is
    /// gone and the queue is empty.
    fn start_settler(
        self: &Arc<Self>,
    ) -> (mpsc::UnboundedSender<Done>, tokio::task::JoinHandle<()>) {
        let (tx, mut rx) = mpsc::unbounded_channel::<Done>();
        let runner = self.clone();
        let handle = tokio::spawn(async move {
            let limit = runner.settle_batch();
            let mut group = Vec::with_capacity(limit);
            while rx.recv_many(&mut group, limit).await > 0 {
                // Its own task, so that a panicking handler loses only its group (left
                // leased, checked again after the lease), never the settle stage.
                let settling = runner.clone();
                let batch = std::mem::take(&mut group);
                if let Err(e) =
                    tokio::spawn(async move { settling.settle_group(batch).await }).await
                {
                    tracing::error!(error = %e, "an effect settle group panicked; its effects are checked again after their lease");
                }
                runner.freed.notify_one();
            }
        });
        (tx, handle)
    }

    /// Settles `group` in one transaction; when that fails, each outcome in a transaction
    /// of its own (one effect's handler error or bad row must not hold back the others).
    /// An outcome that cannot be settled leaves its effect leased: after the lease it is
    /// checked again, never called blindly.
    async fn settle_group(&self, group: Vec<Done>) {
        if group.len() > 1 {
            match self.settle_together(&group).await {
                Ok(()) => return,
                Err(e) => {
                    tracing::debug!(error = %e, effects = group.len(), "group settle failed; settling each alone");
                }
            }
        }
        for done in &group {
            if let Err(e) = self.settle_together(std::slice::from_ref(done)).await {
                tracing::warn!(effect = %done.pending.effect.id, error = %e, "effect not settled; checked again after its lease");
            }
        }
    }

    /// One transaction: every outcome's fenced update and evidence
    /// ([`EffectStore::settle_batch`]), then the handler's business update of each effect
    /// whose lease held. An effect whose lease was lost is skipped (its successor settles
    /// it).
    async fn settle_together(&self, group: &[Done]) -> Result<(), StoreError> {
        let db = self.store.database();
        let mut tx = db.begin().await?;
        let items: Vec<SettleItem<'_>> = group.iter().map(|d| d.pending.item()).collect();
        let held = EffectStore::settle_batch(&mut tx, &items, now_ms()).await?;
        for (done, held) in group.iter().zip(held) {
            let pending = &done.pending;
            if !held {
                tracing::warn!(effect = %pending.effect.id, "lease lost before the settle; another runner has the effect");
                continue;
            }
            if let Some(outcome) = pending.settled() {
                self.handler
                    .settled(&mut tx, &pending.effect, outcome)
                    .await?;
            }
        }
        tx.commit().await
    }

    fn request(effect: &Effect) -> Result<EffectRequest, StoreError> {
        Ok(EffectRequest {
            operation: effect.operation.clone(),
            reference: effect.reference.clone(),
            key: effect.key.clone(),
            params: effect.params()?,
        })
    }

    async fn call(&self, lane: &Lane, effect: &Effect) -> Result<Pending, StoreError> {
        let started = now_ms();
        let request = Self::request(effect)?;
        let outcome = lane.provider.call(&request).await;
        if self.config.abort_after_call {
            eprintln!(
                "ONCELY_FAULT: aborting after a {} {} call of effect {}, before settling it",
                effect.provider, effect.operation, effect.id
            );
            std::process::abort();
        }
        let (class_word, status, ids, detail) = describe_call(&outcome);
        metrics::counter!(metric::ATTEMPTS_TOTAL, "provider" => effect.provider.clone(), "outcome" => class_word)
            .increment(1);
        let evidence = evidence(
            EvidenceKind::Call,
            &effect.key,
            started,
            class_word,
            status,
            &ids,
            &detail,
        );
        match &outcome {
            CallOutcome::Succeeded(object) => {
                let retried = effect.attempts > 1 || effect.unavailable_streak > 0;
                lane.budget.on_success(retried.then_some(false));
                let settle = Settle::Succeeded {
                    provider_id: object.id.clone(),
                    response: object.raw.to_string(),
                };
                Ok(Self::pending(
                    effect,
                    &settle,
                    &evidence,
                    Some(Settled::Succeeded(object)),
                ))
            }
            CallOutcome::Failed {
                message, object, ..
            } => {
                let error = format!("{class_word}: {message}");
                let settle = Settle::Failed {
                    error: error.clone(),
                    response: object.as_ref().map(|o| o.raw.to_string()),
                };
                Ok(Self::pending(
                    effect,
                    &settle,
                    &evidence,
                    Some(Settled::Failed { error: &error }),
                ))
            }
            CallOutcome::Unknown { reason, .. } => {
                // Never a blind retry: the status is checked first (the policy's
                // CheckStatus for an unknown outcome; checks withdraw no budget).
                let settle = Settle::Unknown {
                    at: now_ms() + ms(self.config.check_delay),
                    error: reason.clone(),
                };
                Ok(Self::pending(effect, &settle, &evidence, None))
            }
            CallOutcome::Retryable { .. } | CallOutcome::NotSent { .. } => {
                match self.decide_outage(lane, effect, outcome.class(), outcome.retry_after()) {
                    RetryDecision::RetryAfter(wait) => {
                        let settle = Settle::Unavailable {
                            at: now_ms() + ms(wait),
                            error: detail.clone(),
                        };
                        Ok(Self::pending(effect, &settle, &evidence, None))
                    }
                    // Nothing reached the provider, or it answered that it did not act: the
                    // effect provably did not happen, so it may be failed.
                    decision => {
                        let error = format!(
                            "gave up ({}) while {} was unavailable; nothing was done: {detail}",
                            give_up_word(decision),
                            effect.provider
                        );
                        let settle = Settle::GaveUpUnavailable {
                            error: error.clone(),
                        };
                        Ok(Self::pending(
                            effect,
                            &settle,
                            &evidence,
                            Some(Settled::Failed { error: &error }),
                        ))
                    }
                }
            }
        }
    }

    /// Whether and when to try again after a call or a status check found the provider
    /// unavailable (`class` [`OutcomeClass::NotSent`] or [`OutcomeClass::Retryable`]):
    /// [`RunnerConfig::outage`]'s backoff over the consecutive-unavailable streak,
    /// `retry_after` honoured, [`RunnerConfig::retry`]'s deadline from the intent's
    /// creation; never an attempt limit. A spent budget is no reason to give up: the wait
    /// is the cap then (and counted in [`metric::BUDGET_EXHAUSTED_TOTAL`]).
    fn decide_outage(
        &self,
        lane: &Lane,
        effect: &Effect,
        class: OutcomeClass,
        retry_after: Option<Duration>,
    ) -> RetryDecision {
        let policy = RetryPolicy {
            max_attempts: u32::MAX,
            deadline: self.config.retry.deadline,
            ..self.config.outage
        };
        let streak = u32::try_from(effect.unavailable_streak.max(0)).unwrap_or(0);
        let failure = Failure {
            failures: streak.saturating_add(1).min(u32::MAX - 1),
            class,
            retry_after,
            elapsed: since(effect.created_at),
            timed_out: false,
        };
        Self::decide_within_budget(lane, effect, &policy, &failure)
    }

    /// Whether and when to send again a call that a status check proved absent:
    /// [`RunnerConfig::retry`] over the attempts made so far (each proven to have done
    /// nothing), with its attempt limit and deadline.
    fn decide_resend(&self, lane: &Lane, effect: &Effect) -> RetryDecision {
        let failure = Failure {
            failures: u32::try_from(effect.attempts.max(1)).unwrap_or(1),
            class: OutcomeClass::NotSent,
            retry_after: None,
            elapsed: since(effect.created_at),
            timed_out: false,
        };
        Self::decide_within_budget(lane, effect, &self.config.retry, &failure)
    }

    /// [`RetryPolicy::decide`] with `lane`'s budget; a spent budget turns into the longest
    /// wait of `policy` (its cap, or a longer `Retry-After` up to the ceiling) instead of
    /// giving up: the budget spaces retries out, it does not fail effects.
    fn decide_within_budget(
        lane: &Lane,
        effect: &Effect,
        policy: &RetryPolicy,
        failure: &Failure,
    ) -> RetryDecision {
        match policy.decide(failure, Some(&lane.budget), rand::random::<f64>()) {
            RetryDecision::GiveUp(GiveUpReason::BudgetExhausted) => {
                metrics::counter!(metric::BUDGET_EXHAUSTED_TOTAL, "provider" => effect.provider.clone())
                    .increment(1);
                RetryDecision::RetryAfter(policy.delay_honouring(
                    u32::MAX,
                    1.0,
                    failure.retry_after,
                ))
            }
            decision => decision,
        }
    }

    /// Asks the provider for the status of an effect whose outcome is unknown, and settles
    /// it by what the provider says — never a call.
    async fn check(&self, lane: &Lane, effect: &Effect) -> Result<Pending, StoreError> {
        let started = now_ms();
        let request = Self::request(effect)?;
        let to_time =
            |ms: i64| UNIX_EPOCH + Duration::from_millis(u64::try_from(ms.max(0)).unwrap_or(0));
        let query = StatusQuery {
            request: &request,
            last_sent: Some(to_time(effect.sent_at.unwrap_or(effect.updated_at))),
            // Five minutes of clock skew between us and the provider.
            since: to_time(effect.created_at - 300_000),
        };
        let found = lane.provider.status(query).await;
        let result = match &found {
            Ok(StatusOutcome::Found(_)) => "found",
            Ok(StatusOutcome::Absent) => "absent",
            Ok(StatusOutcome::NotYetVisible { .. }) => "not_yet_visible",
            Err(e) if e.is_unavailable() => "unavailable",
            Err(_) => "invalid",
        };
        metrics::counter!(metric::RESOLUTIONS_TOTAL, "provider" => effect.provider.clone(), "result" => result)
            .increment(1);
        let checks = u32::try_from(effect.checks).unwrap_or(u32::MAX) + 1;
        match found {
            Ok(StatusOutcome::Found(objects)) => Ok(self.found(effect, started, checks, &objects)),
            Ok(StatusOutcome::Absent) => self.absent(lane, effect, started).await,
            Ok(StatusOutcome::NotYetVisible { settles_at }) => {
                let at = settles_at.duration_since(UNIX_EPOCH).map_or(now_ms(), ms);
                Ok(self.still_unknown(
                    effect,
                    started,
                    checks,
                    "not_yet_visible",
                    at,
                    "the lookup may lag",
                ))
            }
            Err(e) if e.is_unavailable() => {
                let decision = self.decide_outage(lane, effect, OutcomeClass::NotSent, None);
                Ok(Self::unavailable(effect, started, decision, &e.to_string()))
            }
            Err(e) => {
                let error = e.to_string();
                let evidence = evidence(
                    EvidenceKind::Status,
                    &effect.key,
                    started,
                    "invalid",
                    None,
                    &[],
                    &error,
                );
                let settle = Settle::NeedsReview {
                    error: error.clone(),
                };
                Ok(Self::pending(
                    effect,
                    &settle,
                    &evidence,
                    Some(Settled::NeedsReview { error: &error }),
                ))
            }
        }
    }

    /// The provider has objects for the effect, read three-valued (docs/DESIGN.md "Status
    /// vocabularies"): a live one settles it `succeeded`; else one still pending keeps it
    /// unknown and checks again (within [`RunnerConfig::max_checks`]); else one in a word
    /// nobody listed parks it in `needs_review` with the object attached; only when every
    /// object found ended in the provider's own words is it `failed`. More than one object
    /// is noted in the evidence for reconciliation.
    fn found(
        &self,
        effect: &Effect,
        started: i64,
        checks: u32,
        objects: &[RemoteObject],
    ) -> Pending {
        let ids: Vec<String> = objects.iter().map(|o| o.id.clone()).collect();
        let first_in = |state| objects.iter().find(|o| o.state == state);
        let object = first_in(ObjectState::Live)
            .or_else(|| first_in(ObjectState::Pending))
            .or_else(|| first_in(ObjectState::Unrecognised))
            .unwrap_or(&objects[0]);
        let detail = if objects.len() > 1 {
            format!(
                "{} objects at the provider for one reference",
                objects.len()
            )
        } else {
            String::new()
        };
        let evidence = evidence(
            EvidenceKind::Status,
            &effect.key,
            started,
            "found",
            None,
            &ids,
            &detail,
        );
        match object.state {
            ObjectState::Live => {
                let settle = Settle::Succeeded {
                    provider_id: object.id.clone(),
                    response: object.raw.to_string(),
                };
                Self::pending(effect, &settle, &evidence, Some(Settled::Succeeded(object)))
            }
            ObjectState::Pending => self.still_unknown(
                effect,
                started,
                checks,
                "found",
                now_ms() + ms(self.config.check_delay),
                &format!("found {} {}: still pending", object.id, object.status),
            ),
            ObjectState::Ended => {
                let error = format!("found {} {}", object.id, object.status);
                let settle = Settle::Failed {
                    error: error.clone(),
                    response: Some(object.raw.to_string()),
                };
                Self::pending(
                    effect,
                    &settle,
                    &evidence,
                    Some(Settled::Failed { error: &error }),
                )
            }
            _ => {
                let error = format!(
                    "found {} in a status this provider's vocabulary does not list ({:?}): {}",
                    object.id, object.status, object.raw
                );
                Self::park(effect, &evidence, &error)
            }
        }
    }

    /// The provider has nothing for the effect: it is sent again with the same key — or,
    /// when the provider honours keys and replayed a stored failure under this one (Stripe
    /// v1 stores a 500), under the key's next generation, which cannot duplicate anything
    /// because nothing exists — after [`RunnerConfig::retry`]'s backoff. Past its attempt
    /// limit or deadline it is `failed`: provably nothing happened at the provider.
    /// Whether the provider keeps a stored failure under the effect's current key, so that a
    /// resend under it would only replay that failure: the provider honours keys and a call
    /// under this key was answered with a 5xx (Stripe v1 stores a 500 with the key and
    /// replays it). Read from the evidence, not from `last_error`, which the status checks
    /// since then have overwritten.
    ///
    /// # Errors
    /// [`StoreError`] when the evidence cannot be read.
    async fn key_holds_a_stored_failure(
        &self,
        lane: &Lane,
        effect: &Effect,
    ) -> Result<bool, StoreError> {
        if !lane.provider.honours_keys() {
            return Ok(false);
        }
        let answered_5xx = self.store.evidence(&effect.id).await?.iter().any(|row| {
            row.kind == "call" && row.key == effect.key && row.http_status.is_some_and(|s| s >= 500)
        });
        Ok(answered_5xx
            || effect
                .last_error
                .as_deref()
                .is_some_and(|e| e.contains("replayed")))
    }

    async fn absent(
        &self,
        lane: &Lane,
        effect: &Effect,
        started: i64,
    ) -> Result<Pending, StoreError> {
        let (key, key_generation) = if self.key_holds_a_stored_failure(lane, effect).await? {
            (
                next_key(&effect.key, effect.key_generation + 1),
                effect.key_generation + 1,
            )
        } else {
            (effect.key.clone(), effect.key_generation)
        };
        let evidence = evidence(
            EvidenceKind::Status,
            &effect.key,
            started,
            "absent",
            None,
            &[],
            "",
        );
        match self.decide_resend(lane, effect) {
            RetryDecision::RetryAfter(wait) => {
                let settle = Settle::Absent {
                    at: now_ms() + ms(wait),
                    key,
                    key_generation,
                };
                Ok(Self::pending(effect, &settle, &evidence, None))
            }
            decision => {
                let error = format!(
                    "gave up ({}) after {} attempts; the provider has no such object",
                    give_up_word(decision),
                    effect.attempts
                );
                let settle = Settle::Failed {
                    error: error.clone(),
                    response: None,
                };
                Ok(Self::pending(
                    effect,
                    &settle,
                    &evidence,
                    Some(Settled::Failed { error: &error }),
                ))
            }
        }
    }

    /// A status check found the provider unavailable: asked again after the outage wait
    /// (`decision`, of `decide_outage`), no check counted — or, past the
    /// deadline, `needs_review`: the outcome could still be an effect.
    fn unavailable(
        effect: &Effect,
        started: i64,
        decision: RetryDecision,
        detail: &str,
    ) -> Pending {
        let evidence = evidence(
            EvidenceKind::Status,
            &effect.key,
            started,
            "unavailable",
            None,
            &[],
            detail,
        );
        if let RetryDecision::RetryAfter(wait) = decision {
            let settle = Settle::Unavailable {
                at: now_ms() + ms(wait),
                error: detail.to_owned(),
            };
            return Self::pending(effect, &settle, &evidence, None);
        }
        let error = format!(
            "outcome still unknown, gave up ({}): {detail}",
            give_up_word(decision)
        );
        let settle = Settle::GaveUpUnavailable {
            error: error.clone(),
        };
        Self::pending(
            effect,
            &settle,
            &evidence,
            Some(Settled::NeedsReview { error: &error }),
        )
    }

    fn still_unknown(
        &self,
        effect: &Effect,
        started: i64,
        checks: u32,
        outcome: &str,
        at: i64,
        detail: &str,
    ) -> Pending {
        let evidence = evidence(
            EvidenceKind::Status,
            &effect.key,
            started,
            outcome,
            None,
            &[],
            detail,
        );
        if checks >= self.config.max_checks {
            let error = format!("outcome still unknown after {checks} status checks: {detail}");
            return Self::park(effect, &evidence, &error);
        }
        // The deadline ends the waiting too; the outcome may be an effect, so a person
        // decides (never `failed`, never a blind call).
        if self
            .config
            .retry
            .deadline
            .is_some_and(|d| since(effect.created_at) >= d)
        {
            let error = format!("outcome still unknown at the deadline: {detail}");
            return Self::park(effect, &evidence, &error);
        }
        let settle = Settle::Unknown {
            at,
            error: detail.to_owned(),
        };
        Self::pending(effect, &settle, &evidence, None)
    }

    /// Parks `effect` in `needs_review` with `error`.
    fn park(effect: &Effect, evidence: &Evidence, error: &str) -> Pending {
        Self::pending(
            effect,
            &Settle::NeedsReview {
                error: error.to_owned(),
            },
            evidence,
            Some(Settled::NeedsReview { error }),
        )
    }

    /// The outcome of a call or check, for the settle stage.
    fn pending(
        effect: &Effect,
        settle: &Settle,
        evidence: &Evidence,
        settled: Option<Settled<'_>>,
    ) -> Pending {
        Pending {
            effect: effect.clone(),
            settle: settle.clone(),
            evidence: evidence.clone(),
            outcome: settled.map(|o| match o {
                Settled::Succeeded(object) => Outcome::Succeeded(object.clone()),
                Settled::Failed { error } => Outcome::Failed(error.to_owned()),
                Settled::NeedsReview { error } => Outcome::NeedsReview(error.to_owned()),
            }),
        }
    }
}

/// Time since `created_at` (Unix ms), zero for a time in the future.
fn since(created_at: i64) -> Duration {
    Duration::from_millis(u64::try_from(now_ms().saturating_sub(created_at)).unwrap_or(0))
}

/// The reason of a give-up decision, for the effect's error.
fn give_up_word(decision: RetryDecision) -> &'static str {
    match decision {
        RetryDecision::GiveUp(GiveUpReason::AttemptsExhausted) => "attempt limit",
        RetryDecision::GiveUp(GiveUpReason::DeadlinePassed) => "deadline",
        RetryDecision::GiveUp(GiveUpReason::BudgetExhausted) => "retry budget",
        RetryDecision::GiveUp(GiveUpReason::Final) => "final answer",
        _ => "policy",
    }
}

fn describe_call(outcome: &CallOutcome) -> (&'static str, Option<u16>, Vec<String>, String) {
    match outcome {
        CallOutcome::Succeeded(o) => ("succeeded", None, vec![o.id.clone()], String::new()),
        CallOutcome::Failed {
            status,
            code,
            message,
            object,
        } => (
            "failed",
            Some(*status),
            object.iter().map(|o| o.id.clone()).collect(),
            format!("{}: {message}", code.as_deref().unwrap_or("refused")),
        ),
        CallOutcome::Retryable {
            status,
            retry_after,
        } => (
            "retryable",
            Some(*status),
            Vec::new(),
            format!("HTTP {status}, Retry-After {retry_after:?}"),
        ),
        CallOutcome::Unknown { status, reason } => ("unknown", *status, Vec::new(), reason.clone()),
        CallOutcome::NotSent { reason } => ("not_sent", None, Vec::new(), reason.clone()),
    }
}

fn evidence(
    kind: EvidenceKind,
    key: &str,
    started_at: i64,
    outcome: &str,
    http_status: Option<u16>,
    provider_ids: &[String],
    detail: &str,
) -> Evidence {
    Evidence {
        kind,
        key: key.to_owned(),
        started_at,
        finished_at: now_ms(),
        outcome: outcome.to_owned(),
        http_status,
        provider_ids: provider_ids.to_vec(),
        detail: detail.to_owned(),
    }
}
