//! The JSON canonicaliser of the fingerprint (RFC 8785, JCS): one canonical form for every
//! text of the same I-JSON value.

use std::fmt::Write as _;

use proptest::prelude::*;
use serde_json::{Map, Number, Value};

use super::config;
use crate::fingerprint::canonical_json;

/// A finite double of any class (normal, subnormal, ±0).
fn finite_f64() -> impl Strategy<Value = f64> {
    use prop::num::f64::{NEGATIVE, NORMAL, POSITIVE, SUBNORMAL, ZERO};
    prop_oneof![
        (POSITIVE | NEGATIVE | NORMAL | SUBNORMAL | ZERO),
        -1e6_f64..1e6,
        Just(-0.0),
        Just(f64::MAX),
        Just(f64::MIN_POSITIVE),
    ]
}

/// Any string, control characters and non-BMP characters included.
fn any_string(max: usize) -> impl Strategy<Value = String> {
    prop::collection::vec(any::<char>(), 0..max).prop_map(String::from_iter)
}

/// A JSON leaf: null, a boolean, an integer (i64 or u64), a finite double or a string.
pub(super) fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        (-1000_i64..1000).prop_map(Value::from),
        finite_f64().prop_map(|x| Value::Number(Number::from_f64(x).expect("finite"))),
        any_string(8).prop_map(Value::String),
    ]
}

