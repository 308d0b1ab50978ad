//! The world every saga test runs in: a fresh migrated database with the service's own
//! `stock` and `ledger` tables, the payments and shipping simulators on `127.0.0.1:0`
//! behind the real adapters, the real effect runner with the orchestrator as its handler.

use std::sync::Arc;
use std::time::{Duration, Instant};

use oncely_core::RetryPolicy;
use oncely_effects::{
    EffectRunner, Provider, RunnerConfig, ShippingClient, ShippingConfig, StripeConfig,
    StripePayments,
};
use oncely_saga::{
    Action, NewSaga, Orchestrator, OrchestratorConfig, Saga, SagaDefinition, SagaState, Started,
    Step, StepContext, StepError, StepRecord,
};
use oncely_sim::{
    serve, FaultConfig, PaymentsConfig, PaymentsSim, ShippingConfig as SimShipping, ShippingSim,
};
use oncely_sql::{query, Database, Tx};
use oncely_testkit::TestDb;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

pub(crate) const SK: &str = "sk_test_oncely_saga";
pub(crate) const TENANT: &str = "tenant-a";
/// An SKU the shipping simulator refuses for good (422).
pub(crate) const UNDELIVERABLE: &str = "sku-fragile";

pub(crate) struct World {
    pub(crate) db: Database,
    pub(crate) orchestrator: Arc<Orchestrator>,
    pub(crate) runner: Arc<EffectRunner>,
    pub(crate) payments: PaymentsSim,
    pub(crate) payments_url: String,
    pub(crate) shipping: ShippingSim,
    pub(crate) shipping_url: String,
    pub(crate) stripe: Arc<StripePayments>,
    pub(crate) kind: String,
    stop: CancellationToken,
    _db: TestDb,
}

impl Drop for World {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// The definition's shape for one test.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shape {
    /// A local `record` step (a ledger row, no unique key) between charge and ship.
    pub(crate) ledger: bool,
    /// The ship step's timeout.
    pub(crate) ship_timeout: Duration,
    /// A retriable step `gift` after the pivot, booking one of this SKU (two attempts).
    pub(crate) gift: Option<&'static str>,
}

impl Default for Shape {
    fn default() -> Self {
        Self {
            ledger: false,
            ship_timeout: Duration::from_secs(30),
            gift: None,
        }
    }
}

async fn listen(router: axum::Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(serve(listener, router, std::future::pending()));
    format!("http://{addr}")
}

/// The process's Prometheus recorder (one per test process: counters add up across
/// tests, so each test's definition has a kind of its own and checks its own labels).
pub(crate) fn recorder() -> &'static metrics_exporter_prometheus::PrometheusHandle {
    static HANDLE: std::sync::OnceLock<metrics_exporter_prometheus::PrometheusHandle> =
        std::sync::OnceLock::new();
    HANDLE.get_or_init(|| {
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .install_recorder()
            .expect("the only recorder of this test process")
    })
}

/// The value of the sample `name{labels}` in Prometheus text (0 when absent), as a whole
/// number: every value checked is a count.
pub(crate) fn sample(name_and_labels: &str) -> i64 {
    recorder()
        .render()
        .lines()
        .find_map(|l| l.strip_prefix(name_and_labels)?.trim().parse::<f64>().ok())
        .map_or(0, |v| v.round() as i64)
}

fn text(v: &Value, what: &str) -> Result<String, StepError> {
    v.as_str()
        .map(str::to_owned)
        .ok_or_else(|| StepError::Refused(format!("{what}: a string")))
}

fn reserve() -> Step {
    Step::local("reserve", |tx: &mut Tx, ctx: &StepContext| {
        Box::pin(async move {
            let qty = ctx.input["quantity"].as_i64().unwrap_or(0);
            let sku = text(&ctx.input["sku"], "sku")?;
            let n = tx
                .execute(
                    query(
                        "UPDATE stock SET available = available - $1, reserved = reserved + $2 \
                         WHERE sku = $3 AND available >= $4",
                    )
                    .bind(qty)
                    .bind(qty)
                    .bind(sku.as_str())
                    .bind(qty),
                )
                .await?;
            if n == 0 {
                return Err(StepError::Refused(format!("{sku}: not enough stock")));
            }
            Ok(json!({"reserved": qty}))
        })
    })
    .compensated_by(Action::local(|tx: &mut Tx, ctx: &StepContext| {
        Box::pin(async move {
            let qty = ctx.input["quantity"].as_i64().unwrap_or(0);
            let sku = text(&ctx.input["sku"], "sku")?;
            tx.execute(
                query(
                    "UPDATE stock SET available = available + $1, reserved = reserved - $2 \
                     WHERE sku = $3",
                )
                .bind(qty)
                .bind(qty)
                .bind(sku.as_str()),
            )
            .await?;
            Ok(json!({"released": qty}))
        })
    }))
}

