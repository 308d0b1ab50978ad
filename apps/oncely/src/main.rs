//! The `oncely` binary: the operator's tool for any service that uses oncely's tables —
//! argument parsing and wiring over the libraries (the runtime assembly is
//! `oncely-runtime`, the shared argument groups `oncely-cli`). It depends on no app: an
//! operator's decision is recorded in the store, and the service's own runner continues it
//! with the service's own configuration. The reference order service is its own binary,
//! `orders` (`orders serve`, `orders consume …`, `orders import`, `orders effects run`).
//!
//! - `oncely migrate` — applies oncely's embedded migrations and exits.
//! - `oncely relay` — the outbox relay alone.
//! - `oncely outbox stats|dead list|dead requeue` — outbox operator commands.
//! - `oncely inbox dead list|requeue` — a consumer group's dead letters on any broker.
//! - `oncely consume --deliver-to URL` — a consumer group's messages POSTed to a service in
//!   any language, signed as Standard Webhooks (logic in `oncely-delivery`).
//! - `oncely effects list|show|retry|resolve` — outgoing effects, audited operator actions.
//! - `oncely saga list|show|retry` — sagas across tenants, one with its step log and
//!   evidence, the audited retry of a parked step (logic in `oncely-saga`).
//! - `oncely idempotency list` — idempotency records, e.g. the multi-phase ones left
//!   `processing` or `unknown`.
//! - `oncely reconcile [resolve]` — a provider's records against the effects over a window,
//!   and the audited resolution of a discrepancy (logic in `oncely-effects`).
//! - `oncely verify` — the idempotency acceptance checks against any HTTP endpoint
//!   (logic in `oncely-verify`).
//! - `oncely sim payments|shipping` — a provider simulator (logic in `oncely-sim`).
//! - `oncely gateway` — an idempotency gateway in front of a service you cannot change
//!   (logic in `oncely-gateway`).
//!
//! The benchmarks are their own binary: `cargo run --release -p oncely-bench -- intake|relay|inbox …`.

mod consume_cmd;
mod effects_cmd;
mod gateway_cmd;
mod idempotency_cmd;
mod inbox_cmd;
mod outbox_cmd;
mod saga_cmd;
mod sim_cmd;
mod verify_cmd;

use std::net::SocketAddr;

use clap::{Args, Subcommand};
use oncely_cli::{DbArgs, RelayArgs};
use oncely_runtime::{redact, shutdown_signal, MetricsEndpoint};

#[derive(Debug, Subcommand)]
enum Command {
    /// Apply oncely's embedded migrations and exit.
    Migrate(DbArgs),
    /// Run the outbox relay alone (publishes outbox events to the broker).
    Relay(RelayCmdArgs),
    /// Outbox operator commands.
    Outbox(OperatorArgs<outbox_cmd::OutboxCommand>),
    /// Inbox consumer operator commands: dead letters on the broker `--broker` names.
    Inbox(OperatorArgs<inbox_cmd::InboxCommand>),
    /// Deliver a consumer group's messages to an HTTP endpoint (any language), signed as
    /// Standard Webhooks; an unavailable receiver is retried, a refused message is dead.
    Consume(consume_cmd::ConsumeArgs),
    /// Outgoing effects: list, show with evidence, retry, resolve (audited).
    Effects(OperatorArgs<effects_cmd::EffectsCommand>),
    /// Sagas: list, show with steps and evidence, retry a parked step (audited).
    Saga(OperatorArgs<saga_cmd::SagaCommand>),
    /// Idempotency records: list them, e.g. the multi-phase ones left `processing` or
    /// `unknown`.
    Idempotency(OperatorArgs<idempotency_cmd::IdempotencyCommand>),
    /// Reconcile a provider's records with the effects over a window; resolve a
    /// discrepancy (audited).
    Reconcile(oncely_cli::ReconcileArgs),
    /// Check that an HTTP endpoint is idempotent under retries (key handling, S1-S4, scope).
    Verify(verify_cmd::VerifyArgs),
    /// Run a provider simulator (Stripe v1 subset or keyless shipping) with fault injection.
    Sim(sim_cmd::SimArgs),
    /// Run an idempotency gateway in front of an HTTP service (keys, replays, unknown
    /// outcomes on the routes given; everything else passes through).
    Gateway(gateway_cmd::GatewayArgs),
}

