use std::time::Duration;

/// Exponential backoff with full jitter, a cap and an attempt limit (DESIGN.md "Retries
/// with judgement"; the "Full Jitter" of the AWS architecture blog's *Exponential Backoff
/// and Jitter*).
///
/// After the `n`-th failed attempt (`n` ≥ 1) the next attempt waits a uniformly random time
/// in `[0, min(cap, base · 2^(n-1))]`; after `max_attempts` failures the work is given up
/// (dead-lettered).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Upper bound of the first wait. Default 500 ms.
    pub base: Duration,
    /// Upper bound of any wait. Default 5 min.
    pub cap: Duration,
    /// Failed attempts after which the work is dead. Default 10; at least 1.
    pub max_attempts: u32,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            base: Duration::from_millis(500),
            cap: Duration::from_secs(300),
            max_attempts: 10,
        }
    }
}

impl RetryPolicy {
    /// The largest wait after `failures` failed attempts: `min(cap, base · 2^(failures-1))`
    /// (zero for `failures == 0`).
    pub fn ceiling(&self, failures: u32) -> Duration {
        if failures == 0 {
            return Duration::ZERO;
        }
        let factor = 1_u32.checked_shl(failures - 1).unwrap_or(u32::MAX);
        self.base.saturating_mul(factor).min(self.cap)
    }

    /// The wait after `failures` failed attempts, full jitter: `unit` (a uniform sample in
    /// `[0, 1)`, supplied by the caller so this type stays deterministic and I/O-free)
    /// times [`RetryPolicy::ceiling`].
    pub fn delay(&self, failures: u32, unit: f64) -> Duration {
        self.ceiling(failures).mul_f64(unit.clamp(0.0, 1.0))
    }

    /// `true` when `failures` failed attempts exhaust the policy.
    pub fn exhausted(&self, failures: u32) -> bool {
        failures >= self.max_attempts.max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ceiling_doubles_up_to_the_cap_and_jitter_stays_below_it() {
        let p = RetryPolicy {
            base: Duration::from_millis(100),
            cap: Duration::from_secs(1),
            max_attempts: 3,
        };
        assert_eq!(p.ceiling(0), Duration::ZERO);
        assert_eq!(p.ceiling(1), Duration::from_millis(100));
        assert_eq!(p.ceiling(2), Duration::from_millis(200));
        assert_eq!(p.ceiling(4), Duration::from_millis(800));
        assert_eq!(p.ceiling(5), Duration::from_secs(1));
        assert_eq!(p.ceiling(200), Duration::from_secs(1));
        assert_eq!(p.delay(2, 0.5), Duration::from_millis(100));
        assert_eq!(p.delay(2, 7.0), Duration::from_millis(200));
        assert!(!p.exhausted(2));
        assert!(p.exhausted(3));
    }
}