fn ledger_entry(entry: &'static str, sign: i64) -> Action {
    Action::local(move |tx: &mut Tx, ctx: &StepContext| {
        Box::pin(async move {
            let amount = ctx.input["amount"].as_i64().unwrap_or(0) * sign;
            tx.execute(
                query("INSERT INTO ledger (saga_id, entry, amount) VALUES ($1, $2, $3)")
                    .bind(ctx.saga_id.as_str())
                    .bind(entry)
                    .bind(amount),
            )
            .await?;
            Ok(json!({"entry": entry}))
        })
    })
}

fn charge() -> Step {
    Step::effect("charge", "payments", "charge", |ctx| {
        Ok(json!({
            "amount": ctx.input["amount"],
            "currency": "eur",
            "payment_method": ctx.input["payment_method"],
            "metadata": {"order_id": ctx.input["order_id"]},
        }))
    })
    .timeout(Duration::from_secs(30))
    .compensated_by(Action::effect("payments", "refund", |ctx| {
        let intent = ctx
            .output("charge")
            .and_then(|o| o["id"].as_str())
            .ok_or_else(|| StepError::Refused("no PaymentIntent to refund".into()))?;
        Ok(json!({"payment_intent": intent}))
    }))
}

fn ship(timeout: Duration) -> Step {
    Step::effect("ship", "shipping", "book", |ctx| {
        Ok(json!({
            "order_id": ctx.input["order_id"],
            "items": [{"sku": ctx.input["sku"], "quantity": ctx.input["quantity"]}],
        }))
    })
    .timeout(timeout)
    // Used only when the booking commits after its timeout started compensation.
    .compensated_by(Action::effect("shipping", "cancel", |ctx| {
        let id = ctx
            .output("ship")
            .and_then(|o| o["id"].as_str())
            .ok_or_else(|| StepError::Refused("no shipment to cancel".into()))?;
        Ok(json!({"shipment_id": id}))
    }))
}

/// A retriable shipment of one `sku` after the pivot: two attempts, 10–50 ms apart.
fn gift(sku: &'static str) -> Step {
    Step::effect("gift", "shipping", "book", move |ctx| {
        Ok(json!({
            "order_id": ctx.input["order_id"],
            "items": [{"sku": sku, "quantity": 1}],
        }))
    })
    .retry(RetryPolicy {
        base: Duration::from_millis(10),
        cap: Duration::from_millis(50),
        max_attempts: 2,
        ..RetryPolicy::default()
    })
}

/// reserve (local) → charge → [record (local)] → ship (pivot) → [gift (retriable)].
pub(crate) fn definition(kind: &str, shape: Shape) -> SagaDefinition {
    let mut b = SagaDefinition::builder(kind)
        .compensable(reserve())
        .compensable(charge());
    if shape.ledger {
        b = b.compensable(
            Step::new("record", ledger_entry("payment", 1))
                .compensated_by(ledger_entry("reversal", -1)),
        );
    }
    b = b.pivot(ship(shape.ship_timeout));
    if let Some(sku) = shape.gift {
        b = b.retriable(gift(sku));
    }
    b.build().unwrap()
}

fn runner_config() -> RunnerConfig {
    RunnerConfig {
        poll: Duration::from_millis(20),
        check_delay: Duration::from_millis(100),
        lease: Duration::from_secs(30),
        retry: RetryPolicy {
            base: Duration::from_millis(50),
            cap: Duration::from_millis(500),
            ..RetryPolicy::default()
        },
        outage: RetryPolicy {
            base: Duration::from_millis(50),
            cap: Duration::from_millis(500),
            max_attempts: u32::MAX,
            ..RetryPolicy::default()
        },
        ..RunnerConfig::default()
    }
}

