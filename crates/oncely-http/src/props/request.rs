//! `key_of` and `fingerprint_of`: the layer's reading of the `Idempotency-Key` header and
//! of the body, for any header bytes and any body.

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, StatusCode};
use oncely_core::{Fingerprint, FingerprintParts, IdempotencyKey};
use proptest::prelude::*;

use super::{config, problem_of};
use crate::request::{fingerprint_of, key_of, IDEMPOTENCY_KEY};
use crate::PROBLEM_JSON;

/// Header value bytes: any bytes, and keys (bare or quoted) with a stray byte now and then.
fn header_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..300),
        "[\\x20-\\x7e]{0,40}".prop_map(String::into_bytes),
        "\"[\\x20-\\x7e]{0,40}\"".prop_map(String::into_bytes),
    ]
}

/// Asserts that `res` is the 400 `idempotency-key-malformed` problem.
fn assert_malformed(res: axum::response::Response) -> Result<(), TestCaseError> {
    let (status, content_type, _, body) = problem_of(res);
    prop_assert_eq!(status, StatusCode::BAD_REQUEST);
    prop_assert_eq!(content_type.as_deref(), Some(PROBLEM_JSON));
    prop_assert_eq!(
        &body["type"],
        "urn:oncely:problem:idempotency-key-malformed"
    );
    Ok(())
}

/// A JSON object in two texts: members in drawn orders, with drawn whitespace.
fn object_texts() -> impl Strategy<Value = (String, String)> {
    let member = prop_oneof![
        any::<i64>().prop_map(|n| n.to_string()),
        any::<bool>().prop_map(|b| b.to_string()),
        "[a-z ]{0,6}".prop_map(|s| format!("\"{s}\"")),
        Just("null".to_owned()),
    ];
    prop::collection::btree_map("[a-z]{1,4}", member, 0..6).prop_flat_map(|m| {
        let members: Vec<String> = m.iter().map(|(k, v)| format!("\"{k}\":{v}")).collect();
        let text = |members: Vec<String>| {
            (
                Just(members).prop_shuffle(),
                prop::sample::select(vec!["", " ", "\n\t"]),
            )
                .prop_map(|(m, ws)| format!("{ws}{{{ws}{}{ws}}}", m.join(&format!(",{ws}"))))
        };
        (text(members.clone()), text(members))
    })
}

fn parts(method: &str, path: &str, content_type: Option<&[u8]>) -> http::request::Parts {
    let mut req = Request::builder().method(method).uri(path);
    if let Some(ct) = content_type {
        req = req.header(
            http::header::CONTENT_TYPE,
            HeaderValue::from_bytes(ct).unwrap(),
        );
    }
    req.body(()).unwrap().into_parts().0
}

proptest! {
    #![proptest_config(config(2048))]

    /// One header of any bytes a header may hold: the key `IdempotencyKey::parse` reads
    /// from them, or the 400 `idempotency-key-malformed` problem when it reads none.
    #[test]
    fn one_key_header_is_the_parsed_key_or_a_400_problem(raw in header_bytes()) {
        let Ok(value) = HeaderValue::from_bytes(&raw) else { return Ok(()) };
        let mut headers = HeaderMap::new();
        headers.insert(IDEMPOTENCY_KEY, value);
        match (key_of(&headers), IdempotencyKey::parse(&raw)) {
            (Ok(Some(got)), Ok(expected)) => prop_assert_eq!(got, expected),
            (Err(res), Err(_)) => assert_malformed(res)?,
            (got, expected) => prop_assert!(false, "{:?} for {:?}", got.map_err(|r| r.status()), expected),
        }
    }

    /// No header is no key; two headers, whatever their values, are the 400 problem.
    #[test]
    fn two_key_headers_are_a_400_problem(a in header_bytes(), b in header_bytes()) {
        prop_assert!(matches!(key_of(&HeaderMap::new()), Ok(None)));
        let (Ok(a), Ok(b)) = (HeaderValue::from_bytes(&a), HeaderValue::from_bytes(&b)) else {
            return Ok(());
        };
        let mut headers = HeaderMap::new();
        headers.append(IDEMPOTENCY_KEY, a);
        headers.append(IDEMPOTENCY_KEY, b);
        assert_malformed(key_of(&headers).expect_err("two keys are refused"))?;
    }

    /// The fingerprint of a request is `Fingerprint::compute` of its method, template,
    /// path, `Content-Type` (none when it is not visible ASCII) and body; a body that is no
    /// JSON under a JSON media type is the 400 `malformed-json` problem.
    #[test]
    fn the_request_fingerprint_is_the_core_fingerprint_of_its_parts(
        method in prop::sample::select(vec!["POST", "PATCH", "PUT"]),
        path in "/[a-z0-9]{0,8}(/[a-z0-9]{1,8}){0,2}",
        content_type in prop::option::of(prop_oneof![
            Just(b"application/json".to_vec()),
            Just(b"application/merge-patch+json; charset=utf-8".to_vec()),
            Just(b"text/plain".to_vec()),
            Just(b"application/json; x=\xe9".to_vec()),
        ]),
        body in prop_oneof![
            prop::collection::vec(any::<u8>(), 0..40),
            "[\\[\\]{}\":,0-9a-z ]{0,30}".prop_map(String::into_bytes),
        ],
    ) {
        let parts = parts(method, &path, content_type.as_deref());
        let ct = content_type.as_deref().and_then(|c| std::str::from_utf8(c).ok());
        let expected = Fingerprint::compute(method, "/t/{id}", &path, ct, &body);
        match (fingerprint_of(&parts, "/t/{id}", &Bytes::from(body), &FingerprintParts::default()), expected) {
            (Ok(got), Ok(expected)) => prop_assert_eq!(got, expected),
            (Err(res), Err(_)) => {
                let (status, content_type, _, problem) = problem_of(res);
                prop_assert_eq!(status, StatusCode::BAD_REQUEST);
                prop_assert_eq!(content_type.as_deref(), Some(PROBLEM_JSON));
                prop_assert_eq!(&problem["type"], "urn:oncely:problem:malformed-json");
            }
            (got, expected) => prop_assert!(false, "{:?} against {:?}", got.map_err(|r| r.status()), expected.is_ok()),
        }
    }

    /// Two texts of one JSON object (members reordered, whitespace): one fingerprint.
    #[test]
    fn reordered_json_bodies_have_one_request_fingerprint((a, b) in object_texts()) {
        let parts = parts("POST", "/v1/orders/7", Some(b"application/json"));
        let fa = fingerprint_of(&parts, "/v1/orders/{id}", &Bytes::from(a), &FingerprintParts::default()).ok();
        let fb = fingerprint_of(&parts, "/v1/orders/{id}", &Bytes::from(b), &FingerprintParts::default()).ok();
        prop_assert!(fa.is_some());
        prop_assert_eq!(fa, fb);
    }
}
