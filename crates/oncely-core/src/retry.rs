use std::time::{Duration, SystemTime};

use crate::budget::RetryBudget;

/// The one retry policy of oncely, used by the outbox relay, the inbox consumers and the
/// effect runner: exponential backoff with full jitter, a cap, an attempt limit and a
/// deadline; `Retry-After` honoured up to a ceiling; and, through [`RetryPolicy::decide`],
/// a per-dependency [`RetryBudget`] and the [`OutcomeClass`] of the failed attempt
/// (docs/DESIGN.md "Retries with judgement"; the "Full Jitter" of the AWS architecture
/// blog's *Exponential Backoff and Jitter*).
///
/// After the `n`-th failed attempt (`n` ≥ 1) the next attempt waits a uniformly random time
/// in `[0, min(cap, base · 2^(n-1))]`; after `max_attempts` failures, or once `deadline` has
/// passed since the first attempt, the work is given up (dead-lettered or parked).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Upper bound of the first wait. Default 500 ms.
    pub base: Duration,
    /// Upper bound of any wait. Default 5 min.
    pub cap: Duration,
    /// Failed attempts after which the work is dead. Default 10; at least 1.
    pub max_attempts: u32,
    /// Time since the first attempt after which no retry starts, `None` for no deadline.
    /// Default `None`.
    pub deadline: Option<Duration>,
    /// The longest `Retry-After` honoured (RFC 9110 §10.2.3): a server asking for more is
    /// waited for this long at most. Default 5 min.
    pub retry_after_ceiling: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            base: Duration::from_millis(500),
            cap: Duration::from_secs(300),
            max_attempts: 10,
            deadline: None,
            retry_after_ceiling: Duration::from_secs(300),
        }
    }
}

/// What a failed attempt says about whether the work happened — the question every retry
/// must answer first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum OutcomeClass {
    /// Failed before the request left (connect refused, DNS, pool closed, a broker that
    /// is down): nothing happened, a retry is safe.
    NotSent,
    /// Sent, and no answer says what happened (timeout after sending, connection dropped
    /// mid-answer, any 5xx, a 409, an unreadable 2xx): the effect may exist. The status is checked before any
    /// new attempt; never a blind retry.
    Unknown,
    /// The other side answered that it did not act and asks to retry (a 429 with
    /// `Retry-After`).
    Retryable,
    /// A definitive answer (success, or a refusal such as 400/402/404/422): retrying
    /// cannot change it.
    Final,
}

impl OutcomeClass {
    /// The class of an HTTP answer with `status` (RFC 9110 §15) to a request that **has
    /// left**, for a provider that gives no better signal; `retry_after` tells whether the
    /// answer carried a `Retry-After`. The one conservative classifier of oncely
    /// (docs/DESIGN.md "Outcome classes"): only an answer that proves nothing happened is a
    /// refusal, everything else is unknown and goes to a status check.
    ///
    /// | status | class | why |
    /// |---|---|---|
    /// | 2xx | [`Final`](Self::Final) | an answer; the adapter reads its object (an unreadable 2xx body is unknown) |
    /// | 400, 401, 402, 403, 404, 405, 406, 410, 411, 413, 414, 415, 422, 431 | [`Final`](Self::Final) | refused before acting: bad request, credentials, a declined card, no such resource, a body the server will not take |
    /// | 429 with `Retry-After` | [`Retryable`](Self::Retryable) | rate limited: the server did not process it and says when to come back (RFC 6585 §4, Stripe's rate limits) |
    /// | 429 without `Retry-After`, 408, 425 | [`Unknown`](Self::Unknown) | nothing the provider documents as "not executed"; an intermediary may have timed out on a request that went through |
    /// | 409 | [`Unknown`](Self::Unknown) | Stripe's "a request with this key is in progress": the first one may commit |
    /// | any other 4xx (418, 423, 499, …) | [`Unknown`](Self::Unknown) | not documented as "not executed" |
    /// | every 5xx (500, 503 from an egress proxy, 507, 520, 524 from a CDN, …) | [`Unknown`](Self::Unknown) | a server or an intermediary failed after the request may have been acted on |
    /// | 1xx, 3xx, anything else | [`Unknown`](Self::Unknown) | not an answer this call can end on |
    ///
    /// A failure before the request left (connection refused, no such host) is
    /// [`NotSent`](Self::NotSent), decided by the transport, not by a status.
    pub fn of_answer(status: u16, retry_after: bool) -> Self {
        match status {
            200..=299 | 400..=406 | 410 | 411 | 413 | 414 | 415 | 422 | 431 => Self::Final,
            429 if retry_after => Self::Retryable,
            _ => Self::Unknown,
        }
    }

