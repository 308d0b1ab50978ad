//! Runtime assembly for services built on oncely: what a process needs around the libraries'
//! objects, shared by the `oncely` binary and by any service that embeds the relay or a
//! consumer.
//!
//! - [`connect`] / [`connect_existing`]: a [`Database`](oncely_sql::Database) from a URL,
//!   the error naming the URL without its password ([`redact`]).
//! - [`BrokerConfig`]: which broker and how to reach it; [`BrokerConfig::publisher`] makes
//!   the relay's publisher, [`ConsumerSettings::spawn`] the consumers' subscriber,
//!   [`BrokerConfig::dead_letters`] the consumer groups' dead letters (list, requeue).
//! - [`RelaySupervisor`]: a relay task that waits out a broker down at start-up (1 s
//!   doubling to 30 s) while the outbox keeps every event; [`run_relay`] runs one until
//!   shutdown.
//! - [`ConsumerSettings`] + [`ConsumerFactory`]: an inbox consumer on the configured broker;
//!   [`run_consumer`] runs one until shutdown.
//! - [`EffectsConfig`]: the outgoing-effect providers (payments, shipping) and the effect
//!   runner's settings; [`EffectsConfig::spawn`] starts a runner, [`run_effects`] runs one
//!   until shutdown.
//! - [`spawn_reconciler`]: the periodic reconciler ([`ReconcileSchedule`]) over the
//!   configured providers.
//! - [`serve_metrics`]: `GET /metrics` in the Prometheus text format.
//! - [`shutdown_signal`]: SIGTERM or Ctrl-C, handlers installed at once.
//! - [`init_logging`]: the `tracing` subscriber, filter from `ONCELY_LOG`.
//!
//! Shutdown is injected: every `run_*` takes a future that resolves when the process should
//! stop (for a binary, [`shutdown_signal`]; for a test or an embedding service, anything).
//!
//! The relay of an embedding service, on NATS, until SIGTERM or Ctrl-C:
//!
//! ```no_run
//! # async fn relay() -> Result<(), Box<dyn std::error::Error>> {
//! use oncely_runtime::{BrokerConfig, BrokerKind, RelaySupervisor};
//!
//! let db = oncely_runtime::connect("postgres://…", &oncely_sql::DbOptions::default()).await?;
//! db.migrate().await?; // oncely's outbox, inbox and queue tables
//! let relay = RelaySupervisor {
//!     broker: BrokerConfig { kind: BrokerKind::Nats, ..BrokerConfig::default() },
//!     ..RelaySupervisor::default()
//! };
//! oncely_runtime::run_relay(&db, &relay, None, oncely_runtime::shutdown_signal()).await?;
//! # Ok(())
//! # }
//! ```
//!
//! Brokers are behind features (`rabbitmq`, `nats`, `kafka`, none by default); the SQL
//! transport is always there. `clap` derives `clap::ValueEnum` on [`BrokerKind`] and
//! [`LogFormat`].
//!
//! # Layout
//! - `db` — [`connect`], [`connect_existing`], [`redact`].
//! - `broker` — [`BrokerKind`], [`BrokerConfig`] and the publisher factory.
//! - `relay` — [`RelaySupervisor`], [`run_relay`].
//! - `consumer` — [`ConsumerSettings`], [`ConsumerFactory`], [`run_consumer`].
//! - `effects` — [`EffectsConfig`], [`run_effects`].
//! - `reconcile` — [`ReconcileSchedule`], [`spawn_reconciler`].
//! - `metrics` — [`MetricsEndpoint`], [`serve_metrics`].
//! - `signal` — [`shutdown_signal`].
//! - `logging` — [`LogFormat`], [`init_logging`], [`DEFAULT_LOG_FILTER`].
//! - `error` — [`RuntimeError`].

mod broker;
mod consumer;
mod db;
mod effects;
mod error;
mod logging;
mod metrics;
mod reconcile;
mod relay;
mod signal;

pub use broker::{BrokerConfig, BrokerKind};
pub use consumer::{run_consumer, ConsumerFactory, ConsumerSettings};
pub use db::{connect, connect_existing, redact};
pub use effects::{run_effects, EffectsConfig};
pub use error::{BoxError, RuntimeError};
pub use logging::{init_logging, LogFormat, DEFAULT_LOG_FILTER};
pub use metrics::{serve_metrics, MetricsEndpoint};
pub use reconcile::{spawn_reconciler, ReconcileSchedule};
pub use relay::{run_relay, RelaySupervisor};
pub use signal::shutdown_signal;
