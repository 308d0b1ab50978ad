use std::sync::atomic::{AtomicU32, Ordering};

/// A retry budget per dependency (one provider, one broker), on the token-bucket model of
/// the AWS SDKs' "standard" retry mode: the bucket starts full; every retry withdraws
/// tokens ([`RETRY_COST`](Self::RETRY_COST), or
/// [`TIMEOUT_RETRY_COST`](Self::TIMEOUT_RETRY_COST) after a timeout, which costs the
/// dependency more); a success deposits ([`NO_RETRY_INCREMENT`](Self::NO_RETRY_INCREMENT)
/// for a first-attempt success, the withdrawn cost back for a success after a retry). When
/// the bucket cannot pay for a retry, the retry does not happen: a dependency that fails
/// broadly is not hammered by every caller's retries at once, and retries resume as
/// successes refill the bucket.
///
/// Shared by reference (`Arc`) between every task that calls the dependency; lock-free.
#[derive(Debug)]
pub struct RetryBudget {
    tokens: AtomicU32,
    capacity: u32,
}

impl RetryBudget {
    /// Tokens of a full bucket in the AWS SDKs (`INITIAL_RETRY_TOKENS`): 500.
    pub const DEFAULT_CAPACITY: u32 = 500;
    /// Tokens one retry costs (`RETRY_COST`): 5.
    pub const RETRY_COST: u32 = 5;
    /// Tokens one retry after a timeout costs (`TIMEOUT_RETRY_COST`): 10.
    pub const TIMEOUT_RETRY_COST: u32 = 10;
    /// Tokens a first-attempt success deposits (`NO_RETRY_INCREMENT`): 1.
    pub const NO_RETRY_INCREMENT: u32 = 1;

    /// A full bucket of `capacity` tokens.
    pub fn new(capacity: u32) -> Self {
        Self {
            tokens: AtomicU32::new(capacity),
            capacity,
        }
    }

    /// Tokens left.
    pub fn available(&self) -> u32 {
        self.tokens.load(Ordering::Relaxed)
    }

    /// The cost of a retry after a failure that did (`timed_out`) or did not time out.
    pub fn cost(timed_out: bool) -> u32 {
        if timed_out {
            Self::TIMEOUT_RETRY_COST
        } else {
            Self::RETRY_COST
        }
    }

    /// Withdraws the cost of one retry; `false` (and nothing withdrawn) when the bucket
    /// cannot pay it.
    pub fn try_withdraw(&self, timed_out: bool) -> bool {
        let cost = Self::cost(timed_out);
        self.tokens
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| t.checked_sub(cost))
            .is_ok()
    }

    /// Records a success: `retried` is `None` for a first-attempt success, or whether the
    /// retry that succeeded followed a timeout (its cost is refunded). Never above the
    /// capacity.
    pub fn on_success(&self, retried: Option<bool>) {
        let deposit = retried.map_or(Self::NO_RETRY_INCREMENT, Self::cost);
        let capacity = self.capacity;
        // fetch_update's closure never fails here: the result is always Ok.
        let _ = self
            .tokens
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| {
                Some(t.saturating_add(deposit).min(capacity))
            });
    }
}

impl Default for RetryBudget {
    fn default() -> Self {
        Self::new(Self::DEFAULT_CAPACITY)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::{Failure, GiveUpReason, OutcomeClass, RetryDecision, RetryPolicy};

    fn retry(policy: &RetryPolicy, budget: &RetryBudget, timed_out: bool) -> RetryDecision {
        let failure = Failure {
            failures: 1,
            class: OutcomeClass::NotSent,
            retry_after: None,
            elapsed: Duration::ZERO,
            timed_out,
        };
        policy.decide(&failure, Some(budget), 0.5)
    }

    /// A provider outage: every call fails, so every caller wants to retry. The budget pays
    /// for 500 / 5 = 100 retries, then stops them (while single first attempts still go
    /// out); when the provider is back, successes refill it and retries resume.
    #[test]
    fn the_budget_stops_retries_during_an_outage_and_recovers_after_it() {
        let policy = RetryPolicy::default();
        let budget = RetryBudget::default();
        let mut allowed = 0;
        for _ in 0..1_000 {
            match retry(&policy, &budget, false) {
                RetryDecision::RetryAfter(_) => allowed += 1,
                RetryDecision::GiveUp(GiveUpReason::BudgetExhausted) => {}
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(allowed, 100, "the outage gets 100 retries, not 1,000");
        assert_eq!(budget.available(), 0);
        // Timeouts cost double: none fits an empty bucket either.
        assert_eq!(
            retry(&policy, &budget, true),
            RetryDecision::GiveUp(GiveUpReason::BudgetExhausted)
        );
        // Back up: four first-attempt successes are not yet enough for a retry...
        for _ in 0..4 {
            budget.on_success(None);
        }
        assert_eq!(
            retry(&policy, &budget, false),
            RetryDecision::GiveUp(GiveUpReason::BudgetExhausted)
        );
        // ... the fifth is, and a retry that succeeds gets its cost back.
        budget.on_success(None);
        assert!(matches!(
            retry(&policy, &budget, false),
            RetryDecision::RetryAfter(_)
        ));
        budget.on_success(Some(false));
        assert_eq!(budget.available(), 5);
        // A long healthy run refills the bucket to its capacity, not beyond.
        for _ in 0..10_000 {
            budget.on_success(None);
        }
        assert_eq!(budget.available(), RetryBudget::DEFAULT_CAPACITY);
    }

    #[test]
    fn concurrent_withdrawals_never_overdraw_the_bucket() {
        let budget = std::sync::Arc::new(RetryBudget::new(1_000));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let b = budget.clone();
                std::thread::spawn(move || (0..1_000).filter(|_| b.try_withdraw(false)).count())
            })
            .collect();
        let granted: usize = threads.into_iter().map(|t| t.join().unwrap()).sum();
        assert_eq!(granted, 200);
        assert_eq!(budget.available(), 0);
    }
}
