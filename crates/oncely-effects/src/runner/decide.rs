//! The settle decisions the call and the status check share: retry or give up within the budget, park, and the evidence of an attempt.

use std::time::Duration;

use oncely_core::{Failure, GiveUpReason, OutcomeClass, RetryDecision, RetryPolicy};
use oncely_sql::{Effect, Evidence, EvidenceKind, Settle};

use crate::metrics as metric;
use crate::{ObjectState, RemoteObject};

use super::{now_ms, since, EffectRunner, Lane, Outcome, Pending, Settled};

impl EffectRunner {
    /// The wait of an effect whose retry the provider's spent budget cannot pay: uniform over
    /// `[0, cap]` of `policy` (full jitter, `unit` a sample in `[0, 1)`), never shorter
    /// than the `Retry-After` asked (up to the policy's ceiling).
    ///
    /// Not the cap itself: a burst of failures (a provider cut off for a second) can leave
    /// hundreds of effects behind one spent budget, and a fixed wait brings them all back
    /// at the same instant, five minutes later by default, with nothing in between (seen in
    /// the fleet test: 584 payment effects idle for 5 min). Spread over the cap, they come
    /// back as a trickle of about `n / cap` per second whose successes refill the bucket,
    /// and the provider still sees no herd.
    pub(super) fn spent_budget_wait(
        policy: &RetryPolicy,
        retry_after: Option<Duration>,
        unit: f64,
    ) -> Duration {
        policy.delay_honouring(u32::MAX, unit, retry_after)
    }

    /// Whether and when to try again after a call or a status check found the provider
    /// unavailable (`class` [`OutcomeClass::NotSent`] or [`OutcomeClass::Retryable`]):
    /// [`RunnerConfig::outage`]'s backoff over the consecutive-unavailable streak,
    /// `retry_after` honoured, [`RunnerConfig::retry`]'s deadline from the intent's
    /// creation; never an attempt limit. A spent budget is no reason to give up: the wait
    /// is [`EffectRunner::spent_budget_wait`] then (counted in
    /// [`metric::BUDGET_EXHAUSTED_TOTAL`]).
    pub(super) fn decide_outage(
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
    pub(super) fn decide_resend(&self, lane: &Lane, effect: &Effect) -> RetryDecision {
        let failure = Failure {
            failures: u32::try_from(effect.attempts.max(1)).unwrap_or(1),
            class: OutcomeClass::NotSent,
            retry_after: None,
            elapsed: since(effect.created_at),
            timed_out: false,
        };
        Self::decide_within_budget(lane, effect, &self.config.retry, &failure)
    }

    /// [`RetryPolicy::decide`] with `lane`'s budget; a spent budget turns into
    /// [`EffectRunner::spent_budget_wait`] instead of giving up: the budget spaces retries
    /// out, it does not fail effects.
    pub(super) fn decide_within_budget(
        lane: &Lane,
        effect: &Effect,
        policy: &RetryPolicy,
        failure: &Failure,
    ) -> RetryDecision {
        match policy.decide(failure, Some(&lane.budget), rand::random::<f64>()) {
            RetryDecision::GiveUp(GiveUpReason::BudgetExhausted) => {
                metrics::counter!(metric::BUDGET_EXHAUSTED_TOTAL, "provider" => effect.provider.clone())
                    .increment(1);
                RetryDecision::RetryAfter(Self::spent_budget_wait(
                    policy,
                    failure.retry_after,
                    rand::random::<f64>(),
                ))
            }
            decision => decision,
        }
    }

    /// Parks `effect` in `needs_review` with `error`.
    pub(super) fn park(effect: &Effect, evidence: &Evidence, error: &str) -> Pending {
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
    pub(super) fn pending(
        effect: &Effect,
        settle: &Settle,
        evidence: &Evidence,
        settled: Option<Settled<'_>>,
    ) -> Pending {
        Pending {
            effect: effect.clone(),
            settle: settle.clone(),
            evidence: evidence.clone(),
            outcome: settled.map(Outcome::from),
        }
    }
}

/// What one provider object found for an effect settles it into, read three-valued as a
/// status check reads it (docs/DESIGN.md "Status vocabularies"): live → `succeeded`,
/// ended in the provider's own words → `failed`, a word nobody listed → `needs_review`
/// with the object named; `None` for a pending object (the effect stays unknown and the
/// runner's own checks decide). Reconciliation's completions and a provider's pushed
/// events ([`crate::apply_pushed`]) settle through it.
pub(crate) fn verdict(object: &RemoteObject) -> Option<(Settle, Outcome)> {
    match object.state {
        ObjectState::Live => Some((
            Settle::Succeeded {
                provider_id: object.id.clone(),
                response: object.raw.to_string(),
            },
            Outcome::Succeeded(object.clone()),
        )),
        ObjectState::Pending => None,
        ObjectState::Ended => {
            let error = format!("found {} {}", object.id, object.status);
            Some((
                Settle::Failed {
                    error: error.clone(),
                    response: Some(object.raw.to_string()),
                },
                Outcome::Failed(error),
            ))
        }
        _ => {
            let error = format!(
                "found {} in a status the vocabulary does not list ({:?})",
                object.id, object.status
            );
            Some((
                Settle::NeedsReview {
                    error: error.clone(),
                },
                Outcome::NeedsReview(error),
            ))
        }
    }
}

/// The reason of a give-up decision, for the effect's error.
pub(super) fn give_up_word(decision: RetryDecision) -> &'static str {
    match decision {
        RetryDecision::GiveUp(GiveUpReason::AttemptsExhausted) => "attempt limit",
        RetryDecision::GiveUp(GiveUpReason::DeadlinePassed) => "deadline",
        RetryDecision::GiveUp(GiveUpReason::BudgetExhausted) => "retry budget",
        RetryDecision::GiveUp(GiveUpReason::Final) => "final answer",
        _ => "policy",
    }
}

pub(super) fn evidence(
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use oncely_core::RetryPolicy;

    use super::EffectRunner;

    #[test]
    fn a_spent_budget_spreads_the_waits_over_the_cap_instead_of_herding_them_at_it() {
        let policy = RetryPolicy {
            cap: Duration::from_secs(300),
            ..RetryPolicy::default()
        };
        let waits: Vec<Duration> = (0..1000)
            .map(|_| EffectRunner::spent_budget_wait(&policy, None, rand::random::<f64>()))
            .collect();
        let (min, max) = (waits.iter().min().unwrap(), waits.iter().max().unwrap());
        assert!(*max <= policy.cap, "{max:?} over the cap");
        assert!(*min < policy.cap / 10, "none came back early: {min:?}");
        assert!(*max > policy.cap * 9 / 10, "none waited long: {max:?}");
        let asked = EffectRunner::spent_budget_wait(&policy, Some(Duration::from_secs(200)), 0.0);
        assert_eq!(asked, Duration::from_secs(200), "Retry-After is honoured");
    }
}
