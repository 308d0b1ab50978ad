//! The effect store's values: states, a new effect and a stored one, settle outcomes, evidence, operator resolutions.

use crate::StoreError;

oncely_core::stored_words! {
    /// The states of an outgoing effect (docs/DESIGN.md "External effects"):
    /// `pending` → `in_flight` (attempt n, under a lease) → `succeeded` | `failed` |
    /// `unknown` → resolution by status check → `succeeded` | `absent` (sent again with the
    /// same key) | still `unknown` → `needs_review`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    #[non_exhaustive]
    pub enum EffectState {
        /// Recorded, not attempted yet (or waiting out a provider's unavailability).
        Pending => "pending",
        /// An attempt was started under a lease: the request may be on its way.
        InFlight => "in_flight",
        /// The provider made the object (its id is recorded).
        Succeeded => "succeeded",
        /// The provider refused for good (a declined card, an undeliverable shipment).
        Failed => "failed",
        /// The request may have reached the provider: its status must be checked before
        /// anything is sent again.
        Unknown => "unknown",
        /// A status check proved the provider has no such object: it may be sent again with
        /// the same key.
        Absent => "absent",
        /// The resolution budget is spent and the outcome is still not known: a person decides,
        /// with the evidence.
        NeedsReview => "needs_review",
    }
}

impl EffectState {
    /// `true` for the states no runner touches again (succeeded, failed; needs_review until
    /// a person acts).
    pub fn is_settled(self) -> bool {
        matches!(self, Self::Succeeded | Self::Failed | Self::NeedsReview)
    }
}

/// The intent of one outgoing call, recorded with [`EffectStore::enqueue`](crate::EffectStore::enqueue) in the caller's
/// business transaction.
#[derive(Debug, Clone, Copy)]
pub struct NewEffect<'a> {
    /// The tenant the effect acts for (never shown to another).
    pub tenant: &'a str,
    /// The provider's name (`payments`, `shipping`).
    pub provider: &'a str,
    /// The provider's operation (`charge`, `refund`, `book`, `cancel`).
    pub operation: &'a str,
    /// The stable reference of the business object (invoice id, order id): at most one
    /// effect per provider, operation and reference.
    pub reference: &'a str,
    /// The idempotency key, derived from the parent operation — never minted per attempt.
    pub key: &'a str,
    /// The operation's parameters (a JSON object).
    pub request: &'a serde_json::Value,
}

/// An effect as stored.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Effect {
    /// Its id (UUIDv7).
    pub id: String,
    /// The tenant it acts for.
    pub tenant: String,
    /// The provider's name.
    pub provider: String,
    /// The provider's operation.
    pub operation: String,
    /// The business reference.
    pub reference: String,
    /// The idempotency key sent on every attempt.
    #[sqlx(rename = "idem_key")]
    pub key: String,
    /// Raised only when a status check proved a stored failure under the old key took no
    /// effect (see `oncely_effects::derive_key`).
    pub key_generation: i32,
    /// The parameters, JSON text.
    pub request: String,
    /// The state's stored word ([`Effect::state`] parses it).
    #[sqlx(rename = "state")]
    pub state_word: String,
    /// Calls started that counted (a provider being unavailable does not count).
    pub attempts: i32,
    /// Status checks made that reached the provider (one that found it unavailable does
    /// not count).
    pub checks: i32,
    /// Consecutive calls or status checks that found the provider unavailable (refused
    /// connection, 429, 503 — [`Settle::Unavailable`], or [`Settle::Retry`] that does not
    /// count): none of them is an attempt or a check, so this is what the outage backoff
    /// grows with. 0 after anything else.
    pub unavailable_streak: i32,
    /// When the effect is next due, Unix ms.
    pub available_at: i64,
    /// When its latest call was allowed out (the claim that made it `in_flight`), Unix ms;
    /// `None` before the first. A status check's settle time counts from it.
    pub sent_at: Option<i64>,
    /// The provider's object id, once known.
    pub provider_id: Option<String>,
    /// The provider's answer (JSON text), once known.
    pub response: Option<String>,
    /// What the latest attempt or check found, when it was not a success.
    pub last_error: Option<String>,
    /// The lease's version: every claim raises it, every settle names it.
    pub lease_version: i64,
    /// Unix ms.
    pub created_at: i64,
    /// Unix ms.
    pub updated_at: i64,
}

impl Effect {
    /// The effect's state.
    ///
    /// # Errors
    /// [`StoreError::Corrupt`] for a word no state has.
    pub fn state(&self) -> Result<EffectState, StoreError> {
        Ok(EffectState::parse(&self.state_word)?)
    }

    /// The parameters, parsed.
    ///
    /// # Errors
    /// [`StoreError::Corrupt`] when the stored text is not JSON.
    pub fn params(&self) -> Result<serde_json::Value, StoreError> {
        serde_json::from_str(&self.request)
            .map_err(|e| StoreError::Corrupt(format!("effect {} request: {e}", self.id)))
    }
}