impl World {
    /// A world on `t` whose definition's kind is `"{name}-{backend}"` (metrics labels
    /// per test), with shipping's late answers `late_ms` after the booking.
    pub(crate) async fn new(t: TestDb, name: &str, shape: Shape, late_ms: u64) -> Self {
        recorder();
        let db = t.db.clone();
        db.migrate().await.unwrap();
        for ddl in [
            "CREATE TABLE stock (sku VARCHAR(64) PRIMARY KEY, available BIGINT NOT NULL, \
             reserved BIGINT NOT NULL)",
            "CREATE TABLE ledger (saga_id VARCHAR(255) NOT NULL, entry VARCHAR(64) NOT NULL, \
             amount BIGINT NOT NULL)",
        ] {
            db.execute(query(ddl)).await.unwrap();
        }
        let payments = PaymentsSim::new(PaymentsConfig {
            secret_keys: vec![SK.into()],
            search_lag: Duration::ZERO,
            faults: FaultConfig {
                seed: Some(7),
                ..FaultConfig::default()
            },
        });
        let payments_url = listen(payments.router()).await;
        let shipping = ShippingSim::new(SimShipping {
            undeliverable_skus: [UNDELIVERABLE.to_owned()].into(),
            faults: FaultConfig {
                late_ms,
                seed: Some(7),
                ..FaultConfig::default()
            },
            ..SimShipping::default()
        });
        let shipping_url = listen(shipping.router()).await;
        let stripe = Arc::new(
            StripePayments::new(StripeConfig {
                base_url: payments_url.clone(),
                secret_key: SK.into(),
                timeout: Duration::from_secs(10),
                search: false,
                ..StripeConfig::default()
            })
            .unwrap(),
        );
        let ship_client = Arc::new(
            ShippingClient::new(ShippingConfig {
                base_url: shipping_url.clone(),
                api_key: None,
                timeout: Duration::from_secs(10),
                settle_time: Duration::from_secs(2),
                ..ShippingConfig::default()
            })
            .unwrap(),
        );
        let kind = format!("{name}-{}", db.backend().as_str());
        let orchestrator = Arc::new(
            Orchestrator::new(
                db.clone(),
                vec![definition(&kind, shape)],
                OrchestratorConfig {
                    poll: Duration::from_millis(25),
                    ..OrchestratorConfig::default()
                },
            )
            .unwrap(),
        );
        let providers: Vec<Arc<dyn Provider>> = vec![stripe.clone(), ship_client];
        let runner = Arc::new(EffectRunner::new(
            oncely_sql::EffectStore::new(db.clone()),
            providers,
            orchestrator.clone(),
            runner_config(),
        ));
        Self {
            db,
            orchestrator,
            runner,
            payments,
            payments_url,
            shipping,
            shipping_url,
            stripe,
            kind,
            stop: CancellationToken::new(),
            _db: t,
        }
    }

    pub(crate) async fn stock(&self, sku: &str, available: i64) {
        self.db
            .execute(
                query("INSERT INTO stock (sku, available, reserved) VALUES ($1, $2, 0)")
                    .bind(sku)
                    .bind(available),
            )
            .await
            .unwrap();
    }

    /// `(available, reserved)` of `sku`.
    pub(crate) async fn stock_of(&self, sku: &str) -> (i64, i64) {
        self.db
            .fetch_optional(query("SELECT available, reserved FROM stock WHERE sku = $1").bind(sku))
            .await
            .unwrap()
            .expect("a stock row")
    }

    /// Starts the saga `id` for one order in its own transaction.
    pub(crate) async fn start(&self, id: &str, input: &Value) -> Started {
        let mut tx = self.db.begin().await.unwrap();
        let started = self
            .orchestrator
            .start(
                &mut tx,
                &NewSaga {
                    id,
                    tenant: TENANT,
                    kind: &self.kind,
                    input,
                },
            )
            .await
            .unwrap();
        tx.commit().await.unwrap();
        started
    }

    /// Runs the effect runner and the orchestrator's timeout sweep in the background
    /// until the world is dropped.
    pub(crate) fn run_in_background(&self) {
        tokio::spawn(self.runner.clone().run(self.stop.clone()));
        tokio::spawn(self.orchestrator.clone().run(self.stop.clone()));
    }

    pub(crate) async fn saga(&self, id: &str) -> Saga {
        self.orchestrator
            .get(TENANT, id)
            .await
            .unwrap()
            .expect("the saga")
    }

    pub(crate) async fn steps(&self, id: &str) -> Vec<StepRecord> {
        self.orchestrator.steps(TENANT, id).await.unwrap()
    }

    /// Waits (at most 30 s) until saga `id` is in `state`, driving the runner one round at
    /// a time unless it runs in the background.
    pub(crate) async fn until(&self, id: &str, state: SagaState, drive: bool) -> Saga {
        let started = Instant::now();
        loop {
            if drive {
                self.runner.run_once().await.unwrap();
                self.orchestrator
                    .expire_due(oncely_core::now_ms())
                    .await
                    .unwrap();
            }
            let saga = self.saga(id).await;
            if saga.state == state {
                return saga;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "saga {id} is {} ({:?}), not {state}; steps: {:#?}",
                saga.state,
                saga.error,
                self.steps(id).await
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Arms one fault of `kind` for the simulator at `base`'s next effect.
    pub(crate) async fn next_fault(base: &str, kind: &str) {
        let res = reqwest::Client::new()
            .post(format!("{base}/_sim/faults/next"))
            .json(&json!({"kind": kind}))
            .send()
            .await
            .unwrap();
        assert!(res.status().is_success(), "arming {kind}: {}", res.status());
    }
}

/// An order's saga input.
pub(crate) fn order(order_id: &str, sku: &str, quantity: i64, payment_method: &str) -> Value {
    json!({
        "order_id": order_id,
        "sku": sku,
        "quantity": quantity,
        "amount": 1250,
        "payment_method": payment_method,
    })
}

/// `(name, phase, state)` of each step-log row, in order.
pub(crate) fn log(steps: &[StepRecord]) -> Vec<(String, &'static str, &'static str)> {
    steps
        .iter()
        .map(|s| (s.name.clone(), s.phase.as_str(), s.state.as_str()))
        .collect()
}
