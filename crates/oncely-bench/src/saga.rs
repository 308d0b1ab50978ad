//! `oncely-bench saga`: milliseconds per durable saga step (p50/p99) beside the same steps
//! run in memory, in one run, as a ratio.
//!
//! Durable: a saga of three effect steps (two compensable, the pivot) started in its own
//! transaction and driven by the real effect runner, one round at a time (no polling
//! pause), with the orchestrator as its handler — per step one claim transaction (the
//! call's intent turned `in_flight`) and one settle transaction (the effect's result, the
//! step's completion, the saga's transition and the next step's intent). The provider
//! answers from memory, so the figure is the store's cost, not a network's. In memory: the
//! same parameters built and the same provider called, the saga's state in a map.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use clap::Args;
use futures_util::future::BoxFuture;
use oncely_effects::{
    CallOutcome, EffectRequest, EffectRunner, ListPage, ObjectState, Provider, ProviderError,
    RemoteObject, RunnerConfig, StatusOutcome, StatusQuery,
};
use oncely_saga::{
    Action, NewSaga, Orchestrator, OrchestratorConfig, SagaDefinition, SagaState, Step,
    StepContext, StepError,
};
use oncely_sql::{DbOptions, EffectStore};
use oncely_testkit::TestDb;
use serde_json::{json, Value};

use crate::stats::quantile;

#[derive(Debug, Args)]
pub(crate) struct SagaBenchArgs {
    /// Database to measure on; a fresh schema (PostgreSQL), database (MySQL) or file
    /// (SQLite) is used.
    #[arg(
        long,
        env = "ONCELY_TEST_POSTGRES_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/test"
    )]
    database_url: String,
    /// Sagas run per side, one after another.
    #[arg(long, default_value_t = 300)]
    sagas: u32,
}

const STEPS: [&str; 3] = ["reserve", "charge", "ship"];
const KIND: &str = "bench";

/// A provider that answers at once from memory, honouring keys as Stripe does.
#[derive(Debug, Default)]
struct MemoryProvider {
    objects: Mutex<HashMap<String, RemoteObject>>,
}

impl MemoryProvider {
    fn answer(&self, request: &EffectRequest) -> RemoteObject {
        let mut objects = self
            .objects
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let n = objects.len();
        objects
            .entry(request.key.clone())
            .or_insert_with(|| RemoteObject {
                id: format!("obj_{n}"),
                status: "succeeded".into(),
                state: ObjectState::Live,
                reference: Some(request.reference.clone()),
                amount: None,
                currency: None,
                created: None,
                raw: json!({"id": format!("obj_{n}"), "params": request.params}),
            })
            .clone()
    }
}

impl Provider for MemoryProvider {
    fn name(&self) -> &'static str {
        "memory"
    }

    fn honours_keys(&self) -> bool {
        true
    }

    fn call<'a>(&'a self, request: &'a EffectRequest) -> BoxFuture<'a, CallOutcome> {
        Box::pin(async move { CallOutcome::Succeeded(self.answer(request)) })
    }

    fn status<'a>(
        &'a self,
        query: StatusQuery<'a>,
    ) -> BoxFuture<'a, Result<StatusOutcome, ProviderError>> {
        Box::pin(async move {
            let objects = self
                .objects
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            Ok(match objects.get(&query.request.key) {
                Some(o) => StatusOutcome::Found(vec![o.clone()]),
                None => StatusOutcome::Absent,
            })
        })
    }

    fn list<'a>(
        &'a self,
        _operation: &'a str,
        _since: SystemTime,
        _cursor: Option<&'a str>,
    ) -> BoxFuture<'a, Result<ListPage, ProviderError>> {
        Box::pin(async {
            Ok(ListPage {
                objects: Vec::new(),
                next: None,
            })
        })
    }
}

fn params(ctx: &StepContext) -> Value {
    json!({"order_id": ctx.input["order_id"], "step": ctx.step})
}

/// [`params`] as a step's parameter builder.
#[allow(clippy::unnecessary_wraps)] // the builder's signature: other steps can refuse
fn build(ctx: &StepContext) -> Result<Value, StepError> {
    Ok(params(ctx))
}

fn definition() -> anyhow::Result<SagaDefinition> {
    let step = |name: &str| {
        Step::effect(name, "memory", "do", build)
            .compensated_by(Action::effect("memory", "undo", build))
    };
    Ok(SagaDefinition::builder(KIND)
        .compensable(step(STEPS[0]))
        .compensable(step(STEPS[1]))
        .pivot(Step::effect(STEPS[2], "memory", "do", build))
        .build()?)
}

