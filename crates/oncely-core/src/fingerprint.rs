use sha2::{Digest, Sha256};
use std::fmt;

/// SHA-256 fingerprint of a request, stored with its idempotency record.
///
/// Two digests are kept so a mismatch can name *which part* differs without revealing values
/// (docs/DESIGN.md "HTTP semantics"):
/// - `route`: over the method, the route template and the concrete path (the route
///   parameters);
/// - `full`: over `route` and the body. A JSON body (`application/json` or `+json` media
///   type) is hashed in its RFC 8785 (JCS) canonical form, so key order and whitespace do not
///   matter while array order and value types (`10` vs `"10"`) do; any other body is hashed
///   as raw bytes.
///
/// Every field is length-prefixed before hashing, so no two distinct inputs share a byte
/// stream.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint {
    full: [u8; 32],
    route: [u8; 32],
}

/// Which part of a request differs from the one that reserved the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FingerprintMismatch {
    /// Route parameters (the concrete path) differ.
    Route,
    /// The body differs (after JCS canonicalisation for JSON).
    Body,
}

impl FingerprintMismatch {
    /// `"route"` or `"body"`, as named in problem details.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Route => "route",
            Self::Body => "body",
        }
    }
}

/// The body claims to be JSON but is not.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FingerprintError {
    /// A JSON media type with a body that does not parse.
    #[error("the request body is not valid JSON: {0}")]
    InvalidJson(#[source] serde_json::Error),
}

impl Fingerprint {
    /// Fingerprints a request.
    ///
    /// - `method`: HTTP method, e.g. `POST`;
    /// - `template`: route template, e.g. `/v1/orders/{id}`;
    /// - `path`: the concrete path, e.g. `/v1/orders/42` (carries the route parameters);
    /// - `content_type`: the request's `Content-Type`, if any;
    /// - `body`: the body bytes.
    ///
    /// # Errors
    /// [`FingerprintError::InvalidJson`] when the media type is JSON and the body does not
    /// parse (such a request is rejected before any reservation).
    pub fn compute(
        method: &str,
        template: &str,
        path: &str,
        content_type: Option<&str>,
        body: &[u8],
    ) -> Result<Self, FingerprintError> {
        let mut route = Sha256::new();
        for part in [
            method.to_ascii_uppercase().as_bytes(),
            template.as_bytes(),
            path.as_bytes(),
        ] {
            route.update((part.len() as u64).to_be_bytes());
            route.update(part);
        }
        let route: [u8; 32] = route.finalize().into();

        let canonical;
        let (kind, bytes): (&[u8], &[u8]) = if is_json(content_type) && !body.is_empty() {
            canonical = canonical_json(body)?;
            (b"jcs", &canonical)
        } else {
            (b"raw", body)
        };
        let mut full = Sha256::new();
        full.update(route);
        full.update(kind);
        full.update((bytes.len() as u64).to_be_bytes());
        full.update(bytes);
        Ok(Self {
            full: full.finalize().into(),
            route,
        })
    }

    /// Rebuilds a fingerprint from its stored digests.
    pub fn from_digests(full: [u8; 32], route: [u8; 32]) -> Self {
        Self { full, route }
    }

    /// Digest over the whole request (32 bytes).
    pub fn full(&self) -> &[u8; 32] {
        &self.full
    }

    /// Digest over method, template and route parameters (32 bytes).
    pub fn route(&self) -> &[u8; 32] {
        &self.route
    }

    /// Compares `self` (the stored request) with `other` (a retry).
    /// `None` when they are the same request.
    pub fn mismatch(&self, other: &Self) -> Option<FingerprintMismatch> {
        if self.full == other.full {
            None
        } else if self.route == other.route {
            Some(FingerprintMismatch::Body)
        } else {
            Some(FingerprintMismatch::Route)
        }
    }
}

/// `body` parsed as I-JSON and written in its RFC 8785 (JCS) canonical form.
///
/// # Errors
/// [`FingerprintError::InvalidJson`] when `body` is not I-JSON (RFC 7493 §2: no duplicate
/// member names, finite numbers) or nests deeper than serde_json's recursion limit (128).
pub(crate) fn canonical_json(body: &[u8]) -> Result<Vec<u8>, FingerprintError> {
    let value = parse_i_json(body)?;
    serde_json_canonicalizer::to_vec(&value).map_err(FingerprintError::InvalidJson)
}

/// `body` parsed as I-JSON (RFC 7493 §2), exactly as [`Fingerprint::compute`] reads a JSON
/// body: what this refuses, the idempotency layer answers with 400 `malformed-json`. For
/// tools that prepare request bodies (e.g. a bulk import) and must refuse what the API
/// refuses, rather than let `serde_json::Value` keep the last of two duplicate members.
///
/// # Errors
/// [`FingerprintError::InvalidJson`] when `body` is not JSON, has an object with a
/// duplicate member name, or nests deeper than serde_json's recursion limit (128).
pub fn parse_i_json(body: &[u8]) -> Result<serde_json::Value, FingerprintError> {
    serde_json::from_slice::<IJson>(body)
        .map(|v| v.0)
        .map_err(FingerprintError::InvalidJson)
}

