//! Status checks: asking the provider what became of an effect whose outcome is unknown, and what its answer means.

use std::time::{Duration, UNIX_EPOCH};

use oncely_core::{OutcomeClass, RetryDecision};
use oncely_sql::{Effect, EvidenceKind, EvidenceRow, Settle, StoreError};

use crate::metrics as metric;
use crate::next_key;
use crate::{ObjectState, RemoteObject, StatusOutcome, StatusQuery};

use super::decide::{evidence, give_up_word};
use super::{ms, now_ms, since, EffectRunner, Lane, Pending, Settled, SEND_BOUND};

impl EffectRunner {
    /// When the latest attempt may last have reached the provider (Unix ms), from the
    /// effect's `evidence`: the end of the latest call (its timeout or reset — a request may
    /// arrive as late as the moment we gave up on it), else the recorded send (`sent_at`)
    /// plus [`SEND_BOUND`], the latest a call may leave unrecorded after its claim. The
    /// settle window runs from here: the claim alone can precede the send by a pipeline's
    /// wait, which would end the window early and let "not found" mean absent while the
    /// request is still committing.
    fn last_sent(effect: &Effect, trail: &[EvidenceRow]) -> i64 {
        let claimed = effect
            .sent_at
            .map_or(effect.updated_at, |t| t.saturating_add(ms(SEND_BOUND)));
        let last_call = trail
            .iter()
            .filter(|row| row.kind == "call")
            .map(|row| row.finished_at.max(row.started_at))
            .max();
        last_call.map_or(claimed, |t| t.max(claimed))
    }

    /// Asks the provider for the status of an effect whose outcome is unknown, and settles
    /// it by what the provider says — never a call.
    pub(super) async fn check(&self, lane: &Lane, effect: &Effect) -> Result<Pending, StoreError> {
        let started = now_ms();
        let request = Self::request(effect)?;
        // Read once: the settle window and, when absent, the stored-failure test use it.
        let trail = self.store.evidence(&effect.id).await?;
        let to_time =
            |ms: i64| UNIX_EPOCH + Duration::from_millis(u64::try_from(ms.max(0)).unwrap_or(0));
        let last_sent = Self::last_sent(effect, &trail);
        let query = StatusQuery {
            request: &request,
            last_sent: Some(to_time(last_sent)),
            // Five minutes of clock skew between us and the provider.
            since: to_time(effect.created_at - 300_000),
        };
        let found = lane.provider.status(query).await;
        // The provider said what it holds; the effect is still `unknown` in the store.
        oncely_core::failpoint::fail_point!("runner.after_check");
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
            Ok(StatusOutcome::Found(objects)) => {
                let objects = of_this_key(effect, &trail, objects);
                if objects.is_empty() {
                    Ok(self.only_earlier_keys(lane, effect, &trail, started, checks, last_sent))
                } else {
                    Ok(self.found(effect, started, checks, &objects))
                }
            }
            Ok(StatusOutcome::Absent) => Ok(self.absent(lane, effect, &trail, started)),
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

    /// The provider has only ended objects of the effect's earlier keys: nothing is known
    /// of the current key's attempt, which is "not found" — absent once the provider's
    /// settle time after the latest send has passed, else checked again; a provider that
    /// does not say its settle time is checked again (within the check limit, then
    /// `needs_review`), never `failed`.
    fn only_earlier_keys(
        &self,
        lane: &Lane,
        effect: &Effect,
        trail: &[EvidenceRow],
        started: i64,
        checks: u32,
        last_sent: i64,
    ) -> Pending {
        let detail = "found only ended objects of earlier keys";
        let settles_at = lane
            .provider
            .settle_time()
            .map(|settle| last_sent.saturating_add(ms(settle)));
        match settles_at {
            Some(at) if at <= now_ms() => self.absent(lane, effect, trail, started),
            Some(at) => self.still_unknown(effect, started, checks, "not_yet_visible", at, detail),
            None => {
                let at = now_ms() + ms(self.config.check_delay);
                self.still_unknown(effect, started, checks, "found", at, detail)
            }
        }
    }

    /// The provider has objects for the effect, read three-valued (docs/DESIGN.md "Status
    /// vocabularies"): a live one settles it `succeeded`; else one still pending keeps it
    /// unknown and checks again (within [`RunnerConfig::max_checks`]); else one in a word
    /// nobody listed parks it in `needs_review` with the object attached; only when every
    /// object found ended in the provider's own words is it `failed`. More than one object
    /// is noted in the evidence for reconciliation.
    pub(super) fn found(
        &self,
        effect: &Effect,
        started: i64,
        checks: u32,
        objects: &[RemoteObject],
    ) -> Pending {
        let ids: Vec<String> = objects.iter().map(|o| o.id.clone()).collect();
        let object = RemoteObject::deciding(objects).unwrap_or(&objects[0]);
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
    /// replays it). Read from the evidence `trail`, not from `last_error`, which the status
    /// checks since then have overwritten.
    fn key_holds_a_stored_failure(lane: &Lane, effect: &Effect, trail: &[EvidenceRow]) -> bool {
        if !lane.provider.honours_keys() {
            return false;
        }
        let answered_5xx = trail.iter().any(|row| {
            row.kind == "call" && row.key == effect.key && row.http_status.is_some_and(|s| s >= 500)
        });
        answered_5xx
            || effect
                .last_error
                .as_deref()
                .is_some_and(|e| e.contains("replayed"))
    }

    fn absent(&self, lane: &Lane, effect: &Effect, trail: &[EvidenceRow], started: i64) -> Pending {
        let (key, key_generation) = if Self::key_holds_a_stored_failure(lane, effect, trail) {
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
                Self::pending(effect, &settle, &evidence, None)
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
                Self::pending(
                    effect,
                    &settle,
                    &evidence,
                    Some(Settled::Failed { error: &error }),
                )
            }
        }
    }

    /// A status check found the provider unavailable: asked again after the outage wait
    /// (`decision`, of `decide_outage`), no check counted — or, past the
    /// deadline, `needs_review`: the outcome could still be an effect.
    pub(super) fn unavailable(
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

    pub(super) fn still_unknown(
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
}

/// `objects` without the ended objects of the effect's earlier keys
/// ([`RemoteObject::of_attempt_since`]): for an effect under its first key, all of them;
/// else those not ended before the first call under the current key left (the claim's
/// `sent_at` when no such call is recorded). The runner's status check and reconciliation
/// both read what they found through it.
pub(crate) fn of_this_key(
    effect: &Effect,
    trail: &[EvidenceRow],
    objects: Vec<RemoteObject>,
) -> Vec<RemoteObject> {
    if effect.key_generation == 0 {
        return objects;
    }
    let first_send = trail
        .iter()
        .filter(|row| row.kind == "call" && row.key == effect.key)
        .map(|row| row.started_at)
        .min()
        .or(effect.sent_at);
    match first_send {
        Some(since) => RemoteObject::of_attempt_since(objects, since),
        None => objects,
    }
}
