//! Stripe's webhook events, received: the `Stripe-Signature` check and the event's reading
//! (Stripe's "Check the webhook signatures": `t=<unix seconds>,v1=<hex HMAC-SHA256(endpoint
//! secret, "{t}.{raw body}")>`, several `v1` while a secret rolls). Kept beside the Stripe
//! adapter: the scheme and the event shape are Stripe's own.

use std::time::Duration;

use hmac::{Hmac, Mac};
use serde_json::Value;
use sha2::Sha256;

use crate::{PushedEvent, StripePayments};

/// Settings of [`StripeWebhook`].
#[derive(Clone)]
pub struct StripeWebhookConfig {
    /// The endpoint's signing secrets (`whsec_…`): an event signed with any one of them is
    /// taken, so a secret can be rolled (both configured while Stripe signs with both).
    pub secrets: Vec<String>,
    /// How far the signature's timestamp `t` may lie from our clock, either way, before the
    /// event is refused as a replay. Default 300 s (Stripe's libraries' default).
    pub tolerance: Duration,
}

impl std::fmt::Debug for StripeWebhookConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StripeWebhookConfig")
            .field("secrets", &self.secrets.len())
            .field("tolerance", &self.tolerance)
            .finish()
    }
}

impl Default for StripeWebhookConfig {
    fn default() -> Self {
        Self {
            secrets: Vec::new(),
            tolerance: Duration::from_secs(300),
        }
    }
}

/// Why a webhook request was refused. Nothing was applied for any of them.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WebhookError {
    /// No `Stripe-Signature` header.
    #[error("no Stripe-Signature header")]
    MissingSignature,
    /// The header has no `t=` timestamp or no `v1=` signature.
    #[error("a Stripe-Signature header without t= and v1=")]
    MalformedSignature,
    /// The timestamp `t` (Unix seconds) is further than the tolerance from `now`.
    #[error("Stripe-Signature timestamp {t} is outside the tolerance of {tolerance_secs} s")]
    OutsideTolerance {
        /// The header's timestamp, Unix seconds.
        t: i64,
        /// The tolerance, seconds.
        tolerance_secs: u64,
    },
    /// No `v1` signature matches any configured secret.
    #[error("no Stripe-Signature v1 signature matches a configured secret")]
    NoMatchingSignature,
    /// The signed body is not a Stripe event (`id`, `type`, `created`, `data.object`).
    #[error("not a Stripe event: {0}")]
    InvalidEvent(String),
}

/// One Stripe event, as signed: `id` (`evt_…`), `type` (`payment_intent.succeeded`, …),
/// `created` (Unix seconds) and `data.object` (the object as the event saw it).
#[derive(Debug, Clone, PartialEq)]
pub struct StripeEvent {
    /// `evt_…`: the same for every delivery of the event.
    pub id: String,
    /// `type`.
    pub kind: String,
    /// When the event happened at Stripe, Unix seconds.
    pub created: i64,
    /// `data.object`.
    pub object: Value,
}

impl StripeEvent {
    /// Reads an event body.
    ///
    /// # Errors
    /// [`WebhookError::InvalidEvent`] when it is not JSON or lacks a member.
    pub fn parse(body: &[u8]) -> Result<Self, WebhookError> {
        let bad = |why: &str| WebhookError::InvalidEvent(why.to_owned());
        let v: Value = serde_json::from_slice(body).map_err(|e| bad(&e.to_string()))?;
        let text = |k: &str| {
            v[k].as_str()
                .filter(|s| !s.is_empty() && s.len() <= 255)
                .map(str::to_owned)
                .ok_or_else(|| bad(&format!("no {k}")))
        };
        Ok(Self {
            id: text("id")?,
            kind: text("type")?,
            created: v["created"].as_i64().ok_or_else(|| bad("no created"))?,
            object: v["data"]["object"].clone(),
        })
    }
}

/// Stripe's webhook endpoint logic: checks a delivery's signature and turns a
/// `payment_intent.*` event into a [`PushedEvent`] for [`crate::apply_pushed`].
#[derive(Debug, Clone)]
pub struct StripeWebhook {
    config: StripeWebhookConfig,
    payments: StripePayments,
}

impl StripeWebhook {
    /// An endpoint with `config`, reading PaymentIntents as `payments` does (its
    /// reference field and status vocabulary).
    pub fn new(config: StripeWebhookConfig, payments: StripePayments) -> Self {
        Self { config, payments }
    }

    /// Checks `signature` (the `Stripe-Signature` header) over the raw `body` at `now`
    /// (Unix seconds), then reads the event.
    ///
    /// # Errors
    /// [`WebhookError`]: no header, a malformed one, a timestamp outside the tolerance, no
    /// matching `v1`, or a signed body that is not an event.
    pub fn verify(
        &self,
        signature: Option<&str>,
        body: &[u8],
        now: i64,
    ) -> Result<StripeEvent, WebhookError> {
        verify_signature(&self.config, signature, body, now)?;
        StripeEvent::parse(body)
    }

