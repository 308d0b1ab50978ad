//! `RetryPolicy`: waits within `[0, cap]`, `Retry-After` up to its ceiling, no overflow
//! for any attempt count; `parse_retry_after` (RFC 9110 §10.2.3).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use proptest::prelude::*;

use super::config;
use crate::{parse_retry_after, Failure, OutcomeClass, RetryDecision, RetryPolicy};

/// Any duration, small ones (ms to hours) more often than huge ones.
fn duration() -> impl Strategy<Value = Duration> {
    prop_oneof![
        2 => (0_u64..10_000_000).prop_map(Duration::from_millis),
        1 => (any::<u64>(), 0_u32..1_000_000_000).prop_map(|(s, n)| Duration::new(s, n)),
        1 => (u64::MAX - 1024.., 0_u32..1_000_000_000).prop_map(|(s, n)| Duration::new(s, n)),
        1 => Just(Duration::MAX),
        1 => Just(Duration::ZERO),
    ]
}

/// An attempt count, often near 0 and near `u32::MAX`.
fn failures() -> impl Strategy<Value = u32> {
    prop_oneof![0_u32..70, any::<u32>(), u32::MAX - 70..=u32::MAX]
}

/// A jitter sample: mostly in `[0, 1)`, also its edges, and out-of-range and non-finite
/// values a caller might pass by mistake.
fn unit() -> impl Strategy<Value = f64> {
    prop_oneof![
        4 => 0.0_f64..1.0,
        1 => Just(0.0),
        1 => Just(1.0),
        1 => Just(1.0 - f64::EPSILON / 2.0),
        1 => any::<f64>(),
    ]
}

fn policy() -> impl Strategy<Value = RetryPolicy> {
    (
        duration(),
        duration(),
        0_u32..20,
        prop::option::of(duration()),
        duration(),
    )
        .prop_map(
            |(base, cap, max_attempts, deadline, retry_after_ceiling)| RetryPolicy {
                base,
                cap,
                max_attempts,
                deadline,
                retry_after_ceiling,
            },
        )
}

/// A time from 1970 to 9999 (the HTTP-date range), in whole seconds.
fn http_time() -> impl Strategy<Value = SystemTime> {
    (0_u64..253_402_300_800).prop_map(|s| UNIX_EPOCH + Duration::from_secs(s))
}

/// The IMF-fixdate of `t` in the obsolete forms of RFC 9110 §5.6.7: rfc850-date
/// (`Sunday, 06-Nov-94 08:49:37 GMT`) and asctime-date (`Sun Nov  6 08:49:37 1994`).
fn obsolete_forms(t: SystemTime) -> [String; 2] {
    let imf = httpdate::fmt_http_date(t);
    let (wkday, day, mon, year, time) = (
        &imf[0..3],
        &imf[5..7],
        &imf[8..11],
        &imf[12..16],
        &imf[17..25],
    );
    let weekday = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ]
    .into_iter()
    .find(|w| w.starts_with(wkday))
    .expect("a day name");
    let asctime_day = day
        .strip_prefix('0')
        .map_or_else(|| day.to_owned(), |d| format!(" {d}"));
    [
        format!("{weekday}, {day}-{mon}-{} {time} GMT", &year[2..]),
        format!("{wkday} {mon} {asctime_day} {time} {year}"),
    ]
}

/// Seconds in 49 years of 365 days: well within RFC 9110's 50-year window.
const YEARS_49: u64 = 49 * 365 * 86_400;

