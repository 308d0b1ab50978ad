//! `orders dev`: the whole system in one process, for a first look — the order service on a
//! fresh SQLite file with the SQL transport, under the fulfilment saga, with its relay,
//! consumer, effect runner and console (all as `orders serve` runs them), and both provider
//! simulators in-process on free ports. Once the service answers it seeds some stock and
//! prints where everything is, a key for tenant `demo`, the console's admin token and five
//! things to try as shell commands.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, Parser};
use oncely_sim::{PaymentsConfig, PaymentsSim, ShippingConfig, ShippingSim};
use tokio_util::sync::CancellationToken;

use super::serve::{self, ServeArgs};

/// The tenant `orders dev` mints its API key for.
const TENANT: &str = "demo";
/// The secret key the payments simulator accepts.
const SECRET_KEY: &str = "sk_test_oncely_dev";
/// The SKU the shipping simulator refuses for good: an order of it compensates its saga.
const UNDELIVERABLE: &str = "sku-fragile";
/// The SKU of the orders that go through.
const SKU: &str = "sku-1";
/// Stock seeded for each of [`SKU`] and [`UNDELIVERABLE`], so the saga's reservations hold.
const STOCK: i64 = 1000;
/// How long the banner waits for `/readyz` before it gives up.
const READY_WITHIN: Duration = Duration::from_secs(30);

/// `orders dev`.
#[derive(Debug, Args)]
pub(super) struct DevArgs {
    /// Listen address of the order service (port 0: any free port; the banner shows the
    /// one bound).
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// The SQLite file: deleted (with its `-wal` and `-shm` files) and created afresh at
    /// every start.
    #[arg(long, default_value = "oncely-dev.db")]
    db_file: PathBuf,
}

/// `orders serve`'s arguments, parsed from the command line `orders dev` composes.
#[derive(Debug, Parser)]
struct AsServe {
    #[command(flatten)]
    serve: ServeArgs,
}

/// What `orders dev` started and prints.
#[derive(Debug)]
struct Dev {
    /// The order service's base URL.
    api: String,
    /// Tenant `demo`'s API key: `dev-key-` and 32 random hex digits.
    key: String,
    /// The console's admin token: `dev-admin-` and 32 random hex digits.
    admin_token: String,
    /// The SQLite file (absolute).
    db_file: PathBuf,
    /// The payments simulator's base URL.
    payments: String,
    /// The shipping simulator's base URL.
    shipping: String,
}

/// `orders dev`: runs until SIGTERM / Ctrl-C.
///
/// # Errors
/// The listen address cannot be bound (a port in use is named with `--listen`), the
/// database file cannot be removed, or `orders serve`'s own errors.
pub(super) async fn dev(args: DevArgs) -> anyhow::Result<()> {
    let listener = oncely_cli::bind(args.listen, "--listen").await?;
    let listen = listener.local_addr()?;
    let db_file = fresh_file(&args.db_file)?;
    let stop = CancellationToken::new();
    let payments = PaymentsSim::new(PaymentsConfig {
        secret_keys: vec![SECRET_KEY.to_owned()],
        ..PaymentsConfig::default()
    });
    let shipping = ShippingSim::new(ShippingConfig {
        undeliverable_skus: [UNDELIVERABLE.to_owned()].into(),
        ..ShippingConfig::default()
    });
    let dev = Dev {
        api: format!("http://{listen}"),
        key: secret("dev-key-"),
        admin_token: secret("dev-admin-"),
        db_file,
        payments: simulator(payments.router(), &stop).await?,
        shipping: simulator(shipping.router(), &stop).await?,
    };
    let serve_args = dev.serve_args(listen)?;
    let announce = tokio::spawn(async move {
        if let Err(e) = dev.announce().await {
            tracing::error!("orders dev is not ready: {e:#}");
        }
    });
    let served = serve::serve_on(serve_args, listener).await;
    stop.cancel();
    announce.abort();
    served
}

/// `prefix` and 32 random hex digits (a v4 UUID's 122 random bits).
fn secret(prefix: &str) -> String {
    format!("{prefix}{}", uuid::Uuid::new_v4().simple())
}

/// `path` made absolute, with the SQLite database there (and its `-wal`, `-shm` and
/// `-journal` files) removed.
fn fresh_file(path: &Path) -> anyhow::Result<PathBuf> {
    let path =
        std::path::absolute(path).with_context(|| format!("--db-file {}", path.display()))?;
    for suffix in ["", "-wal", "-shm", "-journal"] {
        let mut file = path.clone().into_os_string();
        file.push(suffix);
        match std::fs::remove_file(&file) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(e).with_context(|| format!("removing {}", Path::new(&file).display()))
            }
        }
    }
    Ok(path)
}

/// Serves a simulator's `router` on a free loopback port until `stop`; its base URL.
async fn simulator(router: axum::Router, stop: &CancellationToken) -> anyhow::Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .context("binding a provider simulator")?;
    let base = format!("http://{}", listener.local_addr()?);
    let stopped = stop.clone().cancelled_owned();
    tokio::spawn(async move {
        if let Err(e) = oncely_sim::serve(listener, router, stopped).await {
            tracing::error!(error = %e, "a provider simulator stopped");
        }
    });
    Ok(base)
}

