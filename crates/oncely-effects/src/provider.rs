use std::fmt;
use std::time::{Duration, SystemTime};

use futures_util::future::BoxFuture;
use oncely_core::OutcomeClass;
use serde::{Deserialize, Serialize};

/// One outgoing call as recorded with its intent: which operation, on which business
/// object, under which key, with which parameters. The same value is sent on every attempt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EffectRequest {
    /// The provider's operation, e.g. `"charge"` / `"refund"` (payments) or `"book"` /
    /// `"cancel"` (shipping). A provider answers an operation it does not know with
    /// [`CallOutcome::Failed`].
    pub operation: String,
    /// The stable reference of the business object this call acts for (an invoice id for
    /// a charge, an order id for a shipment): what the status check and reconciliation
    /// search by.
    pub reference: String,
    /// The idempotency key, derived from the parent operation ([`crate::derive_key`]).
    /// Sent as `Idempotency-Key` to providers that honour keys; kept as evidence for the
    /// others.
    pub key: String,
    /// The operation's parameters: a JSON object whose members each provider documents.
    pub params: serde_json::Value,
}

/// An object at the provider (a PaymentIntent, a Refund, a Shipment), as much as the
/// effect runner and reconciliation need of it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RemoteObject {
    /// The provider's id (`pi_…`, `re_…`, `shp_…`).
    pub id: String,
    /// The provider's status word, unchanged (`succeeded`, `requires_payment_method`,
    /// `booked`, `cancelled`, …).
    pub status: String,
    /// Whether `status` means the effect took place and is live (a succeeded charge, a
    /// booked shipment); `false` for a declined, cancelled or still-processing object.
    pub effective: bool,
    /// The business reference the object carries (metadata or `merchant_reference`).
    pub reference: Option<String>,
    /// Amount in the currency's smallest unit, where the object has one.
    pub amount: Option<i64>,
    /// ISO 4217 currency code, lower case, where the object has one.
    pub currency: Option<String>,
    /// Creation time at the provider, Unix seconds.
    pub created: Option<i64>,
    /// The provider's whole answer, kept as evidence.
    pub raw: serde_json::Value,
}

/// What one call proved. Each variant maps to one [`OutcomeClass`] ([`CallOutcome::class`]).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum CallOutcome {
    /// The provider answered with the object the call made (or, for a key it had seen,
    /// the object the first call made).
    Succeeded(RemoteObject),
    /// A definitive refusal (card declined, undeliverable, invalid parameters): the effect
    /// did not happen and a retry would be refused too.
    Failed {
        /// HTTP status.
        status: u16,
        /// The provider's error code (`card_declined`, `undeliverable`, …), when given.
        code: Option<String>,
        /// The provider's message, for the evidence.
        message: String,
        /// The object the refusal left behind (Stripe keeps a declined PaymentIntent).
        object: Option<RemoteObject>,
    },
    /// The provider said it did not act and may be asked again (429, 503, 408, 425).
    Retryable {
        /// HTTP status.
        status: u16,
        /// Its `Retry-After` (RFC 9110 §10.2.3), when sent.
        retry_after: Option<Duration>,
    },
    /// The request may have reached the provider and taken effect — a timeout after
    /// sending, a connection dropped before the answer, a 500/502/504, a 500 replayed
    /// under the key. Nothing more may be sent before the status is checked.
    Unknown {
        /// HTTP status, when there was an answer.
        status: Option<u16>,
        /// What was seen, for the evidence.
        reason: String,
    },
    /// The request never left (connection refused, name not resolved): nothing happened.
    NotSent {
        /// What failed.
        reason: String,
    },
}

impl CallOutcome {
    /// The outcome's class, for [`RetryPolicy::decide`](oncely_core::RetryPolicy::decide).
    pub fn class(&self) -> OutcomeClass {
        match self {
            Self::Succeeded(_) | Self::Failed { .. } => OutcomeClass::Final,
            Self::Retryable { .. } => OutcomeClass::Retryable,
            Self::Unknown { .. } => OutcomeClass::Unknown,
            Self::NotSent { .. } => OutcomeClass::NotSent,
        }
    }

