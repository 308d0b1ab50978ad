use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch, UTC.
///
/// Every timestamp oncely stores (`created_at`, `completed_at`, `expires_at`, …) is an
/// `i64` in this unit, so the three SQL backends store the same values.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, millis)
}

/// `d` in whole milliseconds, the unit of every stored timestamp and interval; saturates at
/// `i64::MAX` (a "forever" retention or lease stays forever).
pub fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// The time `d` after `at_ms` (Unix ms), saturating: a lease's end, an expiry, a retry's
/// time.
pub fn ms_after(at_ms: i64, d: Duration) -> i64 {
    at_ms.saturating_add(millis(d))
}

/// `ms` (Unix ms, the stored unit) as an RFC 3339 UTC time with milliseconds,
/// `2025-12-01T00:00:00.250Z`: what every human-facing table and page prints.
///
/// Hand-written (Howard Hinnant's days-to-civil on the proleptic Gregorian calendar, a
/// dozen integer lines) so that the core crate, which every other depends on, needs no
/// date library for one fixed format.
pub fn rfc3339(ms: i64) -> String {
    let secs = ms.div_euclid(1000);
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let shifted = days + 719_468;
    let era = shifted.div_euclid(146_097);
    let doe = shifted.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        ms.rem_euclid(1000)
    )
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{millis, ms_after};

    #[test]
    fn durations_become_saturating_milliseconds() {
        assert_eq!(millis(Duration::from_millis(1500)), 1500);
        assert_eq!(millis(Duration::MAX), i64::MAX);
        assert_eq!(ms_after(1_000, Duration::from_secs(2)), 3_000);
        assert_eq!(ms_after(i64::MAX - 1, Duration::from_secs(1)), i64::MAX);
    }

    #[test]
    fn times_render_as_rfc3339_utc() {
        assert_eq!(super::rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(
            super::rfc3339(1_764_547_200_250),
            "2025-12-01T00:00:00.250Z"
        );
        assert_eq!(
            super::rfc3339(951_782_400_000 + 3_661_000),
            "2000-02-29T01:01:01.000Z"
        );
    }
}