/// An operator command group: the database and the group's subcommand.
#[derive(Debug, Args)]
struct OperatorArgs<C: Subcommand> {
    #[command(flatten)]
    db: DbArgs,
    #[command(subcommand)]
    command: C,
}

/// How a list command prints (`--limit`, `--json`).
#[derive(Debug, Args)]
struct ListArgs {
    /// Most rows to print.
    #[arg(long, default_value_t = 100)]
    limit: u32,
    /// One JSON object per line instead of a table.
    #[arg(long)]
    json: bool,
}

impl ListArgs {
    /// Prints `rows`: each as its `json` object, one a line, or `header` and each row's
    /// tab-separated `line`.
    fn print<T>(
        &self,
        rows: &[T],
        json: impl Fn(&T) -> serde_json::Value,
        header: &str,
        line: impl Fn(&T) -> String,
    ) {
        if !self.json {
            println!("{header}");
        }
        for r in rows {
            if self.json {
                println!("{}", json(r));
            } else {
                println!("{}", line(r));
            }
        }
    }
}

/// `text` on one table cell: tabs and line breaks as spaces.
fn cell(text: Option<&str>) -> String {
    text.unwrap_or_default().replace(['\t', '\n', '\r'], " ")
}

#[derive(Debug, Args)]
struct RelayCmdArgs {
    #[command(flatten)]
    db: DbArgs,
    #[command(flatten)]
    relay: RelayArgs,
    /// Serve the relay's metrics on `GET /metrics` at this address (e.g. 127.0.0.1:9464).
    #[arg(long, env = "ONCELY_METRICS_LISTEN")]
    metrics_listen: Option<SocketAddr>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = oncely_cli::Cli::<Command>::start(
        "oncely",
        "One business operation, one business effect — however often it is delivered.",
    );
    match cli.command {
        Command::Migrate(args) => {
            args.connect_oncely().await?;
            tracing::info!(database = %redact(&args.database_url), "migrations applied");
            Ok(())
        }
        Command::Relay(args) => {
            args.db.require_pool(&[oncely_cli::PoolUser::Relay]);
            let db = args.db.connect_oncely().await?;
            let metrics = args.metrics_listen.map(|listen| MetricsEndpoint {
                listen,
                handle: oncely_cli::metrics_handle(),
            });
            let relay = args.relay.supervisor();
            Ok(oncely_runtime::run_relay(&db, &relay, metrics, shutdown_signal()).await?)
        }
        Command::Outbox(args) => {
            outbox_cmd::outbox(args.db.connect_existing().await?, args.command).await
        }
        Command::Inbox(args) => {
            let broker = args.command.broker().config();
            // Only the SQL transport keeps its dead letters in the database.
            let db = match broker.kind {
                oncely_runtime::BrokerKind::Sql => Some(args.db.connect_existing().await?),
                _ => None,
            };
            inbox_cmd::inbox(broker.dead_letters(db.as_ref())?, args.command).await
        }
        Command::Consume(args) => consume_cmd::run(args).await,
        Command::Effects(args) => {
            effects_cmd::effects(args.db.connect_existing().await?, args.command).await
        }
        Command::Saga(args) => {
            saga_cmd::saga(args.db.connect_existing().await?, args.command).await
        }
        Command::Idempotency(args) => {
            idempotency_cmd::idempotency(args.db.connect_existing().await?, args.command).await
        }
        Command::Reconcile(args) => {
            oncely_cli::reconcile(args, |_| oncely_cli::Service::default()).await
        }
        Command::Verify(args) => verify_cmd::run(&args).await,
        Command::Sim(args) => sim_cmd::run(args, shutdown_signal()).await,
        Command::Gateway(args) => gateway_cmd::run(args).await,
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory as _;

    #[test]
    fn the_command_line_is_consistent() {
        oncely_cli::Cli::<super::Command>::command().debug_assert();
    }

    #[test]
    fn the_two_simulators_default_to_ports_of_their_own() {
        use super::sim_cmd::SimApi;
        assert_ne!(
            SimApi::Payments.default_listen(),
            SimApi::Shipping.default_listen()
        );
    }
}
