use std::fmt;

/// The authenticated principal's tenant.
///
/// Always taken from the credential (API key, token), never from the idempotency key or the
/// request body: two tenants using the same key never see each other's records.
/// 1–128 characters from `[A-Za-z0-9._-]`.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TenantId(String);

/// Why a string is not a tenant id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TenantError {
    /// Empty or longer than 128 characters.
    #[error("a tenant id has 1 to 128 characters, this one has {0}")]
    Length(usize),
    /// A character outside `[A-Za-z0-9._-]`.
    #[error("a tenant id uses only A-Z, a-z, 0-9, '.', '_' and '-'")]
    InvalidCharacter,
}

impl TenantId {
    /// Validates a tenant id.
    ///
    /// # Errors
    /// [`TenantError`] when it is empty, longer than 128 characters or has a character
    /// outside `[A-Za-z0-9._-]`.
    pub fn parse(s: &str) -> Result<Self, TenantError> {
        if s.is_empty() || s.len() > 128 {
            return Err(TenantError::Length(s.len()));
        }
        if !s
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        {
            return Err(TenantError::InvalidCharacter);
        }
        Ok(Self(s.to_owned()))
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for TenantId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("TenantId").field(&self.0).finish()
    }
}

impl fmt::Display for TenantId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Route identity of an operation: HTTP method and route *template*, e.g.
/// `POST /v1/orders` or `POST /v1/orders/{id}/cancel`.
///
/// The concrete route parameters are not part of the operation; they go into the
/// [`Fingerprint`](crate::Fingerprint), so the same key reused on another resource is a
/// conflict rather than a replay.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Operation(String);

impl Operation {
    /// Builds `"{METHOD} {template}"`, the method upper-cased.
    pub fn new(method: &str, template: &str) -> Self {
        Self(format!("{} {template}", method.to_ascii_uppercase()))
    }

    /// Wraps an already formatted operation name (as read back from a store).
    pub fn from_stored(s: impl Into<String>) -> Self {
        Self(s.into())
    }

    /// `"{METHOD} {template}"`.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Operation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Operation").field(&self.0).finish()
    }
}

impl fmt::Display for Operation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Where an idempotency key lives: one tenant, one operation. The record's primary key is
/// `(tenant, operation, key)`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Scope {
    /// Authenticated tenant.
    pub tenant: TenantId,
    /// Method and route template.
    pub operation: Operation,
}

impl Scope {
    /// A scope for `tenant` and `operation`.
    pub fn new(tenant: TenantId, operation: Operation) -> Self {
        Self { tenant, operation }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenant_ids_are_validated() {
        assert!(TenantId::parse("acme-1").is_ok());
        assert_eq!(TenantId::parse(""), Err(TenantError::Length(0)));
        assert_eq!(TenantId::parse("a b"), Err(TenantError::InvalidCharacter));
    }

    #[test]
    fn operation_upper_cases_the_method() {
        assert_eq!(
            Operation::new("post", "/v1/orders").as_str(),
            "POST /v1/orders"
        );
    }
}
