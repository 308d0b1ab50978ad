//! Push delivery: an inbox consumer that POSTs each message of a consumer group to an HTTP
//! endpoint of a service written in any language, signed as Standard Webhooks
//! (standardwebhooks.com), so that a receiver needs nothing of oncely but an HTTP server
//! and an HMAC (`oncely consume --deliver-to`, docs/consume-in-any-language.md).
//!
//! Each message goes through the inbox ([`oncely_inbox::Consumer`]) with a
//! [`DeliveryHandler`]: receive → begin → inbox row → POST → commit → acknowledge. The
//! receiver's answer decides ([`Verdict`]):
//!
//! - **2xx** — delivered: the inbox row commits and the delivery is acknowledged, so oncely
//!   does not deliver it again (a copy the broker redelivers is recognised by the inbox).
//! - **5xx, 408, 429, a status outside 2xx/4xx, a timeout, a refused or dropped
//!   connection** — the receiver is unavailable, the message is not defective: the
//!   delivery is retried by the consumer's one [`oncely_core::RetryPolicy`] (exponential
//!   backoff with full jitter up to its cap), for ever or until shutdown, and never
//!   dead-lettered for it ([`Delivery::retry_policy`] lifts the attempt limit and the
//!   deadline). A `Retry-After` (429, 503) is waited out before the retry, up to
//!   [`DeliveryConfig::retry_after_ceiling`].
//! - **any other 4xx** (400, 401, 404, 409, 410, 422, …) — the receiver refuses the message:
//!   it is dead at once ([`oncely_inbox::Rejected`]) with `HTTP <status>: <first 200 bytes
//!   of the body>` as its reason; `oncely inbox dead requeue` sends it back, and it is
//!   delivered again.
//!
//! Delivery is at least once: an attempt whose answer is lost (the connection dropped
//! after the receiver applied it, a commit that failed after a 2xx) is repeated with the
//! same `webhook-id` (the message id), on which the receiver deduplicates. Redirects are
//! not followed.
//!
//! # Layout
//! - `signing` — [`SigningSecret`] (`whsec_…`, the `v1` HMAC-SHA256 signature) and the
//!   `webhook-*` header names.
//! - `answer` — [`Verdict`]: what a status says (delivered, unavailable, refused).
//! - `deliver` — [`DeliveryConfig`], [`DeliveryHandler`] (the request and its judgement),
//!   [`Unavailable`], [`Delivery`] (the consumer factory and its retry policy).

mod answer;
mod deliver;
mod signing;

pub use answer::Verdict;
pub use deliver::{ClientError, Delivery, DeliveryConfig, DeliveryHandler, Unavailable};
pub use signing::{SecretError, SigningSecret, WEBHOOK_ID, WEBHOOK_SIGNATURE, WEBHOOK_TIMESTAMP};
