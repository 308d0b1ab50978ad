//! What the claim tests relay with: the recording publisher ([`Recorder`]), their events
//! ([`seq_event`]), their relay configuration ([`claim_test_config`]) and a relay that
//! claims by lease ([`lease_relay`]).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use oncely_broker::{Message, Publisher};
use oncely_core::{MessageId, RetryPolicy};
use oncely_outbox::RelayConfig;
use oncely_sql::{OutboxEvent, OutboxStore};
use tokio_util::sync::CancellationToken;

/// A recording publisher for the claim tests: keeps, per partition key, the payloads it
/// confirmed in confirmation order; fails each message with probability `fail_pct`%;
/// panics on a whole call with probability `panic_pct`% (the relay task dies with its
/// batch, which is dropped unsettled); and notes every moment two messages of one
/// partition were being published at once (across all relays sharing the recorder).
#[derive(Debug, Default)]
pub(crate) struct Recorder {
    fail_pct: u32,
    panic_pct: u32,
    /// Upper bound of a random delay per call, microseconds.
    max_delay_us: u64,
    /// Panic on the first call only.
    panic_once: std::sync::atomic::AtomicBool,
    state: std::sync::Mutex<RecorderState>,
}

#[derive(Debug, Default)]
pub(crate) struct RecorderState {
    in_flight: HashMap<String, usize>,
    /// "partition: payload overlapped payload" descriptions.
    overlaps: Vec<String>,
    /// What is being published now, per partition (for the overlap descriptions).
    current: HashMap<String, Vec<String>>,
    /// Confirmed payloads per partition, in confirmation order.
    confirmed: HashMap<String, Vec<String>>,
    /// All confirmed payloads, in confirmation order.
    pub(crate) global: Vec<String>,
    calls: usize,
}

impl Recorder {
    pub(crate) fn new(fail_pct: u32, panic_pct: u32, max_delay_us: u64) -> Self {
        Self {
            fail_pct,
            panic_pct,
            max_delay_us,
            panic_once: std::sync::atomic::AtomicBool::new(false),
            state: std::sync::Mutex::default(),
        }
    }

    /// A recorder whose first call panics.
    pub(crate) fn panicking_once(max_delay_us: u64) -> Self {
        let r = Self::new(0, 0, max_delay_us);
        r.panic_once
            .store(true, std::sync::atomic::Ordering::SeqCst);
        r
    }

    pub(crate) fn state(&self) -> std::sync::MutexGuard<'_, RecorderState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Distinct confirmed payloads.
    pub(crate) fn confirmed_distinct(&self) -> usize {
        self.state()
            .confirmed
            .values()
            .map(|v| v.iter().collect::<HashSet<_>>().len())
            .sum()
    }

    pub(crate) fn confirmed(&self) -> HashMap<String, Vec<String>> {
        self.state().confirmed.clone()
    }

    pub(crate) fn overlaps(&self) -> Vec<String> {
        self.state().overlaps.clone()
    }
}

/// Takes the batch's partitions out of the in-flight set when the publish ends (also when
/// its future is dropped).
struct InFlight<'a> {
    recorder: &'a Recorder,
    batch: &'a [Message],
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        let mut s = self.recorder.state();
        for m in self.batch {
            let payload = String::from_utf8_lossy(&m.payload).into_owned();
            if let Some(n) = s.in_flight.get_mut(&m.partition_key) {
                *n = n.saturating_sub(1);
            }
            if let Some(cur) = s.current.get_mut(&m.partition_key) {
                if let Some(i) = cur.iter().position(|p| *p == payload) {
                    cur.remove(i);
                }
            }
        }
    }
}

impl Publisher for Recorder {
    fn publish<'a>(
        &'a self,
        batch: &'a [Message],
    ) -> oncely_broker::BoxFuture<'a, Vec<Result<(), oncely_broker::PublishError>>> {
        Box::pin(async move {
            assert!(
                !self
                    .panic_once
                    .swap(false, std::sync::atomic::Ordering::SeqCst),
                "injected publisher panic (once)"
            );
            assert!(
                self.panic_pct == 0 || rand::random::<u32>() % 100 >= self.panic_pct,
                "injected publisher panic"
            );
            {
                let mut s = self.state();
                s.calls += 1;
                for m in batch {
                    let payload = String::from_utf8_lossy(&m.payload).into_owned();
                    let n = s.in_flight.entry(m.partition_key.clone()).or_default();
                    *n += 1;
                    if *n > 1 {
                        let others = s.current.get(&m.partition_key).cloned().unwrap_or_default();
                        s.overlaps
                            .push(format!("{}: {payload} while {others:?}", m.partition_key));
                    }
                    s.current
                        .entry(m.partition_key.clone())
                        .or_default()
                        .push(payload);
                }
            }
            let guard = InFlight {
                recorder: self,
                batch,
            };
            if self.max_delay_us > 0 {
                let us = rand::random::<u64>() % self.max_delay_us;
                tokio::time::sleep(Duration::from_micros(us)).await;
            }
            let mut results = Vec::with_capacity(batch.len());
            {
                let mut s = self.state();
                for m in batch {
                    if self.fail_pct > 0 && rand::random::<u32>() % 100 < self.fail_pct {
                        results.push(Err(oncely_broker::PublishError::rejected(
                            "injected failure",
                        )));
                    } else {
                        let payload = String::from_utf8_lossy(&m.payload).into_owned();
                        s.global.push(payload.clone());
                        s.confirmed
                            .entry(m.partition_key.clone())
                            .or_default()
                            .push(payload);
                        results.push(Ok(()));
                    }
                }
            }
            drop(guard);
            results
        })
    }

    fn name(&self) -> &'static str {
        "recorder"
    }
}

/// An event of partition `partition` whose payload is `partition:seq`.
pub(crate) fn seq_event(partition: &str, seq: usize) -> OutboxEvent {
    OutboxEvent::new(
        MessageId::new_random(),
        "claim-test",
        partition,
        "test.event",
        format!("{partition}:{seq}").into_bytes(),
    )
}

/// A relay configuration for the claim tests: small batches, fast retries.
pub(crate) fn claim_test_config(i: usize, keep: bool) -> RelayConfig {
    RelayConfig {
        relay_id: format!("relay-{i}"),
        batch_size: 8,
        max_in_flight_batches: 4,
        poll_interval: Duration::from_millis(20),
        retry: RetryPolicy {
            base: Duration::from_millis(1),
            cap: Duration::from_millis(20),
            max_attempts: 10_000,
            ..RetryPolicy::default()
        },
        retention: if keep {
            Duration::from_secs(3600)
        } else {
            Duration::ZERO
        },
        // Vacuums run while other relays claim and settle.
        vacuum_after_rows: 300,
        ..RelayConfig::default()
    }
}

/// A relay by lease: claim, publish to `recorder`, mark published, until `stop`.
pub(crate) async fn lease_relay(
    store: OutboxStore,
    recorder: Arc<Recorder>,
    owner: &str,
    batch: u32,
    stop: CancellationToken,
) {
    while !stop.is_cancelled() {
        let rows = store
            .claim(owner, batch, Duration::from_secs(30), oncely_core::now_ms())
            .await
            .unwrap();
        if rows.is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        }
        let ids: Vec<i64> = rows.iter().map(|r| r.id).collect();
        let messages: Vec<Message> = rows
            .into_iter()
            .map(|r| oncely_outbox::to_message(r.event))
            .collect();
        assert!(recorder.publish(&messages).await.iter().all(Result::is_ok));
        store
            .mark_published(owner, &ids, oncely_core::now_ms())
            .await
            .unwrap();
    }
}
