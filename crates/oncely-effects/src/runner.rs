use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use futures_util::future::BoxFuture;
use oncely_core::{Failure, GiveUpReason, OutcomeClass, RetryBudget, RetryDecision, RetryPolicy};
use oncely_sql::{
    Effect, EffectState, EffectStore, Evidence, EvidenceKind, Settle, StoreError, Tx,
};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::metrics as metric;
use crate::next_key;
use crate::{CallOutcome, EffectRequest, Provider, RemoteObject, StatusOutcome, StatusQuery};

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
    /// Effects claimed per provider per round, at most. Default 16.
    pub batch: u32,
    /// Calls in flight per provider, at most. Default 8.
    pub concurrency: usize,
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
    /// is settled — the crash window in which the effect may have happened while the store
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

/// One provider as the runner holds it: the adapter, its retry budget, its concurrency.
struct Lane {
    provider: Arc<dyn Provider>,
    budget: Arc<RetryBudget>,
    permits: Arc<Semaphore>,
}

/// The effect runner, a library runtime like the outbox relay: claims due effects per
/// provider, calls or checks each once, and settles it with its evidence — the effect's
/// result, the handler's business update and its next event in one transaction. Any number
/// of runners may share a store: leases keep each effect with one of them.
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
    /// Signalled when a call or check finishes and frees its lane's permit.
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
        let lanes = providers
            .into_iter()
            .map(|p| {
                let lane = Lane {
                    provider: p.clone(),
                    budget: Arc::new(RetryBudget::new(config.budget_capacity)),
                    permits: Arc::new(Semaphore::new(config.concurrency.max(1))),
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

    /// Runs until `shutdown` is cancelled, then waits for the calls in flight to settle.
    /// Refreshes the gauges every 5 s.
    pub async fn run(self: Arc<Self>, shutdown: CancellationToken) {
        let tasks = tokio_util::task::TaskTracker::new();
        let mut gauges_at = std::time::Instant::now();
        while !shutdown.is_cancelled() {
            if gauges_at.elapsed() >= Duration::from_secs(5) {
                gauges_at = std::time::Instant::now();
                if let Err(e) = self.record_gauges().await {
                    tracing::warn!(error = %e, "effect gauges not refreshed");
                }
            }
            let started = match self.claim_round(&tasks).await {
                Ok(n) => n,
                Err(e) => {
                    tracing::warn!(error = %e, "effect claim failed; the store may be down");
                    0
                }
            };
            if started == 0 {
                // Every lane full: claim again as soon as a call finishes, not after a whole
                // poll interval (which capped a busy runner at `concurrency` calls per poll).
                let full = self
                    .lanes
                    .values()
                    .all(|l| l.permits.available_permits() == 0);
                tokio::select! {
                    () = shutdown.cancelled() => break,
                    () = self.freed.notified(), if full => {}
                    () = tokio::time::sleep(self.config.poll) => {}
                }
            }
        }
        tasks.close();
        tasks.wait().await;
    }

    /// One round: claims what each provider has room for and runs it to completion.
    /// Returns how many effects were processed (for tests and one-shot operator runs).
    ///
    /// # Errors
    /// [`StoreError`] when a claim fails.
    pub async fn run_once(self: &Arc<Self>) -> Result<usize, StoreError> {
        let tasks = tokio_util::task::TaskTracker::new();
        let n = self.claim_round(&tasks).await?;
        tasks.close();
        tasks.wait().await;
        Ok(n)
    }

    async fn claim_round(
        self: &Arc<Self>,
        tasks: &tokio_util::task::TaskTracker,
    ) -> Result<usize, StoreError> {
        let mut started = 0;
        for (name, lane) in &self.lanes {
            let room = lane
                .permits
                .available_permits()
                .min(self.config.batch as usize);
            if room == 0 {
                continue;
            }
            let claimed = self
                .store
                .claim(
                    name,
                    &self.config.runner_id,
                    room as u32,
                    self.config.lease,
                    now_ms(),
                )
                .await?;
            for effect in claimed {
                let Ok(permit) = lane.permits.clone().acquire_owned().await else {
                    continue;
                };
                let runner = self.clone();
                started += 1;
                tasks.spawn(async move {
                    runner.process(effect).await;
                    drop(permit);
                    runner.freed.notify_one();
                });
            }
        }
        Ok(started)
    }

    /// Calls or checks one claimed effect and settles it. A failure to settle leaves the
    /// effect leased; after the lease it is checked again, so nothing is lost or repeated.
    async fn process(&self, effect: Effect) {
        let Some(lane) = self.lanes.get(&effect.provider) else {
            return;
        };
        let result = match effect.state() {
            Ok(EffectState::InFlight) => self.call(lane, &effect).await,
            Ok(EffectState::Unknown) => self.check(lane, &effect).await,
            Ok(other) => {
                tracing::warn!(effect = %effect.id, state = %other, "claimed in an unexpected state");
                return;
            }
            Err(e) => Err(e),
        };
        if let Err(e) = result {
            tracing::warn!(effect = %effect.id, error = %e, "effect not settled; checked again after its lease");
        }
    }

    fn request(effect: &Effect) -> Result<EffectRequest, StoreError> {
        Ok(EffectRequest {
            operation: effect.operation.clone(),
            reference: effect.reference.clone(),
            key: effect.key.clone(),
            params: effect.params()?,
        })
    }

    async fn call(&self, lane: &Lane, effect: &Effect) -> Result<(), StoreError> {
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
                self.settle(effect, &settle, &evidence, Some(Settled::Succeeded(object)))
                    .await
            }
            CallOutcome::Failed {
                message, object, ..
            } => {
                let error = format!("{class_word}: {message}");
                let settle = Settle::Failed {
                    error: error.clone(),
                    response: object.as_ref().map(|o| o.raw.to_string()),
                };
                self.settle(
                    effect,
                    &settle,
                    &evidence,
                    Some(Settled::Failed { error: &error }),
                )
                .await
            }
            CallOutcome::Unknown { reason, .. } => {
                // Never a blind retry: the status is checked first (the policy's
                // CheckStatus for an unknown outcome; checks withdraw no budget).
                let settle = Settle::Unknown {
                    at: now_ms() + ms(self.config.check_delay),
                    error: reason.clone(),
                };
                self.settle(effect, &settle, &evidence, None).await
            }
            CallOutcome::Retryable { .. } | CallOutcome::NotSent { .. } => {
                match self.decide_outage(lane, effect, outcome.class(), outcome.retry_after()) {
                    RetryDecision::RetryAfter(wait) => {
                        let settle = Settle::Unavailable {
                            at: now_ms() + ms(wait),
                            error: detail.clone(),
                        };
                        self.settle(effect, &settle, &evidence, None).await
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
                        self.settle(
                            effect,
                            &settle,
                            &evidence,
                            Some(Settled::Failed { error: &error }),
                        )
                        .await
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
    async fn check(&self, lane: &Lane, effect: &Effect) -> Result<(), StoreError> {
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
            Ok(StatusOutcome::Found(objects)) => self.found(effect, started, &objects).await,
            Ok(StatusOutcome::Absent) => self.absent(lane, effect, started).await,
            Ok(StatusOutcome::NotYetVisible { settles_at }) => {
                let at = settles_at.duration_since(UNIX_EPOCH).map_or(now_ms(), ms);
                self.still_unknown(
                    effect,
                    started,
                    checks,
                    "not_yet_visible",
                    at,
                    "the lookup may lag",
                )
                .await
            }
            Err(e) if e.is_unavailable() => {
                let decision = self.decide_outage(lane, effect, OutcomeClass::NotSent, None);
                self.unavailable(effect, started, decision, &e.to_string())
                    .await
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
                self.settle(
                    effect,
                    &settle,
                    &evidence,
                    Some(Settled::NeedsReview { error: &error }),
                )
                .await
            }
        }
    }

    /// The provider has objects for the effect: settled from the live one (or, when none is
    /// live, the refused one). More than one is noted in the evidence for reconciliation.
    async fn found(
        &self,
        effect: &Effect,
        started: i64,
        objects: &[RemoteObject],
    ) -> Result<(), StoreError> {
        let ids: Vec<String> = objects.iter().map(|o| o.id.clone()).collect();
        let object = objects.iter().find(|o| o.effective).unwrap_or(&objects[0]);
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
        if object.effective {
            let settle = Settle::Succeeded {
                provider_id: object.id.clone(),
                response: object.raw.to_string(),
            };
            return self
                .settle(effect, &settle, &evidence, Some(Settled::Succeeded(object)))
                .await;
        }
        let error = format!("found {} {}", object.id, object.status);
        let settle = Settle::Failed {
            error: error.clone(),
            response: Some(object.raw.to_string()),
        };
        self.settle(
            effect,
            &settle,
            &evidence,
            Some(Settled::Failed { error: &error }),
        )
        .await
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

    async fn absent(&self, lane: &Lane, effect: &Effect, started: i64) -> Result<(), StoreError> {
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
                self.settle(effect, &settle, &evidence, None).await
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
                self.settle(
                    effect,
                    &settle,
                    &evidence,
                    Some(Settled::Failed { error: &error }),
                )
                .await
            }
        }
    }

    /// A status check found the provider unavailable: asked again after the outage wait
    /// (`decision`, of `decide_outage`), no check counted — or, past the
    /// deadline, `needs_review`: the outcome could still be an effect.
    async fn unavailable(
        &self,
        effect: &Effect,
        started: i64,
        decision: RetryDecision,
        detail: &str,
    ) -> Result<(), StoreError> {
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
            return self.settle(effect, &settle, &evidence, None).await;
        }
        let error = format!(
            "outcome still unknown, gave up ({}): {detail}",
            give_up_word(decision)
        );
        let settle = Settle::GaveUpUnavailable {
            error: error.clone(),
        };
        self.settle(
            effect,
            &settle,
            &evidence,
            Some(Settled::NeedsReview { error: &error }),
        )
        .await
    }

    async fn still_unknown(
        &self,
        effect: &Effect,
        started: i64,
        checks: u32,
        outcome: &str,
        at: i64,
        detail: &str,
    ) -> Result<(), StoreError> {
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
            return self.park(effect, &evidence, error).await;
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
            return self.park(effect, &evidence, error).await;
        }
        let settle = Settle::Unknown {
            at,
            error: detail.to_owned(),
        };
        self.settle(effect, &settle, &evidence, None).await
    }

    /// Parks `effect` in `needs_review` with `error`.
    async fn park(
        &self,
        effect: &Effect,
        evidence: &Evidence,
        error: String,
    ) -> Result<(), StoreError> {
        self.settle(
            effect,
            &Settle::NeedsReview {
                error: error.clone(),
            },
            evidence,
            Some(Settled::NeedsReview { error: &error }),
        )
        .await
    }

    async fn settle(
        &self,
        effect: &Effect,
        settle: &Settle,
        evidence: &Evidence,
        settled: Option<Settled<'_>>,
    ) -> Result<(), StoreError> {
        let db = self.store.database();
        let mut tx = db.begin().await?;
        EffectStore::settle(&mut tx, effect, settle, evidence, now_ms()).await?;
        if let Some(outcome) = settled {
            self.handler.settled(&mut tx, effect, outcome).await?;
        }
        tx.commit().await
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
