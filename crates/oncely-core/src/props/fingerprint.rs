//! `Fingerprint::compute`: equal for equal requests, different when anything changes,
//! the same on every run.

use proptest::prelude::*;
use serde_json::Value;

use super::config;
use super::json::{jcs, leaf, text, value, value_and_text};
use crate::{Fingerprint, FingerprintMismatch};

const JSON: Option<&str> = Some("application/json");

fn fp(path: &str, body: &str) -> Fingerprint {
    Fingerprint::compute("POST", "/v1/orders/{id}", path, JSON, body.as_bytes())
        .expect("a JSON body")
}

/// Mutable references to every leaf of `v` (an empty array or object is one), depth first.
fn leaves(v: &mut Value) -> Vec<&mut Value> {
    let container = match v {
        Value::Array(items) => !items.is_empty(),
        Value::Object(m) => !m.is_empty(),
        _ => false,
    };
    if !container {
        return vec![v];
    }
    match v {
        Value::Array(items) => items.iter_mut().flat_map(leaves).collect(),
        Value::Object(m) => m.values_mut().flat_map(leaves).collect(),
        _ => unreachable!("a container"),
    }
}

/// Two texts of one value.
fn two_texts() -> impl Strategy<Value = (String, String)> {
    value().prop_flat_map(|v| (text(&v), text(&v)))
}

proptest! {
    #![proptest_config(config(1024))]

    /// Two texts of one value (members reordered, whitespace, number forms, escapes):
    /// one fingerprint, and the same one when computed again.
    #[test]
    fn semantically_equal_bodies_have_one_fingerprint((a, b) in two_texts()) {
        prop_assert_eq!(fp("/v1/orders/1", &a).mismatch(&fp("/v1/orders/1", &b)), None);
        prop_assert_eq!(fp("/v1/orders/1", &a), fp("/v1/orders/1", &a));
    }

    /// One leaf (an empty array or object counts as one) replaced by a value with another
    /// canonical form: the fingerprints differ, in the body.
    #[test]
    fn changing_one_leaf_changes_the_body_fingerprint(
        (v, t) in value_and_text(),
        which in any::<prop::sample::Index>(),
        replacement in leaf(),
    ) {
        let mut changed = v.clone();
        let mut all = leaves(&mut changed);
        let i = which.index(all.len());
        // A drawn leaf equal to the old one is wrapped in an array: never equal to a leaf.
        *all[i] = if jcs(all[i]) == jcs(&replacement) {
            Value::Array(vec![replacement])
        } else {
            replacement
        };
        let before = fp("/v1/orders/1", &t);
        let after = fp("/v1/orders/1", &serde_json::to_string(&changed).unwrap());
        prop_assert_eq!(before.mismatch(&after), Some(FingerprintMismatch::Body));
    }

    /// Another concrete path is a route mismatch; the method's case does not matter;
    /// the digests are 32 bytes and `Debug` shows 64 lowercase hex digits.
    #[test]
    fn paths_differ_as_routes_and_the_format_is_fixed(
        a in "/[a-z0-9/]{0,12}",
        b in "/[a-z0-9/]{0,12}",
        body in prop::collection::vec(any::<u8>(), 0..64),
    ) {
        let of = |method: &str, path: &str| {
            Fingerprint::compute(method, "/t", path, Some("text/plain"), &body).unwrap()
        };
        let fa = of("POST", &a);
        prop_assert_eq!(of("post", &a), fa);
        let expected = if a == b { None } else { Some(FingerprintMismatch::Route) };
        prop_assert_eq!(fa.mismatch(&of("POST", &b)), expected);
        prop_assert_eq!(fa.full().len() + fa.route().len(), 64);
        let debug = format!("{fa:?}");
        let hex = debug.strip_prefix("Fingerprint(\"").and_then(|d| d.strip_suffix("\")"));
        prop_assert!(
            hex.is_some_and(|h| h.len() == 64 && h.bytes().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f'))),
            "{}", debug
        );
    }
}

/// The fingerprint has no randomness: a pinned request has a pinned digest, on every run
/// and every machine (stored records outlive processes).
#[test]
fn a_pinned_request_has_a_pinned_fingerprint() {
    let f = fp(
        "/v1/orders/42",
        r#"{ "b": [1, 2.0, "x"], "a": {"c": null} }"#,
    );
    assert_eq!(
        format!("{f:?}"),
        "Fingerprint(\"bf68ce39ae1255e4fa58862e4dc74566ba35b40bc6fb244fab9e8a3ace12069c\")"
    );
}
