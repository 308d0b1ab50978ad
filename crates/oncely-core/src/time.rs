use std::time::{SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch, UTC.
///
/// Every timestamp oncely stores (`created_at`, `completed_at`, `expires_at`, …) is an
/// `i64` in this unit, so the three SQL backends store the same values.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}
