//! Keys of outgoing calls, derived from the parent operation (docs/DESIGN.md "External
//! effects": never minted per attempt).

use crate::{IdempotencyKey, Scope};
use sha2::{Digest, Sha256};

/// The idempotency key of one outgoing call: a UUID (version 8, RFC 9562 §5.8) made from
/// SHA-256 over the parent operation's scope (tenant, operation), its key and the `step`
/// name (e.g. `"charge"`, `"refund"`), so every attempt of the step — in this process or
/// after a crash, from any runner — sends the same key, and two steps of one operation
/// never share one. `generation` is 0 for the first key of a step; it is raised only when
/// a status check has *proved* that no earlier attempt took effect while the provider keeps
/// replaying a stored failure under the old key (Stripe v1 stores a 500), so a new key can
/// never duplicate an effect.
///
/// The inputs are length-prefixed before hashing, so no two different tuples collide by
/// concatenation.
pub fn derive_key(scope: &Scope, parent: &IdempotencyKey, step: &str, generation: u32) -> String {
    let mut h = Sha256::new();
    for part in [
        scope.tenant.as_str().as_bytes(),
        scope.operation.as_str().as_bytes(),
        parent.as_str().as_bytes(),
        step.as_bytes(),
    ] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part);
    }
    h.update(generation.to_be_bytes());
    uuid_v8(h)
}

/// The key of an effect's `generation`-th key generation: a UUID (version 8) over SHA-256 of
/// the previous key and the generation. Raised only once the provider's status proved that
/// nothing exists under the old key while the provider keeps replaying a stored failure for
/// it (see [`derive_key`]), or by an operator's retry of a failed effect.
pub fn next_key(previous: &str, generation: i32) -> String {
    uuid_v8(
        Sha256::new()
            .chain_update(previous.as_bytes())
            .chain_update(generation.to_be_bytes()),
    )
}

/// The first 16 bytes of the digest as a UUID, version 8 (RFC 9562 §5.8: custom bits).
fn uuid_v8(hash: Sha256) -> String {
    let digest = hash.finalize();
    let mut bytes = [0_u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    uuid::Builder::from_custom_bytes(bytes)
        .into_uuid()
        .to_string()
}

#[cfg(test)]
mod tests {
    use crate::{Operation, TenantId};

    use super::*;

    #[test]
    fn a_step_always_gets_the_same_key_and_different_steps_or_parents_do_not() {
        let scope = Scope::new(
            TenantId::parse("acme").unwrap(),
            Operation::new("POST", "/v1/orders/{id}/payments"),
        );
        let other = Scope::new(
            TenantId::parse("other").unwrap(),
            Operation::new("POST", "/v1/orders/{id}/payments"),
        );
        let k = IdempotencyKey::parse(b"0192b3c4-0000-7000-8000-000000000001").unwrap();
        let k2 = IdempotencyKey::parse(b"0192b3c4-0000-7000-8000-000000000002").unwrap();
        let a = derive_key(&scope, &k, "charge", 0);
        assert_eq!(a, derive_key(&scope, &k, "charge", 0));
        assert_eq!(uuid::Uuid::parse_str(&a).unwrap().get_version_num(), 8);
        for different in [
            derive_key(&scope, &k, "refund", 0),
            derive_key(&scope, &k2, "charge", 0),
            derive_key(&other, &k, "charge", 0),
            derive_key(&scope, &k, "charge", 1),
        ] {
            assert_ne!(a, different);
        }
    }
}
