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
}
