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
    /// What `status` means for the effect, read through the provider's
    /// [`StatusVocabulary`]: live, ended, pending, or a word it does not know.
    pub state: ObjectState,
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

impl RemoteObject {
    /// `true` when the object is [`ObjectState::Live`]: the effect took place.
    pub fn is_live(&self) -> bool {
        self.state == ObjectState::Live
    }

    /// `objects` without the ended ones made before `since_ms` (Unix ms, our clock): the
    /// objects of an effect's earlier keys — a declined charge an operator retried under
    /// the next key — which say nothing of the current key's attempt and must not decide
    /// it `failed` (found by the effect protocol's model). Live, pending and unlisted
    /// objects stay whatever their age (a late success of an earlier key is the effect
    /// having happened), as do objects without a creation time. `created` is whole seconds,
    /// so an object counts as earlier only when its second ended before `since_ms`; a
    /// provider clock behind ours can only make an attempt's own ended object look earlier,
    /// which turns a `failed` into another status check — never the reverse.
    #[must_use]
    pub fn of_attempt_since(objects: Vec<RemoteObject>, since_ms: i64) -> Vec<RemoteObject> {
        objects
            .into_iter()
            .filter(|o| {
                let earlier = o
                    .created
                    .is_some_and(|s| s.saturating_add(1).saturating_mul(1000) <= since_ms);
                !(o.state == ObjectState::Ended && earlier)
            })
            .collect()
    }

    /// The object a status check that found `objects` rests on, read three-valued
    /// (docs/DESIGN.md "Status vocabularies"): a live one; else one still pending; else one
    /// in a word nobody listed; else (every one ended) the first. `None` for no objects.
    /// The runner, reconciliation and the payments endpoint's resolver all decide from it.
    pub fn deciding(objects: &[RemoteObject]) -> Option<&RemoteObject> {
        let first_in = |state| objects.iter().find(|o| o.state == state);
        first_in(ObjectState::Live)
            .or_else(|| first_in(ObjectState::Pending))
            .or_else(|| first_in(ObjectState::Unrecognised))
            .or(objects.first())
    }
}

/// What a provider object's status word means for the effect that made it — three values
/// and the word nobody listed (docs/DESIGN.md "Status vocabularies").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum ObjectState {
    /// The effect took place and stands (a succeeded charge, a booked shipment, a label
    /// created, a parcel in transit).
    Live,
    /// Final and not live, in the provider's own words (declined, cancelled, failed): the
    /// effect did not take place and will not.
    Ended,
    /// Still moving (`processing`, `pending`): it may yet become live or end. The effect
    /// stays unknown and is checked again, within a bound.
    Pending,
    /// A word the vocabulary does not list. Never a failure: the effect is parked for a
    /// person with the object attached.
    Unrecognised,
}

/// A provider's status words, sorted into [`ObjectState`]s. Configuration: a provider
/// that reports other words gets its own lists; a word on no list is
/// [`ObjectState::Unrecognised`]. Words compare exactly (ASCII case-insensitive).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusVocabulary {
    /// Words of a live object.
    pub live: Vec<String>,
    /// Words of an object that ended without taking effect.
    pub ended: Vec<String>,
    /// Words of an object still moving.
    pub pending: Vec<String>,
}

impl StatusVocabulary {
    /// A vocabulary from three lists of words.
    pub fn new(live: &[&str], ended: &[&str], pending: &[&str]) -> Self {
        let own = |w: &[&str]| w.iter().map(|s| (*s).to_owned()).collect();
        Self {
            live: own(live),
            ended: own(ended),
            pending: own(pending),
        }
    }

    /// Stripe's PaymentIntent (API v1 "PaymentIntent.status"): live `succeeded`,
    /// `requires_capture` (authorised, the money held); ended `canceled`,
    /// `requires_payment_method` (the attempt failed, nothing charged); pending
    /// `processing`, `requires_action`, `requires_confirmation`.
    pub fn stripe_payment_intent() -> Self {
        Self::new(
            &["succeeded", "requires_capture"],
            &["canceled", "requires_payment_method"],
            &["processing", "requires_action", "requires_confirmation"],
        )
    }

    /// Stripe's Refund ("Refund.status"): live `succeeded`, `pending` (issued; Stripe
    /// completes it); ended `failed`, `canceled`; pending `requires_action`.
    pub fn stripe_refund() -> Self {
        Self::new(
            &["succeeded", "pending"],
            &["failed", "canceled"],
            &["requires_action"],
        )
    }

    /// The shipping contract's shipment (docs/DESIGN.md "Provider contracts") and the words
    /// carriers use for a shipment that exists: live `booked`, `created`, `label_created`,
    /// `in_transit`, `out_for_delivery`, `delivered`, `shipped`; ended `cancelled`,
    /// `canceled`, `rejected`, `voided`; pending `pending`, `processing`.
    pub fn shipment() -> Self {
        Self::new(
            &[
                "booked",
                "created",
                "label_created",
                "in_transit",
                "out_for_delivery",
                "delivered",
                "shipped",
            ],
            &["cancelled", "canceled", "rejected", "voided"],
            &["pending", "processing"],
        )
    }

    /// The state `word` means.
    pub fn state_of(&self, word: &str) -> ObjectState {
        let listed = |words: &[String]| words.iter().any(|w| w.eq_ignore_ascii_case(word));
        if listed(&self.live) {
            ObjectState::Live
        } else if listed(&self.ended) {
            ObjectState::Ended
        } else if listed(&self.pending) {
            ObjectState::Pending
        } else {
            ObjectState::Unrecognised
        }
    }
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
    /// The provider said it did not act and may be asked again: a 429 with `Retry-After`.
    Retryable {
        /// HTTP status.
        status: u16,
        /// Its `Retry-After` (RFC 9110 §10.2.3), when sent.
        retry_after: Option<Duration>,
    },
    /// The request may have reached the provider and taken effect — a timeout after
    /// sending, a connection dropped before the answer, any 5xx, a 409, a 2xx whose body
    /// cannot be read or whose object is pending or in a word nobody listed
    /// ([`oncely_core::OutcomeClass::of_status`]). Nothing more may be sent before the
    /// status is checked.
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
    /// Nothing found yet, but "not found" cannot be trusted yet: a search index that lags,
    /// or a provider without keys (or a lookup without search) that may still commit a
    /// request it received, until the latest send + the provider's settle time. Ask again
    /// later; this proves nothing.
    NotYetVisible {
        /// When a "not found" will mean absent.
        settles_at: SystemTime,
    },
}

/// What "nothing found" means for a lookup of a call last sent at `last_sent`, with
/// `settle` the provider's settle time: [`StatusOutcome::NotYetVisible`] until `last_sent +
/// settle`, [`StatusOutcome::Absent`] after (or when nothing may have been sent).
pub fn not_found(last_sent: Option<SystemTime>, settle: Duration) -> StatusOutcome {
    match last_sent.map(|t| t + settle) {
        Some(at) if at > SystemTime::now() => StatusOutcome::NotYetVisible { settles_at: at },
        _ => StatusOutcome::Absent,
    }
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

    /// How long after a send a "not found" may still turn into an object (the settle time
    /// its [`not_found`] answers use), or `None` when the provider does not say. The runner
    /// uses it when a status check found only objects of the effect's earlier keys.
    fn settle_time(&self) -> Option<Duration> {
        None
    }

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
