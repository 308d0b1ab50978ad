use std::fmt;

/// Longest accepted idempotency key, in characters (bytes: keys are ASCII).
pub const MAX_KEY_LEN: usize = 255;

/// An idempotency key minted by the caller once per business operation and sent on every
/// retry of it.
///
/// Accepted forms of the `Idempotency-Key` header value
/// (draft-ietf-httpapi-idempotency-key-header-07 §2: the value is an RFC 8941 sf-string):
/// - a quoted sf-string, `"8e03978e-40d5-43e8-bc93-6894a57f9324"` (RFC 8941 §3.3.3, with
///   `\"` and `\\` escapes), whose content is then validated;
/// - the bare content, `8e03978e-40d5-43e8-bc93-6894a57f9324`, as most clients send it.
///
/// The content must be 1–[`MAX_KEY_LEN`] visible ASCII characters (0x21–0x7E). Anything
/// else is a [`KeyError`]; an invalid key cannot be constructed.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdempotencyKey(String);

/// Why a header value is not an idempotency key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The value (or the quoted string's content) is empty.
    #[error("the idempotency key is empty")]
    Empty,
    /// The key is longer than [`MAX_KEY_LEN`] characters.
    #[error("the idempotency key is {len} characters long; at most {MAX_KEY_LEN} are allowed")]
    TooLong {
        /// Length seen, in characters.
        len: usize,
    },
    /// A character outside visible ASCII (0x21–0x7E) at the given byte offset.
    #[error("the idempotency key has a character outside visible ASCII (0x21-0x7E) at byte {at}")]
    InvalidCharacter {
        /// Byte offset in the (unquoted) key.
        at: usize,
    },
    /// A quoted sf-string that is not well formed (RFC 8941 §3.3.3).
    #[error("the idempotency key is a malformed quoted string (RFC 8941 §3.3.3)")]
    MalformedQuotedString,
}

impl IdempotencyKey {
    /// Parses an `Idempotency-Key` header value (bytes as received).
    ///
    /// # Errors
    /// [`KeyError`] when the value is empty, too long, has a character outside 0x21–0x7E or
    /// is a malformed quoted string.
    pub fn parse(raw: &[u8]) -> Result<Self, KeyError> {
        let content = if raw.first() == Some(&b'"') {
            unquote(raw)?
        } else {
            raw.to_vec()
        };
        if content.is_empty() {
            return Err(KeyError::Empty);
        }
        if content.len() > MAX_KEY_LEN {
            return Err(KeyError::TooLong { len: content.len() });
        }
        if let Some(at) = content.iter().position(|b| !(0x21..=0x7e).contains(b)) {
            return Err(KeyError::InvalidCharacter { at });
        }
        // Every byte is visible ASCII, so this cannot fail.
        Ok(Self(
            String::from_utf8(content).map_err(|_| KeyError::InvalidCharacter { at: 0 })?,
        ))
    }

    /// A key read from a JSON document (a business key): a string as written, or a number
    /// in its RFC 8785 form (`1e3` and `1000.0` are `1000`). `None` for any other value,
    /// or one that is not 1–[`MAX_KEY_LEN`] visible ASCII characters, or a string starting
    /// with `"` (sent as a header it would read as an RFC 8941 quoted string, another key).
    pub fn from_json(value: &serde_json::Value) -> Option<Self> {
        let text = match value {
            serde_json::Value::String(s) => s.clone(),
            n @ serde_json::Value::Number(_) => serde_json_canonicalizer::to_string(n).ok()?,
            _ => return None,
        };
        Self::parse(text.as_bytes())
            .ok()
            .filter(|key| key.as_str() == text)
    }

    /// The key's characters, unquoted.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// RFC 8941 §4.2.5 "Parsing a String": `"` … `"` with `\"` and `\\` as the only escapes.
fn unquote(raw: &[u8]) -> Result<Vec<u8>, KeyError> {
    let mut out = Vec::with_capacity(raw.len());
    let mut iter = raw.iter().copied().skip(1);
    loop {
        match iter.next() {
            None => return Err(KeyError::MalformedQuotedString),
            Some(b'\\') => match iter.next() {
                Some(c @ (b'"' | b'\\')) => out.push(c),
                _ => return Err(KeyError::MalformedQuotedString),
            },
            Some(b'"') => {
                return if iter.next().is_none() {
                    Ok(out)
                } else {
                    Err(KeyError::MalformedQuotedString)
                };
            }
            Some(c) => out.push(c),
        }
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("IdempotencyKey").field(&self.0).finish()
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::str::FromStr for IdempotencyKey {
    type Err = KeyError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s.as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_business_key_is_a_json_string_as_written_or_a_canonical_number() {
        use serde_json::json;
        let key = |v| IdempotencyKey::from_json(&v).map(|k| k.as_str().to_owned());
        assert_eq!(key(json!("ref-1")), Some("ref-1".to_owned()));
        assert_eq!(key(json!(1000)), Some("1000".to_owned()));
        assert_eq!(key(json!(1e3)), Some("1000".to_owned()));
        assert_eq!(key(json!(0.5)), Some("0.5".to_owned()));
        assert_eq!(key(json!("\"quoted\"")), None);
        assert_eq!(key(json!("with space")), None);
        assert_eq!(key(json!("")), None);
        assert_eq!(key(json!("x".repeat(256))), None);
        assert_eq!(key(json!(true)), None);
        assert_eq!(key(json!({"a": 1})), None);
        assert_eq!(key(serde_json::Value::Null), None);
    }

    #[test]
    fn bare_and_quoted_forms_parse_to_the_same_key() {
        let bare = IdempotencyKey::parse(b"abc-123").unwrap();
        let quoted = IdempotencyKey::parse(br#""abc-123""#).unwrap();
        assert_eq!(bare, quoted);
        assert_eq!(bare.as_str(), "abc-123");
    }

    #[test]
    fn quoted_escapes_are_decoded() {
        let k = IdempotencyKey::parse(br#""a\"b\\c""#).unwrap();
        assert_eq!(k.as_str(), r#"a"b\c"#);
    }

    #[test]
    fn bad_keys_are_typed_errors() {
        assert_eq!(IdempotencyKey::parse(b""), Err(KeyError::Empty));
        assert_eq!(IdempotencyKey::parse(b"\"\""), Err(KeyError::Empty));
        assert_eq!(
            IdempotencyKey::parse(b"a b"),
            Err(KeyError::InvalidCharacter { at: 1 })
        );
        assert_eq!(
            IdempotencyKey::parse(b"a\x01"),
            Err(KeyError::InvalidCharacter { at: 1 })
        );
        assert_eq!(
            IdempotencyKey::parse("é".as_bytes()),
            Err(KeyError::InvalidCharacter { at: 0 })
        );
        assert_eq!(
            IdempotencyKey::parse(b"\"abc"),
            Err(KeyError::MalformedQuotedString)
        );
        assert_eq!(
            IdempotencyKey::parse(b"\"a\\nb\""),
            Err(KeyError::MalformedQuotedString)
        );
        assert_eq!(
            IdempotencyKey::parse(b"\"ab\"c"),
            Err(KeyError::MalformedQuotedString)
        );
        assert_eq!(
            IdempotencyKey::parse(b"\"a b\""),
            Err(KeyError::InvalidCharacter { at: 1 })
        );
    }

    #[test]
    fn length_bounds_are_1_to_255() {
        assert!(IdempotencyKey::parse(&[b'k'; 255]).is_ok());
        assert_eq!(
            IdempotencyKey::parse(&[b'k'; 256]),
            Err(KeyError::TooLong { len: 256 })
        );
    }
}