    /// The answer's `Retry-After`, when it had one.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::Retryable { retry_after, .. } => *retry_after,
            _ => None,
        }
    }
}

/// A status check of an earlier call: its request, and when its latest attempt was sent
/// (so a lookup that lags can tell "not yet visible" from "absent").
#[derive(Debug, Clone, Copy)]
pub struct StatusQuery<'a> {
    /// The call whose outcome is in question.
    pub request: &'a EffectRequest,
    /// When the latest attempt was sent; `None` when none may have been.
    pub last_sent: Option<SystemTime>,
    /// A lower bound of the object's creation time at the provider (the intent's creation,
    /// minus clock skew): listing stops at older objects.
    pub since: SystemTime,
}

/// What a status check found.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum StatusOutcome {
    /// The provider has objects for this call, newest first (more than one is a duplicate
    /// at the provider, for reconciliation to report).
    Found(Vec<RemoteObject>),
    /// The provider has no such object, and its lookup can be trusted to show one by now:
    /// the call may be sent again **with the same key**.
    Absent,
    /// Nothing found yet, but the lookup may lag (a search index within its settle time):
    /// ask again later; this proves nothing.
    NotYetVisible {
        /// When a "not found" will mean absent.
        settles_at: SystemTime,
    },
}

/// One page of a provider's objects, newest first.
#[derive(Debug, Clone, PartialEq)]
pub struct ListPage {
    /// The objects of this page.
    pub objects: Vec<RemoteObject>,
    /// The cursor of the next (older) page, `None` at the end of the window.
    pub next: Option<String>,
}

/// A provider could not be asked (a status check or a list failed, not a call).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProviderError {
    /// The provider could not be reached or answered 5xx/429: the question stays open.
    #[error("{provider} unavailable: {reason}")]
    Unavailable {
        /// The provider's name.
        provider: String,
        /// What failed.
        reason: String,
    },
    /// The provider answered something this adapter cannot read, or refused the question
    /// (wrong credentials, unknown operation): asking again will not help.
    #[error("{provider} refused or garbled the answer: {reason}")]
    Invalid {
        /// The provider's name.
        provider: String,
        /// What was wrong.
        reason: String,
    },
}

impl ProviderError {
    /// `true` for [`ProviderError::Unavailable`]: a dependency being down, not a defect of
    /// the effect, so it never counts toward the effect's attempts.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, Self::Unavailable { .. })
    }
}

/// A provider of outgoing effects. Object-safe (boxed futures), so a runner holds
/// `Arc<dyn Provider>` per provider name.
pub trait Provider: Send + Sync + fmt::Debug {
    /// The provider's name, as effects record it (`"payments"`, `"shipping"`).
    fn name(&self) -> &str;

    /// `true` when the provider honours `Idempotency-Key` (a re-sent key never makes a
    /// second object). A provider without keys is never re-sent while an outcome is
    /// unknown: its status is checked first.
    fn honours_keys(&self) -> bool;

    /// Makes the call once. Never retries by itself: retrying is the runner's decision.
    fn call<'a>(&'a self, request: &'a EffectRequest) -> BoxFuture<'a, CallOutcome>;

    /// Asks for the objects an earlier call of `query.request` made, by its reference.
    ///
    /// # Errors
    /// [`ProviderError`] when the question could not be answered.
    fn status<'a>(
        &'a self,
        query: StatusQuery<'a>,
    ) -> BoxFuture<'a, Result<StatusOutcome, ProviderError>>;

    /// One page of the provider's objects of `operation`, created at or after `since`,
    /// newest first, continuing after `cursor` (from [`ListPage::next`]).
    ///
    /// # Errors
    /// [`ProviderError`] when the page could not be read.
    fn list<'a>(
        &'a self,
        operation: &'a str,
        since: SystemTime,
        cursor: Option<&'a str>,
    ) -> BoxFuture<'a, Result<ListPage, ProviderError>>;
}
