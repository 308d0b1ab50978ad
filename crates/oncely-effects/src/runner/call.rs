//! Calling the provider: the request an effect sends, and what its answer means.

use std::time::Instant;

use oncely_core::RetryDecision;
use oncely_sql::{Effect, EvidenceKind, Settle, StoreError};

use crate::metrics as metric;
use crate::{CallOutcome, EffectRequest};

use super::decide::{evidence, give_up_word};
use super::{ms, now_ms, EffectRunner, Lane, Pending, Settled, SEND_BOUND};

impl EffectRunner {
    pub(super) fn request(effect: &Effect) -> Result<EffectRequest, StoreError> {
        Ok(EffectRequest {
            operation: effect.operation.clone(),
            reference: effect.reference.clone(),
            key: effect.key.clone(),
            params: effect.params()?,
        })
    }

    pub(super) async fn call(
        &self,
        lane: &Lane,
        effect: &Effect,
        claimed_at: Instant,
    ) -> Result<Pending, StoreError> {
        let started = now_ms();
        let request = Self::request(effect)?;
        // Claimed `in_flight` under this runner's lease; nothing sent.
        oncely_core::failpoint::fail_point!("runner.before_send");
        // Within the send bound the claim stands for the send (its `sent_at` and lease
        // cover it). A claim that waited longer for its call slot may have been taken over:
        // its call leaves only once the send is recorded under the claim's lease version,
        // so the lease and the settle window count from the send.
        if claimed_at.elapsed() > SEND_BOUND
            && !self
                .store
                .stamp_send(effect, &self.config.runner_id, self.config.lease, started)
                .await?
        {
            return Err(StoreError::Conflict(format!(
                "effect {}: the claim ran out before its call left; another runner has it",
                effect.id
            )));
        }
        let outcome = lane.provider.call(&request).await;
        // The provider answered (and may have committed); the store still says `in_flight`.
        oncely_core::failpoint::fail_point!("runner.after_send");
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
}

pub(super) fn describe_call(
    outcome: &CallOutcome,
) -> (&'static str, Option<u16>, Vec<String>, String) {
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
