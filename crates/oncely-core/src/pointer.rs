//! [`JsonPointer`]: an RFC 6901 JSON pointer, checked once where it is configured.

use std::fmt;

/// A JSON pointer (RFC 6901), e.g. `/amount` or `/items/0/sku`: `""` (the whole document)
/// or `/`-separated reference tokens in which `~0` stands for `~` and `~1` for `/`.
///
/// Used to name parts of a JSON request body: the parts a fingerprint covers
/// ([`FingerprintParts::body_pointers`](crate::FingerprintParts::body_pointers)) and the
/// field a business key is read from. An invalid pointer cannot be constructed.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct JsonPointer(String);

/// Why a string is not a JSON pointer (RFC 6901 §3).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PointerError {
    /// Neither empty nor starting with `/`.
    #[error("a JSON pointer is empty or starts with / (RFC 6901 §3)")]
    NoLeadingSlash,
    /// A `~` not followed by `0` or `1`, at the given byte offset.
    #[error("a ~ in a JSON pointer must be followed by 0 or 1 (RFC 6901 §3), at byte {at}")]
    BadEscape {
        /// Byte offset of the `~`.
        at: usize,
    },
}

impl JsonPointer {
    /// Parses `text` as a JSON pointer (RFC 6901 §3).
    ///
    /// # Errors
    /// [`PointerError`] when `text` is neither empty nor starts with `/`, or has a `~` not
    /// followed by `0` or `1`.
    pub fn parse(text: &str) -> Result<Self, PointerError> {
        if !text.is_empty() && !text.starts_with('/') {
            return Err(PointerError::NoLeadingSlash);
        }
        let bytes = text.as_bytes();
        for (at, b) in bytes.iter().enumerate() {
            if *b == b'~' && !matches!(bytes.get(at + 1), Some(b'0' | b'1')) {
                return Err(PointerError::BadEscape { at });
            }
        }
        Ok(Self(text.to_owned()))
    }

    /// The pointer as written, e.g. `/items/0/sku`.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The value `self` points to in `document` (RFC 6901 §4; an array index is a decimal
    /// without leading zeros), `None` when there is none. A JSON `null` there is
    /// `Some(Value::Null)`, not `None`.
    pub fn find<'a>(&self, document: &'a serde_json::Value) -> Option<&'a serde_json::Value> {
        document.pointer(&self.0)
    }
}

impl fmt::Display for JsonPointer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn pointers_follow_rfc_6901() {
        let doc = json!({"a/b": 1, "m~n": 2, "items": [{"sku": "x"}], "n": null});
        let find = |p: &str| JsonPointer::parse(p).unwrap().find(&doc).cloned();
        assert_eq!(find("/a~1b"), Some(json!(1)));
        assert_eq!(find("/m~0n"), Some(json!(2)));
        assert_eq!(find("/items/0/sku"), Some(json!("x")));
        assert_eq!(find("/items/00/sku"), None, "no leading zeros");
        assert_eq!(find("/n"), Some(serde_json::Value::Null));
        assert_eq!(find("/missing"), None);
        assert_eq!(find(""), Some(doc.clone()));
    }

    #[test]
    fn malformed_pointers_are_refused() {
        assert_eq!(
            JsonPointer::parse("amount"),
            Err(PointerError::NoLeadingSlash)
        );
        assert_eq!(
            JsonPointer::parse("/a~2"),
            Err(PointerError::BadEscape { at: 2 })
        );
        assert_eq!(
            JsonPointer::parse("/a~"),
            Err(PointerError::BadEscape { at: 2 })
        );
    }
}