/// What an operator found out about an effect ([`EffectStore::resolve`](crate::EffectStore::resolve)).
#[derive(Debug, Clone, Copy)]
pub struct Resolution<'a> {
    /// [`EffectState::Succeeded`] or [`EffectState::Failed`].
    pub to: EffectState,
    /// The provider's object id (required for `Succeeded`).
    pub provider_id: Option<&'a str>,
    /// Who resolved it (for the audit row).
    pub actor: &'a str,
    /// Why (for the audit row).
    pub reason: &'a str,
}

/// What [`EffectStore::enqueue`](crate::EffectStore::enqueue) did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Enqueued {
    /// A new effect, with its id.
    Created(String),
    /// An effect for this provider, operation and reference (or key) already exists: a
    /// redelivered message or a retried request records nothing new.
    Existing,
}

/// The state an effect settles into, with what is known.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Settle {
    /// The provider's object exists.
    Succeeded {
        /// Its id.
        provider_id: String,
        /// The provider's answer, JSON text.
        response: String,
    },
    /// Refused for good.
    Failed {
        /// What was refused, and why.
        error: String,
        /// The provider's answer, when it left an object (a declined PaymentIntent).
        response: Option<String>,
    },
    /// Try the call again at `at` (Unix ms), same key. `counts`: whether the attempt just
    /// made counts toward the limit (`false` when the provider was unavailable: the attempt
    /// is taken back and [`Effect::unavailable_streak`] raised, as by
    /// [`Settle::Unavailable`]).
    Retry {
        /// When, Unix ms.
        at: i64,
        /// What failed.
        error: String,
        /// Whether the attempt counts.
        counts: bool,
    },
    /// The provider was unavailable (refused connection, 429, 503) for the call or the
    /// status check just made: neither counts (a call's attempt is taken back, a check is
    /// not added) and [`Effect::unavailable_streak`] is raised by one. A call goes back to
    /// `pending`, a status check leaves the effect `unknown`; either is due again at `at`
    /// (Unix ms).
    Unavailable {
        /// When, Unix ms.
        at: i64,
        /// What was seen.
        error: String,
    },
    /// The provider was unavailable for the call or status check just made, and the retry
    /// policy gave up (its deadline passed): neither counts, as with
    /// [`Settle::Unavailable`]. A call — never sent, or not acted upon — makes the effect
    /// `failed`; a status check leaves the outcome unknown, so the effect goes to
    /// `needs_review` (a person decides; never `failed`).
    GaveUpUnavailable {
        /// Why.
        error: String,
    },
    /// The outcome is unknown: check the status at `at` (Unix ms).
    Unknown {
        /// When, Unix ms.
        at: i64,
        /// What was seen.
        error: String,
    },
    /// A status check proved the provider has nothing: send again at `at` with key
    /// `key` (the same one, or — when a provider replays a stored failure under it — the
    /// next generation's).
    Absent {
        /// When, Unix ms.
        at: i64,
        /// The key of the next attempt.
        key: String,
        /// Its generation.
        key_generation: i32,
    },
    /// Park for a person, with the reason.
    NeedsReview {
        /// Why.
        error: String,
    },
}

/// The evidence of one call or status check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Evidence {
    /// `call` or `status`.
    pub kind: EvidenceKind,
    /// The key sent (or asked about).
    pub key: String,
    /// Unix ms.
    pub started_at: i64,
    /// Unix ms.
    pub finished_at: i64,
    /// The outcome class or finding (`succeeded`, `not_sent`, `unknown`, `retryable`,
    /// `failed`, `found`, `absent`, `not_yet_visible`, `unavailable`).
    pub outcome: String,
    /// The HTTP status, when there was an answer.
    pub http_status: Option<u16>,
    /// The provider ids seen.
    pub provider_ids: Vec<String>,
    /// What else was seen (the error, the reason).
    pub detail: String,
}

/// Whether [`Evidence`] is of a call or of a status check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EvidenceKind {
    /// A call to the provider.
    Call,
    /// A status check.
    Status,
}

/// One row of an effect's evidence, as stored.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct EvidenceRow {
    /// 1, 2, … in the order they were recorded.
    pub n: i32,
    /// `call` or `status`.
    pub kind: String,
    /// The key sent.
    #[sqlx(rename = "idem_key")]
    pub key: String,
    /// Unix ms.
    pub started_at: i64,
    /// Unix ms.
    pub finished_at: i64,
    /// See [`Evidence::outcome`].
    pub outcome: String,
    /// HTTP status.
    pub http_status: Option<i32>,
    /// Provider ids seen, comma-separated.
    pub provider_ids: String,
    /// See [`Evidence::detail`].
    pub detail: String,
}

/// One effect's settle in [`EffectStore::settle_batch`](crate::EffectStore::settle_batch): the effect as claimed (its lease
/// version fences the update), the state it settles into and the evidence of the call or
/// status check.
#[derive(Debug, Clone, Copy)]
pub struct SettleItem<'a> {
    /// The effect as claimed.
    pub effect: &'a Effect,
    /// What it settles into.
    pub settle: &'a Settle,
    /// The evidence of the call or status check just made.
    pub evidence: &'a Evidence,
}