pub(crate) async fn run(args: SagaBenchArgs) -> anyhow::Result<()> {
    let t = TestDb::fresh(
        &args.database_url,
        &DbOptions {
            max_connections: 4,
            ..DbOptions::default()
        },
    )
    .await
    .ok_or_else(|| anyhow::anyhow!("database unreachable"))?;
    t.db.migrate().await?;
    let provider = Arc::new(MemoryProvider::default());
    let orchestrator = Arc::new(Orchestrator::new(
        t.db.clone(),
        vec![definition()?],
        OrchestratorConfig::default(),
    )?);
    let runner = Arc::new(EffectRunner::new(
        EffectStore::new(t.db.clone()),
        vec![provider.clone() as Arc<dyn Provider>],
        orchestrator.clone(),
        RunnerConfig::default(),
    ));
    println!(
        "saga bench on {}: {} sagas of {} effect steps per side, one at a time",
        t.db.backend(),
        args.sagas,
        STEPS.len()
    );
    let mut durable = Vec::new();
    for n in 0..args.sagas {
        durable.push(durable_saga(&orchestrator, &runner, n).await? / STEPS.len() as f64);
    }
    let mut memory = Vec::new();
    for n in 0..args.sagas {
        memory.push(memory_saga(&provider, n).await / STEPS.len() as f64);
    }
    durable.sort_by(f64::total_cmp);
    memory.sort_by(f64::total_cmp);
    for (name, q) in [("p50", 0.5), ("p99", 0.99)] {
        let (d, m) = (
            quantile(&durable, q).unwrap_or(0.0),
            quantile(&memory, q).unwrap_or(0.0),
        );
        println!(
            "  {name}: durable {d:.3} ms per step, in memory {m:.4} ms per step, ratio {:.0}x",
            d / m.max(1e-6)
        );
    }
    Ok(())
}

/// One durable saga, start to completion; its wall time in ms.
async fn durable_saga(
    orchestrator: &Orchestrator,
    runner: &Arc<EffectRunner>,
    n: u32,
) -> anyhow::Result<f64> {
    let id = format!("bench-{n}-{}", uuid::Uuid::now_v7());
    let input = json!({"order_id": format!("ord-{n}")});
    let started = Instant::now();
    let mut tx = orchestrator.database().begin().await?;
    orchestrator
        .start(
            &mut tx,
            &NewSaga {
                id: &id,
                tenant: "bench",
                kind: KIND,
                input: &input,
            },
        )
        .await?;
    tx.commit().await?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        runner.run_once().await?;
        let saga = orchestrator
            .get("bench", &id)
            .await?
            .ok_or_else(|| anyhow::anyhow!("saga {id} vanished"))?;
        match saga.state {
            SagaState::Completed => break,
            SagaState::Running if Instant::now() < deadline => {}
            other => anyhow::bail!("saga {id} is {other}: {:?}", saga.error),
        }
    }
    Ok(started.elapsed().as_secs_f64() * 1000.0)
}

/// The same three steps in memory: parameters built, provider called, state in a map
/// with its version raised per transition; wall time in ms.
async fn memory_saga(provider: &MemoryProvider, n: u32) -> f64 {
    let started = Instant::now();
    let id = format!("mem-{n}");
    let mut state: HashMap<String, (i64, usize, HashMap<String, Value>)> = HashMap::new();
    state.insert(id.clone(), (0, 0, HashMap::new()));
    for (i, step) in STEPS.iter().enumerate() {
        let ctx = StepContext {
            saga_id: id.clone(),
            tenant: "bench".into(),
            kind: KIND.into(),
            step: (*step).to_owned(),
            attempt: 1,
            input: json!({"order_id": format!("ord-{n}")}),
            outputs: std::collections::BTreeMap::new(),
        };
        let request = EffectRequest {
            operation: "do".into(),
            reference: format!("{id}:{step}"),
            key: format!("{id}:{step}"),
            params: params(&ctx),
        };
        if let CallOutcome::Succeeded(o) = provider.call(&request).await {
            if let Some(s) = state.get_mut(&id) {
                s.0 += 1;
                s.1 = i + 1;
                s.2.insert((*step).to_owned(), o.raw);
            }
        }
    }
    std::hint::black_box(&state);
    started.elapsed().as_secs_f64() * 1000.0
}
