//! `oncely-bench`: the benchmark programs, out of the shipped `oncely` binary so that it
//! links neither the test kit nor the raw broker clients the baselines use. Each prints its
//! figure beside a baseline measured in the same run, as a ratio, so that a
//! loaded machine moves both (docs/DESIGN.md "Measuring").
//!
//! Run with `cargo run --release -p oncely-bench -- <intake|relay|inbox|saga|effects|gateway|year|chain> …` (these were
//! `oncely bench …`; the subcommands and flags are unchanged).
//!
//! Layout:
//! - `intake` — `oncely-bench intake`: creates/s through the idempotency layer vs the bare
//!   handler, and replays/s.
//! - `relay` — `oncely-bench relay`: relay events/s beside the raw broker client with the
//!   same confirmation window, and commit-to-publish latency.
//! - `inbox` — `oncely-bench inbox`: consumed messages/s through the inbox vs the bare
//!   handler.
//! - `saga` — `oncely-bench saga`: ms per durable saga step p50/p99 vs the same steps in
//!   memory.
//! - `effects` — `oncely-bench effects`: charges/s driven to `succeeded` by the effect
//!   runner vs raw HTTP calls to the payments simulator at the same concurrency.
//! - `year` — `oncely-bench year`: intake on preloaded tables (10M idempotency records, 10M
//!   published outbox rows, 5M inbox rows) beside the empty tables, the inbox consumer on
//!   the full inbox beside the empty one, and each table's retention sweep under intake.
//! - `chain` — `oncely-bench chain`: orders/s from `POST /v1/orders` to the invoice
//!   (serve → outbox → relay → broker → `billing`), beside the intake alone, and scaled out.
//! - `db` — the fresh database the `inbox` and `effects` benchmarks run on.
//! - `stats` — the median of rounds and the latency quantile every benchmark prints.

mod chain;
mod db;
mod effects;
mod gateway;
mod inbox;
mod intake;
mod relay;
mod saga;
mod stats;
mod year;

use clap::{Parser, Subcommand};
use oncely_runtime::LogFormat;

#[derive(Debug, Parser)]
#[command(name = "oncely-bench", version, about = "oncely's benchmarks.")]
struct Cli {
    /// Log format.
    #[arg(long, env = "ONCELY_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: BenchCommand,
}

/// Benchmarks.
#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// Order intake: creates/s through the idempotency layer vs the same handler without
    /// it, and replays/s.
    Intake(intake::IntakeArgs),
    /// Outbox relay: events/s to RabbitMQ and NATS beside the raw client with the same
    /// confirmation window, and commit-to-publish latency p50/p99 at a steady rate.
    Relay(relay::RelayBenchArgs),
    /// Inbox consumer: consumed messages/s through the inbox (`billing`) beside the same
    /// handler acknowledging without the inbox.
    Inbox(inbox::InboxBenchArgs),
    /// Saga orchestrator: ms per durable saga step p50/p99 beside the same steps in memory.
    Saga(saga::SagaBenchArgs),
    /// Effect runner: charges/s driven to `succeeded` through the runner (claim, call,
    /// settle with evidence) beside the same charges as raw HTTP calls to the payments
    /// simulator, at the same concurrency.
    Effects(effects::EffectsBenchArgs),
    /// Gateway: requests/s through `oncely gateway` (new keys, and replays) beside the same
    /// requests sent directly to the same upstream.
    Gateway(gateway::GatewayBenchArgs),
    /// A year of traffic: creates/s on tables of a year's size (idempotency, published
    /// outbox, inbox) beside the empty tables, the inbox consumer on the full inbox, and
    /// intake p99 while each table's retention sweep deletes its expired rows.
    Year(year::YearArgs),
    /// The whole chain: orders/s from `POST /v1/orders` to the invoice written by the
    /// `billing` consumer (relay and broker between), beside the intake alone, and with
    /// several `serve`s and relays on one database.
    Chain(chain::ChainBenchArgs),
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    oncely_runtime::init_logging(cli.log_format);
    match cli.command {
        BenchCommand::Intake(args) => intake::run(args).await,
        BenchCommand::Relay(args) => relay::run(args).await,
        BenchCommand::Inbox(args) => inbox::run(args).await,
        BenchCommand::Saga(args) => saga::run(args).await,
        BenchCommand::Effects(args) => effects::run(args).await,
        BenchCommand::Gateway(args) => gateway::run(args).await,
        BenchCommand::Year(args) => year::run(args).await,
        BenchCommand::Chain(args) => chain::run(args).await,
    }
}
