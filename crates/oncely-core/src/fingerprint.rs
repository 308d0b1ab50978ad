use sha2::{Digest, Sha256};
use std::fmt;

use crate::JsonPointer;

/// SHA-256 fingerprint of a request, stored with its idempotency record.
///
/// Digests are kept per part so a mismatch can name *which part* differs without revealing
/// values (docs/DESIGN.md "HTTP semantics"):
/// - `route`: over the method, the route template and the concrete path (the route
///   parameters);
/// - `headers`: over the values of the request headers the [`FingerprintParts`] name, when
///   they name any;
/// - `full`: over `route`, `headers` and the body. A JSON body (`application/json` or
///   `+json` media type) is hashed in its RFC 8785 (JCS) canonical form, so key order and
///   whitespace do not matter while array order and value types (`10` vs `"10"`) do; any
///   other body is hashed as raw bytes. [`FingerprintParts::body_pointers`] narrows the
///   body to the values at some JSON pointers.
///
/// Every field is length-prefixed before hashing, so no two distinct inputs share a byte
/// stream.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint {
    full: [u8; 32],
    route: [u8; 32],
    headers: Option<[u8; 32]>,
}

/// Which part of a request differs from the one that reserved the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FingerprintMismatch {
    /// Route parameters (the concrete path) differ.
    Route,
    /// The body differs (after JCS canonicalisation for JSON), or the parts of it the
    /// fingerprint covers.
    Body,
    /// The values of the headers the fingerprint covers differ.
    Headers,
}

impl FingerprintMismatch {
    /// `"route"`, `"body"` or `"headers"`, as named in problem details.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Route => "route",
            Self::Body => "body",
            Self::Headers => "headers",
        }
    }
}

/// Why a request cannot be fingerprinted.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FingerprintError {
    /// A JSON media type with a body that does not parse.
    #[error("the request body is not valid JSON: {0}")]
    InvalidJson(#[source] serde_json::Error),
    /// The fingerprint covers JSON pointers into the body, and the body's media type is not
    /// JSON (`application/json` or `+json`).
    #[error(
        "the fingerprint covers fields of a JSON body, and the request's Content-Type is not JSON"
    )]
    NotJson,
}

impl Fingerprint {
    /// Fingerprints a request over all of it: [`FingerprintParts::default`].
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
        FingerprintParts::default().compute(&FingerprintInput {
            method,
            template,
            path,
            content_type,
            headers: &[],
            body,
        })
    }

    /// Rebuilds a fingerprint from its stored digests (no headers digest: add it with
    /// [`Fingerprint::with_headers_digest`]).
    pub fn from_digests(full: [u8; 32], route: [u8; 32]) -> Self {
        Self {
            full,
            route,
            headers: None,
        }
    }

    /// `self` with its headers digest set to `headers` (as stored; `None` when the
    /// fingerprint covers no header).
    #[must_use]
    pub fn with_headers_digest(mut self, headers: Option<[u8; 32]>) -> Self {
        self.headers = headers;
        self
    }

    /// Digest over the whole request (32 bytes).
    pub fn full(&self) -> &[u8; 32] {
        &self.full
    }

    /// Digest over method, template and route parameters (32 bytes).
    pub fn route(&self) -> &[u8; 32] {
        &self.route
    }

    /// Digest over the covered headers' values (32 bytes), `None` when none are covered.
    pub fn headers(&self) -> Option<&[u8; 32]> {
        self.headers.as_ref()
    }

    /// Compares `self` (the stored request) with `other` (a retry).
    /// `None` when they are the same request.
    pub fn mismatch(&self, other: &Self) -> Option<FingerprintMismatch> {
        if self.full == other.full {
            None
        } else if self.route != other.route {
            Some(FingerprintMismatch::Route)
        } else if self.headers != other.headers {
            Some(FingerprintMismatch::Headers)
        } else {
            Some(FingerprintMismatch::Body)
        }
    }
}