/// Any I-JSON value up to 4 levels deep.
pub(super) fn value() -> impl Strategy<Value = Value> {
    leaf().prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(any_string(6), inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

/// Insignificant whitespace (RFC 8259 §2): space, tab, line feed, carriage return.
fn ws() -> impl Strategy<Value = String> {
    prop::collection::vec(prop::sample::select(vec![' ', '\t', '\n', '\r']), 0..3)
        .prop_map(String::from_iter)
}

/// `t` with whitespace drawn on both sides.
fn padded(t: BoxedStrategy<String>) -> BoxedStrategy<String> {
    (ws(), t, ws()).prop_map(|(a, t, b)| a + &t + &b).boxed()
}

/// Texts of `s`, each character written as itself or escaped (`\uXXXX`, surrogate pairs
/// above the BMP); `"`, `\` and control characters always escaped.
fn string_text(s: &str) -> BoxedStrategy<String> {
    let chars: Vec<char> = s.chars().collect();
    prop::collection::vec(any::<bool>(), chars.len())
        .prop_map(move |escape| {
            let mut out = String::from("\"");
            for (&c, &e) in chars.iter().zip(&escape) {
                if e || c == '"' || c == '\\' || c < ' ' {
                    let mut units = [0_u16; 2];
                    for u in c.encode_utf16(&mut units) {
                        let _ = write!(out, "\\u{u:04x}");
                    }
                } else {
                    out.push(c);
                }
            }
            out + "\""
        })
        .boxed()
}

/// Decimal texts of `x` this draws from: Rust's shortest round-trip forms (`1`, `1.0`,
/// `1e0`, `1E0`), the same digits with the point moved (`10e-1`, `0.1e1`), and 17 and 40
/// significant digits (each nearer to `x` than to any other double).
pub(super) fn number_forms(x: f64) -> Vec<String> {
    let sci = format!("{x:e}");
    let (mantissa, exp) = sci.split_once('e').expect("{:e} has an exponent");
    let exp: i32 = exp.parse().expect("an integer exponent");
    let (sign, digits) = mantissa
        .strip_prefix('-')
        .map_or(("", mantissa), |m| ("-", m));
    let (int, frac) = digits.split_once('.').unwrap_or((digits, ""));
    let all = format!("{int}{frac}");
    let frac_len = i32::try_from(frac.len()).expect("short");
    let mut forms = vec![
        format!("{x}"),
        format!("{x:?}"),
        sci.clone(),
        format!("{x:E}"),
        // 17 significant digits (C's `%.17g`, as many encoders write doubles), and 40.
        format!("{x:.16e}"),
        format!("{x:.39e}"),
        format!("{sign}{all}e{}", exp - frac_len),
        format!("{sign}0.{all}e{}", exp + 1),
    ];
    // JSON has no leading zeros: `00E-1` is no number.
    if all != "0" {
        forms.push(format!("{sign}{all}0E{:+}", exp - frac_len - 1));
    }
    forms
}

/// Texts of the number `n`: its double's decimal forms, and for an integer its digits
/// as written (`-0` for zero too).
fn number_text(n: &Number) -> BoxedStrategy<String> {
    let mut forms = number_forms(n.as_f64().expect("serde_json numbers are finite"));
    if n.is_i64() || n.is_u64() {
        forms.extend([n.to_string(), format!("{n}.0"), format!("{n}e0")]);
        if n.as_u64() == Some(0) {
            forms.extend(["-0".into(), "-0.0".into(), "0e7".into(), "-0E-3".into()]);
        }
    }
    prop::sample::select(forms).boxed()
}

/// Texts of `v` in any member order, with any whitespace, number form and string
/// escaping: all the same I-JSON value.
pub(super) fn text(v: &Value) -> BoxedStrategy<String> {
    let t = match v {
        Value::Null => Just("null".to_owned()).boxed(),
        Value::Bool(b) => Just(b.to_string()).boxed(),
        Value::Number(n) => number_text(n),
        Value::String(s) => string_text(s),
        Value::Array(items) => {
            let items: Vec<_> = items.iter().map(text).collect();
            (items, ws())
                .prop_map(|(items, w)| format!("[{w}{}]", items.join(",")))
                .boxed()
        }
        Value::Object(members) => {
            let members: Vec<_> = members
                .iter()
                .map(|(k, v)| (padded(string_text(k)), text(v)))
                .collect();
            (Just(members).prop_shuffle(), ws())
                .prop_flat_map(|(members, w)| {
                    members.prop_map(move |m| {
                        let m: Vec<String> =
                            m.into_iter().map(|(k, v)| format!("{k}:{v}")).collect();
                        format!("{{{w}{}}}", m.join(","))
                    })
                })
                .boxed()
        }
    };
    padded(t)
}

/// A value and one text of it.
pub(super) fn value_and_text() -> impl Strategy<Value = (Value, String)> {
    value().prop_flat_map(|v| {
        let t = text(&v);
        (Just(v), t)
    })
}

/// RFC 8785's form of `v`, written straight from the value (no parsing).
pub(super) fn jcs(v: &Value) -> Vec<u8> {
    serde_json_canonicalizer::to_vec(v).expect("finite numbers")
}

/// `v` with every number as its double and -0 as 0: what JCS keeps of a value.
fn as_doubles(v: &Value) -> Value {
    match v {
        Value::Number(n) => {
            let x = n.as_f64().expect("finite") + 0.0;
            Value::Number(Number::from_f64(x).expect("finite"))
        }
        Value::Array(items) => Value::Array(items.iter().map(as_doubles).collect()),
        Value::Object(m) => {
            Value::Object(m.iter().map(|(k, v)| (k.clone(), as_doubles(v))).collect())
        }
        other => other.clone(),
    }
}

/// `levels` nestings around `inner`: `true` an array `[…]`, `false` an object `{"k":…}`;
/// with whitespace between the tokens unless `compact`.
fn nest(levels: &[bool], inner: &str, compact: bool) -> String {
    let (open_array, open_object, close_object) = if compact {
        ("[", "{\"k\":", "}")
    } else {
        ("[ ", "{\"k\" :\n", " }")
    };
    let mut out = String::new();
    for &array in levels {
        out.push_str(if array { open_array } else { open_object });
    }
    out.push_str(inner);
    for &array in levels.iter().rev() {
        out.push_str(if array { "]" } else { close_object });
    }
    out
}

/// Nesting depth of `v` (a leaf is 0).
fn depth(v: &Value) -> usize {
    match v {
        Value::Array(items) => 1 + items.iter().map(depth).max().unwrap_or(0),
        Value::Object(m) => 1 + m.values().map(depth).max().unwrap_or(0),
        _ => 0,
    }
}

proptest! {
    #![proptest_config(config(1024))]

    /// Member order, whitespace, number form (`1`, `1.0`, `1e0`, `-0`) and string escapes
    /// do not change the canonical form: it is JCS of the value itself.
    #[test]
    fn every_text_of_a_value_canonicalises_to_the_jcs_of_the_value((v, t) in value_and_text()) {
        let got = canonical_json(t.as_bytes()).map_err(|e| e.to_string());
        prop_assert_eq!(got, Ok(jcs(&v)), "text {}", t);
    }

    /// The canonical form is a fixed point, and valid JSON of an equal value (numbers as
    /// doubles).
    #[test]
    fn the_canonical_form_is_idempotent_and_parses_to_an_equal_value((v, t) in value_and_text()) {
        let once = canonical_json(t.as_bytes()).expect("a valid text");
        let twice = canonical_json(&once).expect("the canonical form is valid JSON");
        prop_assert_eq!(&twice, &once);
        let parsed: Value = serde_json::from_slice(&once).expect("valid JSON");
        prop_assert_eq!(as_doubles(&parsed), as_doubles(&v));
    }

    /// Within serde_json's recursion limit (128) nesting keeps the canonical form of the
    /// inner value; beyond it the text is refused (an error, never a stack overflow).
    #[test]
    fn nesting_keeps_the_canonical_form_up_to_the_limit(
        (v, t) in value_and_text(),
        levels in prop::collection::vec(any::<bool>(), 0..160),
    ) {
        let got = canonical_json(nest(&levels, &t, false).as_bytes()).ok();
        let total = levels.len() + depth(&v);
        if total <= 120 {
            let expected = nest(&levels, &String::from_utf8(jcs(&v)).unwrap(), true);
            prop_assert_eq!(got.map(String::from_utf8), Some(Ok(expected)));
        } else if total > 128 {
            prop_assert_eq!(got, None);
        }
    }

    /// Any bytes, and any text from JSON's alphabet: no panic; what is accepted has a
    /// canonical form that is a fixed point.
    #[test]
    fn arbitrary_bytes_never_panic_and_accepted_ones_reach_a_fixed_point(
        raw in prop_oneof![
            prop::collection::vec(any::<u8>(), 0..64),
            "[\\[\\]{}\":,0-9.eE+\\- \\\\tfrueansl]{0,40}".prop_map(String::into_bytes),
        ],
    ) {
        if let Ok(once) = canonical_json(&raw) {
            prop_assert_eq!(canonical_json(&once).ok(), Some(once));
        }
    }

    /// Each decimal form of a double parses to that double: the canonical form of a
    /// number does not depend on how it was written.
    #[test]
    fn every_decimal_form_of_a_double_has_one_canonical_form(x in finite_f64()) {
        let expected = jcs(&Value::Number(Number::from_f64(x).unwrap()));
        for form in number_forms(x) {
            let got = canonical_json(form.as_bytes()).map_err(|e| e.to_string());
            prop_assert_eq!(got, Ok(expected.clone()), "form {}", form);
        }
    }
}

#[test]
fn negative_zero_and_integral_doubles_are_written_as_integers() {
    for text in ["-0", "-0.0", "0e0", "-0E+5"] {
        assert_eq!(canonical_json(text.as_bytes()).unwrap(), b"0", "{text}");
    }
    for text in [
        "1",
        "1.0",
        "1e0",
        "10e-1",
        "0.1e1",
        "1.000000000000000000000001",
    ] {
        assert_eq!(canonical_json(text.as_bytes()).unwrap(), b"1", "{text}");
    }
}
