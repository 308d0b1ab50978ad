//! `orders effects run`: the effect runner alone with the service's handler, and the
//! settings it shares with `orders serve` ([`FulfilmentArgs`], [`service_handler`]).

use std::net::SocketAddr;
use std::sync::Arc;

use clap::{Args, Subcommand, ValueEnum};
use oncely_effects::EffectHandler;
use oncely_runtime::shutdown_signal;

/// `orders effects …`.
#[derive(Debug, Args)]
pub(super) struct EffectsArgs {
    #[command(flatten)]
    db: oncely_cli::DbArgs,
    #[command(subcommand)]
    command: EffectsCommand,
}

/// `orders effects …` (the operator commands are `oncely effects …`).
#[derive(Debug, Subcommand)]
enum EffectsCommand {
    /// Runs the effect runner alone until SIGTERM / Ctrl-C (then lets calls in flight
    /// settle): claims due effects, calls or checks each at its provider, settles it with
    /// the order service's update (invoice paid + invoice.paid), and continues the
    /// outcomes operators recorded with `oncely effects resolve`.
    Run(RunArgs),
}

/// Runs an `orders effects` command.
pub(super) async fn effects(args: EffectsArgs) -> anyhow::Result<()> {
    match args.command {
        EffectsCommand::Run(r) => run(&args.db, &r).await,
    }
}

/// `orders effects run`: the effect runner alone.
#[derive(Debug, Args)]
pub(super) struct RunArgs {
    #[command(flatten)]
    pub(super) providers: oncely_cli::ProviderArgs,
    /// Topic the runner writes the service's events to (`invoice.paid`); the service's
    /// `--events-topic`.
    #[arg(long, env = "ONCELY_EVENTS_TOPIC", default_value = crate::ORDERS_TOPIC)]
    pub(super) events_topic: String,
    /// Serve the runner's metrics on `GET /metrics` at this address (e.g. 127.0.0.1:9466).
    #[arg(long, env = "ONCELY_METRICS_LISTEN")]
    pub(super) metrics_listen: Option<SocketAddr>,
    /// With `--fulfilment saga` the runner continues the fulfilment sagas whose steps'
    /// effects it settles.
    #[command(flatten)]
    pub(super) fulfilment: FulfilmentArgs,
}

/// The order service's completion of its effects (an invoice marked paid and `invoice.paid`
/// for a succeeded charge), in the transaction that settles each: the saga orchestrator's
/// inner handler. Under the choreography the runners, resolutions and reconcilers use
/// [`crate::resolution_handler`], which also continues a saga's step (a continuation owed
/// after a change of fulfilment mode).
pub(super) fn service_handler(events_topic: &str) -> Arc<dyn EffectHandler> {
    Arc::new(crate::OrderEffects::new(events_topic))
}

/// `orders effects run`: the effect runner alone; under `--fulfilment saga` with the
/// orchestrator as its handler and the saga's timeout sweep beside it.
async fn run(db: &oncely_cli::DbArgs, run: &RunArgs) -> anyhow::Result<()> {
    db.require_pool(&[oncely_cli::PoolUser::Runner]);
    let db = super::connect(db).await?;
    let metrics = super::metrics_endpoint(run.metrics_listen);
    let order_effects = service_handler(&run.events_topic);
    let effects = run.providers.config();
    if !run.fulfilment.saga() {
        // As `orders serve`'s runner: a saga step's continuation continues its saga.
        return Ok(oncely_runtime::run_effects(
            &db,
            &effects,
            crate::resolution_handler(db.clone(), &run.events_topic),
            metrics,
            shutdown_signal(),
        )
        .await?);
    }
    let orchestrator = Arc::new(crate::fulfilment_orchestrator(
        db.clone(),
        &run.fulfilment.config(),
        oncely_saga::OrchestratorConfig::default(),
        order_effects,
    ));
    let stop = tokio_util::sync::CancellationToken::new();
    let sweep = tokio::spawn(orchestrator.clone().run(stop.clone()));
    let ran =
        oncely_runtime::run_effects(&db, &effects, orchestrator, metrics, shutdown_signal()).await;
    stop.cancel();
    sweep.await?;
    Ok(ran?)
}

/// Which fulfilment runs after `order.created` (`serve`, `effects run`), and the saga's
/// step timeouts.
#[derive(Debug, Clone, Args)]
pub(super) struct FulfilmentArgs {
    /// `choreography`: the `billing` and `shipping` consumers (invoice + charge →
    /// `invoice.paid` → booking). `saga`: the orchestrated saga (reserve stock → charge →
    /// ship → invoice, with compensations; needs payments and shipping configured).
    #[arg(long, env = "ONCELY_FULFILMENT", value_enum, default_value_t = FulfilmentArg::Choreography)]
    pub(super) fulfilment: FulfilmentArg,
    /// Saga: seconds the charge may stay unsettled before compensation starts (a late
    /// charge is refunded).
    #[arg(long, env = "ONCELY_SAGA_CHARGE_TIMEOUT_SECS", default_value_t = 300)]
    saga_charge_timeout_secs: u64,
    /// Saga: seconds the shipment booking may stay unsettled before compensation starts (a
    /// late booking is cancelled).
    #[arg(long, env = "ONCELY_SAGA_SHIP_TIMEOUT_SECS", default_value_t = 300)]
    saga_ship_timeout_secs: u64,
}

/// `--fulfilment` on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(super) enum FulfilmentArg {
    Choreography,
    Saga,
}

impl FulfilmentArgs {
    /// The order service's fulfilment settings.
    pub(super) fn config(&self) -> crate::FulfilmentConfig {
        crate::FulfilmentConfig {
            mode: match self.fulfilment {
                FulfilmentArg::Choreography => crate::Fulfilment::Choreography,
                FulfilmentArg::Saga => crate::Fulfilment::Saga,
            },
            charge_timeout: std::time::Duration::from_secs(self.saga_charge_timeout_secs.max(1)),
            ship_timeout: std::time::Duration::from_secs(self.saga_ship_timeout_secs.max(1)),
        }
    }

    /// Whether the saga runs.
    pub(super) fn saga(&self) -> bool {
        self.fulfilment == FulfilmentArg::Saga
    }
}