/// What a request's [`Fingerprint`] covers besides its method, route template and path:
/// the whole body (the default) or the values at some JSON pointers in it, and the values
/// of some request headers (none by default).
///
/// The default reproduces [`Fingerprint::compute`] byte for byte, so records stored before
/// a route had a policy still match. A narrowed body is for clients that regenerate a
/// field (a timestamp, a nonce) on every retry of one operation: only the listed values
/// must then be the same. Pointers and header names are sorted and deduplicated, so the
/// order they are configured in does not change the digests.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FingerprintParts {
    pointers: Option<Vec<JsonPointer>>,
    headers: Vec<String>,
}

/// The request a [`FingerprintParts`] fingerprints.
#[derive(Debug, Clone, Copy)]
pub struct FingerprintInput<'a> {
    /// HTTP method, e.g. `POST`.
    pub method: &'a str,
    /// Route template, e.g. `/v1/orders/{id}`.
    pub template: &'a str,
    /// The concrete path, e.g. `/v1/orders/42`.
    pub path: &'a str,
    /// The request's `Content-Type`, if any.
    pub content_type: Option<&'a str>,
    /// The request's headers as `(name, value)` pairs, in the order received (names in any
    /// case); only those the parts name are read. Empty when they name none.
    pub headers: &'a [(&'a str, &'a [u8])],
    /// The body bytes.
    pub body: &'a [u8],
}

impl FingerprintParts {
    /// The body covered only at `pointers` (RFC 6901): each pointer's value in RFC 8785
    /// canonical form, a missing value distinct from `null`. Such a route needs a JSON
    /// body. An empty list covers no field of the body.
    #[must_use]
    pub fn body_pointers(mut self, pointers: impl IntoIterator<Item = JsonPointer>) -> Self {
        let mut pointers: Vec<_> = pointers.into_iter().collect();
        pointers.sort();
        pointers.dedup();
        self.pointers = Some(pointers);
        self
    }

    /// The values of the request headers `names` covered too (case-insensitive; a header
    /// sent several times counts with all its values, in order; an absent one is distinct
    /// from an empty one).
    #[must_use]
    pub fn headers<S: AsRef<str>>(mut self, names: impl IntoIterator<Item = S>) -> Self {
        let mut names: Vec<String> = names
            .into_iter()
            .map(|n| n.as_ref().to_ascii_lowercase())
            .collect();
        names.sort();
        names.dedup();
        self.headers = names;
        self
    }

    /// The JSON pointers the body is narrowed to, `None` when all of it is covered.
    pub fn pointers(&self) -> Option<&[JsonPointer]> {
        self.pointers.as_deref()
    }

    /// The header names covered, lower-case, sorted.
    pub fn header_names(&self) -> &[String] {
        &self.headers
    }

    /// The fingerprint of `request` under these parts.
    ///
    /// # Errors
    /// [`FingerprintError::InvalidJson`] when the media type is JSON and the body does not
    /// parse (or, with pointers, is empty); [`FingerprintError::NotJson`] when the body is
    /// narrowed to pointers and its media type is not JSON.
    pub fn compute(&self, request: &FingerprintInput<'_>) -> Result<Fingerprint, FingerprintError> {
        let mut route = Sha256::new();
        for part in [
            request.method.to_ascii_uppercase().as_bytes(),
            request.template.as_bytes(),
            request.path.as_bytes(),
        ] {
            put(&mut route, part);
        }
        let route: [u8; 32] = route.finalize().into();
        let headers = self.headers_digest(request.headers);
        let (kind, bytes) = self.body_part(request.content_type, request.body)?;
        let mut full = Sha256::new();
        full.update(route);
        if let Some(headers) = &headers {
            full.update(b"hdr");
            full.update(headers);
        }
        full.update(kind);
        put(&mut full, &bytes);
        Ok(Fingerprint {
            full: full.finalize().into(),
            route,
            headers,
        })
    }