/// A JSON value parsed as I-JSON (RFC 7493 §2.3): an object with a duplicate member name
/// is an error. RFC 8785 §3.1 canonicalises I-JSON only; `serde_json::Value` would keep the
/// last duplicate silently, so `{"a":5,"a":1}` and `{"a":1}` would share a fingerprint
/// while a handler may read either value. (serde_json has no switch for this, hence the
/// small visitor.)
struct IJson(serde_json::Value);

impl<'de> serde::Deserialize<'de> for IJson {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(IJsonVisitor).map(IJson)
    }
}

struct IJsonVisitor;

impl<'de> serde::de::Visitor<'de> for IJsonVisitor {
    type Value = serde_json::Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an I-JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_i64<E>(self, v: i64) -> Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_u64<E>(self, v: u64) -> Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Self::Value, E> {
        serde_json::Number::from_f64(v)
            .map(serde_json::Value::Number)
            .ok_or_else(|| E::custom("a number that is not finite"))
    }
    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(serde_json::Value::Null)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut items = Vec::new();
        while let Some(IJson(v)) = seq.next_element()? {
            items.push(v);
        }
        Ok(serde_json::Value::Array(items))
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut out = serde_json::Map::new();
        while let Some(name) = map.next_key::<String>()? {
            let IJson(v) = map.next_value()?;
            if out.insert(name, v).is_some() {
                return Err(serde::de::Error::custom(
                    "duplicate member name in an object",
                ));
            }
        }
        Ok(serde_json::Value::Object(out))
    }
}

fn is_json(content_type: Option<&str>) -> bool {
    let Some(ct) = content_type else { return false };
    let essence = ct
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || (essence.starts_with("application/") && essence.ends_with("+json"))
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use std::fmt::Write as _;
        let mut hex = String::with_capacity(64);
        for b in &self.full {
            let _ = write!(hex, "{b:02x}");
        }
        f.debug_tuple("Fingerprint").field(&hex).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const JSON: Option<&str> = Some("application/json; charset=utf-8");

    fn fp(path: &str, ct: Option<&str>, body: &str) -> Fingerprint {
        Fingerprint::compute("POST", "/v1/orders/{id}", path, ct, body.as_bytes()).unwrap()
    }

    #[test]
    fn key_order_and_whitespace_do_not_matter() {
        let a = fp("/v1/orders/1", JSON, r#"{"a":1,"b":[1,2]}"#);
        let b = fp("/v1/orders/1", JSON, "{ \"b\" : [1, 2],\n \"a\": 1 }");
        assert_eq!(a.mismatch(&b), None);
    }

    #[test]
    fn array_order_and_value_types_matter() {
        let a = fp("/v1/orders/1", JSON, r#"{"a":10,"b":[1,2]}"#);
        assert_eq!(
            a.mismatch(&fp("/v1/orders/1", JSON, r#"{"a":10,"b":[2,1]}"#)),
            Some(FingerprintMismatch::Body)
        );
        assert_eq!(
            a.mismatch(&fp("/v1/orders/1", JSON, r#"{"a":"10","b":[1,2]}"#)),
            Some(FingerprintMismatch::Body)
        );
    }

    #[test]
    fn route_parameters_are_named_as_route() {
        let a = fp("/v1/orders/1", JSON, "{}");
        assert_eq!(
            a.mismatch(&fp("/v1/orders/2", JSON, "{}")),
            Some(FingerprintMismatch::Route)
        );
    }

    #[test]
    fn non_json_bodies_are_raw_bytes() {
        let a = fp("/x", Some("text/plain"), "{\"a\":1}");
        let b = fp("/x", Some("text/plain"), "{ \"a\":1}");
        assert_eq!(a.mismatch(&b), Some(FingerprintMismatch::Body));
    }

    #[test]
    fn duplicate_member_names_are_an_error() {
        let dup = Fingerprint::compute("POST", "/x", "/x", JSON, br#"{"a":{"b":1,"b":2}}"#);
        assert!(dup.is_err());
        assert!(Fingerprint::compute("POST", "/x", "/x", JSON, br#"[{"b":1},{"b":1}]"#).is_ok());
    }

    #[test]
    fn numbers_canonicalise_as_rfc_8785_doubles() {
        assert_eq!(
            fp("/x", JSON, "1999").mismatch(&fp("/x", JSON, "1999.0")),
            None
        );
        assert_eq!(
            fp("/x", JSON, "1999").mismatch(&fp("/x", JSON, "1.999e3")),
            None
        );
        assert!(fp("/x", JSON, "1999")
            .mismatch(&fp("/x", JSON, "\"1999\""))
            .is_some());
    }

    #[test]
    fn invalid_json_is_an_error() {
        assert!(Fingerprint::compute("POST", "/x", "/x", JSON, b"{nope").is_err());
    }
}
