//! The charge at the provider under the operation's context, and what its outcome answers.

use axum::response::{IntoResponse, Response};
use http::StatusCode;
use oncely_effects::{CallOutcome, EffectRequest, ObjectState, RemoteObject};
use oncely_http::{OperationContext, Problem, StoreFailure};

use crate::payment_store::{self as store, EvidenceRow, PaymentRow};
use crate::problem;

use super::answers::{declined, not_stored, paid};
use super::Pay;

/// The provider's object as the row recorded it (for a replay from the row).
pub(crate) fn remote_of(row: &PaymentRow) -> RemoteObject {
    RemoteObject {
        id: row.payment_intent.clone().unwrap_or_default(),
        status: "succeeded".to_owned(),
        state: ObjectState::Live,
        reference: Some(row.reference.clone()),
        amount: Some(row.amount_minor),
        currency: Some(row.currency.to_ascii_lowercase()),
        created: None,
        raw: serde_json::Value::Null,
    }
}

/// Calls the provider once (the call's evidence written first), records what it proved
/// and answers: 201 charged; 402 declined; 503 not charged (not stored: the key stays
/// usable); 502 unknown (the record turns `unknown`, to be resolved by the status check).
pub(crate) async fn charge(
    pay: &Pay,
    ctx: &OperationContext,
    order_id: &str,
    request: &EffectRequest,
    (amount, currency): (i64, &str),
) -> Response {
    let db = &pay.db;
    let started = EvidenceRow {
        fence: ctx.fence,
        kind: "call".to_owned(),
        provider_key: request.key.clone(),
        started_at: oncely_core::now_ms(),
        finished_at: None,
        outcome: "sent".to_owned(),
        http_status: None,
        provider_id: None,
        detail: None,
    };
    let evidence = match store::add_evidence(db, order_id, &started).await {
        Ok(id) => id,
        // Nothing went out: the payment row stays `charging` under this fence, which the
        // same key's retry takes again.
        Err(e) => return StoreFailure::from(e).into_response(),
    };
    let outcome = pay.settings.provider.call(request).await;
    // The provider answered (and may have committed); nothing of it is recorded yet.
    oncely_core::failpoint::fail_point!("payments.after_call");
    let (state, answer) = answer(order_id, (amount, currency), &outcome);
    let (http_status, provider_id, detail) = describe(&outcome);
    let now = oncely_core::now_ms();
    let recorded = async {
        store::finish_evidence(
            db,
            &evidence,
            state,
            http_status,
            provider_id.as_deref(),
            &detail,
        )
        .await?;
        store::set_outcome(
            db,
            order_id,
            ctx.key.as_str(),
            state,
            provider_id.as_deref(),
            now,
        )
        .await
    };
    if let Err(e) = recorded.await {
        // The record still says what the answer is; the row is corrected by the next
        // status check or reconciliation.
        tracing::warn!(error = %e, order_id, "recording the payment's outcome failed");
    }
    answer
}

/// The payment row's state and the answer for what a call proved.
pub(crate) fn answer(
    order_id: &str,
    (amount, currency): (i64, &str),
    outcome: &CallOutcome,
) -> (&'static str, Response) {
    match outcome {
        CallOutcome::Succeeded(intent) => ("succeeded", paid(order_id, amount, currency, intent)),
        CallOutcome::Failed {
            code,
            message,
            object,
            ..
        } => (
            "declined",
            declined(
                order_id,
                code.as_deref(),
                message,
                object.as_ref().map(|o| o.id.as_str()),
            ),
        ),
        CallOutcome::Retryable { retry_after, .. } => {
            let secs = retry_after.map_or(1, |d| u32::try_from(d.as_secs().max(1)).unwrap_or(60));
            let res = Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                problem::PAYMENTS_UNAVAILABLE,
                "The payments provider is unavailable",
            )
            .detail("nothing was charged; retry with the same key")
            .retry_after(secs)
            .into_response();
            ("not_charged", not_stored(res))
        }
        CallOutcome::NotSent { .. } => {
            let res = Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                problem::PAYMENTS_UNAVAILABLE,
                "The payments provider cannot be reached",
            )
            .detail("nothing was sent; retry with the same key")
            .retry_after(1)
            .into_response();
            ("not_charged", not_stored(res))
        }
        _ => {
            let res = Problem::new(
                StatusCode::BAD_GATEWAY,
                problem::PAYMENT_OUTCOME_UNKNOWN,
                "The outcome of the charge is unknown",
            )
            .detail("the provider may have charged; retry with the same key: the charge is looked up at the provider before anything is sent again")
            .into_response();
            ("unknown", res)
        }
    }
}

/// HTTP status, provider id and a description of `outcome`, for the evidence.
pub(crate) fn describe(outcome: &CallOutcome) -> (Option<i64>, Option<String>, String) {
    match outcome {
        CallOutcome::Succeeded(o) => (None, Some(o.id.clone()), format!("{} {}", o.id, o.status)),
        CallOutcome::Failed {
            status,
            code,
            message,
            object,
        } => (
            Some(i64::from(*status)),
            object.as_ref().map(|o| o.id.clone()),
            format!("{}: {message}", code.as_deref().unwrap_or("refused")),
        ),
        CallOutcome::Retryable { status, .. } => {
            (Some(i64::from(*status)), None, "retryable".to_owned())
        }
        CallOutcome::Unknown { status, reason } => (status.map(i64::from), None, reason.clone()),
        CallOutcome::NotSent { reason } => (None, None, reason.clone()),
        _ => (None, None, format!("{outcome:?}")),
    }
}
