use std::fmt;

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The header carrying the message's identity, stable across redeliveries: the receiver
/// deduplicates on it (Standard Webhooks, "Webhook headers").
pub const WEBHOOK_ID: &str = "webhook-id";
/// The header carrying the attempt's time, Unix seconds.
pub const WEBHOOK_TIMESTAMP: &str = "webhook-timestamp";
/// The header carrying the signature(s), `v1,<base64>`.
pub const WEBHOOK_SIGNATURE: &str = "webhook-signature";

/// The prefix of a Standard Webhooks symmetric secret.
const SECRET_PREFIX: &str = "whsec_";

/// A secret that is not a Standard Webhooks symmetric secret.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SecretError {
    /// It does not start with `whsec_`.
    #[error("a signing secret starts with `whsec_` (Standard Webhooks)")]
    MissingPrefix,
    /// The part after `whsec_` is not standard base64.
    #[error("the part after `whsec_` is not base64")]
    NotBase64(#[source] base64::DecodeError),
    /// The key is shorter than 24 bytes (the spec asks for 24 to 64).
    #[error("the key is {0} bytes; Standard Webhooks asks for 24 to 64")]
    TooShort(usize),
}

/// The HMAC-SHA256 key of a Standard Webhooks endpoint, parsed from its `whsec_<base64>`
/// form (standardwebhooks.com, "Symmetric signatures": the key is the base64-decoded part
/// after the prefix). Its `Debug` shows no key material.
#[derive(Clone)]
pub struct SigningSecret {
    key: Vec<u8>,
}

impl fmt::Debug for SigningSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SigningSecret(whsec_…)")
    }
}

impl SigningSecret {
    /// Parses `whsec_<base64>` (standard alphabet, padded or not).
    ///
    /// # Errors
    /// [`SecretError`] when the prefix is missing, the rest is not base64 or the key is
    /// shorter than 24 bytes.
    pub fn parse(secret: &str) -> Result<Self, SecretError> {
        let encoded = secret
            .trim()
            .strip_prefix(SECRET_PREFIX)
            .ok_or(SecretError::MissingPrefix)?;
        let key = STANDARD
            .decode(encoded)
            .or_else(|_| base64::engine::general_purpose::STANDARD_NO_PAD.decode(encoded))
            .map_err(SecretError::NotBase64)?;
        if key.len() < 24 {
            return Err(SecretError::TooShort(key.len()));
        }
        Ok(Self { key })
    }

    /// The `webhook-signature` value of one attempt: `v1,` and the base64 of
    /// HMAC-SHA256(key, `"{id}.{timestamp}.{body}"`), `timestamp` in Unix seconds
    /// (Standard Webhooks, "Signature scheme"; the spec's test vector is this crate's
    /// test).
    pub fn sign(&self, id: &str, timestamp: i64, body: &[u8]) -> String {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.key).expect("HMAC takes any key length");
        mac.update(id.as_bytes());
        mac.update(b".");
        mac.update(timestamp.to_string().as_bytes());
        mac.update(b".");
        mac.update(body);
        format!("v1,{}", STANDARD.encode(mac.finalize().into_bytes()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The test vector the Standard Webhooks reference libraries share (secret, id,
    /// timestamp, body, signature).
    #[test]
    fn signs_the_standard_webhooks_test_vector() {
        let secret = SigningSecret::parse("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        assert_eq!(
            secret.sign(
                "msg_p5jXN8AQM9LWM0D4loKWxJek",
                1_614_265_330,
                br#"{"test": 2432232314}"#
            ),
            "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
        );
        assert_eq!(format!("{secret:?}"), "SigningSecret(whsec_…)");
    }

    #[test]
    fn a_secret_without_the_prefix_or_not_base64_or_short_is_refused() {
        assert!(matches!(
            SigningSecret::parse("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"),
            Err(SecretError::MissingPrefix)
        ));
        assert!(matches!(
            SigningSecret::parse("whsec_not base64!"),
            Err(SecretError::NotBase64(_))
        ));
        assert!(matches!(
            SigningSecret::parse("whsec_c2hvcnQ="),
            Err(SecretError::TooShort(5))
        ));
    }
}
