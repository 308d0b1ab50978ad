//! The runner's decisions, as `runner/call.rs` and `runner/check.rs` make them, over the crate's own answer types.

use oncely_core::{Failure, OutcomeClass, RetryDecision, RetryPolicy};

use super::{Answer, CheckReply, EarlierEnded, EffectModel, Evidence, Obj, Row, Settle, State};
use crate::{CallOutcome, ObjectState, RemoteObject};

/// The provider's object as a [`RemoteObject`] (what the adapters hand the runner).
pub(super) fn remote(i: usize, obj: Obj) -> RemoteObject {
    let (status, state) = match obj {
        Obj::Live => ("booked", ObjectState::Live),
        Obj::Ended => ("cancelled", ObjectState::Ended),
        Obj::Pending => ("processing", ObjectState::Pending),
        Obj::Unrecognised => ("on_hold", ObjectState::Unrecognised),
    };
    RemoteObject {
        id: format!("obj_{i}"),
        status: status.to_owned(),
        state,
        reference: Some("order-1".to_owned()),
        amount: None,
        currency: None,
        created: None,
        raw: serde_json::Value::Null,
    }
}

/// The answer as the adapter returns it (see `http::answered`).
pub(super) fn call_outcome(answer: Answer) -> CallOutcome {
    match answer {
        Answer::Object(Obj::Live) => CallOutcome::Succeeded(remote(0, Obj::Live)),
        Answer::Object(Obj::Ended) => CallOutcome::Failed {
            status: 402,
            code: Some("card_declined".to_owned()),
            message: "declined".to_owned(),
            object: Some(remote(0, Obj::Ended)),
        },
        Answer::Object(Obj::Pending | Obj::Unrecognised) => CallOutcome::Unknown {
            status: Some(201),
            reason: "an object in a word that is not final".to_owned(),
        },
        Answer::ServerError => CallOutcome::Unknown {
            status: Some(500),
            reason: "500".to_owned(),
        },
        Answer::RateLimited => CallOutcome::Retryable {
            status: 429,
            retry_after: None,
        },
        Answer::None => CallOutcome::Unknown {
            status: None,
            reason: "timed out".to_owned(),
        },
    }
}

impl EffectModel {
    /// `runner/call.rs`: what a call's outcome settles into.
    pub(super) fn settle_call(outcome: &CallOutcome, gave_up: bool) -> Settle {
        match outcome {
            CallOutcome::Succeeded(_) => Settle::Succeeded,
            CallOutcome::Failed { .. } => Settle::Failed,
            CallOutcome::Unknown { .. } => Settle::Unknown,
            CallOutcome::Retryable { .. } | CallOutcome::NotSent { .. } => {
                debug_assert!(matches!(
                    outcome.class(),
                    OutcomeClass::Retryable | OutcomeClass::NotSent
                ));
                if gave_up {
                    Settle::GaveUpUnavailable
                } else {
                    Settle::Unavailable
                }
            }
        }
    }

    /// `runner/check.rs` `still_unknown`.
    pub(super) fn still_unknown(&self, row: &Row) -> Settle {
        if row.checks + 1 >= self.max_checks {
            Settle::NeedsReview
        } else {
            Settle::Unknown
        }
    }

    /// The objects a status check finds for the effect's reference.
    pub(super) fn found_objects(&self, s: &State, row: &Row) -> Vec<(u8, Obj)> {
        s.objects
            .iter()
            .copied()
            .filter(|&(key_gen, obj)| {
                self.earlier_ended == EarlierEnded::Decides
                    || obj != Obj::Ended
                    || key_gen == row.key_gen
            })
            .collect()
    }

    /// `runner/check.rs` `found`: the deciding object, read three-valued.
    pub(super) fn found(&self, row: &Row, objects: &[(u8, Obj)]) -> Settle {
        // Newest first, as the adapters list them.
        let remote: Vec<RemoteObject> = objects
            .iter()
            .enumerate()
            .rev()
            .map(|(i, (_, o))| remote(i, *o))
            .collect();
        let object = RemoteObject::deciding(&remote).unwrap_or(&remote[0]);
        match object.state {
            ObjectState::Live => Settle::Succeeded,
            ObjectState::Pending => self.still_unknown(row),
            ObjectState::Ended => Settle::Failed,
            ObjectState::Unrecognised => Settle::NeedsReview,
        }
    }

    /// `runner/check.rs` `absent`: sent again (under the next key when the provider keeps
    /// a stored 5xx under this one), or failed past the attempt limit.
    pub(super) fn absent(&self, row: &Row) -> Settle {
        let policy = RetryPolicy {
            max_attempts: u32::from(self.max_attempts),
            deadline: None,
            ..RetryPolicy::default()
        };
        let failure = Failure {
            failures: u32::from(row.attempts.max(1)),
            class: OutcomeClass::NotSent,
            retry_after: None,
            elapsed: std::time::Duration::ZERO,
            timed_out: false,
        };
        match policy.decide(&failure, None, 0.5) {
            RetryDecision::RetryAfter(_) => Settle::Absent {
                next_key: self.honours_keys && row.answered_5xx,
            },
            _ => Settle::Failed,
        }
    }

    pub(super) fn check(&self, s: &State, row: &Row, reply: CheckReply) -> (Settle, Evidence) {
        let counted = Evidence::Status { counts: true };
        match reply {
            CheckReply::Answered if !self.found_objects(s, row).is_empty() => {
                (self.found(row, &self.found_objects(s, row)), counted)
            }
            CheckReply::Answered if row.window_passed => (self.absent(row), counted),
            CheckReply::Answered | CheckReply::Lagging => (self.still_unknown(row), counted),
            CheckReply::Unavailable => (Settle::Unavailable, Evidence::Status { counts: false }),
            CheckReply::UnavailableGaveUp => (
                Settle::GaveUpUnavailable,
                Evidence::Status { counts: false },
            ),
            CheckReply::Invalid => (Settle::NeedsReview, counted),
        }
    }
}
