//! The outbox relay: moves events from the transactional outbox (`oncely_outbox`, written by
//! [`oncely_sql::OutboxStore::enqueue`] in the business transaction) to a broker
//! ([`oncely_broker::Publisher`]), with confirmation, retries and per-partition order.
//!
//! # Layout
//! - `relay` — [`Relay`], [`RelayConfig`], [`RoundReport`], [`RelayError`], [`to_message`],
//!   [`published_sweep`]: claim → publish → mark; LISTEN/NOTIFY wake-up on PostgreSQL with a polling fallback; backoff with full
//!   jitter; the gauges and the retention of published rows.
//!   A folder: `drain` (concurrent batches, each claim skipping the id ranges the others
//!   hold), `settle` (publish a batch, settle each row), `background` (the service loop
//!   with its stats and retention loops).
//! - [`metrics`] — the metric names it records and histogram buckets for them.

pub mod metrics;
mod relay;

pub use relay::{published_sweep, to_message, Relay, RelayConfig, RelayError, RoundReport};