proptest! {
    #![proptest_config(config(4096))]

    /// The jittered wait is within `[0, ceiling] ⊆ [0, cap]`, for any policy, attempt
    /// count and sample; a sample in `[0, 1]` gives `unit · ceiling` (rounded).
    #[test]
    fn the_delay_is_within_zero_and_the_cap(p in policy(), n in failures(), u in unit()) {
        let ceiling = p.ceiling(n);
        prop_assert!(ceiling <= p.cap);
        let d = p.delay(n, u);
        prop_assert!(d <= ceiling, "{:?} over the ceiling {:?}", d, ceiling);
        if (0.0..=1.0).contains(&u) {
            let exact = ceiling.as_secs_f64() * u;
            prop_assert!((d.as_secs_f64() - exact).abs() <= exact * 1e-9 + 1e-9);
        }
    }

    /// The ceiling grows with the attempt count and never passes the cap.
    #[test]
    fn the_ceiling_is_monotone_in_the_attempt_count(p in policy(), n in failures()) {
        prop_assert!(p.ceiling(n) <= p.ceiling(n.saturating_add(1)));
        prop_assert!(p.ceiling(n.saturating_add(1)) <= p.cap);
    }

    /// `Retry-After` is waited for up to the ceiling, never beyond it: the wait is at least
    /// `min(asked, ceiling)` and at most the larger of the cap and that.
    #[test]
    fn retry_after_is_honoured_up_to_the_ceiling_never_beyond(
        p in policy(), n in failures(), u in unit(), asked in duration(),
    ) {
        let honoured = asked.min(p.retry_after_ceiling);
        let d = p.delay_honouring(n, u, Some(asked));
        prop_assert!(d >= honoured);
        prop_assert!(d <= p.cap.max(honoured));
        prop_assert_eq!(d, p.delay(n, u).max(honoured));
    }

    /// `decide` and `outage_wait` never panic, and every wait they give is bounded like
    /// `delay_honouring`; a retry never starts past the deadline.
    #[test]
    fn decisions_and_outage_waits_are_bounded(
        p in policy(),
        n in failures(),
        u in unit(),
        asked in prop::option::of(duration()),
        elapsed in duration(),
    ) {
        let bound = p.cap.max(asked.map_or(Duration::ZERO, |a| a.min(p.retry_after_ceiling)));
        let failure = Failure {
            failures: n,
            class: OutcomeClass::NotSent,
            retry_after: asked,
            elapsed,
            timed_out: false,
        };
        if let RetryDecision::RetryAfter(wait) = p.decide(&failure, None, u) {
            prop_assert!(wait <= bound);
            if let Some(deadline) = p.deadline {
                prop_assert!(elapsed.saturating_add(wait) < deadline);
            }
        }
        prop_assert!(p.outage_wait(n, asked, None, u).wait <= bound);
    }

    /// Any string: no panic.
    #[test]
    fn parse_retry_after_never_panics(
        s in prop_oneof![
            any::<String>(),
            "[0-9 ]{0,30}",
            "[A-Za-z0-9 ,:\\-]{0,40}",
            http_time().prop_map(httpdate::fmt_http_date),
        ],
        now in http_time(),
    ) {
        let _ = parse_retry_after(&s, now);
    }

    /// `delay-seconds` (1*DIGIT), with optional whitespace around it and leading zeros.
    #[test]
    fn delay_seconds_are_read_as_seconds(secs in any::<u64>(), zeros in 0_usize..3, now in http_time()) {
        let value = format!(" {}{secs}\t", "0".repeat(zeros));
        prop_assert_eq!(parse_retry_after(&value, now), Some(Duration::from_secs(secs)));
    }

    /// An IMF-fixdate is the wait from `now` until it (zero once it has passed).
    #[test]
    fn an_imf_fixdate_is_the_wait_until_it(at in http_time(), now in http_time()) {
        let expected = at.duration_since(now).unwrap_or(Duration::ZERO);
        prop_assert_eq!(parse_retry_after(&httpdate::fmt_http_date(at), now), Some(expected));
    }

    /// The obsolete forms a recipient must accept (RFC 9110 §5.6.7): asctime-date for any
    /// date, and rfc850-date for a date within 49 years of `now`, whose two-digit year is
    /// read as the year in the 100 years up to 50 years after `now`.
    #[test]
    fn obsolete_http_dates_are_read_per_rfc_9110(
        now in (YEARS_49..253_402_300_800 - YEARS_49).prop_map(|s| UNIX_EPOCH + Duration::from_secs(s)),
        offset in 0..2 * YEARS_49,
    ) {
        let at = now - Duration::from_secs(YEARS_49) + Duration::from_secs(offset);
        let expected = at.duration_since(now).unwrap_or(Duration::ZERO);
        let [rfc850, asctime] = obsolete_forms(at);
        prop_assert_eq!(parse_retry_after(&asctime, now), Some(expected), "{}", asctime);
        prop_assert_eq!(parse_retry_after(&rfc850, now), Some(expected), "{}", rfc850);
    }
}

/// Found by `the_delay_is_within_zero_and_the_cap` and
/// `decisions_and_outage_waits_are_bounded`: a ceiling near `Duration::MAX` and a full
/// sample made `mul_f64` overflow ("cannot convert float seconds to Duration"), a panic.
#[test]
fn a_ceiling_near_duration_max_gives_the_cap_without_panic() {
    let p = RetryPolicy {
        base: Duration::from_secs(4_294_967_297),
        cap: Duration::from_secs(18_446_744_073_709_550_592),
        max_attempts: 0,
        deadline: None,
        retry_after_ceiling: Duration::ZERO,
    };
    assert_eq!(p.delay(33, 1.0), p.cap);
    assert_eq!(p.delay_honouring(33, 1.0, Some(Duration::ZERO)), p.cap);
    assert_eq!(p.outage_wait(33, None, None, 1.0).wait, p.cap);
    let unbounded = RetryPolicy {
        cap: Duration::MAX,
        ..p
    };
    assert_eq!(unbounded.delay(u32::MAX, 1.0), unbounded.ceiling(u32::MAX));
}

/// Found by `the_delay_is_within_zero_and_the_cap`: through f64 seconds a full-jitter wait
/// rounded up to 18136208072741.14453125 s, past the cap of 18136208072741.142578126 s.
#[test]
fn a_full_jitter_wait_never_rounds_past_the_cap() {
    let p = RetryPolicy {
        base: Duration::from_millis(4_222_665),
        cap: Duration::new(18_136_208_072_741, 142_578_126),
        max_attempts: 0,
        deadline: None,
        retry_after_ceiling: Duration::ZERO,
    };
    assert!(p.delay(33, 1.0) <= p.cap);
}

/// Found by `obsolete_http_dates_are_read_per_rfc_9110`: httpdate reads a two-digit year
/// as 1970–2069, so in 2052 `01-Jan-70` (2070, a Wednesday) was refused, and in 9551
/// `01-Jan-70` (9570, a Thursday like 1970-01-01) was read as 1970, a wait of zero.
#[test]
fn rfc850_two_digit_years_are_read_within_50_years_of_now() {
    let at = |s: u64| UNIX_EPOCH + Duration::from_secs(s);
    assert_eq!(
        parse_retry_after("Wednesday, 01-Jan-70 00:00:00 GMT", at(2_598_285_888)),
        Some(Duration::from_secs(557_474_112))
    );
    assert_eq!(
        parse_retry_after("Thursday, 01-Jan-70 00:00:00 GMT", at(239_250_958_007)),
        Some(Duration::from_secs(581_877_193))
    );
    // The wrong weekday for the year RFC 9110 reads is no date, whatever httpdate reads.
    assert_eq!(
        parse_retry_after("Thursday, 01-Jan-70 00:00:00 GMT", at(2_598_285_888)),
        None
    );
}
