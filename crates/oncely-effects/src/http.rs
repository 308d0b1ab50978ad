//! How HTTP failures and answers map to outcome classes, shared by the adapters.

use std::time::SystemTime;

use oncely_core::{parse_retry_after, OutcomeClass};

use crate::{CallOutcome, ObjectState, ProviderError, RemoteObject};

/// An HTTP answer read whole: status, `Retry-After`, whether the provider marked it an
/// idempotent replay, and the JSON body (`Null` when it was not JSON).
#[derive(Debug)]
pub(crate) struct Answer {
    pub(crate) status: u16,
    pub(crate) retry_after: Option<std::time::Duration>,
    pub(crate) replayed: bool,
    pub(crate) body: serde_json::Value,
}

/// Sends `request` and reads the whole answer. A failure is the call's outcome: before any
/// byte left (connect refused, no such host) it is [`CallOutcome::NotSent`]; after (a
/// timeout, a reset, a body cut short) [`CallOutcome::Unknown`], because the provider may
/// have acted.
pub(crate) async fn send(request: reqwest::RequestBuilder) -> Result<Answer, CallOutcome> {
    let response = request.send().await.map_err(|e| transport(&e))?;
    let status = response.status().as_u16();
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let retry_after = header("retry-after").and_then(|v| parse_retry_after(&v, SystemTime::now()));
    let replayed = header("idempotent-replayed").is_some_and(|v| v.eq_ignore_ascii_case("true"));
    let bytes = response.bytes().await.map_err(|e| transport(&e))?;
    let body = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
    Ok(Answer {
        status,
        retry_after,
        replayed,
        body,
    })
}

/// The outcome of a transport failure (see [`send`]).
pub(crate) fn transport(e: &reqwest::Error) -> CallOutcome {
    // is_connect: the connection was never established, so the request never left. A
    // builder error is our own bad request, which never left either.
    if e.is_connect() || e.is_builder() {
        CallOutcome::NotSent {
            reason: oncely_core::error_chain(e),
        }
    } else {
        CallOutcome::Unknown {
            status: None,
            reason: oncely_core::error_chain(e),
        }
    }
}

/// The outcome of a 2xx answer whose body the adapter read as `object` (`None`: the body
/// was not the object it should be — empty, garbled, another shape). Only a live object is
/// a success and only an ended one a refusal; a pending object, a status word nobody
/// listed, or an unreadable body leave the outcome unknown, for the status check.
pub(crate) fn answered(answer: &Answer, object: Option<RemoteObject>) -> CallOutcome {
    let Some(object) = object.filter(|o| !o.id.is_empty()) else {
        return CallOutcome::Unknown {
            status: Some(answer.status),
            reason: format!(
                "a {} whose body is not the object it should be",
                answer.status
            ),
        };
    };
    match object.state {
        ObjectState::Live => CallOutcome::Succeeded(object),
        ObjectState::Ended => CallOutcome::Failed {
            status: answer.status,
            code: Some(object.status.clone()),
            message: format!("the object {} is {}", object.id, object.status),
            object: Some(object),
        },
        ObjectState::Pending | ObjectState::Unrecognised => CallOutcome::Unknown {
            status: Some(answer.status),
            reason: format!(
                "the object {} is {} ({:?}): not yet an outcome",
                object.id, object.status, object.state
            ),
        },
    }
}

/// Who may refuse a call: whether an answer that looks like a refusal counts as one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refuser {
    /// The answer is in the provider's own error shape (Stripe's `error` object, the
    /// shipping contract's problem document): a documented refusal is one.
    Provider,
    /// The answer is not in the provider's shape — an intermediary's (a WAF's 403, a
    /// proxy's 404 or 429), or the provider's success body behind another status: it proves
    /// nothing about the call, which is unknown.
    Other,
}

/// The outcome of a non-2xx answer by [`OutcomeClass::of_answer`], the one conservative
/// classifier: documented refusals are final and a 429 with `Retry-After` retryable — only
/// when the [`Refuser`] is the provider itself; everything else — every 5xx, a 409, a 408,
/// a bare 429, an unlisted 4xx, a 1xx or 3xx, any refusal in another shape — unknown.
pub(crate) fn refusal(
    answer: &Answer,
    refuser: Refuser,
    code: Option<String>,
    message: String,
    object: Option<crate::RemoteObject>,
) -> CallOutcome {
    let class = match OutcomeClass::of_answer(answer.status, answer.retry_after.is_some()) {
        OutcomeClass::Final | OutcomeClass::Retryable if refuser == Refuser::Other => {
            OutcomeClass::Unknown
        }
        class => class,
    };
    match class {
        OutcomeClass::Retryable => CallOutcome::Retryable {
            status: answer.status,
            retry_after: answer.retry_after,
        },
        OutcomeClass::Unknown => CallOutcome::Unknown {
            status: Some(answer.status),
            reason: if answer.replayed {
                format!("a replayed {} under the key: {message}", answer.status)
            } else if refuser == Refuser::Other {
                format!(
                    "a {} not in the provider's error shape: {message}",
                    answer.status
                )
            } else {
                message
            },
        },
        _ => CallOutcome::Failed {
            status: answer.status,
            code,
            message,
            object,
        },
    }
}

/// A lookup (status check, list) that failed: unavailable when the provider could not
/// answer (transport, 5xx, 429), invalid otherwise.
pub(crate) fn lookup_failure(provider: &str, outcome: &CallOutcome) -> ProviderError {
    let reason = match outcome {
        CallOutcome::NotSent { reason } | CallOutcome::Unknown { reason, .. } => reason.clone(),
        CallOutcome::Retryable { status, .. } => format!("HTTP {status}"),
        CallOutcome::Failed {
            status, message, ..
        } => {
            return ProviderError::Invalid {
                provider: provider.to_owned(),
                reason: format!("HTTP {status}: {message}"),
            }
        }
        CallOutcome::Succeeded(_) => "an unexpected answer".to_owned(),
    };
    ProviderError::Unavailable {
        provider: provider.to_owned(),
        reason,
    }
}

/// Sends a lookup and returns its JSON body on 2xx.
pub(crate) async fn lookup(
    provider: &str,
    request: reqwest::RequestBuilder,
) -> Result<Answer, ProviderError> {
    let answer = send(request)
        .await
        .map_err(|o| lookup_failure(provider, &o))?;
    if (200..300).contains(&answer.status) {
        return Ok(answer);
    }
    let message = answer.body["error"]["message"]
        .as_str()
        .or_else(|| answer.body["detail"].as_str())
        .unwrap_or("no message")
        .to_owned();
    Err(lookup_failure(
        provider,
        &refusal(&answer, Refuser::Provider, None, message, None),
    ))
}
