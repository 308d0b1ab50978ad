//! The `orders` binary's commands: the reference order service and the workers that run
//! its flows, each with the service's own configuration (its events topic, its handlers,
//! its saga timeouts). The operator commands for oncely's tables are the `oncely` binary's;
//! an operator's decision recorded there is continued by this service's runner.
//!
//! - `orders dev` — the whole system in one process on a fresh SQLite file, with both
//!   provider simulators, a key for tenant `demo` and five things to try.
//! - `orders serve` — the service (SQLite by default), with the relay, its consumers, the
//!   effect runner and the periodic reconciler in-process as configured.
//! - `orders migrate` — oncely's and the service's migrations, then exits.
//! - `orders consume billing|shipping|fulfilment` — one of its inbox consumers alone.
//! - `orders import FILE --tenant T` — the manual fallback: NDJSON order bodies through the
//!   service's own rules.
//! - `orders effects run` — the effect runner alone, with the service's handler
//!   ([`crate::OrderEffects`], or the fulfilment saga's orchestrator).
//! - `orders reconcile [resolve]` — reconciliation with the payments endpoint's charges as
//!   local intents ([`crate::PaymentsSource`]) and completions through the service's
//!   handler.
//! - `orders show ID --tenant T [--json]` — one order's whole chain ([`crate::order_chain`]).

mod consume;
mod dev;
mod effects;
mod import;
mod serve;
mod show;

use anyhow::Context as _;
use clap::{Args, Subcommand};
use oncely_cli::DbArgs;
use oncely_runtime::{redact, MetricsEndpoint};
use oncely_sql::Database;

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the whole system in one process for a first look: the service on a fresh SQLite
    /// file with its workers and console, both provider simulators, a key for tenant
    /// `demo`, and five things to try.
    Dev(dev::DevArgs),
    /// Run the order service.
    Serve(Box<serve::ServeArgs>),
    /// Apply oncely's and the order service's migrations and exit.
    Migrate(DbArgs),
    /// Run one of the service's inbox consumers alone (from the broker `--broker` names).
    Consume(consume::ConsumeArgs),
    /// Import an NDJSON file of order bodies (the manual fallback): each line created,
    /// existing, conflict or invalid. Exit status 1 when any line was not imported.
    Import(import::ImportArgs),
    /// The effect runner alone, with the service's handler.
    Effects(effects::EffectsArgs),
    /// Reconcile a provider's records with the local intents (the effects and the payments
    /// endpoint's charges) over a window; resolve a discrepancy (audited).
    Reconcile(ServiceReconcileArgs),
    /// Print one order's whole chain (key, order, events, deliveries, invoice, effects with
    /// their evidence, saga) as a timeline; `--json` for the same as JSON.
    Show(show::ShowArgs),
}

/// `orders reconcile`: oncely's, with the service's events topic.
#[derive(Debug, Args)]
struct ServiceReconcileArgs {
    #[command(flatten)]
    reconcile: oncely_cli::ReconcileArgs,
    /// Topic of the service's events (`invoice.paid` when an unknown charge is completed);
    /// the service's `--events-topic`.
    #[arg(long, env = "ONCELY_EVENTS_TOPIC", default_value = crate::ORDERS_TOPIC)]
    events_topic: String,
}

/// Runs the `orders` command line of this process.
///
/// # Errors
/// The command's.
pub async fn run() -> anyhow::Result<()> {
    let cli = oncely_cli::Cli::<Command>::start(
        "orders",
        "The reference order service on oncely: serve, its consumers, import, its effect runner.",
    );
    match cli.command {
        Command::Dev(args) => dev::dev(args).await,
        Command::Serve(args) => serve::serve(*args).await,
        Command::Migrate(args) => {
            connect(&args).await?;
            tracing::info!(database = %redact(&args.database_url), "migrations applied");
            Ok(())
        }
        Command::Consume(args) => consume::consume(args).await,
        Command::Import(args) => import::run(args).await,
        Command::Effects(args) => effects::effects(args).await,
        Command::Reconcile(args) => {
            let topic = args.events_topic;
            oncely_cli::reconcile(args.reconcile, |db| service(db, &topic)).await
        }
        Command::Show(args) => show::run(args).await,
    }
}

/// What the service adds to a reconciliation: its handler (events to `events_topic`) and
/// the payments endpoint's charges.
fn service(db: &Database, events_topic: &str) -> oncely_cli::Service {
    oncely_cli::Service {
        handler: Some(crate::resolution_handler(db.clone(), events_topic)),
        sources: vec![std::sync::Arc::new(crate::PaymentsSource::new(db.clone()))],
    }
}

/// Connects and applies oncely's and the order service's migrations.
async fn connect(db: &DbArgs) -> anyhow::Result<Database> {
    let db = db.connect().await?;
    crate::migrate(&db).await.context("applying migrations")?;
    Ok(db)
}

/// `GET /metrics` on `listen`, with the order service's recorder (installed on first use).
fn metrics_endpoint(listen: Option<std::net::SocketAddr>) -> Option<MetricsEndpoint> {
    listen.map(|listen| MetricsEndpoint {
        listen,
        handle: crate::metrics_handle(),
    })
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory as _;

    #[test]
    fn the_command_line_is_consistent() {
        oncely_cli::Cli::<super::Command>::command().debug_assert();
    }

    /// `serve --help` opens with what a first start needs (`--api-keys`, `--listen`), then
    /// groups every other flag under a heading, in this order.
    #[test]
    fn serve_help_puts_the_needed_flags_first_and_groups_the_rest() {
        let mut cli = oncely_cli::Cli::<super::Command>::command();
        let help = cli
            .find_subcommand_mut("serve")
            .expect("a serve command")
            .render_help()
            .to_string();
        let at = |needle: &str| {
            help.find(needle)
                .unwrap_or_else(|| panic!("{needle:?} not in:\n{help}"))
        };
        let headings = [
            "Options:",
            "Database:",
            "Outbox relay:",
            "Consumers:",
            "Providers and effects:",
            "Reconciliation:",
            "Idempotency:",
            "HTTP limits:",
        ];
        let places: Vec<usize> = headings.iter().map(|h| at(h)).collect();
        assert!(places.windows(2).all(|w| w[0] < w[1]), "{help}");
        assert!(at("--api-keys") < at("--listen") && at("--listen") < at("Database:"));
        assert!(
            at("--database-url") > at("Database:") && at("--database-url") < at("Outbox relay:")
        );
        assert!(at("--max-connections") > at("HTTP limits:"), "{help}");
    }
}
