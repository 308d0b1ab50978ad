//! `IdempotencyKey::parse`: the bare form and the RFC 8941 §3.3.3 sf-string form of the
//! `Idempotency-Key` value (draft-ietf-httpapi-idempotency-key-header-07 §2).

use proptest::prelude::*;

use super::config;
use crate::{IdempotencyKey, KeyError, MAX_KEY_LEN};

/// RFC 8941 §4.1.6 "Serializing a String": `"`, the content with `"` and `\` escaped, `"`.
pub(crate) fn sf_string(content: &str) -> Vec<u8> {
    let mut out = vec![b'"'];
    for b in content.bytes() {
        if matches!(b, b'"' | b'\\') {
            out.push(b'\\');
        }
        out.push(b);
    }
    out.push(b'"');
    out
}

/// RFC 8941 §4.2.5 "Parsing a String", the reference: the content of a whole input that is
/// one sf-string, `None` when it is not one (a character outside 0x20–0x7E, an escape
/// other than `\"` and `\\`, no closing quote, or anything after it).
fn rfc8941_string(raw: &[u8]) -> Option<Vec<u8>> {
    let (&b'"', mut rest) = raw.split_first()? else {
        return None;
    };
    let mut out = Vec::new();
    loop {
        let (&c, tail) = rest.split_first()?;
        rest = tail;
        match c {
            b'\\' => {
                let (&next, tail) = rest.split_first()?;
                rest = tail;
                if !matches!(next, b'"' | b'\\') {
                    return None;
                }
                out.push(next);
            }
            b'"' => return rest.is_empty().then_some(out),
            0x20..=0x7e => out.push(c),
            _ => return None,
        }
    }
}

/// A valid key: 1–255 visible ASCII characters.
fn valid_key() -> impl Strategy<Value = String> {
    "[\\x21-\\x7e]{1,255}"
}

/// A byte outside visible ASCII.
fn invalid_byte() -> impl Strategy<Value = u8> {
    prop_oneof![0x00_u8..=0x20, 0x7f_u8..=0xff]
}

/// Bytes from an alphabet that hits the sf-string grammar's corners often.
fn quoted_ish() -> impl Strategy<Value = Vec<u8>> {
    let byte = prop_oneof![
        4 => Just(b'"'),
        4 => Just(b'\\'),
        4 => b'a'..=b'c',
        1 => Just(b' '),
        1 => Just(b'\t'),
        1 => Just(0x01_u8),
        1 => Just(0x7f_u8),
        1 => Just(0xc3_u8),
        1 => any::<u8>(),
    ];
    prop::collection::vec(byte, 0..24).prop_map(|mut v| {
        v.insert(0, b'"');
        v
    })
}

proptest! {
    #![proptest_config(config(2048))]

    /// Any bytes: no panic, and an accepted key is 1–255 visible ASCII characters.
    #[test]
    fn arbitrary_bytes_never_panic_and_accepted_keys_are_visible_ascii(
        raw in prop::collection::vec(any::<u8>(), 0..300),
    ) {
        if let Ok(key) = IdempotencyKey::parse(&raw) {
            let s = key.as_str();
            prop_assert!((1..=MAX_KEY_LEN).contains(&s.len()));
            prop_assert!(s.bytes().all(|b| (0x21..=0x7e).contains(&b)));
        }
    }

    /// Every accepted key, from any input, parses back from its sf-string serialisation
    /// to the same key.
    #[test]
    fn every_accepted_key_round_trips_through_its_sf_string(
        raw in prop_oneof![prop::collection::vec(any::<u8>(), 0..300), quoted_ish()],
    ) {
        if let Ok(key) = IdempotencyKey::parse(&raw) {
            prop_assert_eq!(IdempotencyKey::parse(&sf_string(key.as_str())), Ok(key));
        }
    }

    /// A valid key: its sf-string parses to it; so does its bare form, which its
    /// `Display` writes, unless it begins with `"` (then the bare form reads as a quoted
    /// string, and only the sf-string carries the key).
    #[test]
    fn quoted_and_bare_forms_agree_where_both_are_valid(content in valid_key()) {
        let quoted = IdempotencyKey::parse(&sf_string(&content));
        prop_assert_eq!(quoted.as_ref().map(IdempotencyKey::as_str), Ok(content.as_str()));
        let key = quoted.unwrap();
        if !content.starts_with('"') {
            prop_assert_eq!(IdempotencyKey::parse(content.as_bytes()), Ok(key.clone()));
            prop_assert_eq!(key.to_string().parse::<IdempotencyKey>(), Ok(key));
        }
    }

    /// `n` visible ASCII characters, bare or quoted: a key for 1 ≤ n ≤ 255, `Empty` for 0,
    /// `TooLong { len: n }` above 255.
    #[test]
    fn length_bounds_hold_in_both_forms(n in 0_usize..600, c in 0x21_u8..=0x7e) {
        // A first character that is not `"` keeps the bare form bare.
        let content = "k".repeat(n.min(1)) + &char::from(c).to_string().repeat(n.saturating_sub(1));
        let expected = match n {
            0 => Err(KeyError::Empty),
            1..=MAX_KEY_LEN => Ok(content.clone()),
            _ => Err(KeyError::TooLong { len: n }),
        };
        for raw in [content.clone().into_bytes(), sf_string(&content)] {
            let got = IdempotencyKey::parse(&raw).map(|k| k.as_str().to_owned());
            prop_assert_eq!(&got, &expected);
        }
    }

    /// One byte outside visible ASCII in a key of valid length: `InvalidCharacter` at its
    /// offset in the (unquoted) key, bare or quoted.
    #[test]
    fn an_invalid_byte_is_rejected_with_its_offset(
        content in "[\\x21\\x23-\\x7e]{1,254}",
        bad in invalid_byte(),
        at in any::<prop::sample::Index>(),
    ) {
        let at = at.index(content.len() + 1);
        let mut raw = content.into_bytes();
        raw.insert(at, bad);
        prop_assert_eq!(
            IdempotencyKey::parse(&raw),
            Err(KeyError::InvalidCharacter { at })
        );
        let mut quoted = vec![b'"'];
        quoted.extend(raw.iter().flat_map(|&b| {
            if matches!(b, b'"' | b'\\') { vec![b'\\', b] } else { vec![b] }
        }));
        quoted.push(b'"');
        prop_assert_eq!(
            IdempotencyKey::parse(&quoted),
            Err(KeyError::InvalidCharacter { at })
        );
    }

    /// An input that begins with `"` is a key exactly when it is one RFC 8941 sf-string
    /// whose content is a valid key; when it is no sf-string at all the error is
    /// `MalformedQuotedString` or, for a character outside 0x20–0x7E, `InvalidCharacter`.
    #[test]
    fn quoted_input_agrees_with_the_rfc_8941_string_grammar(raw in quoted_ish()) {
        let reference = rfc8941_string(&raw).filter(|c| {
            (1..=MAX_KEY_LEN).contains(&c.len()) && c.iter().all(|b| (0x21..=0x7e).contains(b))
        });
        let got = IdempotencyKey::parse(&raw);
        prop_assert_eq!(
            got.as_ref().ok().map(|k| k.as_str().as_bytes().to_vec()),
            reference,
            "{:?} -> {:?}", String::from_utf8_lossy(&raw), got
        );
        if rfc8941_string(&raw).is_none() {
            let typed = matches!(
                got,
                Err(KeyError::MalformedQuotedString | KeyError::InvalidCharacter { .. })
            );
            prop_assert!(typed, "{:?}", got);
        }
    }
}
