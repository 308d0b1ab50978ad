//! `GET /readyz`: whether this process can do its work now — its database, its broker and
//! its providers each checked and named apart. `GET /healthz` stays liveness (the process
//! answers and reaches its database).

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use http::StatusCode;
use oncely_http::Problem;
use oncely_sql::Database;
use serde_json::{json, Map, Value};

/// How long one check may take before its dependency counts as unavailable.
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(2);

/// A dependency `/readyz` checks besides the database.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Dependency {
    /// The broker the relay and the consumers use: `backend` as `--broker` names it. The
    /// SQL transport (`sql`) is the database itself; any other is up when a TCP connection
    /// to one of `addrs` (`host:port`) opens within [`CHECK_TIMEOUT`].
    Broker {
        /// `sql`, `rabbitmq`, `nats` or `kafka`.
        backend: String,
        /// `host:port` of each broker node (for `sql`: none).
        addrs: Vec<String>,
    },
    /// A provider the effect runner calls (`payments`, `shipping`): up when a TCP
    /// connection to its base URL's host and port opens within [`CHECK_TIMEOUT`].
    Provider {
        /// The provider's name.
        name: String,
        /// Its base URL, `http://host[:port][/…]` or `https://…`.
        url: String,
    },
}

impl Dependency {
    /// The broker behind `url` (`amqp://…`, `nats://…`) or a comma-separated `host:port`
    /// list (Kafka bootstrap servers).
    pub fn broker(backend: &str, url_or_addrs: &str) -> Self {
        let addrs = if backend == "sql" {
            Vec::new()
        } else {
            url_or_addrs
                .split(',')
                .filter_map(|a| authority(a.trim(), default_port(backend)))
                .collect()
        };
        Self::Broker {
            backend: backend.to_owned(),
            addrs,
        }
    }
}

/// The port a broker or URL scheme listens on by default.
fn default_port(scheme: &str) -> u16 {
    match scheme {
        "amqp" | "rabbitmq" => 5672,
        "amqps" => 5671,
        "nats" => 4222,
        "kafka" => 9092,
        "https" => 443,
        _ => 80,
    }
}

/// `host:port` of `url` (`scheme://[user[:pass]@]host[:port][/…]`) or of a bare
/// `host[:port]`, the port defaulting per scheme.
fn authority(url: &str, fallback_port: u16) -> Option<String> {
    let (port, rest) = match url.split_once("://") {
        Some((scheme, rest)) => (default_port(scheme), rest),
        None => (fallback_port, url),
    };
    let host_port = rest.split(['/', '?', '#']).next()?;
    let host_port = host_port.rsplit('@').next()?;
    if host_port.is_empty() {
        return None;
    }
    // `[::1]:5672`, `host:5672`, or no port.
    let has_port = match host_port.rfind(':') {
        Some(i) => !host_port[i..].contains(']'),
        None => false,
    };
    Some(if has_port {
        host_port.to_owned()
    } else {
        format!("{host_port}:{port}")
    })
}

/// What `/readyz` checks, shared by its handler.
#[derive(Debug, Clone, Default)]
pub(crate) struct Readiness {
    pub(crate) dependencies: Arc<Vec<Dependency>>,
}

/// `true` when a TCP connection to one of `addrs` opens within [`CHECK_TIMEOUT`].
async fn reachable(addrs: &[String]) -> bool {
    for addr in addrs {
        let connect = tokio::net::TcpStream::connect(addr.as_str());
        if let Ok(Ok(_)) = tokio::time::timeout(CHECK_TIMEOUT, connect).await {
            return true;
        }
    }
    false
}

fn word(up: bool) -> &'static str {
    if up {
        "ok"
    } else {
        "unavailable"
    }
}

/// `GET /readyz`: `{"status":"ready","checks":{"database":{"status":"ok","backend":…},
/// "broker":{"status":"ok","backend":…},"providers":{"payments":{"status":"ok"},…}}}`, or
/// 503 problem `not-ready` with the same `checks` naming each unavailable dependency. Only
/// stable words: no addresses, no driver text (those go to the log).
#[utoipa::path(
    get,
    path = "/readyz",
    tag = "operations",
    security(()),
    responses(
        (status = 200, description = "Every dependency answers: `checks` names the database, \
            the broker and each provider with `ok`", content_type = "application/json",
            body = Object),
        (status = 503, description = "not-ready: a dependency is unavailable; `checks` says \
            which (`ok` or `unavailable` each)", body = crate::schema::Problem,
            content_type = "application/problem+json"),
    )
)]
pub(crate) async fn readyz(
    State(db): State<Database>,
    Extension(readiness): Extension<Readiness>,
) -> Response {
    let db_up = match tokio::time::timeout(CHECK_TIMEOUT, db.ping()).await {
        Ok(Ok(())) => true,
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "readiness: the database cannot be reached");
            false
        }
        Err(_) => {
            tracing::warn!("readiness: the database did not answer in time");
            false
        }
    };
    let mut all_up = db_up;
    let mut checks = Map::new();
    checks.insert(
        "database".to_owned(),
        json!({"status": word(db_up), "backend": db.backend().as_str()}),
    );
    let mut providers = Map::new();
    for dep in readiness.dependencies.iter() {
        match dep {
            Dependency::Broker { backend, addrs } => {
                let up = if backend == "sql" {
                    db_up
                } else {
                    reachable(addrs).await
                };
                if !up {
                    tracing::warn!(backend = %backend, "readiness: the broker cannot be reached");
                }
                all_up &= up;
                checks.insert(
                    "broker".to_owned(),
                    json!({"status": word(up), "backend": backend}),
                );
            }
            Dependency::Provider { name, url } => {
                let up = match authority(url, 80) {
                    Some(addr) => reachable(&[addr]).await,
                    None => false,
                };
                if !up {
                    tracing::warn!(provider = %name, "readiness: the provider cannot be reached");
                }
                all_up &= up;
                providers.insert(name.clone(), json!({"status": word(up)}));
            }
        }
    }
    if !providers.is_empty() {
        checks.insert("providers".to_owned(), Value::Object(providers));
    }
    if all_up {
        Json(json!({"status": "ready", "checks": checks})).into_response()
    } else {
        Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            crate::problem::NOT_READY,
            "A dependency is unavailable",
        )
        .with("checks", Value::Object(checks))
        .into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::authority;

    #[test]
    fn authorities_of_broker_and_provider_urls() {
        let a = |u: &str| authority(u, 9092);
        assert_eq!(
            a("amqp://guest:guest@127.0.0.1:5672/%2f").as_deref(),
            Some("127.0.0.1:5672")
        );
        assert_eq!(a("amqp://rabbit/%2f").as_deref(), Some("rabbit:5672"));
        assert_eq!(
            a("nats://127.0.0.1:4222").as_deref(),
            Some("127.0.0.1:4222")
        );
        assert_eq!(a("127.0.0.1:9092").as_deref(), Some("127.0.0.1:9092"));
        assert_eq!(a("kafka-1").as_deref(), Some("kafka-1:9092"));
        assert_eq!(
            a("http://127.0.0.1:12111/v1").as_deref(),
            Some("127.0.0.1:12111")
        );
        assert_eq!(
            a("https://api.stripe.com").as_deref(),
            Some("api.stripe.com:443")
        );
        assert_eq!(a("http://[::1]:8080/").as_deref(), Some("[::1]:8080"));
        assert_eq!(a("http://[::1]/").as_deref(), Some("[::1]:80"));
        assert_eq!(a(""), None);
    }
}
