//! The `oncely` binary as a process: migrations, the relay (with SIGTERM drains, an
//! aborted process, a broker outage, SIGKILLed at random), the operator commands
//! (outbox, inbox on every broker, effects, saga, idempotency, reconcile), `oncely sim` and
//! `oncely consume --deliver-to` (module `deliver`).
//! The order service's binary (`orders serve`, its consumers, `orders import`) is tested
//! in apps/orders's acceptance tests (module `binary`).

use oncely_testkit::process::{ProcessGuard, SpawnTied as _};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use oncely_testkit::TestDb;
use serde_json::Value;

#[path = "cli/deliver.rs"]
mod deliver;

#[path = "cli/idempotency.rs"]
mod idempotency;
use idempotency::idempotency_resolve_stores_a_found_answer_or_frees_the_key_with_an_audit_row;

#[path = "cli/reconcile.rs"]
mod reconcile;
use reconcile::reconcile_command_reports_as_json_and_table_and_resolve_writes_an_audit_row;

#[path = "cli/operator.rs"]
mod operator;
use operator::{
    idempotency_list_shows_multi_phase_records_by_state,
    operator_commands_on_a_database_without_the_schema_fail_and_create_nothing,
    outbox_stats_dead_list_and_requeue_commands_show_and_revive_a_dead_event,
};

#[path = "cli/publish.rs"]
mod publish;

#[path = "cli/refusals.rs"]
mod refusals;

#[path = "cli/relay.rs"]
mod relay;
use relay::{
    relay_command_applies_oncely_schema_and_not_the_order_services,
    relay_process_aborted_after_confirm_is_republished_with_the_same_ids_and_jetstream_drops_the_copies,
};

#[path = "cli/saga.rs"]
mod saga;
use saga::saga_commands_list_show_and_retry_a_parked_saga_with_its_audit;

/// A child process, killed on drop.
struct Proc {
    child: Child,
}

impl Drop for Proc {
    fn drop(&mut self) {
        drop(self.child.kill());
        drop(self.child.wait());
    }
}

oncely_testkit::matrix! {
    tests: [
        idempotency_list_shows_multi_phase_records_by_state,
        idempotency_resolve_stores_a_found_answer_or_frees_the_key_with_an_audit_row,
        saga_commands_list_show_and_retry_a_parked_saga_with_its_audit,
        reconcile_command_reports_as_json_and_table_and_resolve_writes_an_audit_row,
        outbox_stats_dead_list_and_requeue_commands_show_and_revive_a_dead_event,
        relay_process_aborted_after_confirm_is_republished_with_the_same_ids_and_jetstream_drops_the_copies,
        operator_commands_on_a_database_without_the_schema_fail_and_create_nothing,
        relay_command_applies_oncely_schema_and_not_the_order_services,
        default_idle_transaction_timeout_is_set_on_every_session_and_bounds_recovery_within_90_s,
    ],
    cannot_apply: [
        // PostgreSQL and MariaDB only: an embedded SQLite database dies with its process, so a
        // partition cannot leave its sessions behind.
        default_idle_transaction_timeout_is_set_on_every_session_and_bounds_recovery_within_90_s on sqlite,
    ],
}

/// Slack on top of the idle-transaction timeout for a second server to complete every key
/// of a vanished one: the second server's start-up, a retry interval and request time.
/// README states the bound: idle-transaction timeout + 5 s (65 s with the defaults).
const PARTITION_SLACK: Duration = Duration::from_secs(5);

/// The default idle-transaction timeout is what every pooled session gets, and with the
/// slack the partition test allows it bounds recovery from a vanished server within 90 s.
async fn default_idle_transaction_timeout_is_set_on_every_session_and_bounds_recovery_within_90_s(
    t: TestDb,
) {
    let opts = oncely_sql::DbOptions::default();
    let db = oncely_sql::Database::connect(&t.url, &opts).await.unwrap();
    let sql = match db {
        oncely_sql::Database::MySql(_) => {
            "SELECT CAST(@@SESSION.idle_transaction_timeout AS SIGNED)"
        }
        _ => {
            "SELECT setting::bigint / 1000 FROM pg_settings \
             WHERE name = 'idle_in_transaction_session_timeout'"
        }
    };
    // Several sessions at once, so each comes from its own pooled connection.
    let mut sessions = Vec::new();
    for _ in 0..3 {
        sessions.push(db.begin().await.unwrap());
    }
    for tx in &mut sessions {
        let secs: i64 =
            oncely_sql::on_tx!(tx, |c| sqlx::query_scalar(sql).fetch_one(c).await).unwrap();
        assert_eq!(secs.unsigned_abs(), opts.idle_transaction_timeout.as_secs());
        let recovery = Duration::from_secs(secs.unsigned_abs()) + PARTITION_SLACK;
        assert!(recovery <= Duration::from_secs(90), "{recovery:?}");
    }
}