    /// [`OutcomeClass::of_answer`] for an answer whose headers are not at hand (no
    /// `Retry-After` known).
    pub fn of_status(status: u16) -> Self {
        Self::of_answer(status, false)
    }
}

/// What to do after a failed attempt: [`RetryPolicy::decide`]'s answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RetryDecision {
    /// Attempt again after this wait.
    RetryAfter(Duration),
    /// The outcome is unknown: ask the other side for the status of this attempt (by its
    /// key or stable reference) before anything else.
    CheckStatus,
    /// Stop: no further attempt.
    GiveUp(GiveUpReason),
}

/// Why [`RetryPolicy::decide`] gave up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum GiveUpReason {
    /// The answer was definitive.
    Final,
    /// `max_attempts` failures.
    AttemptsExhausted,
    /// The deadline passed, or the next wait would end after it.
    DeadlinePassed,
    /// The dependency's retry budget is spent: the dependency is failing broadly, and more
    /// retries would only add load to it.
    BudgetExhausted,
}

/// The facts of one failed attempt that [`RetryPolicy::decide`] weighs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Failure {
    /// Failed attempts so far, this one included (≥ 1).
    pub failures: u32,
    /// What the failure says about the effect.
    pub class: OutcomeClass,
    /// The wait the other side asked for (`Retry-After`, parsed by [`parse_retry_after`]).
    pub retry_after: Option<Duration>,
    /// Time since the first attempt.
    pub elapsed: Duration,
    /// `true` when the attempt timed out (it costs the budget more).
    pub timed_out: bool,
}

impl RetryPolicy {
    /// A policy for the outage rounds of a background loop (a relay, a consumer, an effect
    /// runner waiting out a dependency that is down): waits from `base` up to `cap`, and
    /// never gives up (`max_attempts` = `u32::MAX`); the rest as [`RetryPolicy::default`].
    pub fn outage(base: Duration, cap: Duration) -> Self {
        Self {
            base,
            cap,
            max_attempts: u32::MAX,
            ..Self::default()
        }
    }

    /// The largest wait after `failures` failed attempts: `min(cap, base · 2^(failures-1))`
    /// (zero for `failures == 0`). Never overflows: the factor saturates and the product
    /// is capped.
    pub fn ceiling(&self, failures: u32) -> Duration {
        if failures == 0 {
            return Duration::ZERO;
        }
        let factor = 1_u32.checked_shl(failures - 1).unwrap_or(u32::MAX);
        self.base.saturating_mul(factor).min(self.cap)
    }

    /// The wait after `failures` failed attempts, full jitter: `unit` (a uniform sample in
    /// `[0, 1)`, supplied by the caller so this type stays deterministic and I/O-free)
    /// times [`RetryPolicy::ceiling`]. Always within `[0, cap]`.
    pub fn delay(&self, failures: u32, unit: f64) -> Duration {
        let unit = if unit.is_finite() {
            unit.clamp(0.0, 1.0)
        } else {
            0.0
        };
        let ceiling = self.ceiling(failures);
        // Not `mul_f64`: through f64 seconds a ceiling near `Duration::MAX` overflows (a
        // panic), and one above 2^53 ns can round up past itself.
        Duration::try_from_secs_f64(ceiling.as_secs_f64() * unit)
            .map_or(ceiling, |d| d.min(ceiling))
    }