    /// The digest of the covered headers' values, `None` when none are covered.
    fn headers_digest(&self, headers: &[(&str, &[u8])]) -> Option<[u8; 32]> {
        if self.headers.is_empty() {
            return None;
        }
        let mut digest = Sha256::new();
        for name in &self.headers {
            put(&mut digest, name.as_bytes());
            let values: Vec<&[u8]> = headers
                .iter()
                .filter(|(n, _)| n.eq_ignore_ascii_case(name))
                .map(|(_, v)| *v)
                .collect();
            digest.update((values.len() as u64).to_be_bytes());
            for value in values {
                put(&mut digest, value);
            }
        }
        Some(digest.finalize().into())
    }

    /// The body as hashed, with its 3-byte kind: `jcs` (canonical JSON), `raw`, or `ptr`
    /// (the values at the pointers, each length-prefixed after a presence byte).
    fn body_part(
        &self,
        content_type: Option<&str>,
        body: &[u8],
    ) -> Result<(&'static [u8; 3], Vec<u8>), FingerprintError> {
        let Some(pointers) = &self.pointers else {
            return Ok(if is_json_media_type(content_type) && !body.is_empty() {
                (b"jcs", canonical_json(body)?)
            } else {
                (b"raw", body.to_vec())
            });
        };
        if !is_json_media_type(content_type) {
            return Err(FingerprintError::NotJson);
        }
        let document = parse_i_json(body)?;
        let mut out = Vec::new();
        for pointer in pointers {
            out.extend_from_slice(&(pointer.as_str().len() as u64).to_be_bytes());
            out.extend_from_slice(pointer.as_str().as_bytes());
            match pointer.find(&document) {
                None => out.push(0),
                Some(value) => {
                    let canonical = serde_json_canonicalizer::to_vec(value)
                        .map_err(FingerprintError::InvalidJson)?;
                    out.push(1);
                    out.extend_from_slice(&(canonical.len() as u64).to_be_bytes());
                    out.extend_from_slice(&canonical);
                }
            }
        }
        Ok((b"ptr", out))
    }
}