impl Dev {
    /// `orders serve`'s arguments for this run (on `listen`): settings a user sets in the
    /// environment (`ONCELY_…`) apply, except those given here.
    fn serve_args(&self, listen: SocketAddr) -> anyhow::Result<ServeArgs> {
        let listen = listen.to_string();
        let database_url = format!("sqlite://{}", self.db_file.display());
        let api_keys = format!("{}={TENANT}", self.key);
        let argv = [
            "orders dev",
            "--database-url",
            database_url.as_str(),
            "--broker",
            "sql",
            "--listen",
            listen.as_str(),
            "--api-keys",
            api_keys.as_str(),
            "--admin-token",
            self.admin_token.as_str(),
            "--payments-url",
            self.payments.as_str(),
            "--payments-secret-key",
            SECRET_KEY,
            "--shipping-url",
            self.shipping.as_str(),
            "--fulfilment",
            "saga",
        ];
        Ok(AsServe::try_parse_from(argv)?.serve)
    }

    /// Waits for `/readyz`, seeds the stock and prints the banner.
    async fn announce(self) -> anyhow::Result<()> {
        let client = reqwest::Client::new();
        let deadline = tokio::time::Instant::now() + READY_WITHIN;
        loop {
            let ready = client.get(format!("{}/readyz", self.api)).send().await;
            if ready.is_ok_and(|r| r.status().is_success()) {
                break;
            }
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "{}/readyz did not answer 200 within {READY_WITHIN:?}",
                self.api
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        for sku in [SKU, UNDELIVERABLE] {
            client
                .put(format!("{}/v1/stock/{sku}", self.api))
                .bearer_auth(&self.key)
                .json(&serde_json::json!({ "available": STOCK }))
                .send()
                .await?
                .error_for_status()
                .with_context(|| format!("seeding the stock of {sku}"))?;
        }
        print!("{}", self.banner());
        Ok(())
    }

    /// What `orders dev` prints once ready: where everything is, and five things to try.
    fn banner(&self) -> String {
        let (api, key, db) = (&self.api, &self.key, self.db_file.display());
        let mut b = String::new();
        let _ = writeln!(
            b,
            "orders dev: the order service (saga fulfilment, relay, consumer, effect runner, \
             console) and both provider simulators. Ctrl-C stops them.\n\
             \n  API        {api}  tenant {TENANT}, key {key}\
             \n  Console    {api}/console/login  admin token {}\
             \n  Payments   {}  simulator; one-shot faults: POST /_sim/faults/next\
             \n  Shipping   {}  simulator; it refuses {UNDELIVERABLE} for good\
             \n  Database   {db}  (fresh; also the broker)\
             \n  Stock      {SKU} and {UNDELIVERABLE}: {STOCK} each\
             \n\nFive things to try. First, in your shell:\
             \n    export API={api} KEY={key} PAY={}\n",
            self.admin_token, self.payments, self.shipping, self.payments
        );
        let _ = writeln!(
            b,
            "1. Create an order (201):\n    {}\n\
             2. Send the very same request again: the stored answer comes back, with \
             Idempotent-Replayed: true, and there is still one order:\n    {}\n\
             3. Make the payments simulator lose its answer after it charged, then order: \
             the effect runner cannot know whether the charge happened, so it checks its \
             status and finds it. The order ends fulfilled, and its charge effect shows 1 \
             check (the last command from this checkout):\n    \
             curl -s $PAY/_sim/faults/next -H 'Content-Type: application/json' \
             -d '{{\"kind\":\"drop_after\"}}'\n    {}\n\
             \x20  a few seconds later:\n    {}\n    \
             cargo run --release -q -p oncely -- effects list --database-url sqlite://{db}\n\
             4. A saga compensated: shipping refuses {UNDELIVERABLE} for good, so the charge \
             is refunded and the stock released (status rejected):\n    {}\n\
             \x20  a few seconds later:\n    {}\n\
             5. That order's page in the console (sign in with the admin token first):\n    \
             echo $API/console/orders/$ID",
            create("try-1", SKU),
            create("try-1", SKU),
            create_id("try-2", SKU),
            SHOW,
            create_id("try-3", UNDELIVERABLE),
            SHOW,
        );
        b
    }
}

/// The shell command that creates an order of one `sku` with external ref and
/// `Idempotency-Key` `name`.
fn create(name: &str, sku: &str) -> String {
    format!(
        "curl -si $API/v1/orders -H \"Authorization: Bearer $KEY\" -H 'Idempotency-Key: {name}' \
         -H 'Content-Type: application/json' -d '{{\"source\":\"dev\",\"external_ref\":\"{name}\",\
         \"customer_id\":\"c-1\",\"items\":[{{\"sku\":\"{sku}\",\"quantity\":1}}],\
         \"amount_minor\":2500,\"currency\":\"EUR\"}}'"
    )
}

/// [`create`] with the new order's id kept in `$ID` (the first UUID of its answer: `id`
/// leads the order's JSON).
fn create_id(name: &str, sku: &str) -> String {
    let create = create(name, sku).replacen("curl -si", "curl -s", 1);
    format!("ID=$({create} | grep -o '[0-9a-f-]\\{{36\\}}' | head -1); echo $ID")
}

/// The shell command that shows the order `$ID`.
const SHOW: &str = "curl -s $API/v1/orders/$ID -H \"Authorization: Bearer $KEY\"";
