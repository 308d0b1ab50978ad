//! `oncely saga list|show|retry` as a process against a saga the real orchestrator parked:
//! a shipment (the pivot) booked, then a retriable shipment the simulator refuses for good
//! (422) until its policy is spent.

use std::process::{Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use oncely_core::RetryPolicy;
use oncely_effects::{EffectRunner, Provider, RunnerConfig, ShippingClient, ShippingConfig};
use oncely_saga::{
    NewSaga, Orchestrator, OrchestratorConfig, SagaDefinition, SagaOperator, SagaState, Step,
};
use oncely_sim::{ShippingConfig as SimShipping, ShippingSim};
use oncely_testkit::TestDb;
use serde_json::{json, Value};

const UNDELIVERABLE: &str = "sku-fragile";
const KIND: &str = "cli-ship";

fn book(name: &str, sku: &'static str) -> Step {
    Step::effect(name, "shipping", "book", move |ctx| {
        Ok(json!({
            "order_id": ctx.input["order_id"],
            "items": [{"sku": sku, "quantity": 1}],
        }))
    })
}

/// ship (pivot) → gift (retriable, one attempt, always refused).
fn definition() -> SagaDefinition {
    SagaDefinition::builder(KIND)
        .pivot(book("ship", "sku-1"))
        .retriable(book("gift", UNDELIVERABLE).retry(RetryPolicy {
            max_attempts: 1,
            ..RetryPolicy::default()
        }))
        .build()
        .unwrap()
}

fn runner(
    db: &oncely_sql::Database,
    url: &str,
    orchestrator: Arc<Orchestrator>,
) -> Arc<EffectRunner> {
    let client = ShippingClient::new(ShippingConfig {
        base_url: url.to_owned(),
        api_key: None,
        timeout: Duration::from_secs(10),
        settle_time: Duration::from_secs(2),
        ..ShippingConfig::default()
    })
    .unwrap();
    let providers: Vec<Arc<dyn Provider>> = vec![Arc::new(client)];
    Arc::new(EffectRunner::new(
        oncely_sql::EffectStore::new(db.clone()),
        providers,
        orchestrator,
        RunnerConfig {
            poll: Duration::from_millis(20),
            ..RunnerConfig::default()
        },
    ))
}

/// Drives `runner` until saga `id` is `state` (at most 30 s).
async fn until(runner: &Arc<EffectRunner>, sagas: &SagaOperator, id: &str, state: SagaState) {
    let started = Instant::now();
    loop {
        runner.run_once().await.unwrap();
        let saga = sagas.get(id).await.unwrap().unwrap();
        if saga.state == state {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "saga {id} is {} ({:?}), not {state}",
            saga.state,
            saga.error
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn run(url: &str, args: &[&str]) -> Output {
    oncely_testkit::process::command(env!("CARGO_BIN_EXE_oncely"))
        .args(["saga", "--database-url", url])
        .args(args)
        .stderr(Stdio::piped())
        .output()
        .unwrap()
}

fn stdout(out: &Output) -> String {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

/// A saga parked in `needs_review` is listed by state, shown with its step log, the
/// refusal as evidence and its effects' attempts; `retry` sends the parked step's effect
/// again under its next key (audited) and the saga waits for it again; a saga that is
/// not in review is not retried.
#[allow(
    clippy::too_many_lines,
    reason = "one parked saga through every operator command, read top to bottom"
)]
pub(crate) async fn saga_commands_list_show_and_retry_a_parked_saga_with_its_audit(t: TestDb) {
    t.db.migrate().await.unwrap();
    let sim = ShippingSim::new(SimShipping {
        undeliverable_skus: [UNDELIVERABLE.to_owned()].into(),
        ..SimShipping::default()
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let sim_url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(oncely_sim::serve(
        listener,
        sim.router(),
        std::future::pending(),
    ));
    let orchestrator = Arc::new(
        Orchestrator::new(
            t.db.clone(),
            vec![definition()],
            OrchestratorConfig::default(),
        )
        .unwrap(),
    );
    let runner = runner(&t.db, &sim_url, orchestrator.clone());
    let sagas = SagaOperator::new(t.db.clone());
    for (id, tenant) in [("saga-parked", "acme"), ("saga-other", "globex")] {
        let mut tx = t.db.begin().await.unwrap();
        let input = json!({"order_id": id});
        let new = NewSaga {
            id,
            tenant,
            kind: KIND,
            input: &input,
        };
        orchestrator.start(&mut tx, &new).await.unwrap();
        tx.commit().await.unwrap();
    }
    until(&runner, &sagas, "saga-parked", SagaState::NeedsReview).await;
    until(&runner, &sagas, "saga-other", SagaState::NeedsReview).await;

    let listed: Vec<Value> = stdout(&run(&t.url, &["list", "--state", "needs-review", "--json"]))
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let mut ids: Vec<_> = listed.iter().map(|s| s["id"].as_str().unwrap()).collect();
    ids.sort_unstable();
    assert_eq!(ids, ["saga-other", "saga-parked"]);
    let one: Vec<String> = stdout(&run(&t.url, &["list", "--tenant", "acme"]))
        .lines()
        .map(str::to_owned)
        .collect();
    assert_eq!(one.len(), 2, "a header and acme's saga: {one:?}");
    assert!(
        one[1].starts_with("saga-parked\tacme\tcli-ship\tneeds_review\t1\t"),
        "{one:?}"
    );
    // The table's time is RFC 3339 UTC (`2026-12-05T20:41:07.123Z`), not Unix ms.
    let updated_at = one[1].split('\t').nth(5).unwrap();
    assert!(
        updated_at.len() == 24 && updated_at.ends_with('Z') && updated_at.as_bytes()[10] == b'T',
        "{updated_at}"
    );
    // The state as the output prints it is accepted back.
    let printed = stdout(&run(&t.url, &["list", "--state", "needs_review", "--json"]));
    assert_eq!(printed.lines().count(), 2, "{printed}");
    let none = stdout(&run(&t.url, &["list", "--state", "completed", "--json"]));
    assert!(none.is_empty(), "{none}");

    let show: Value =
        serde_json::from_str(&stdout(&run(&t.url, &["show", "saga-parked"]))).unwrap();
    assert_eq!(show["state"], "needs_review");
    assert_eq!(show["input"]["order_id"], "saga-parked");
    let steps = show["steps"].as_array().unwrap();
    let log: Vec<_> = steps
        .iter()
        .map(|s| (s["name"].as_str().unwrap(), s["state"].as_str().unwrap()))
        .collect();
    assert_eq!(log, [("ship", "succeeded"), ("gift", "needs_review")]);
    assert!(
        steps[1]["evidence"]
            .as_str()
            .unwrap()
            .contains("cannot be shipped"),
        "{show:#}"
    );
    assert_eq!(steps[1]["effect"]["state"], "failed");
    assert_eq!(steps[1]["effect"]["evidence"][0]["http_status"], 422);
    assert_eq!(steps[0]["effect"]["state"], "succeeded");

    let retry: Value = serde_json::from_str(&stdout(&run(
        &t.url,
        &["retry", "saga-parked", "--actor", "ops@acme"],
    )))
    .unwrap();
    assert_eq!(retry["state"], "running", "{retry}");
    assert_eq!(retry["retried"]["step"], "gift");
    let effect_id = steps[1]["effect"]["id"].as_str().unwrap();
    let effect = oncely_sql::EffectStore::new(t.db.clone())
        .get(effect_id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (effect.state_word.as_str(), effect.key_generation),
        ("absent", 1),
        "a refused effect is sent again under its next key"
    );
    let refused_before = sim.stats().refused;
    until(&runner, &sagas, "saga-parked", SagaState::NeedsReview).await;
    assert_eq!(
        sim.stats().refused,
        refused_before + 1,
        "the retried step reached the provider once more"
    );
    let show: Value =
        serde_json::from_str(&stdout(&run(&t.url, &["show", "saga-parked"]))).unwrap();
    let audit = show["audit"].as_array().unwrap();
    assert_eq!(audit.len(), 1, "{show:#}");
    assert_eq!(
        (
            audit[0]["actor"].as_str(),
            audit[0]["action"].as_str(),
            audit[0]["from"].as_str(),
            audit[0]["to"].as_str(),
            audit[0]["step"].as_str()
        ),
        (
            Some("ops@acme"),
            Some("retry"),
            Some("needs_review"),
            Some("running"),
            Some("gift")
        )
    );
    assert_eq!(
        show["steps"][1]["effect"]["state"], "failed",
        "refused again"
    );

    let mut tx = t.db.begin().await.unwrap();
    let input = json!({"order_id": "saga-done"});
    let new = NewSaga {
        id: "saga-running",
        tenant: "acme",
        kind: KIND,
        input: &input,
    };
    orchestrator.start(&mut tx, &new).await.unwrap();
    tx.commit().await.unwrap();
    let refused = run(&t.url, &["retry", "saga-running"]);
    assert!(
        !refused.status.success(),
        "only a saga in review is retried"
    );
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("only a saga in needs_review"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    let missing = run(&t.url, &["show", "no-such-saga"]);
    assert!(!missing.status.success());
}
