use std::time::Duration;

/// What a receiver's answer says about one delivery attempt: the rule of docs/DESIGN.md
/// ("only a message's own defect counts toward dead-lettering") applied to an HTTP
/// endpoint that deduplicates by `webhook-id`, so that a repeated attempt is harmless.
///
/// Not [`oncely_core::OutcomeClass::of_answer`]: that classifier serves calls to providers,
/// where an unknown outcome must be checked before any new attempt. A delivery's receiver
/// deduplicates by `webhook-id`, so an unknown outcome is simply delivered again, and a
/// refusal is safe to requeue once the receiver is fixed: the only question left is whether
/// the message or the receiver is at fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Verdict {
    /// 2xx: the receiver has the message; the delivery is acknowledged.
    Delivered,
    /// The receiver is unavailable, the message is not defective: every 5xx, 408, 429, a
    /// status this rule does not know (1xx, 3xx, anything outside 100–599) and every
    /// failure without an answer (a timeout, a refused or dropped connection). Retried with
    /// backoff until it is delivered; never counts toward dead-lettering.
    Unavailable,
    /// Any other 4xx (400, 401, 403, 404, 409, 410, 422, …): the receiver refuses this
    /// message; it goes to the dead letters at once, with the answer as the reason.
    Refused,
}

impl Verdict {
    /// The verdict of an answer with `status` (RFC 9110 §15).
    pub fn of_status(status: u16) -> Self {
        match status {
            200..=299 => Self::Delivered,
            408 | 429 => Self::Unavailable,
            400..=499 => Self::Refused,
            _ => Self::Unavailable,
        }
    }
}

/// How much of an answer's body a reason quotes, in bytes.
pub(crate) const BODY_PREVIEW_BYTES: usize = 200;

/// The first [`BODY_PREVIEW_BYTES`] of `body` as one line of text (lossy UTF-8, line
/// breaks and tabs as spaces), for a dead letter's reason or a log line.
pub(crate) fn preview(body: &[u8]) -> String {
    let cut = &body[..body.len().min(BODY_PREVIEW_BYTES)];
    String::from_utf8_lossy(cut)
        .replace(['\r', '\n', '\t'], " ")
        .trim()
        .to_owned()
}

/// The `Retry-After` of an answer (RFC 9110 §10.2.3), read by oncely's one parser.
pub(crate) fn retry_after(headers: &http::HeaderMap) -> Option<Duration> {
    let value = headers.get(http::header::RETRY_AFTER)?.to_str().ok()?;
    oncely_core::parse_retry_after(value, std::time::SystemTime::now())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every status 0–1000: 2xx delivered, 4xx other than 408 and 429 refused, everything
    /// else (5xx, 408, 429, 1xx, 3xx, unknown) unavailable.
    #[test]
    fn only_a_4xx_other_than_408_and_429_refuses_the_message() {
        for status in 0..=1000_u16 {
            let expected = match status {
                200..=299 => Verdict::Delivered,
                400..=499 if status != 408 && status != 429 => Verdict::Refused,
                _ => Verdict::Unavailable,
            };
            assert_eq!(Verdict::of_status(status), expected, "{status}");
        }
        for unavailable in [500, 502, 503, 504, 408, 429, 301, 302, 307, 100, 600] {
            assert_eq!(Verdict::of_status(unavailable), Verdict::Unavailable);
        }
        for refused in [400, 401, 403, 404, 409, 410, 422] {
            assert_eq!(Verdict::of_status(refused), Verdict::Refused);
        }
    }

    #[test]
    fn a_preview_is_one_line_of_at_most_200_bytes() {
        assert_eq!(preview(b"  bad\r\norder\t7 "), "bad  order 7");
        let long = vec![b'x'; 1000];
        assert_eq!(preview(&long).len(), BODY_PREVIEW_BYTES);
    }
}
