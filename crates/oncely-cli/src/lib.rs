//! The command-line front of oncely's libraries, shared by the `oncely` binary (the tool for
//! any service using oncely's tables) and a service's own binary (the reference order
//! service's `orders`): the argument groups every command line needs, each turned into its
//! library's configuration, and the generic reconciliation command. Binaries stay thin:
//! they choose commands and wire these to their own code.
//!
//! # Layout
//! - `db` — [`DbArgs`]: the database URL and pool settings, and the three ways to connect
//!   (unmigrated, with oncely's migrations, an existing database); [`PoolUser`], what a
//!   command runs on its pool, so a pool too small is refused at start.
//! - `broker` — [`BrokerArgs`] (which broker and how to reach it) and [`RelayArgs`] (the
//!   outbox relay's settings, a [`oncely_runtime::RelaySupervisor`]).
//! - `consumer` — [`ConsumerArgs`]: an inbox consumer's settings.
//! - `command` — [`Cli`]: a binary's command line, its [`LogArgs`] and its subcommands.
//! - `http` — [`HttpLimitArgs`]: the slow-client and connection limits of a command that
//!   serves HTTP, an [`oncely_http::HttpLimits`].
//! - `listen` — [`bind`]: a command's listen address, a port in use refused in words.
//! - `metrics` — [`metrics_handle`]: the process-wide Prometheus recorder.
//! - `providers` — [`ProviderArgs`]: the payments and shipping providers and the effect
//!   runner's settings, an [`oncely_runtime::EffectsConfig`].
//! - `reconcile` — [`ReconcileArgs`] and [`reconcile`]: a reconciliation run or the
//!   resolution of a discrepancy, with what a service adds ([`Service`]).

mod broker;
mod command;
mod consumer;
mod db;
mod http;
mod listen;
mod metrics;
mod providers;
mod reconcile;

pub use broker::{BrokerArgs, RelayArgs};
pub use command::{Cli, LogArgs};
pub use consumer::{ConsumerArgs, DEFAULT_CONSUMER_TOPIC};
pub use db::{DbArgs, PoolUser};
pub use http::HttpLimitArgs;
pub use listen::bind;
pub use metrics::metrics_handle;
pub use providers::ProviderArgs;
pub use reconcile::{
    reconcile, Action, ProviderName, ReconcileArgs, ReconcileCommand, RunArgs, Service,
    EXIT_CANNOT_RUN, EXIT_OPEN_DISCREPANCIES,
};