    /// [`RetryPolicy::delay`], but never shorter than the `Retry-After` the other side sent,
    /// itself honoured up to `retry_after_ceiling`.
    pub fn delay_honouring(
        &self,
        failures: u32,
        unit: f64,
        retry_after: Option<Duration>,
    ) -> Duration {
        let backoff = self.delay(failures, unit);
        match retry_after {
            Some(asked) => backoff.max(asked.min(self.retry_after_ceiling)),
            None => backoff,
        }
    }

    /// `true` when `failures` failed attempts exhaust the policy.
    pub fn exhausted(&self, failures: u32) -> bool {
        failures >= self.max_attempts.max(1)
    }

    /// What to do after `failure`: give up on a final answer, an exhausted attempt limit,
    /// a passed deadline or a spent `budget` (when one is given; withdrawing is the cost of
    /// the retry); check the status when the outcome is unknown; else retry after
    /// [`RetryPolicy::delay_honouring`]. `unit` is a uniform sample in `[0, 1)`.
    ///
    /// A [`CheckStatus`](RetryDecision::CheckStatus) answer withdraws nothing: the status
    /// check is not a retry of the effect. Once it says the effect is absent, the caller
    /// decides again with [`OutcomeClass::NotSent`].
    pub fn decide(
        &self,
        failure: &Failure,
        budget: Option<&RetryBudget>,
        unit: f64,
    ) -> RetryDecision {
        match failure.class {
            OutcomeClass::Final => return RetryDecision::GiveUp(GiveUpReason::Final),
            OutcomeClass::Unknown => return RetryDecision::CheckStatus,
            OutcomeClass::NotSent | OutcomeClass::Retryable => {}
        }
        if self.exhausted(failure.failures) {
            return RetryDecision::GiveUp(GiveUpReason::AttemptsExhausted);
        }
        let wait = self.delay_honouring(failure.failures, unit, failure.retry_after);
        if let Some(deadline) = self.deadline {
            if failure.elapsed.saturating_add(wait) >= deadline {
                return RetryDecision::GiveUp(GiveUpReason::DeadlinePassed);
            }
        }
        if let Some(budget) = budget {
            if !budget.try_withdraw(failure.timed_out) {
                return RetryDecision::GiveUp(GiveUpReason::BudgetExhausted);
            }
        }
        RetryDecision::RetryAfter(wait)
    }
}

/// How long to wait before probing a dependency that is unavailable again:
/// [`RetryPolicy::outage_wait`]'s answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutageWait {
    /// The wait.
    pub wait: Duration,
    /// `true` when the dependency's retry budget could not pay for this retry: the wait is
    /// then the policy's longest (its cap, or a longer `Retry-After` up to the ceiling).
    pub budget_exhausted: bool,
}

impl RetryPolicy {
    /// The wait after the `failures`-th consecutive failure (≥ 1) of a dependency that is
    /// unavailable (a broker or a database that is down, a provider that refuses or
    /// answers 429/503), decided by [`RetryPolicy::decide`] as
    /// [`OutcomeClass::NotSent`]: an outage never gives up and never counts toward an
    /// attempt limit (`max_attempts` and `deadline` are ignored), so the answer is always a
    /// wait — [`RetryPolicy::delay_honouring`] while `budget` (when given) pays for the
    /// retry, the longest wait of the policy once it does not. `unit` is a uniform sample
    /// in `[0, 1)`.
    pub fn outage_wait(
        &self,
        failures: u32,
        retry_after: Option<Duration>,
        budget: Option<&RetryBudget>,
        unit: f64,
    ) -> OutageWait {
        let policy = RetryPolicy {
            max_attempts: u32::MAX,
            deadline: None,
            ..*self
        };
        let failure = Failure {
            // Below u32::MAX: the attempt limit of `policy` is never reached.
            failures: failures.clamp(1, u32::MAX - 1),
            class: OutcomeClass::NotSent,
            retry_after,
            elapsed: Duration::ZERO,
            timed_out: false,
        };
        match policy.decide(&failure, budget, unit) {
            RetryDecision::RetryAfter(wait) => OutageWait {
                wait,
                budget_exhausted: false,
            },
            _ => OutageWait {
                wait: policy.delay_honouring(u32::MAX, 1.0, retry_after),
                budget_exhausted: true,
            },
        }
    }
}