    /// The PaymentIntent a `payment_intent.*` event carries, as a pushed status of the
    /// effect it names (provider `payments`, operation `charge`); `None` for other events
    /// (acknowledged, not applied: a `charge.*` object speaks in the Charge's words, which
    /// the PaymentIntent events repeat in the intent's).
    pub fn pushed(&self, event: &StripeEvent) -> Option<PushedEvent> {
        let is_intent = event.kind.starts_with("payment_intent.")
            && event.object["object"].as_str() == Some("payment_intent")
            && event.object["id"].is_string();
        is_intent.then(|| PushedEvent {
            source: "stripe".to_owned(),
            id: event.id.clone(),
            kind: event.kind.clone(),
            created: event.created,
            provider: "payments".to_owned(),
            operation: "charge".to_owned(),
            object: self.payments.payment_intent(&event.object),
        })
    }
}

/// Checks a `Stripe-Signature` header: its `t` within `config.tolerance` of `now` (Unix
/// seconds) and one of its `v1` values equal — compared in constant time
/// ([`Mac::verify_slice`]) — to HMAC-SHA256 of `"{t}.{body}"` under one of the secrets.
///
/// # Errors
/// See [`StripeWebhook::verify`].
pub fn verify_signature(
    config: &StripeWebhookConfig,
    signature: Option<&str>,
    body: &[u8],
    now: i64,
) -> Result<(), WebhookError> {
    let header = signature.ok_or(WebhookError::MissingSignature)?;
    let mut t = None;
    let mut v1 = Vec::new();
    for part in header.split(',') {
        match part.trim().split_once('=') {
            Some(("t", value)) => t = value.parse::<i64>().ok(),
            Some(("v1", value)) => v1.extend(hex(value)),
            _ => {}
        }
    }
    let t = t.ok_or(WebhookError::MalformedSignature)?;
    if v1.is_empty() {
        return Err(WebhookError::MalformedSignature);
    }
    let tolerance = config.tolerance.as_secs();
    if now.abs_diff(t) > tolerance {
        return Err(WebhookError::OutsideTolerance {
            t,
            tolerance_secs: tolerance,
        });
    }
    for secret in &config.secrets {
        let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(secret.as_bytes()) else {
            continue;
        };
        mac.update(t.to_string().as_bytes());
        mac.update(b".");
        mac.update(body);
        if v1.iter().any(|sig| mac.clone().verify_slice(sig).is_ok()) {
            return Ok(());
        }
    }
    Err(WebhookError::NoMatchingSignature)
}

/// The bytes of lower- or upper-case hex `s`; `None` when it is not hex of whole bytes.
fn hex(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// A `Stripe-Signature` header for `body` at `t` under `secret` (`t=…,v1=…`), as Stripe
/// sends it: for tests and tools that post signed events.
pub fn sign(secret: &str, t: i64, body: &[u8]) -> String {
    let mut mac =
        Hmac::<Sha256>::new_from_slice(secret.as_bytes()).expect("HMAC takes a key of any size");
    mac.update(t.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    let sig = mac
        .finalize()
        .into_bytes()
        .iter()
        .fold(String::with_capacity(64), |mut s, b| {
            use std::fmt::Write as _;
            let _ = write!(s, "{b:02x}");
            s
        });
    format!("t={t},v1={sig}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(secrets: &[&str]) -> StripeWebhookConfig {
        StripeWebhookConfig {
            secrets: secrets.iter().map(|s| (*s).to_owned()).collect(),
            ..StripeWebhookConfig::default()
        }
    }

    #[test]
    fn a_signature_verifies_under_any_configured_secret_and_any_of_its_v1_values() {
        let body = br#"{"id":"evt_1"}"#;
        let good = sign("whsec_new", 1000, body);
        let v1 = good.split_once(",v1=").unwrap().1;
        assert_eq!(
            verify_signature(
                &config(&["whsec_old", "whsec_new"]),
                Some(&good),
                body,
                1000
            ),
            Ok(())
        );
        let two = format!("t=1000,v1={},v1={v1}", "00".repeat(32));
        assert_eq!(
            verify_signature(&config(&["whsec_new"]), Some(&two), body, 1200),
            Ok(())
        );
    }

    #[test]
    fn a_wrong_secret_a_changed_body_a_stale_or_missing_header_is_refused() {
        let body = br#"{"id":"evt_1"}"#;
        let header = sign("whsec_a", 1000, body);
        let c = config(&["whsec_b"]);
        assert_eq!(
            verify_signature(&c, Some(&header), body, 1000),
            Err(WebhookError::NoMatchingSignature)
        );
        let c = config(&["whsec_a"]);
        assert_eq!(
            verify_signature(&c, Some(&header), b"{}", 1000),
            Err(WebhookError::NoMatchingSignature)
        );
        assert!(matches!(
            verify_signature(&c, Some(&header), body, 1301),
            Err(WebhookError::OutsideTolerance { t: 1000, .. })
        ));
        assert!(verify_signature(&c, Some(&header), body, 700).is_ok());
        assert!(matches!(
            verify_signature(&c, Some(&header), body, 699),
            Err(WebhookError::OutsideTolerance { .. })
        ));
        assert_eq!(
            verify_signature(&c, None, body, 1000),
            Err(WebhookError::MissingSignature)
        );
        assert_eq!(
            verify_signature(&c, Some("t=1000"), body, 1000),
            Err(WebhookError::MalformedSignature)
        );
        assert_eq!(
            verify_signature(&c, Some("v1=00"), body, 1000),
            Err(WebhookError::MalformedSignature)
        );
    }
}
