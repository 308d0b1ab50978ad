use std::fmt;

use sha2::{Digest, Sha256};
use uuid::Uuid;

use crate::{IdempotencyKey, Scope};

/// The identity of one message (an outbox event, a broker message): a UUID, carried as the
/// broker's message id (AMQP `message_id` property, JetStream `Nats-Msg-Id` header) so that
/// consumers' inboxes and the broker's de-duplication recognise redeliveries.
///
/// A message produced inside an idempotent operation takes a *derived* id
/// ([`MessageId::derive`]): re-executing the operation (after a rollback, or a retry past the
/// key's retention that was not stopped by a business key) yields the same id, never a new
/// one.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MessageId(Uuid);

/// Why a string is not a message id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MessageIdError {
    /// Not a UUID in any of the textual forms `uuid` accepts.
    #[error("a message id is a UUID: {0}")]
    NotAUuid(String),
}

impl MessageId {
    /// A fresh id (UUIDv7: time-ordered, random), for messages not produced by an
    /// idempotent operation.
    pub fn new_random() -> Self {
        Self(Uuid::now_v7())
    }

    /// The id of the `ordinal`-th event of type `event_type` produced by the operation
    /// `scope` + `key`: a UUIDv8 (RFC 9562 §5.8) whose 122 free bits are the first bits of
    /// SHA-256 over the length-prefixed tenant, operation, key, event type and ordinal.
    /// Deterministic: the same inputs give the same id on every run and every machine.
    pub fn derive(scope: &Scope, key: &IdempotencyKey, event_type: &str, ordinal: u32) -> Self {
        Self::derive_from_parts(&[
            scope.tenant.as_str(),
            scope.operation.as_str(),
            key.as_str(),
            event_type,
            &ordinal.to_string(),
        ])
    }

    /// A deterministic id from arbitrary parts (length-prefixed, so `["ab", "c"]` and
    /// `["a", "bc"]` differ), for events whose identity is a business key rather than an
    /// idempotency key.
    pub fn derive_from_parts(parts: &[&str]) -> Self {
        let mut h = Sha256::new();
        h.update(b"oncely.message-id.v1");
        for part in parts {
            h.update((part.len() as u64).to_be_bytes());
            h.update(part.as_bytes());
        }
        let d = h.finalize();
        let mut bytes = [0_u8; 16];
        bytes.copy_from_slice(&d[..16]);
        Self(uuid::Builder::from_custom_bytes(bytes).into_uuid())
    }

    /// Parses the hyphenated (or any other `uuid`-accepted) form.
    ///
    /// # Errors
    /// [`MessageIdError::NotAUuid`] when `s` is not a UUID.
    pub fn parse(s: &str) -> Result<Self, MessageIdError> {
        Uuid::parse_str(s)
            .map(Self)
            .map_err(|_| MessageIdError::NotAUuid(s.chars().take(64).collect()))
    }

    /// The UUID.
    pub fn as_uuid(&self) -> &Uuid {
        &self.0
    }
}

impl From<Uuid> for MessageId {
    fn from(u: Uuid) -> Self {
        Self(u)
    }
}

impl fmt::Debug for MessageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MessageId({})", self.0)
    }
}

impl fmt::Display for MessageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0.hyphenated(), f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Operation, TenantId};

    #[test]
    fn derived_ids_are_stable_and_distinguish_every_input() {
        let scope = Scope::new(
            TenantId::parse("t1").unwrap(),
            Operation::new("POST", "/v1/orders"),
        );
        let key: IdempotencyKey = "k-1".parse().unwrap();
        let a = MessageId::derive(&scope, &key, "order.created", 0);
        assert_eq!(a, MessageId::derive(&scope, &key, "order.created", 0));
        assert_eq!(a.as_uuid().get_version_num(), 8);
        assert_ne!(a, MessageId::derive(&scope, &key, "order.created", 1));
        assert_ne!(a, MessageId::derive(&scope, &key, "order.updated", 0));
        let other: IdempotencyKey = "k-2".parse().unwrap();
        assert_ne!(a, MessageId::derive(&scope, &other, "order.created", 0));
        let other_tenant = Scope::new(
            TenantId::parse("t2").unwrap(),
            Operation::new("POST", "/v1/orders"),
        );
        assert_ne!(
            a,
            MessageId::derive(&other_tenant, &key, "order.created", 0)
        );
        assert_ne!(
            MessageId::derive_from_parts(&["ab", "c"]),
            MessageId::derive_from_parts(&["a", "bc"])
        );
        assert_eq!(MessageId::parse(&a.to_string()).unwrap(), a);
    }
}
