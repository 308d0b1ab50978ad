//! `oncely consume --deliver-to URL`: a consumer group's messages POSTed to an HTTP
//! endpoint, signed as Standard Webhooks (logic in `oncely-delivery`).

use std::net::SocketAddr;
use std::time::Duration;

use clap::Args;
use oncely_delivery::{Delivery, DeliveryConfig, DeliveryHandler, SigningSecret};
use oncely_runtime::{shutdown_signal, MetricsEndpoint};

/// `oncely consume`.
#[derive(Debug, Args)]
pub(crate) struct ConsumeArgs {
    /// The endpoint each message is POSTed to (e.g. http://127.0.0.1:8000/webhooks).
    #[arg(long, env = "ONCELY_DELIVER_TO")]
    deliver_to: reqwest::Url,
    /// The endpoint's Standard Webhooks secret, `whsec_<base64>` (24 to 64 bytes).
    #[arg(long, env = "ONCELY_SIGNING_SECRET", hide_env_values = true)]
    signing_secret: String,
    /// The consumer group (its inbox rows and dead letters: `oncely inbox dead … --consumer`).
    #[arg(long, alias = "group")]
    consumer: String,
    /// The longest one delivery attempt may take, in seconds (connect to last body byte).
    #[arg(long, env = "ONCELY_DELIVERY_TIMEOUT_SECS", default_value_t = 10)]
    delivery_timeout_secs: u64,
    /// The longest `Retry-After` (of a 429 or 503) waited for before the retry, in seconds.
    #[arg(
        long,
        env = "ONCELY_DELIVERY_RETRY_AFTER_CEILING_SECS",
        default_value_t = 10
    )]
    retry_after_ceiling_secs: u64,
    #[command(flatten)]
    db: oncely_cli::DbArgs,
    #[command(flatten)]
    broker: oncely_cli::BrokerArgs,
    // `--consumer-max-attempts` does not apply: an unavailable receiver is retried until it
    // answers, and a refused message is dead at once (`oncely_delivery::Delivery`).
    #[command(flatten)]
    consumer_args: oncely_cli::ConsumerArgs,
    /// Serve the consumer's metrics on `GET /metrics` at this address (e.g. 127.0.0.1:9465).
    #[arg(long, env = "ONCELY_METRICS_LISTEN")]
    metrics_listen: Option<SocketAddr>,
}

/// `oncely consume`: the delivery consumer until SIGTERM / Ctrl-C.
pub(crate) async fn run(args: ConsumeArgs) -> anyhow::Result<()> {
    let mut config =
        DeliveryConfig::new(args.deliver_to, SigningSecret::parse(&args.signing_secret)?);
    config.timeout = Duration::from_secs(args.delivery_timeout_secs.max(1));
    config.retry_after_ceiling = Duration::from_secs(args.retry_after_ceiling_secs);
    let settings = args.consumer_args.settings(&args.consumer);
    anyhow::ensure!(
        config.longest_attempt() < settings.lease,
        "--consumer-lease-secs ({} s) must exceed --delivery-timeout-secs plus \
         --retry-after-ceiling-secs ({} s): a message in hand would be delivered twice",
        settings.lease.as_secs(),
        config.longest_attempt().as_secs()
    );
    let delivery = Delivery::new(DeliveryHandler::new(config)?);
    args.db.require_pool(&[oncely_cli::PoolUser::Consumer]);
    let db = args.db.connect_oncely().await?;
    let metrics = args.metrics_listen.map(|listen| MetricsEndpoint {
        listen,
        handle: oncely_cli::metrics_handle(),
    });
    let broker = args.broker.config();
    Ok(oncely_runtime::run_consumer(
        &db,
        &broker,
        &settings,
        &delivery,
        metrics,
        shutdown_signal(),
    )
    .await?)
}