/// A `Retry-After` value (RFC 9110 §10.2.3) as a wait from `now`: `delay-seconds`, or an
/// HTTP-date (IMF-fixdate, and the obsolete RFC 850 and asctime forms a recipient must
/// accept, §5.6.7, an rfc850-date's two-digit year read as the latest such year not more
/// than 50 years after `now`) — a date in the past is a wait of zero. `None` when the value
/// is neither.
pub fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        // Seconds beyond u64 are "very long": saturate rather than refuse.
        return Some(Duration::from_secs(value.parse().unwrap_or(u64::MAX)));
    }
    let imf = rfc850_as_imf_fixdate(value, now);
    let at = httpdate::parse_http_date(imf.as_deref().unwrap_or(value)).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

/// An rfc850-date (`Sunday, 06-Nov-94 08:49:37 GMT`) written as the IMF-fixdate of the
/// year RFC 9110 §5.6.7 reads its two digits as: the latest year with those digits not more
/// than 50 years after `now` (to the year), where httpdate would read 1970–2069 only.
/// `None` when `value` does not have the rfc850-date shape (or `now` is outside
/// 1970–9999). A weekday that is not the date's still makes the result no date.
fn rfc850_as_imf_fixdate(value: &str, now: SystemTime) -> Option<String> {
    const WEEKDAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let (weekday, rest) = value.split_once(", ")?;
    let b = rest.as_bytes();
    if !WEEKDAYS.contains(&weekday) || !rest.is_ascii() || b.len() != 22 {
        return None;
    }
    if b[2] != b'-' || b[6] != b'-' || !b[7].is_ascii_digit() || !b[8].is_ascii_digit() {
        return None;
    }
    let yy = u32::from(b[7] - b'0') * 10 + u32::from(b[8] - b'0');
    // `fmt_http_date` panics outside 1970–9999.
    let secs = now.duration_since(SystemTime::UNIX_EPOCH).ok()?.as_secs();
    if secs >= 253_402_300_800 {
        return None;
    }
    let now_year: u32 = httpdate::fmt_http_date(now).get(12..16)?.parse().ok()?;
    let latest = now_year + 50;
    let year = latest - (latest - yy) % 100;
    Some(format!(
        "{}, {} {} {year:04} {}",
        &weekday[..3],
        &rest[..2],
        &rest[3..6],
        &rest[10..]
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> RetryPolicy {
        RetryPolicy {
            base: Duration::from_millis(100),
            cap: Duration::from_secs(1),
            max_attempts: 3,
            ..RetryPolicy::default()
        }
    }

    #[test]
    fn ceiling_doubles_up_to_the_cap_and_jitter_stays_below_it() {
        let p = policy();
        assert_eq!(p.ceiling(0), Duration::ZERO);
        assert_eq!(p.ceiling(1), Duration::from_millis(100));
        assert_eq!(p.ceiling(2), Duration::from_millis(200));
        assert_eq!(p.ceiling(4), Duration::from_millis(800));
        assert_eq!(p.ceiling(5), Duration::from_secs(1));
        assert_eq!(p.ceiling(200), Duration::from_secs(1));
        assert_eq!(p.delay(2, 0.5), Duration::from_millis(100));
        assert_eq!(p.delay(2, 7.0), Duration::from_millis(200));
        assert_eq!(p.delay(2, f64::NAN), Duration::ZERO);
        assert!(!p.exhausted(2));
        assert!(p.exhausted(3));
    }

    /// 10,000 drawn delays for attempt numbers 0..=1000 (and the extremes of `u32`) lie in
    /// `[0, cap]`, with no overflow, also for a huge base and cap.
    #[test]
    fn ten_thousand_drawn_delays_for_attempts_up_to_1000_lie_within_zero_and_the_cap() {
        let policies = [
            RetryPolicy::default(),
            policy(),
            RetryPolicy {
                base: Duration::MAX,
                cap: Duration::MAX,
                ..RetryPolicy::default()
            },
            RetryPolicy {
                base: Duration::from_nanos(1),
                cap: Duration::from_secs(u64::MAX / 2),
                ..RetryPolicy::default()
            },
        ];
        // A fixed-seed xorshift: reproducible draws without a dependency.
        let mut state = 0x9E37_79B9_7F4A_7C15_u64;
        let mut unit = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 11) as f64 / (1_u64 << 53) as f64
        };
        for p in policies {
            for i in 0..10_000_u32 {
                let attempt = if i % 100 == 0 { u32::MAX - i } else { i % 1001 };
                let d = p.delay(attempt, unit());
                assert!(
                    d <= p.cap,
                    "{d:?} over the cap {:?} at attempt {attempt}",
                    p.cap
                );
                assert!(d <= p.ceiling(attempt));
            }
        }
    }

    #[test]
    fn retry_after_is_honoured_up_to_the_ceiling() {
        let p = RetryPolicy {
            retry_after_ceiling: Duration::from_secs(30),
            ..policy()
        };
        // Longer than the backoff: waited for.
        assert_eq!(
            p.delay_honouring(1, 0.0, Some(Duration::from_secs(7))),
            Duration::from_secs(7)
        );
        // Over the ceiling: the ceiling.
        assert_eq!(
            p.delay_honouring(1, 0.0, Some(Duration::from_secs(3600))),
            Duration::from_secs(30)
        );
        // Shorter than the backoff: the backoff.
        assert_eq!(
            p.delay_honouring(4, 1.0, Some(Duration::from_millis(1))),
            Duration::from_millis(800)
        );
        let failure = Failure {
            failures: 1,
            class: OutcomeClass::Retryable,
            retry_after: Some(Duration::from_secs(3600)),
            elapsed: Duration::ZERO,
            timed_out: false,
        };
        assert_eq!(
            p.decide(&failure, None, 0.5),
            RetryDecision::RetryAfter(Duration::from_secs(30))
        );
    }

    #[test]
    fn retry_after_reads_seconds_and_every_http_date_form() {
        let now = httpdate::parse_http_date("Sun, 06 Nov 1994 08:49:37 GMT").unwrap();
        assert_eq!(
            parse_retry_after("120", now),
            Some(Duration::from_secs(120))
        );
        assert_eq!(parse_retry_after(" 0 ", now), Some(Duration::ZERO));
        assert_eq!(
            parse_retry_after("99999999999999999999999", now),
            Some(Duration::from_secs(u64::MAX))
        );
        for later in [
            "Sun, 06 Nov 1994 08:50:37 GMT",
            "Sunday, 06-Nov-94 08:50:37 GMT",
            "Sun Nov  6 08:50:37 1994",
        ] {
            assert_eq!(
                parse_retry_after(later, now),
                Some(Duration::from_secs(60)),
                "{later}"
            );
        }
        assert_eq!(
            parse_retry_after("Sun, 06 Nov 1994 08:00:00 GMT", now),
            Some(Duration::ZERO)
        );
        assert_eq!(parse_retry_after("-5", now), None);
        assert_eq!(parse_retry_after("soon", now), None);
        assert_eq!(parse_retry_after("", now), None);
    }

    #[test]
    fn unknown_outcomes_check_the_status_and_final_ones_give_up() {
        let p = policy();
        let mut failure = Failure {
            failures: 1,
            class: OutcomeClass::Unknown,
            retry_after: None,
            elapsed: Duration::ZERO,
            timed_out: true,
        };
        assert_eq!(p.decide(&failure, None, 0.5), RetryDecision::CheckStatus);
        failure.class = OutcomeClass::Final;
        assert_eq!(
            p.decide(&failure, None, 0.5),
            RetryDecision::GiveUp(GiveUpReason::Final)
        );
        failure.class = OutcomeClass::NotSent;
        failure.failures = 3;
        assert_eq!(
            p.decide(&failure, None, 0.5),
            RetryDecision::GiveUp(GiveUpReason::AttemptsExhausted)
        );
        assert_eq!(OutcomeClass::of_answer(429, true), OutcomeClass::Retryable);
        assert_eq!(OutcomeClass::of_status(500), OutcomeClass::Unknown);
        assert_eq!(OutcomeClass::of_status(402), OutcomeClass::Final);
    }

    /// After the request left, only a documented "not executed" answer is a refusal: every
    /// status 0–1000, with and without `Retry-After`, is classified, and none outside the
    /// refusal list and a 429 with `Retry-After` is anything but unknown — 503, 507, 520,
    /// 524, 409, 408 and a bare 429 among them (issue 26, scenario 3).
    #[test]
    fn every_status_that_does_not_prove_nothing_happened_is_unknown() {
        let refusals = [
            400, 401, 402, 403, 404, 405, 406, 410, 411, 413, 414, 415, 422, 431,
        ];
        for status in 0..=1000_u16 {
            for retry_after in [false, true] {
                let expected = if (200..300).contains(&status) || refusals.contains(&status) {
                    OutcomeClass::Final
                } else if status == 429 && retry_after {
                    OutcomeClass::Retryable
                } else {
                    OutcomeClass::Unknown
                };
                assert_eq!(
                    OutcomeClass::of_answer(status, retry_after),
                    expected,
                    "status {status}, Retry-After {retry_after}"
                );
            }
        }
        for status in [
            409, 503, 507, 520, 524, 599, 418, 499, 301, 100, 408, 425, 429,
        ] {
            assert_eq!(OutcomeClass::of_status(status), OutcomeClass::Unknown);
        }
    }

    #[test]
    fn outage_waits_grow_never_give_up_and_take_the_cap_once_the_budget_is_spent() {
        let p = RetryPolicy {
            deadline: Some(Duration::from_secs(1)),
            ..policy()
        };
        let budget = RetryBudget::new(2 * RetryBudget::RETRY_COST);
        // Far past max_attempts (3) and the deadline: still a wait, growing with failures.
        let first = p.outage_wait(1, None, Some(&budget), 1.0);
        let fourth = p.outage_wait(4, None, Some(&budget), 1.0);
        assert_eq!(
            (first.wait, first.budget_exhausted),
            (Duration::from_millis(100), false)
        );
        assert_eq!(
            (fourth.wait, fourth.budget_exhausted),
            (Duration::from_millis(800), false)
        );
        assert_eq!(budget.available(), 0);
        let spent = p.outage_wait(1, None, Some(&budget), 0.0);
        assert_eq!((spent.wait, spent.budget_exhausted), (p.cap, true));
        let asked = p.outage_wait(1, Some(Duration::from_secs(7)), Some(&budget), 0.0);
        assert_eq!(asked.wait, Duration::from_secs(7));
        // Without a budget nothing is spent; zero failures are treated as the first.
        assert_eq!(
            p.outage_wait(0, None, None, 1.0).wait,
            Duration::from_millis(100)
        );
        assert_eq!(p.outage_wait(u32::MAX, None, None, 1.0).wait, p.cap);
    }

    #[test]
    fn no_retry_starts_that_would_end_after_the_deadline() {
        let p = RetryPolicy {
            deadline: Some(Duration::from_secs(10)),
            max_attempts: 100,
            ..policy()
        };
        let failure = |elapsed| Failure {
            failures: 2,
            class: OutcomeClass::NotSent,
            retry_after: None,
            elapsed,
            timed_out: false,
        };
        assert_eq!(
            p.decide(&failure(Duration::from_secs(9)), None, 1.0),
            RetryDecision::RetryAfter(Duration::from_millis(200))
        );
        assert_eq!(
            p.decide(&failure(Duration::from_millis(9_900)), None, 1.0),
            RetryDecision::GiveUp(GiveUpReason::DeadlinePassed)
        );
    }
}
