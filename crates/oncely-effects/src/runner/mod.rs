mod call;
mod check;
pub(crate) use check::of_this_key;
mod continuation;
mod decide;
mod pipeline;
mod settle;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use oncely_core::{RetryBudget, RetryPolicy};
use oncely_sql::{Effect, EffectState, EffectStore, Evidence, Settle, SettleItem, StoreError, Tx};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::metrics as metric;
use crate::{Provider, RemoteObject};
pub(crate) use continuation::continue_outcome;
pub use continuation::Continue;
pub(crate) use decide::verdict;

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
    /// How long a claimed effect stays this runner's after its call leaves; must exceed the
    /// provider's timeout. A claim holds it for this plus [`SEND_BOUND`], the longest a call
    /// may leave after its claim without renewing it. Default 60 s.
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

/// [`Settled`], owned: while its outcome waits in the settle stage, and as a continuation
/// recorded for the service's runner (JSON in `oncely_effects.continuation`).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Outcome {
    Succeeded(RemoteObject),
    Failed(String),
    NeedsReview(String),
}

impl Outcome {
    /// The outcome as the handler takes it.
    pub(crate) fn settled(&self) -> Settled<'_> {
        match self {
            Self::Succeeded(object) => Settled::Succeeded(object),
            Self::Failed(error) => Settled::Failed { error },
            Self::NeedsReview(error) => Settled::NeedsReview { error },
        }
    }
}

impl From<Settled<'_>> for Outcome {
    fn from(settled: Settled<'_>) -> Self {
        match settled {
            Settled::Succeeded(object) => Self::Succeeded(object.clone()),
            Settled::Failed { error } => Self::Failed(error.to_owned()),
            Settled::NeedsReview { error } => Self::NeedsReview(error.to_owned()),
        }
    }
}

impl Pending {
    fn settled(&self) -> Option<Settled<'_>> {
        self.outcome.as_ref().map(Outcome::settled)
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

/// How long after its claim a claimed call may leave without recording its send: within
/// this bound the claim's `sent_at` (the claim's instant) and its lease stand for the send;
/// a call that waited longer for its call slot first renews its claim, fenced, with
/// [`EffectStore::stamp_send`] (and does not leave when another runner has it).
///
/// The protocol's promise, which every runner and status check must share (so it is a
/// constant, not a setting): the latest attempt left no later than `sent_at` + this
/// bound. A status check counts the settle window from there (`runner/check.rs`
/// `last_sent`), and a claim's lease is [`RunnerConfig::lease`] plus this bound, so that
/// the lease outlasts an unrecorded call by the whole `lease`. The bound is measured on the
/// monotonic clock from just before the claim's round trip, so it errs long.
///
/// Without it every call paid one more fenced write and commit before it left (PostgreSQL,
/// 0 ms provider: 1,615 effects/s with a stamp per call; see docs/benchmarks.md). Checked
/// by the effect protocol's model (`Timing::Bounded`, `oncely-effects`' `model`). 1 s.
pub const SEND_BOUND: Duration = Duration::from_secs(1);

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
            for &state in EffectState::ALL {
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
    /// their outcomes. Refreshes the gauges every 5 s and continues owed outcomes
    /// ([`EffectRunner::continue_owed`]) once per [`RunnerConfig::poll`].
    pub async fn run(self: Arc<Self>, shutdown: CancellationToken) {
        let tasks = tokio_util::task::TaskTracker::new();
        let (settle_tx, settler) = self.start_settler();
        let mut gauges_at = std::time::Instant::now();
        // Continuations are read once per poll, not before every claim: a busy runner
        // claims every few ms, and a read on each claim's path was one more round trip
        // per claim (137 reads for 2,000 effects; see docs/benchmarks.md).
        let mut continued_at: Option<std::time::Instant> = None;
        while !shutdown.is_cancelled() {
            if gauges_at.elapsed() >= Duration::from_secs(5) {
                gauges_at = std::time::Instant::now();
                if let Err(e) = self.record_gauges().await {
                    tracing::warn!(error = %e, "effect gauges not refreshed");
                }
            }
            if continued_at.is_none_or(|at| at.elapsed() >= self.config.poll) {
                continued_at = Some(std::time::Instant::now());
                match self.continue_owed().await {
                    // A full batch: more may be owed, read again next round.
                    Ok(n) if n >= self.config.batch.max(1) as usize => continued_at = None,
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!(error = %e, "continuations not read; the store may be down");
                    }
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

    /// One round: continues the outcomes decided elsewhere that this runner's handler owes
    /// ([`EffectRunner::continue_owed`]), then claims what each provider has room for and
    /// runs it to completion, its outcomes settled. Returns how many effects were processed
    /// (for tests and one-shot operator runs).
    ///
    /// # Errors
    /// [`StoreError`] when reading the continuations or a claim fails.
    pub async fn run_once(self: &Arc<Self>) -> Result<usize, StoreError> {
        let continued = self.continue_owed().await?;
        let tasks = tokio_util::task::TaskTracker::new();
        let (settle_tx, settler) = self.start_settler();
        let claimed = self.claim_round(&tasks, &settle_tx, false).await;
        tasks.close();
        tasks.wait().await;
        drop(settle_tx);
        if let Err(e) = settler.await {
            tracing::warn!(error = %e, "the effect settle stage ended abnormally");
        }
        Ok(continued + claimed?)
    }

    /// The most effects a lane holds unsettled.
    fn capacity(&self) -> usize {
        self.config.concurrency.max(1) + self.config.batch.max(1) as usize + self.settle_batch()
    }

    fn settle_batch(&self) -> usize {
        self.config.settle_batch.max(1)
    }
}

/// Time since `created_at` (Unix ms), zero for a time in the future.
fn since(created_at: i64) -> Duration {
    Duration::from_millis(u64::try_from(now_ms().saturating_sub(created_at)).unwrap_or(0))
}