/// Feeds `part` to `digest`, length-prefixed (8 bytes, big-endian).
fn put(digest: &mut Sha256, part: &[u8]) {
    digest.update((part.len() as u64).to_be_bytes());
    digest.update(part);
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

/// Whether `content_type` is a JSON media type: `application/json` or
/// `application/<subtype>+json` (RFC 6839 §3.1), parameters ignored, any case — the bodies
/// a [`Fingerprint`] canonicalizes.
pub fn is_json_media_type(content_type: Option<&str>) -> bool {
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

    fn hex(d: &[u8; 32]) -> String {
        use std::fmt::Write as _;
        d.iter().fold(String::new(), |mut out, b| {
            let _ = write!(out, "{b:02x}");
            out
        })
    }

    /// The digests as computed before fingerprint parts existed (an independent
    /// implementation: Python's hashlib over the same length-prefixed stream), so records
    /// stored then still match.
    #[test]
    fn the_default_parts_reproduce_the_stored_digests_byte_for_byte() {
        let json = fp("/v1/orders/1", JSON, "{\"b\":[1, 2], \"a\":1}");
        assert_eq!(
            hex(json.route()),
            "9b3c9522e8b7bd2542c1f6a802b608fb762d5e81939b70be8d842af5b2abdfe9"
        );
        assert_eq!(
            hex(json.full()),
            "ae642ac2323016a562f3ed1acaa3f625408c35b0cc4d2a85c4937fad01844afe"
        );
        let raw = fp("/v1/orders/1", None, "hello");
        assert_eq!(
            hex(raw.full()),
            "6565ff8fead53de82146ba476f0c55f3c443441bbb8f93d83e9dfa4898f74dde"
        );
        assert_eq!(json.headers(), None);
        let explicit = FingerprintParts::default()
            .compute(&input(JSON, &[], b"{\"a\":1,\"b\":[1,2]}"))
            .unwrap();
        assert_eq!(explicit, json);
    }

    fn input<'a>(
        ct: Option<&'a str>,
        headers: &'a [(&'a str, &'a [u8])],
        body: &'a [u8],
    ) -> FingerprintInput<'a> {
        FingerprintInput {
            method: "POST",
            template: "/v1/orders/{id}",
            path: "/v1/orders/1",
            content_type: ct,
            headers,
            body,
        }
    }

    fn narrowed(pointers: &[&str]) -> FingerprintParts {
        FingerprintParts::default()
            .body_pointers(pointers.iter().map(|p| JsonPointer::parse(p).unwrap()))
    }

    #[test]
    fn a_narrowed_body_covers_only_the_listed_values() {
        let parts = narrowed(&["/currency", "/amount"]);
        let of = |body: &str| parts.compute(&input(JSON, &[], body.as_bytes())).unwrap();
        let a = of(r#"{"amount":10,"currency":"EUR","nonce":"x1"}"#);
        assert_eq!(
            a.mismatch(&of(r#"{"nonce":"x2","currency":"EUR","amount":10.0}"#)),
            None
        );
        assert_eq!(
            a.mismatch(&of(r#"{"amount":11,"currency":"EUR","nonce":"x1"}"#)),
            Some(FingerprintMismatch::Body)
        );
        // A missing value is not `null`, and neither is the whole body's digest.
        let missing = of(r#"{"amount":10}"#);
        let null = of(r#"{"amount":10,"currency":null}"#);
        assert!(missing.mismatch(&null).is_some());
        let whole = fp(
            "/v1/orders/1",
            JSON,
            r#"{"amount":10,"currency":"EUR","nonce":"x1"}"#,
        );
        assert!(whole.mismatch(&a).is_some());
        // The order pointers are configured in does not matter.
        assert_eq!(narrowed(&["/amount", "/currency", "/amount"]), parts);
    }

    #[test]
    fn a_narrowed_body_must_be_json() {
        let parts = narrowed(&["/amount"]);
        assert!(matches!(
            parts.compute(&input(Some("text/plain"), &[], b"{}")),
            Err(FingerprintError::NotJson)
        ));
        assert!(matches!(
            parts.compute(&input(None, &[], b"{}")),
            Err(FingerprintError::NotJson)
        ));
        assert!(matches!(
            parts.compute(&input(JSON, &[], b"")),
            Err(FingerprintError::InvalidJson(_))
        ));
    }

    #[test]
    fn covered_headers_are_named_as_headers() {
        let parts = FingerprintParts::default().headers(["Stripe-Version", "x-b"]);
        let of = |headers: &[(&str, &[u8])]| parts.compute(&input(JSON, headers, b"{}")).unwrap();
        let a = of(&[("stripe-version", b"2024-01-01"), ("x-other", b"1")]);
        assert_eq!(a.mismatch(&of(&[("Stripe-Version", b"2024-01-01")])), None);
        assert_eq!(
            a.mismatch(&of(&[("stripe-version", b"2025-01-01")])),
            Some(FingerprintMismatch::Headers)
        );
        let absent = of(&[]);
        let empty = of(&[("stripe-version", b"")]);
        assert_eq!(absent.mismatch(&empty), Some(FingerprintMismatch::Headers));
        let body_changed = parts
            .compute(&input(JSON, &[("stripe-version", b"2024-01-01")], b"[]"))
            .unwrap();
        assert_eq!(a.mismatch(&body_changed), Some(FingerprintMismatch::Body));
        let stored = Fingerprint::from_digests(*a.full(), *a.route())
            .with_headers_digest(a.headers().copied());
        assert_eq!(stored, a);
    }

    #[test]
    fn invalid_json_is_an_error() {
        assert!(Fingerprint::compute("POST", "/x", "/x", JSON, b"{nope").is_err());
    }
}
