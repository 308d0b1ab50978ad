//! `oncely gateway`: flags and the configuration file → [`oncely_gateway::router`] →
//! served until SIGTERM / Ctrl-C.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context as _;
use clap::Args;
use http::HeaderName;
use oncely_cli::DbArgs;
use oncely_gateway::{Authentication, GatewayConfig, RouteConfig, TrustedHeader};
use oncely_http::ApiKeys;
use oncely_runtime::{redact, shutdown_signal};

/// Run an idempotency gateway in front of an HTTP service you cannot change: keys,
/// fingerprints, tenant scope, durable replays and honest unknown outcomes on the routes
/// given; every other request passes through.
#[derive(Debug, Args)]
pub(crate) struct GatewayArgs {
    #[command(flatten)]
    db: DbArgs,
    #[command(flatten)]
    http: oncely_cli::HttpLimitArgs,
    /// Listen address.
    #[arg(long, env = "ONCELY_LISTEN", default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// The service behind the gateway, e.g. http://127.0.0.1:9000 (overrides the file's).
    #[arg(long, env = "ONCELY_UPSTREAM")]
    upstream: Option<String>,
    /// An idempotent route, `METHOD /path/{param}` (POST or PATCH), every option at its
    /// default (repeatable; added to the file's routes).
    #[arg(long = "route", value_name = "METHOD /PATH")]
    routes: Vec<String>,
    /// A TOML configuration file: `upstream`, `connect_timeout_ms` and `[[route]]` tables
    /// with per-route options (docs/gateway.md).
    #[arg(long, env = "ONCELY_GATEWAY_CONFIG")]
    config: Option<PathBuf>,
    /// API keys and their tenants: `key=tenant[,key=tenant…]` (keys ≥ 16 characters), as
    /// `orders serve` reads them.
    #[arg(long, env = "ONCELY_API_KEYS", hide_env_values = true)]
    api_keys: Option<String>,
    /// Take the tenant from this header, set by an authentication proxy in front, instead
    /// of API keys; the proxy proves itself with `--trusted-proxy-secret`.
    #[arg(long, env = "ONCELY_TENANT_HEADER", requires = "trusted_proxy_secret")]
    tenant_header: Option<String>,
    /// The secret the authentication proxy sends as `Authorization: Bearer <secret>` (at
    /// least 16 characters).
    #[arg(long, env = "ONCELY_TRUSTED_PROXY_SECRET", hide_env_values = true)]
    trusted_proxy_secret: Option<String>,
}

impl GatewayArgs {
    fn config(&self) -> anyhow::Result<GatewayConfig> {
        let mut config = match &self.config {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("reading {}", path.display()))?;
                GatewayConfig::from_toml(&text).with_context(|| path.display().to_string())?
            }
            None => GatewayConfig::new(""),
        };
        if let Some(upstream) = &self.upstream {
            config.upstream.clone_from(upstream);
        }
        for spec in &self.routes {
            config.routes.push(RouteConfig::parse(spec)?);
        }
        config.http = self.http.limits();
        anyhow::ensure!(
            !config.upstream.is_empty(),
            "no upstream: set --upstream or `upstream` in the configuration file"
        );
        config.validate()?;
        Ok(config)
    }

    fn authentication(&self) -> anyhow::Result<Authentication> {
        if let (Some(header), Some(secret)) = (&self.tenant_header, &self.trusted_proxy_secret) {
            anyhow::ensure!(
                secret.len() >= 16,
                "--trusted-proxy-secret must be at least 16 characters"
            );
            let header = HeaderName::try_from(header.as_str()).context("--tenant-header")?;
            return Ok(Authentication::TrustedHeader(TrustedHeader::new(
                header, secret,
            )));
        }
        let keys = oncely_http::parse_api_keys(self.api_keys.as_deref().unwrap_or_default())
            .context("parsing --api-keys")?;
        anyhow::ensure!(
            !keys.is_empty(),
            "no API keys configured: set --api-keys or ONCELY_API_KEYS (or --tenant-header)"
        );
        Ok(Authentication::ApiKeys(ApiKeys::new(keys)))
    }
}

/// `oncely gateway`: validates, connects and migrates, binds, serves until shutdown.
pub(crate) async fn run(args: GatewayArgs) -> anyhow::Result<()> {
    let config = args.config()?;
    let auth = args.authentication()?;
    let db = args.db.connect_oncely().await?;
    let router = oncely_gateway::with_metrics(
        oncely_gateway::router(&config, &db, auth)?,
        oncely_cli::metrics_handle(),
    );
    let listener = oncely_cli::bind(args.listen, "--listen").await?;
    tracing::info!(
        listen = %listener.local_addr()?,
        upstream = %config.upstream,
        routes = config.routes.len(),
        database = %redact(&args.db.database_url),
        "gateway started"
    );
    oncely_gateway::serve(listener, router, &db, &config.http, shutdown_signal()).await?;
    Ok(())
}
