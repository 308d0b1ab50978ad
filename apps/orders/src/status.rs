//! The order's `status`, one vocabulary for both fulfilment modes: what `GET
//! /v1/orders/{id}` says and what an order's chain (the console, `orders show`) reports. A
//! leaf: the order view, the saga view and the chain read it, it reads none of them.
//!
//! The status is derived from the stores on every read — the invoice and the effects under
//! the choreography, the saga's state under `--fulfilment saga` — so it cannot disagree
//! with them, and no consumer writes it apart from the step it reports.

use oncely_sql::EffectState;

/// An order's status. Choreography: `created` → `paid` (its invoice's charge succeeded) →
/// `fulfilled` (its shipment is booked); `rejected` when the charge failed for good;
/// `needs_review` when the charge or the booking waits for a person. Saga: `processing` →
/// `fulfilled`, or `compensating` → `rejected` / `cancelled`; `needs_review`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OrderStatus {
    /// Stored; nothing of its flow has happened yet (or its saga has not started).
    Created,
    /// Its saga is running (saga mode).
    Processing,
    /// Paid; not shipped yet.
    Paid,
    /// Paid and shipped: the flow is done.
    Fulfilled,
    /// Its saga is undoing its steps.
    Compensating,
    /// Refused on the way (a declined charge, no stock, a refused shipment), undone.
    Rejected,
    /// Cancelled by the client, undone.
    Cancelled,
    /// An outcome is not known and a person decides (`/console/review`).
    NeedsReview,
}

impl OrderStatus {
    /// The word the API and the chain show.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Created => "created",
            Self::Processing => "processing",
            Self::Paid => "paid",
            Self::Fulfilled => "fulfilled",
            Self::Compensating => "compensating",
            Self::Rejected => "rejected",
            Self::Cancelled => "cancelled",
            Self::NeedsReview => "needs_review",
        }
    }

    /// The status under the saga, from its state word (`running`, `compensating`,
    /// `completed`, `compensated`, `needs_review`); `cancelled`: it compensated because the
    /// client cancelled.
    pub(crate) fn of_saga(state: &str, cancelled: bool) -> Self {
        match state {
            "completed" => Self::Fulfilled,
            "compensating" => Self::Compensating,
            "compensated" if cancelled => Self::Cancelled,
            "compensated" => Self::Rejected,
            "needs_review" => Self::NeedsReview,
            _ => Self::Processing,
        }
    }

    /// The status under the choreography, from its invoice (`paid`: its `paid_at` is set),
    /// its charge's state and its shipment's state (`None`: no such effect yet).
    pub(crate) fn of_flow(
        paid: bool,
        charge: Option<EffectState>,
        shipment: Option<EffectState>,
    ) -> Self {
        let waits = |s: Option<EffectState>| {
            matches!(
                s,
                Some(EffectState::NeedsReview | EffectState::Unknown | EffectState::Absent)
            )
        };
        match shipment {
            Some(EffectState::Succeeded) => return Self::Fulfilled,
            Some(EffectState::Failed) => return Self::NeedsReview,
            s if waits(s) => return Self::NeedsReview,
            _ => {}
        }
        if paid || charge == Some(EffectState::Succeeded) {
            Self::Paid
        } else if charge == Some(EffectState::Failed) {
            Self::Rejected
        } else if waits(charge) {
            Self::NeedsReview
        } else {
            Self::Created
        }
    }
}

#[cfg(test)]
mod tests {
    use oncely_sql::EffectState as E;

    use super::OrderStatus as S;

    #[test]
    fn the_choreography_status_follows_payment_and_shipment() {
        assert_eq!(S::of_flow(false, None, None), S::Created);
        assert_eq!(S::of_flow(false, Some(E::Pending), None), S::Created);
        assert_eq!(S::of_flow(true, Some(E::Succeeded), None), S::Paid);
        assert_eq!(
            S::of_flow(true, Some(E::Succeeded), Some(E::Pending)),
            S::Paid
        );
        assert_eq!(
            S::of_flow(true, Some(E::Succeeded), Some(E::Succeeded)),
            S::Fulfilled
        );
        assert_eq!(S::of_flow(false, Some(E::Failed), None), S::Rejected);
        assert_eq!(S::of_flow(false, Some(E::Unknown), None), S::NeedsReview);
        assert_eq!(
            S::of_flow(true, Some(E::Succeeded), Some(E::NeedsReview)),
            S::NeedsReview
        );
    }
}
