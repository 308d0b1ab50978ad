//! `oncely sim payments|shipping`: a provider simulator on its own listener (logic in
//! `oncely-sim`). For tests and local runs only: the control endpoints (`/_sim/…`) take
//! no credentials.

use std::future::Future;
use std::net::SocketAddr;

use anyhow::Context as _;
use clap::{Args, ValueEnum};
use oncely_sim::{FaultConfig, PaymentsConfig, PaymentsSim, ShippingConfig, ShippingSim};

#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum SimApi {
    /// The Stripe API v1 subset (payment intents, refunds, search).
    Payments,
    /// The shipping provider without idempotency keys.
    Shipping,
}

impl SimApi {
    /// Where the simulator listens without `--listen`: each API on a port of its own.
    pub(crate) fn default_listen(self) -> SocketAddr {
        let port = match self {
            SimApi::Payments => 12111,
            SimApi::Shipping => 12112,
        };
        SocketAddr::from(([127, 0, 0, 1], port))
    }
}

#[derive(Debug, Args)]
pub(crate) struct SimArgs {
    /// Which API to simulate.
    #[arg(value_enum)]
    api: SimApi,
    /// Listen address (port 0: a free port; the bound address is printed on stdout).
    /// Default: 127.0.0.1:12111 for payments, 127.0.0.1:12112 for shipping, so both run
    /// side by side.
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// A fault rate, `kind=rate` with rate 0.0–1.0 (repeatable). Kinds: latency,
    /// error_before, error_after, drop_after, late_after, rate_limit.
    #[arg(long = "fault", value_name = "KIND=RATE")]
    faults: Vec<String>,
    /// Payments: a secret key accepted (repeatable; default sk_test_oncely_sim).
    #[arg(long = "secret-key", value_name = "KEY")]
    secret_keys: Vec<String>,
    /// Payments: ms after its creation before a PaymentIntent is visible to search.
    #[arg(long, default_value_t = 1000)]
    search_lag_ms: u64,
    /// Delay of a `late_after` answer, in ms.
    #[arg(long, default_value_t = 5000)]
    late_ms: u64,
    /// Extra delay of a `latency` fault, in ms.
    #[arg(long, default_value_t = 200)]
    latency_ms: u64,
    /// `Retry-After` of a `rate_limit` answer, in seconds.
    #[arg(long, default_value_t = 1)]
    retry_after_secs: u32,
    /// Seed of the fault draws (reproducible runs).
    #[arg(long)]
    seed: Option<u64>,
    /// Shipping: an SKU refused for good with 422 (repeatable).
    #[arg(long = "undeliverable-sku", value_name = "SKU")]
    undeliverable_skus: Vec<String>,
}

pub(crate) async fn run(
    args: SimArgs,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let mut faults = FaultConfig {
        latency_ms: args.latency_ms,
        late_ms: args.late_ms,
        retry_after_secs: args.retry_after_secs,
        seed: args.seed,
        ..FaultConfig::default()
    };
    for f in &args.faults {
        faults
            .rates
            .set_from_str(f)
            .with_context(|| format!("--fault {f}"))?;
    }
    let api = args.api;
    let (name, router) = match api {
        SimApi::Payments => {
            let mut config = PaymentsConfig {
                search_lag: std::time::Duration::from_millis(args.search_lag_ms),
                faults,
                ..PaymentsConfig::default()
            };
            if !args.secret_keys.is_empty() {
                config.secret_keys = args.secret_keys;
            }
            ("payments", PaymentsSim::new(config).router())
        }
        SimApi::Shipping => {
            let config = ShippingConfig {
                undeliverable_skus: args.undeliverable_skus.into_iter().collect(),
                faults,
                ..ShippingConfig::default()
            };
            ("shipping", ShippingSim::new(config).router())
        }
    };
    let listen = args.listen.unwrap_or_else(|| api.default_listen());
    let listener = oncely_cli::bind(listen, "--listen").await?;
    println!("{name} simulator listening on {}", listener.local_addr()?);
    oncely_sim::serve(listener, router, shutdown).await?;
    Ok(())
}
