//! The test's processes and servers: the Python upstream (a child process the test owns)
//! and gateway instances served in the test's runtime.

use std::io::{BufRead as _, BufReader};
use std::process::Stdio;

use oncely_core::TenantId;
use oncely_gateway::{Authentication, GatewayConfig, RouteConfig};
use oncely_http::ApiKeys;
use oncely_sql::{Database, DbOptions};
use oncely_testkit::process::{command, ProcessGuard};
use oncely_testkit::{TestBackend, TestDb};
use serde_json::Value;

pub(crate) const KEY_A: &str = "key-of-tenant-a-0123456789";
pub(crate) const KEY_B: &str = "key-of-tenant-b-0123456789";

/// The Python upstream: killed when dropped. Its SQLite file lives in `_dir`.
pub(crate) struct Upstream {
    pub(crate) base: String,
    _process: ProcessGuard,
    _dir: tempfile::TempDir,
}

impl Upstream {
    /// Starts `upstream.py` on a free port.
    pub(crate) fn start() -> Self {
        Self::on_port(0)
    }

    /// Starts `upstream.py` on `port` (0: any free one).
    pub(crate) fn on_port(port: u16) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/gateway/upstream.py");
        let mut cmd = command("python3");
        cmd.arg(script)
            .arg(dir.path().join("orders.db"))
            .arg(port.to_string())
            .stdout(Stdio::piped());
        let mut process = ProcessGuard::spawn(cmd).expect("start python3 upstream.py");
        let stdout = process.child.stdout.take().unwrap();
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line).unwrap();
        let port: u16 = line.trim().parse().expect("upstream.py prints its port");
        Self {
            base: format!("http://127.0.0.1:{port}"),
            _process: process,
            _dir: dir,
        }
    }

    /// Rows the upstream inserted.
    pub(crate) async fn count(&self) -> u64 {
        let v: Value = reqwest::get(format!("{}/orders/count", self.base))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        v["count"].as_u64().unwrap()
    }

    /// Queues `fault` for the next `POST /orders`.
    pub(crate) async fn fault(&self, fault: &str) {
        let res = reqwest::Client::new()
            .post(format!("{}/_faults", self.base))
            .body(fault.to_owned())
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 200);
    }
}

/// A gateway served on `127.0.0.1:0` in this runtime; stopped when dropped.
pub(crate) struct Gateway {
    pub(crate) base: String,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Gateway {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Tenants `a` and `b` with [`KEY_A`] and [`KEY_B`], parsed as `ONCELY_API_KEYS` is.
pub(crate) fn api_keys() -> Authentication {
    let keys = oncely_http::parse_api_keys(&format!("{KEY_A}=a, {KEY_B}=b")).unwrap();
    assert_eq!(keys[1].1, TenantId::parse("b").unwrap());
    Authentication::ApiKeys(ApiKeys::new(keys))
}

/// A gateway on `db` in front of `upstream` with `routes`.
pub(crate) async fn gateway(db: &Database, upstream: &str, routes: Vec<RouteConfig>) -> Gateway {
    let mut config = GatewayConfig::new(upstream);
    config.routes = routes;
    gateway_with(db, &config).await
}

/// The test process's Prometheus recorder, installed once as the global one (every
/// gateway of this binary records into it; tests read it through `/_oncely/metrics`).
pub(crate) fn metrics_handle() -> metrics_exporter_prometheus::PrometheusHandle {
    static HANDLE: std::sync::OnceLock<metrics_exporter_prometheus::PrometheusHandle> =
        std::sync::OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
            let handle = recorder.handle();
            metrics::set_global_recorder(recorder).expect("the first recorder");
            handle
        })
        .clone()
}

/// A gateway on `db` for `config` (with `/_oncely/metrics`).
pub(crate) async fn gateway_with(db: &Database, config: &GatewayConfig) -> Gateway {
    let router = oncely_gateway::with_metrics(
        oncely_gateway::router(config, db, api_keys()).unwrap(),
        metrics_handle(),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let (db, limits) = (db.clone(), config.http.clone());
    let task = tokio::spawn(async move {
        oncely_gateway::serve(listener, router, &db, &limits, std::future::pending())
            .await
            .unwrap();
    });
    Gateway { base, task }
}

/// `POST /orders` with its default options.
pub(crate) fn orders_route() -> RouteConfig {
    RouteConfig::parse("POST /orders").unwrap()
}

/// A fresh, migrated database on `backend` with a pool of `connections`, or `None` when
/// its server is unreachable (and services are not required).
pub(crate) async fn test_db(backend: TestBackend, connections: u32) -> Option<TestDb> {
    let options = DbOptions {
        max_connections: connections,
        ..DbOptions::default()
    };
    let db = TestDb::with_options(backend, &options).await?;
    db.db.migrate().await.unwrap();
    Some(db)
}

/// A `POST {base}{path}` with `key` (if any), tenant `api_key` and JSON `body`.
pub(crate) async fn post(
    base: &str,
    path: &str,
    api_key: &str,
    key: Option<&str>,
    body: &Value,
) -> reqwest::Response {
    let mut req = reqwest::Client::new()
        .post(format!("{base}{path}"))
        .bearer_auth(api_key)
        .json(body);
    if let Some(key) = key {
        req = req.header("Idempotency-Key", key);
    }
    req.send().await.unwrap()
}

/// Two retries of `key` on `base` (tenant A) each get the stored 409
/// `response-not-replayable` naming the first answer's 201; returns the operation's status
/// resource.
pub(crate) async fn retries_get_not_replayable(base: &str, key: &str, body: &Value) -> Value {
    for _ in 0..2 {
        let again = post(base, "/orders", KEY_A, Some(key), body).await;
        assert_eq!(again.status(), 409);
        assert_eq!(again.headers()["idempotent-replayed"], "true");
        let problem: Value = again.json().await.unwrap();
        assert_eq!(
            problem["type"],
            "urn:oncely:problem:response-not-replayable"
        );
        assert_eq!(problem["answered_status"], 201);
    }
    operation_status(base, key).await
}

/// The gateway's status document of tenant A's operation `key` on route 0
/// (`GET /_oncely/routes/0/operations/{key}`).
pub(crate) async fn operation_status(base: &str, key: &str) -> Value {
    reqwest::Client::new()
        .get(format!("{base}/_oncely/routes/0/operations/{key}"))
        .bearer_auth(KEY_A)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}
