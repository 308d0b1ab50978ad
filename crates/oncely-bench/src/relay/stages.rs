//! Where the latency run's commit-to-publish time goes, event by event: the writer's
//! transaction, the wait from its commit to the relay's publish call (notification, claim
//! and the claim's commit), and the broker's confirmation. A CPU profile cannot place a
//! tail (benchmarks.md, "What bounds the misses"); these stamps can, for the very events
//! that make it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use futures_util::future::BoxFuture;
use oncely_broker::{Message, PublishError, Publisher};
use oncely_core::MessageId;

use crate::stats::quantile;

/// Microseconds since the run's origin: one monotonic clock for the writers and the
/// publisher, all in this process.
#[derive(Debug, Clone, Copy)]
pub(super) struct Clock(Instant);

impl Clock {
    pub(super) fn start() -> Self {
        Self(Instant::now())
    }

    /// µs since [`Clock::start`].
    pub(super) fn now(self) -> u64 {
        u64::try_from(self.0.elapsed().as_micros()).unwrap_or(u64::MAX)
    }
}

/// The relay's publisher, stamping each message's publish call and the return of its
/// batch's confirmation (µs on [`Clock`]); publishing itself is passed through unchanged.
#[derive(Debug)]
pub(super) struct Stamped {
    inner: Arc<dyn Publisher>,
    clock: Clock,
    stamps: Mutex<HashMap<MessageId, (u64, u64)>>,
}

impl Stamped {
    pub(super) fn new(inner: Arc<dyn Publisher>, clock: Clock) -> Self {
        Self {
            inner,
            clock,
            stamps: Mutex::new(HashMap::new()),
        }
    }

    /// (publish call, confirmation) of `id`, µs; `None` if it was never published.
    fn stamps(&self, id: MessageId) -> Option<(u64, u64)> {
        self.stamps
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&id)
            .copied()
    }
}

impl Publisher for Stamped {
    fn publish<'a>(&'a self, batch: &'a [Message]) -> BoxFuture<'a, Vec<Result<(), PublishError>>> {
        Box::pin(async move {
            let called = self.clock.now();
            let results = self.inner.publish(batch).await;
            let confirmed = self.clock.now();
            let mut stamps = self
                .stamps
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            for m in batch {
                // The first publish counts: a retried message's wait started there.
                stamps.entry(m.id).or_insert((called, confirmed));
            }
            results
        })
    }

    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn close(&self) -> BoxFuture<'_, ()> {
        self.inner.close()
    }
}

/// One event's writer stamps, µs on [`Clock`]: before `BEGIN`, after `COMMIT` returned.
#[derive(Debug, Clone, Copy)]
pub(super) struct Written {
    pub(super) begun: u64,
    pub(super) committed: u64,
}

/// The three stages of every event, µs, each sorted ascending.
#[derive(Debug, Default)]
pub(super) struct Stages {
    /// `BEGIN` to `COMMIT` returned, in the writer.
    transaction: Vec<u64>,
    /// `COMMIT` returned to the relay's publish call (0 when the relay was faster than the
    /// writer's return).
    to_publish: Vec<u64>,
    /// Publish call to the batch's confirmation.
    confirm: Vec<u64>,
    /// (to_publish, confirm) of the slowest 1% of the events by their sum, slowest first.
    tail: Vec<(u64, u64)>,
}

impl Stages {
    /// Joins the writers' stamps with the publisher's; events never published are left out.
    pub(super) fn collect(written: &HashMap<MessageId, Written>, publisher: &Stamped) -> Self {
        let mut s = Self::default();
        let mut both = Vec::with_capacity(written.len());
        for (id, w) in written {
            let Some((called, confirmed)) = publisher.stamps(*id) else {
                continue;
            };
            let to_publish = called.saturating_sub(w.committed);
            let confirm = confirmed - called;
            s.transaction.push(w.committed - w.begun);
            s.to_publish.push(to_publish);
            s.confirm.push(confirm);
            both.push((to_publish, confirm));
        }
        for v in [&mut s.transaction, &mut s.to_publish, &mut s.confirm] {
            v.sort_unstable();
        }
        // The slowest 1% by rank (at least one event), slowest first.
        both.sort_unstable_by_key(|(a, b)| std::cmp::Reverse(a + b));
        both.truncate(both.len().div_ceil(100));
        s.tail = both;
        s
    }

    /// The lines the relay bench prints under its commit-to-publish figure.
    pub(super) fn lines(&self, broker: &str) -> Vec<String> {
        let ms = |v: &[u64], q: f64| quantile(v, q).unwrap_or(0) as f64 / 1000.0;
        let row = |name: &str, v: &[u64]| {
            format!(
                "{broker:>8}:   {name:<28} p50 {:>6.2} ms, p99 {:>6.2} ms, max {:>7.2} ms",
                ms(v, 0.5),
                ms(v, 0.99),
                ms(v, 1.0)
            )
        };
        let mut to_publish: Vec<u64> = self.tail.iter().map(|t| t.0).collect();
        let mut confirm: Vec<u64> = self.tail.iter().map(|t| t.1).collect();
        to_publish.sort_unstable();
        confirm.sort_unstable();
        vec![
            row("writer's transaction", &self.transaction),
            row("commit → relay's publish call", &self.to_publish),
            row("publish call → confirmation", &self.confirm),
            format!(
                "{broker:>8}:   the slowest 1% ({} events): commit → publish call median {:.2} ms, \
                 publish call → confirmation median {:.2} ms",
                self.tail.len(),
                ms(&to_publish, 0.5),
                ms(&confirm, 0.5)
            ),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tail_is_the_slowest_one_percent() {
        let clock = Clock::start();
        let publisher = Stamped::new(Arc::new(NoBroker), clock);
        let mut written = HashMap::new();
        for k in 0..100_u64 {
            let id = MessageId::new_random();
            written.insert(
                id,
                Written {
                    begun: 0,
                    committed: 10,
                },
            );
            // Event 99 waits 5,000 µs for its publish call; the others 100.
            let called = if k == 99 { 5_010 } else { 110 };
            publisher
                .stamps
                .lock()
                .unwrap()
                .insert(id, (called, called + 50));
        }
        let s = Stages::collect(&written, &publisher);
        assert_eq!(s.tail, vec![(5_000, 50)]);
        assert_eq!(quantile(&s.to_publish, 0.5), Some(100));
        assert!(
            s.lines("x")[3].contains("median 5.00 ms"),
            "{:?}",
            s.lines("x")
        );
    }

    #[derive(Debug)]
    struct NoBroker;

    impl Publisher for NoBroker {
        fn publish<'a>(
            &'a self,
            batch: &'a [Message],
        ) -> BoxFuture<'a, Vec<Result<(), PublishError>>> {
            Box::pin(async move { batch.iter().map(|_| Ok(())).collect() })
        }

        fn name(&self) -> &'static str {
            "none"
        }
    }
}