/// Operator commands read what a service wrote: a SQLite file that is not there (wrong path
/// or working directory) is an error, and no empty database is left behind.
#[tokio::test]
async fn operator_commands_refuse_a_missing_sqlite_file() {
    let dir = std::env::temp_dir().join(format!("oncely-missing-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("nowhere.db");
    let url = format!("sqlite://{}", file.display());
    for args in [
        &["outbox", "stats"][..],
        &["outbox", "dead", "list"],
        &["inbox", "dead", "list"],
    ] {
        let out = oncely_testkit::process::command(env!("CARGO_BIN_EXE_oncely"))
            .args(args)
            .args(["--database-url", &url])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(
            stderr.contains("no SQLite database at"),
            "{args:?}: {stderr}"
        );
        assert!(out.stdout.is_empty(), "{args:?} printed a result");
        assert!(!file.exists(), "{args:?} created {}", file.display());
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The names of the tables in `t`'s database (PostgreSQL: its schema).
async fn table_names(t: &TestDb) -> Vec<String> {
    let sql = match &t.db {
        oncely_sql::Database::Sqlite(_) => "SELECT name FROM sqlite_master WHERE type = 'table'",
        oncely_sql::Database::Postgres(_) => {
            "SELECT table_name::text FROM information_schema.tables \
             WHERE table_schema = current_schema()"
        }
        oncely_sql::Database::MySql(_) => {
            "SELECT CAST(table_name AS CHAR) FROM information_schema.tables \
             WHERE table_schema = DATABASE()"
        }
    };
    oncely_sql::on_pool!(&t.db, |p| sqlx::query_scalar::<_, String>(sql)
        .fetch_all(p)
        .await)
    .unwrap()
}

/// `oncely sim payments` serves the Stripe subset on the address it prints: one confirmed
/// PaymentIntent is created with the configured secret key and counted at the provider.
#[tokio::test]
async fn sim_payments_command_prints_its_address_and_creates_one_intent() {
    let mut child = oncely_testkit::process::command(env!("CARGO_BIN_EXE_oncely"))
        .args(["sim", "payments", "--listen", "127.0.0.1:0"])
        .args(["--secret-key", "sk_test_cli_sim", "--search-lag-ms", "0"])
        .args(["--fault", "error_after=0", "--seed", "7"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn_tied()
        .expect("spawn oncely sim");
    let stdout = child.stdout.take().unwrap();
    let p = Proc { child };
    let line = BufReader::new(stdout)
        .lines()
        .next()
        .expect("oncely sim exited before listening")
        .unwrap();
    let addr = line
        .strip_prefix("payments simulator listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"));
    let base = format!("http://{addr}");
    let client = reqwest::Client::new();
    let res = client
        .post(format!("{base}/v1/payment_intents"))
        .bearer_auth("sk_test_cli_sim")
        .header("Idempotency-Key", "cli-sim-1")
        .form(&[
            ("amount", "1250"),
            ("currency", "eur"),
            ("confirm", "true"),
            ("payment_method", "pm_card_visa"),
            ("metadata[invoice_id]", "inv-cli"),
        ])
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    let pi: Value = res.json().await.unwrap();
    assert_eq!(pi["status"], "succeeded");
    assert_eq!(pi["metadata"]["invoice_id"], "inv-cli");
    let found: Value = client
        .get(format!("{base}/v1/payment_intents/search"))
        .query(&[("query", "metadata['invoice_id']:'inv-cli'")])
        .bearer_auth("sk_test_cli_sim")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(found["data"][0]["id"], pi["id"]);
    let stats: Value = reqwest::get(format!("{base}/_sim/stats"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(stats["payment_intents"], 1);
    drop(p);
}

fn outbox_event(topic: &str, partition: &str, n: usize) -> oncely_sql::OutboxEvent {
    oncely_sql::OutboxEvent::new(
        oncely_core::MessageId::new_random(),
        topic,
        partition,
        "order.created",
        format!("{{\"n\":{n}}}").into_bytes(),
    )
}

async fn enqueue(t: &TestDb, events: &[oncely_sql::OutboxEvent]) -> Vec<i64> {
    let mut tx = t.db.begin().await.unwrap();
    let mut ids = Vec::new();
    for e in events {
        ids.push(oncely_sql::OutboxStore::enqueue(&mut tx, e).await.unwrap());
    }
    tx.commit().await.unwrap();
    ids
}

/// Waits for `child` to exit (30 s at most) and returns its status.
async fn wait_exit(child: &mut Child) -> std::process::ExitStatus {
    for _ in 0..300 {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("process did not exit within 30 s");
}

/// Most stderr lines `oncely relay` may write from the moment RabbitMQ is cut until every
/// waiting event is published after it is back: the broker's two state changes (down with
/// its cause, up with the outage's length) — whatever the number of events waiting and the
/// length of the outage. (Before the fix: a line per event and attempt, and lapin's three
/// lines per failed reconnection, about 45 a minute here.)
const OUTAGE_LOG_LINES: usize = 2;

/// A real `oncely relay` process (SQLite outbox, RabbitMQ through a [`FaultProxy`],
/// defaults but a short backoff), stderr piped as in production under systemd or a
/// container: an unroutable event first (RabbitMQ returns it twice, then it is dead), then a
/// 60 s outage while 100 events wait. The outage costs at most [`OUTAGE_LOG_LINES`] lines,
/// none of them lapin's dump of a returned message (off by default), no line carries
/// colour codes (stderr is not a terminal), and `/metrics` shows the broker down during
/// the outage and up after it. Every event is published after the outage, none dead.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[allow(
    clippy::too_many_lines,
    reason = "one outage scenario with its broker, process and log checks, read top to bottom"
)]
async fn relay_process_logs_a_60_s_rabbitmq_outage_with_100_events_waiting_in_a_few_plain_lines() {
    use lapin::options::{
        ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
        QueueDeleteOptions,
    };
    use lapin::types::FieldTable;
    let amqp = oncely_testkit::amqp_url();
    if !oncely_testkit::service_reachable("RabbitMQ", &amqp).await {
        return;
    }
    let Some(t) = TestDb::new(oncely_testkit::TestBackend::Sqlite).await else {
        return;
    };
    t.db.migrate().await.unwrap();
    let authority = oncely_testkit::url_authority(&amqp).unwrap();
    let target = tokio::net::lookup_host(&authority)
        .await
        .unwrap()
        .next()
        .unwrap();
    let proxy = oncely_testkit::FaultProxy::start(target).await;
    let proxied = amqp.replacen(&authority, &proxy.addr().to_string(), 1);
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    let (exchange, topic, queue) = (
        format!("logs.{suffix}"),
        format!("logs.{suffix}.orders"),
        format!("logs.{suffix}.q"),
    );
    let conn = lapin::Connection::connect(&amqp, oncely_broker::amqp_connection_properties())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.exchange_declare(
        &exchange,
        lapin::ExchangeKind::Topic,
        ExchangeDeclareOptions {
            durable: true,
            ..ExchangeDeclareOptions::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.queue_declare(
        &queue,
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.queue_bind(
        &queue,
        &exchange,
        &topic,
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    enqueue(
        &t,
        &[
            outbox_event(&format!("{topic}.nowhere"), "lost", 0),
            outbox_event(&topic, "warm", 0),
        ],
    )
    .await;
    let mut cmd = oncely_testkit::process::command(env!("CARGO_BIN_EXE_oncely"));
    cmd.args(["relay", "--database-url", &t.url, "--broker", "rabbitmq"])
        .args(["--amqp-url", &proxied, "--amqp-exchange", &exchange])
        .args(["--relay-max-attempts", "2", "--relay-backoff-base-ms", "50"])
        .args(["--relay-backoff-cap-secs", "1", "--relay-poll-ms", "50"])
        .args(["--metrics-listen", "127.0.0.1:0"])
        .env_remove("ONCELY_LOG")
        .env_remove("ONCELY_LOG_FORMAT")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut relay = ProcessGuard::spawn(cmd).expect("spawn oncely relay");
    let lines: Arc<std::sync::Mutex<Vec<String>>> = Arc::default();
    {
        let lines = lines.clone();
        let mut stderr = BufReader::new(relay.child.stderr.take().unwrap());
        std::thread::spawn(move || loop {
            let mut line = Vec::new();
            match stderr.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => lines
                    .lock()
                    .unwrap()
                    .push(String::from_utf8_lossy(&line).into_owned()),
            }
        });
    }
    let store = oncely_sql::OutboxStore::new(t.db.clone());
    // Nothing pending, the unroutable event dead.
    let settled = || async {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let s = store.stats().await.unwrap();
            if s.pending == 0 && s.dead == 1 {
                return;
            }
            assert!(std::time::Instant::now() < deadline, "not settled: {s:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    settled().await;
    let metrics_addr = lines
        .lock()
        .unwrap()
        .iter()
        .find(|l| l.contains("metrics on /metrics"))
        .and_then(|l| l.split("listen=").nth(1))
        .map(|a| a.trim().to_owned())
        .expect("metrics address logged");
    let broker_up = || {
        let url = format!("http://{metrics_addr}/metrics");
        async move {
            let text = reqwest::get(&url).await.unwrap().text().await.unwrap();
            text.lines()
                .find(|l| {
                    l.starts_with("oncely_dependency_up{")
                        && l.contains("dependency=\"broker\"")
                        && l.contains("component=\"relay\"")
                })
                .and_then(|l| l.rsplit(' ').next())
                .map(str::to_owned)
        }
    };
    assert_eq!(broker_up().await.as_deref(), Some("1"));
    let before = lines.lock().unwrap().len();
    proxy.cut();
    let events: Vec<_> = (0..100)
        .map(|i| outbox_event(&topic, &format!("p-{}", i % 10), i))
        .collect();
    enqueue(&t, &events).await;
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert_eq!(
        broker_up().await.as_deref(),
        Some("0"),
        "broker down in /metrics"
    );
    assert_eq!(store.stats().await.unwrap().pending, 100, "events wait");
    proxy.restore();
    settled().await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(broker_up().await.as_deref(), Some("1"), "broker up again");
    let outage = lines.lock().unwrap()[before..].to_vec();
    assert!(Command::new("kill")
        .arg(relay.id().to_string())
        .status()
        .unwrap()
        .success());
    wait_exit(&mut relay.child).await;
    let lines = lines.lock().unwrap().clone();
    println!("{} lines during the outage:", outage.len());
    for l in &outage {
        print!("  {l}");
    }
    assert!(
        outage.len() <= OUTAGE_LOG_LINES,
        "{} lines for one outage (bound {OUTAGE_LOG_LINES}): {outage:#?}",
        outage.len()
    );
    assert!(
        outage.iter().any(|l| l.contains("is unavailable")),
        "the outage is reported: {outage:#?}"
    );
    assert!(
        outage.iter().any(|l| l.contains("available again")),
        "the recovery is reported: {outage:#?}"
    );
    assert!(
        !lines.iter().any(|l| l.contains("returned us a message")),
        "lapin's dump of a returned message is off by default"
    );
    assert!(
        !lines.iter().any(|l| l.contains('\u{1b}')),
        "no colour codes on piped stderr: {lines:#?}"
    );
    drop(ch.queue_delete(&queue, QueueDeleteOptions::default()).await);
    drop(
        ch.exchange_delete(&exchange, ExchangeDeleteOptions::default())
            .await,
    );
    drop(conn.close(200, "bye").await);
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// xorshift64*: reproducible from the printed seed (as far as scheduling allows).
#[derive(Clone)]
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// Relay processes SIGKILLed at random (see the module's first comment).
#[path = "cli/kill.rs"]
mod kill;
