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

#[path = "cli/publish.rs"]
mod publish;

#[path = "cli/refusals.rs"]
mod refusals;

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

/// Operator commands migrate nothing (issue 14 §9): on a database without oncely's schema
/// each fails, saying so, creates no table and prints no sqlx notice; once `oncely
/// migrate` has run, each answers and prints only its answer.
async fn operator_commands_on_a_database_without_the_schema_fail_and_create_nothing(t: TestDb) {
    let commands: [&[&str]; 5] = [
        &["outbox", "stats"],
        &["outbox", "dead", "list"],
        &["outbox", "dead", "requeue", "--all"],
        &["inbox", "dead", "list"],
        &["inbox", "dead", "requeue", "--all"],
    ];
    let run = |args: &[&str]| {
        oncely_testkit::process::command(env!("CARGO_BIN_EXE_oncely"))
            .args(args)
            .args(["--database-url", &t.url])
            .env_remove("ONCELY_LOG")
            .output()
            .unwrap()
    };
    for args in commands {
        let out = run(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded: {stderr}");
        assert!(
            stderr.contains("no oncely schema in") && stderr.contains("oncely migrate"),
            "{args:?}: {stderr}"
        );
        assert!(
            !stderr.contains("sqlx") && !stderr.contains("NOTICE"),
            "{args:?} printed sqlx output: {stderr}"
        );
        assert!(out.stdout.is_empty(), "{args:?} printed a result");
        assert_eq!(table_names(&t).await, Vec::<String>::new(), "{args:?}");
    }
    let migrate = oncely_testkit::process::command(env!("CARGO_BIN_EXE_oncely"))
        .args(["migrate", "--database-url", &t.url])
        .output()
        .unwrap();
    assert!(migrate.status.success());
    for args in commands {
        let out = run(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{args:?}: {stderr}");
        assert!(
            stderr.is_empty(),
            "{args:?} printed more than its answer: {stderr}"
        );
        assert!(!out.stdout.is_empty(), "{args:?} printed no answer");
    }
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

/// `oncely idempotency list --state processing|unknown`: the multi-phase records a holder
/// still leases, and those whose lease ran out, each in its own listing.
async fn idempotency_list_shows_multi_phase_records_by_state(t: TestDb) {
    use oncely_core::{Fingerprint, IdempotencyKey, Operation, Scope, TenantId};
    t.db.migrate().await.unwrap();
    let store = oncely_sql::IdempotencyStore::new(t.db.clone(), Duration::from_secs(60));
    let scope = Scope::new(
        TenantId::parse("acme").unwrap(),
        Operation::new("POST", "/v1/orders/{id}/payments"),
    );
    let fp = Fingerprint::compute("POST", "/p", "/p", None, b"").unwrap();
    let now = oncely_core::now_ms();
    for (k, lease) in [("k-held", 60_000), ("k-lost", 1)] {
        let key = IdempotencyKey::parse(k.as_bytes()).unwrap();
        let r = store
            .reserve_leased(&scope, &key, &fp, now, Duration::from_millis(lease))
            .await
            .unwrap();
        assert!(matches!(r, oncely_sql::LeaseReservation::Leased(_)));
    }
    assert_eq!(store.expire_leases(now + 1_000, 10).await.unwrap(), 1);
    let run = |args: &[&str]| {
        let out = oncely_testkit::process::command(env!("CARGO_BIN_EXE_oncely"))
            .args(["idempotency", "--database-url", &t.url, "list"])
            .args(args)
            .stderr(Stdio::null())
            .output()
            .unwrap();
        assert!(out.status.success());
        String::from_utf8(out.stdout).unwrap()
    };
    let unknown = run(&["--state", "unknown"]);
    assert!(
        unknown.contains("acme\tPOST /v1/orders/{id}/payments\tk-lost\tunknown\t1\t"),
        "{unknown}"
    );
    assert!(!unknown.contains("k-held"), "{unknown}");
    let processing = run(&["--state", "processing", "--json"]);
    let rows: Vec<Value> = processing
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 1, "{processing}");
    assert_eq!(rows[0]["key"], "k-held");
    assert_eq!(rows[0]["state"], "processing");
    assert_eq!(rows[0]["fence"], 1);
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

async fn outbox_stats_dead_list_and_requeue_commands_show_and_revive_a_dead_event(t: TestDb) {
    t.db.migrate().await.unwrap();
    let events: Vec<_> = ["a", "b", "c"]
        .iter()
        .enumerate()
        .map(|(n, p)| outbox_event("ops", p, n))
        .collect();
    let ids = enqueue(&t, &events).await;
    let store = oncely_sql::OutboxStore::new(t.db.clone());
    let claimed = store
        .claim(
            "op-test",
            10,
            Duration::from_secs(30),
            oncely_core::now_ms(),
        )
        .await
        .unwrap();
    assert_eq!(claimed.len(), 3);
    let outcome = store
        .reschedule("op-test", ids[0], "unroutable\tto nowhere", 0, 1)
        .await
        .unwrap();
    assert_eq!(outcome, oncely_sql::Rescheduled::Dead);
    store.release("op-test", &ids[1..]).await.unwrap();
    // `--database-url` after the leaf subcommand, where an operator types it.
    let run = |args: &[&str]| {
        oncely_testkit::process::command(env!("CARGO_BIN_EXE_oncely"))
            .arg("outbox")
            .args(args)
            .args(["--database-url", &t.url])
            .stderr(Stdio::null())
            .output()
            .unwrap()
    };
    let stats = |out: std::process::Output| -> Value {
        assert!(out.status.success());
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let s = stats(run(&["stats"]));
    assert_eq!(
        (s["pending"].as_u64(), s["dead"].as_u64()),
        (Some(2), Some(1)),
        "{s}"
    );
    assert!(s["oldest_pending_age_seconds"].as_f64().unwrap() >= 0.0);

    let list = run(&["dead", "list"]);
    assert!(list.status.success());
    let out = String::from_utf8(list.stdout).unwrap();
    let line = format!(
        "{}\t{}\tops\ta\torder.created\t1\tunroutable to nowhere",
        ids[0], events[0].message_id
    );
    assert!(out.lines().any(|l| l == line), "{out}");
    assert_eq!(
        out.lines().count(),
        2,
        "header and the one dead event: {out}"
    );

    let requeue = run(&["dead", "requeue", &ids[0].to_string()]);
    assert!(requeue.status.success());
    assert!(String::from_utf8(requeue.stdout)
        .unwrap()
        .contains("requeued 1"));
    let again = run(&["dead", "requeue", &ids[0].to_string()]);
    assert!(!again.status.success(), "nothing dead any more");
    assert!(
        again.stdout.is_empty(),
        "a failed requeue prints no count: {:?}",
        String::from_utf8_lossy(&again.stdout)
    );
    let all = run(&["dead", "requeue", "--all"]);
    assert!(all.status.success());
    assert!(String::from_utf8(all.stdout)
        .unwrap()
        .contains("requeued 0"));
    let s = stats(run(&["stats"]));
    assert_eq!(
        (s["pending"].as_u64(), s["dead"].as_u64()),
        (Some(3), Some(0)),
        "{s}"
    );
    let row = store.get(ids[0]).await.unwrap().unwrap();
    assert_eq!(row.attempts, 0, "requeue resets the attempts");
    assert_eq!(row.state, oncely_sql::OutboxState::Pending);
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

/// Only the commands that use the orders schema (`serve`, `migrate`, `consume billing`) run
/// the order service's migrations: `oncely relay` on an empty database creates oncely's
/// tables (outbox, queue), not `orders` or `invoices`, and drains at SIGTERM.
async fn relay_command_applies_oncely_schema_and_not_the_order_services(t: TestDb) {
    let mut cmd = oncely_testkit::process::command(env!("CARGO_BIN_EXE_oncely"));
    cmd.args(["relay", "--database-url", &t.url])
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut relay = ProcessGuard::spawn(cmd).unwrap();
    // Started (signal handlers installed, publisher connected) once it says so.
    let stderr = relay.child.stderr.take().unwrap();
    let started = tokio::task::spawn_blocking(move || {
        let mut lines = BufReader::new(stderr).lines();
        let found = lines
            .by_ref()
            .map_while(Result::ok)
            .any(|l| l.contains("outbox relay starting"));
        // Keep draining so the relay never blocks on a full pipe.
        std::thread::spawn(move || lines.for_each(drop));
        found
    });
    let started = tokio::time::timeout(Duration::from_secs(30), started)
        .await
        .expect("the relay starts within 30 s")
        .unwrap();
    assert!(started, "the relay exited before starting");
    let tables = table_names(&t).await;
    assert!(tables.iter().any(|n| n == "oncely_outbox"), "{tables:?}");
    assert!(tables.iter().any(|n| n == "oncely_queue"), "{tables:?}");
    assert!(
        !tables.iter().any(|n| n == "orders" || n == "invoices"),
        "the relay created the order service's tables: {tables:?}"
    );
    let pid = relay.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let status = wait_exit(&mut relay.child).await;
    assert!(
        status.success(),
        "the relay drains and exits 0 at SIGTERM, got {status}"
    );
}

/// A relay *process* aborted at exactly the crash window of at-least-once publishing: the
/// broker confirmed the batch, the outbox does not record it. Another relay process
/// republishes those rows with the same message ids, and JetStream's duplicate window drops
/// the copies: the stream ends with one message per event.
async fn relay_process_aborted_after_confirm_is_republished_with_the_same_ids_and_jetstream_drops_the_copies(
    t: TestDb,
) {
    let nats_url = oncely_testkit::nats_url();
    if !oncely_testkit::service_reachable("NATS", &nats_url).await {
        return;
    }
    t.db.migrate().await.unwrap();
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    let topic = format!("kill.{suffix}");
    let stream = format!("KILL{suffix}");
    // 4 aggregates × 5 events: the first batch holds the 4 partition heads.
    let events: Vec<_> = (0..20)
        .map(|n| outbox_event(&topic, &format!("agg-{}", n % 4), n))
        .collect();
    let ids = enqueue(&t, &events).await;
    let relay = |fault: bool| {
        let mut c = oncely_testkit::process::command(env!("CARGO_BIN_EXE_oncely"));
        c.args(["relay", "--database-url", &t.url, "--broker", "nats"])
            .args(["--nats-url", &nats_url, "--nats-stream", &stream])
            .args(["--nats-subjects", &topic, "--relay-lease-secs", "2"])
            .args(["--relay-poll-ms", "50"])
            // Keep the published rows, so the test can read their state.
            .args(["--outbox-retention-secs", "3600"])
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if fault {
            c.env("FAILPOINTS", "relay.after_confirm=panic(abort)");
        }
        ProcessGuard::spawn(c).expect("spawn oncely relay")
    };
    let mut first = relay(true);
    let status = wait_exit(&mut first.child).await;
    assert!(!status.success(), "the faulted relay aborts: {status:?}");

    let client = async_nats::connect(&nats_url).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let mut s = js.get_stream(&stream).await.unwrap();
    let confirmed = s.info().await.unwrap().state.messages;
    assert_eq!(
        confirmed, 4,
        "the broker confirmed the first batch before the abort"
    );
    let store = oncely_sql::OutboxStore::new(t.db.clone());
    for id in &ids {
        assert_eq!(
            store.get(*id).await.unwrap().unwrap().state,
            oncely_sql::OutboxState::Pending,
            "the aborted relay recorded nothing"
        );
    }

    let second = relay(false);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while store.stats().await.unwrap().pending > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the second relay did not drain the outbox"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(second);
    for id in &ids {
        assert_eq!(
            store.get(*id).await.unwrap().unwrap().state,
            oncely_sql::OutboxState::Published
        );
    }
    // One message per event: the 4 republished copies carried the same Nats-Msg-Id and
    // were dropped inside the duplicate window.
    let info = s.info().await.unwrap().state.clone();
    assert_eq!(info.messages, 20, "one message per event, copies dropped");
    let mut seen = std::collections::HashSet::new();
    for seq in info.first_sequence..=info.last_sequence {
        let m = s.get_raw_message(seq).await.unwrap();
        let id = m
            .headers
            .get("Nats-Msg-Id")
            .map(|v| v.as_str().to_owned())
            .expect("message id header");
        assert!(seen.insert(id), "a duplicate reached the stream");
    }
    let expected: std::collections::HashSet<String> =
        events.iter().map(|e| e.message_id.to_string()).collect();
    assert_eq!(seen, expected);
    drop(js.delete_stream(&stream).await);
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
mod kill {
    // Chaos: several `oncely relay` *processes* on one PostgreSQL outbox, publishing to NATS
    // JetStream, SIGKILLed at random moments and restarted, while new events keep committing —
    // some of them late, so rows commit out of id order, also within one partition key.
    // Afterwards the stream must hold every event (at least once, a copy only under the same
    // `Nats-Msg-Id`), each partition's events in order, and the outbox must be empty.
    //
    // Knobs (environment): `ONCELY_KILL_SEED` (the PRNG seed, printed), `ONCELY_KILL_EVENTS`
    // (3000), `ONCELY_KILL_KEYS` (50), `ONCELY_KILL_LATE` (late-commit transactions, 300),
    // `ONCELY_KILL_KILLS` (at least this many SIGKILLs, 60). Relay logs go to
    // `$TMPDIR/oncely-kill-<suffix>/`.

    use std::collections::{BTreeMap, HashMap};
    use std::process::{Child, Stdio};

    use oncely_testkit::process::SpawnTied as _;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    use oncely_testkit::{TestBackend, TestDb};
    use serde_json::Value;

    use super::{env_u64, Rng};

    /// What the test knows of each event it committed.
    #[derive(Debug, Clone)]
    struct Sent {
        key: String,
        id: i64,
        /// Global commit sequence (commits are serialised by [`Producer::commit_lock`], so this
        /// is the order in which they became visible).
        commit_seq: u64,
    }

    #[derive(Clone)]
    struct Producer {
        db: oncely_sql::Database,
        topic: String,
        commit_lock: Arc<tokio::sync::Mutex<()>>,
        commit_seq: Arc<AtomicU64>,
        sent: Arc<Mutex<HashMap<String, Sent>>>,
    }

    impl Producer {
        /// Enqueues events for `keys` in one transaction, sleeps `hold` before committing.
        async fn commit(&self, keys: &[String], hold: Duration) {
            let mut tx = self.db.begin().await.unwrap();
            let mut pending = Vec::new();
            for key in keys {
                let mid = oncely_core::MessageId::new_random();
                let e = oncely_sql::OutboxEvent::new(
                    mid,
                    &self.topic,
                    key,
                    "order.created",
                    format!("{{\"k\":\"{key}\"}}").into_bytes(),
                );
                let id = oncely_sql::OutboxStore::enqueue(&mut tx, &e).await.unwrap();
                pending.push((mid.to_string(), key.clone(), id));
            }
            if !hold.is_zero() {
                tokio::time::sleep(hold).await;
            }
            let _g = self.commit_lock.lock().await;
            tx.commit().await.unwrap();
            let seq = self.commit_seq.fetch_add(1, Ordering::SeqCst);
            let mut sent = self.sent.lock().unwrap();
            for (mid, key, id) in pending {
                sent.insert(
                    mid,
                    Sent {
                        key,
                        id,
                        commit_seq: seq,
                    },
                );
            }
        }
    }

    struct Slot {
        child: Option<Child>,
        started: u64,
    }

    impl Slot {
        /// SIGKILLs the slot's relay, if one runs; true when it did. A relay that exited by
        /// itself fails the test.
        fn kill(&mut self) -> bool {
            let Some(mut c) = self.child.take() else {
                return false;
            };
            if let Some(status) = c.try_wait().unwrap() {
                panic!("relay {} exited by itself: {status:?}", self.started);
            }
            c.kill().unwrap();
            c.wait().unwrap();
            true
        }
    }

    /// A test that fails mid-run does not leave its relays (and their pools) running until
    /// the test binary exits.
    impl Drop for Slot {
        fn drop(&mut self) {
            if let Some(mut c) = self.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }

    fn spawn_relay(
        url: &str,
        nats: &str,
        stream: &str,
        topic: &str,
        extra: &[String],
        log: std::fs::File,
    ) -> Child {
        oncely_testkit::process::command(env!("CARGO_BIN_EXE_oncely"))
            .args(["relay", "--database-url", url, "--broker", "nats"])
            // Three relays run at once: a pool each of the LISTEN connection, the four
            // batches in flight and one for the loops, not the default 16 (PostgreSQL
            // allows 100 for the whole suite).
            .args(["--db-max-connections", "6"])
            .args([
                "--nats-url",
                nats,
                "--nats-stream",
                stream,
                "--nats-subjects",
                topic,
            ])
            .args(["--relay-batch", "16", "--relay-poll-ms", "50"])
            .args([
                "--relay-backoff-base-ms",
                "50",
                "--relay-backoff-cap-secs",
                "1",
            ])
            .args(extra)
            .env("ONCELY_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn_tied()
            .expect("spawn oncely relay")
    }

    fn outbox_stats(url: &str) -> Value {
        let out = oncely_testkit::process::command(env!("CARGO_BIN_EXE_oncely"))
            .args(["outbox", "stats", "--database-url", url])
            .stderr(Stdio::null())
            .output()
            .unwrap();
        assert!(out.status.success(), "outbox stats failed");
        serde_json::from_slice(&out.stdout).unwrap()
    }

    /// `dup_window`: `None` lets the relay create the stream (JetStream's default 2 min duplicate
    /// window: the stream must end with exactly one message per event); `Some(w)` creates it
    /// first with window `w`, so republished copies stay visible (same id, first arrival in order).
    #[allow(
        clippy::too_many_lines,
        reason = "one kill-and-restart scenario shared by two brokers' tests"
    )]
    async fn killed_relays(extra: &[&str], dup_window: Option<Duration>) {
        let Some(t) = TestDb::new(TestBackend::Postgres).await else {
            return;
        };
        let nats_url = oncely_testkit::nats_url();
        if !oncely_testkit::service_reachable("NATS", &nats_url).await {
            return;
        }
        t.db.migrate().await.unwrap();
        let seed = env_u64("ONCELY_KILL_SEED", oncely_core::now_ms() as u64) | 1;
        let events = env_u64("ONCELY_KILL_EVENTS", 3000);
        let keys_n = env_u64("ONCELY_KILL_KEYS", 50);
        let late_n = env_u64("ONCELY_KILL_LATE", 300);
        let min_kills = env_u64("ONCELY_KILL_KILLS", 60);
        let suffix = uuid::Uuid::new_v4().simple().to_string();
        let topic = format!("kill.{suffix}");
        let stream = format!("KILL{suffix}");
        let logs = std::env::temp_dir().join(format!("oncely-kill-{suffix}"));
        std::fs::create_dir_all(&logs).unwrap();
        eprintln!(
            "kill test: seed {seed}, {events} events over {keys_n} keys, {late_n} late commits, \
             extra {extra:?}, url {}, stream {stream}, logs {}",
            t.url,
            logs.display()
        );
        if let Some(w) = dup_window {
            let client = async_nats::connect(&nats_url).await.unwrap();
            async_nats::jetstream::new(client)
                .create_stream(async_nats::jetstream::stream::Config {
                    name: stream.clone(),
                    subjects: vec![topic.clone()],
                    duplicate_window: w,
                    ..Default::default()
                })
                .await
                .unwrap();
        }
        let keys: Vec<String> = (0..keys_n).map(|k| format!("agg-{k:03}")).collect();
        let producer = Producer {
            db: t.db.clone(),
            topic: topic.clone(),
            commit_lock: Arc::default(),
            commit_seq: Arc::default(),
            sent: Arc::default(),
        };
        // The backlog: `events` events, each key several times, in transactions of 25.
        let mut rng = Rng(seed);
        let backlog: Vec<String> = (0..events)
            .map(|_| keys[rng.below(keys_n) as usize].clone())
            .collect();
        for chunk in backlog.chunks(25) {
            producer.commit(chunk, Duration::ZERO).await;
        }

        // Relays.
        let extra: Vec<String> = extra.iter().map(|s| (*s).to_owned()).collect();
        let mut started = 0u64;
        let start = |started: &mut u64| {
            *started += 1;
            let log = std::fs::File::create(logs.join(format!("relay-{started:04}.log"))).unwrap();
            spawn_relay(&t.url, &nats_url, &stream, &topic, &extra, log)
        };
        let mut slots: Vec<Slot> = (0..3)
            .map(|_| {
                let child = start(&mut started);
                Slot {
                    child: Some(child),
                    started,
                }
            })
            .collect();

        // Live producers: a steady one and four that hold their transaction open (late commits).
        let live_done = Arc::new(AtomicBool::new(false));
        let mut producers = tokio::task::JoinSet::new();
        {
            let (p, keys, done) = (producer.clone(), keys.clone(), live_done.clone());
            let mut rng = Rng(seed ^ 0x9E37_79B9_7F4A_7C15);
            producers.spawn(async move {
                while !done.load(Ordering::SeqCst) {
                    let n = 1 + rng.below(3) as usize;
                    let ks: Vec<String> = (0..n)
                        .map(|_| keys[rng.below(keys.len() as u64) as usize].clone())
                        .collect();
                    p.commit(&ks, Duration::ZERO).await;
                    tokio::time::sleep(Duration::from_millis(5 + rng.below(20))).await;
                }
            });
        }
        let late_left = Arc::new(AtomicU64::new(late_n));
        for w in 0..4u64 {
            let (p, keys, left) = (producer.clone(), keys.clone(), late_left.clone());
            let mut rng = Rng(seed.rotate_left(7 + w as u32) | 1);
            producers.spawn(async move {
                while left
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| v.checked_sub(1))
                    .is_ok()
                {
                    let key = keys[rng.below(keys.len() as u64) as usize].clone();
                    p.commit(&[key], Duration::from_millis(rng.below(800)))
                        .await;
                }
            });
        }

        // Kill loop: SIGKILL a random relay every 50–600 ms, restart it after 0–300 ms (one time in
        // six all three, restarted after 150–500 ms), until
        // the late commits are done, at least `min_kills` kills happened and the outbox drained
        // once; then stop the live producers and let the relays drain without kills.
        let mut kills = 0u64;
        let deadline = Instant::now() + Duration::from_secs(600);
        let store = oncely_sql::OutboxStore::new(t.db.clone());
        loop {
            assert!(Instant::now() < deadline, "no progress within 10 minutes");
            tokio::time::sleep(Duration::from_millis(50 + rng.below(550))).await;
            if rng.below(6) == 0 {
                // All at once, down for longer than a 100 ms duplicate window: whatever they had
                // confirmed and not recorded is republished by the next ones.
                for slot in &mut slots {
                    kills += u64::from(slot.kill());
                }
                tokio::time::sleep(Duration::from_millis(150 + rng.below(350))).await;
                for slot in &mut slots {
                    slot.child = Some(start(&mut started));
                    slot.started = started;
                }
                continue;
            }
            let slot = &mut slots[rng.below(3) as usize];
            kills += u64::from(slot.kill());
            tokio::time::sleep(Duration::from_millis(rng.below(300))).await;
            slot.child = Some(start(&mut started));
            slot.started = started;
            let late_done = late_left.load(Ordering::SeqCst) == 0;
            if late_done && kills >= min_kills {
                break;
            }
        }
        live_done.store(true, Ordering::SeqCst);
        while let Some(r) = producers.join_next().await {
            r.unwrap();
        }
        let drain_deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let s = store.stats().await.unwrap();
            if s.pending == 0 {
                break;
            }
            assert!(
                Instant::now() < drain_deadline,
                "the relays did not drain the outbox: {s:?}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        // Settles in flight finish their commits.
        tokio::time::sleep(Duration::from_millis(500)).await;
        for slot in &mut slots {
            slot.kill();
        }
        let stats = outbox_stats(&t.url);
        let sent = producer.sent.lock().unwrap().clone();
        eprintln!(
            "kill test: {} events committed, {kills} kills, {started} relay processes, stats {stats}",
            sent.len()
        );

        // Read the stream.
        let client = async_nats::connect(&nats_url).await.unwrap();
        let js = async_nats::jetstream::new(client);
        let mut s = js.get_stream(&stream).await.unwrap();
        let info = s.info().await.unwrap().state.clone();
        // message id -> stream sequences (first arrival first).
        let mut arrivals: BTreeMap<String, Vec<u64>> = BTreeMap::new();
        let mut wrong_key = Vec::new();
        let mut unknown = Vec::new();
        for seq in info.first_sequence..=info.last_sequence {
            let m = s.get_raw_message(seq).await.unwrap();
            let id = m
                .headers
                .get("Nats-Msg-Id")
                .map(|v| v.as_str().to_owned())
                .expect("message id header");
            let pk = m
                .headers
                .get("partition-key")
                .map(|v| v.as_str().to_owned());
            match sent.get(&id) {
                Some(e) if pk.as_deref() != Some(e.key.as_str()) => {
                    wrong_key.push((id.clone(), pk));
                }
                Some(_) => {}
                None => unknown.push(id.clone()),
            }
            arrivals.entry(id).or_default().push(seq);
        }
        let missing: Vec<&String> = sent
            .keys()
            .filter(|id| !arrivals.contains_key(*id))
            .collect();
        let duplicates: Vec<(&String, &Vec<u64>)> =
            arrivals.iter().filter(|(_, seqs)| seqs.len() > 1).collect();

        // Order: per key, for events A, B with A.id < B.id and A committed before B, A's first
        // arrival precedes B's (the relay's guarantee). Pairs whose id order and commit order
        // disagree are only counted (the relay publishes the lower id first when both are
        // visible).
        let mut by_key: HashMap<&str, Vec<(&String, &Sent, u64)>> = HashMap::new();
        for (mid, e) in &sent {
            if let Some(seqs) = arrivals.get(mid) {
                by_key
                    .entry(e.key.as_str())
                    .or_default()
                    .push((mid, e, seqs[0]));
            }
        }
        let mut violations = Vec::new();
        let (mut crossed_pairs, mut crossed_in_commit_order) = (0u64, 0u64);
        for (key, evs) in &by_key {
            for a in evs {
                for b in evs {
                    let (ea, eb) = (a.1, b.1);
                    if ea.commit_seq < eb.commit_seq && ea.id < eb.id && a.2 > b.2 {
                        violations.push(format!(
                            "{key}: id {} (commit #{}, msg {}) arrived at stream seq {} after id {} \
                             (commit #{}, msg {}) at seq {}",
                            ea.id, ea.commit_seq, a.0, a.2, eb.id, eb.commit_seq, b.0, b.2
                        ));
                    }
                    if ea.commit_seq < eb.commit_seq && ea.id > eb.id {
                        crossed_pairs += 1;
                        if a.2 < b.2 {
                            crossed_in_commit_order += 1;
                        }
                    }
                }
            }
        }
        eprintln!(
            "kill test: stream {} messages (seq {}..={}), {} distinct ids, {} duplicates (same id), \
             {} missing, {} unknown, {} wrong partition-key headers, {} order violations; \
             {crossed_pairs} same-key pairs committed against id order, {crossed_in_commit_order} of \
             them arrived in commit order",
            info.messages,
            info.first_sequence,
            info.last_sequence,
            arrivals.len(),
            duplicates.len(),
            missing.len(),
            unknown.len(),
            wrong_key.len(),
            violations.len()
        );
        for v in violations.iter().take(20) {
            eprintln!("ORDER VIOLATION {v}");
        }
        assert!(missing.is_empty(), "events never published: {missing:?}");
        assert!(unknown.is_empty(), "messages nobody sent: {unknown:?}");
        assert!(wrong_key.is_empty(), "wrong partition-key: {wrong_key:?}");
        assert!(
            violations.is_empty(),
            "{} order violations",
            violations.len()
        );
        if dup_window.is_none() {
            assert!(
                duplicates.is_empty(),
                "copies inside the duplicate window reached the stream: {duplicates:?}"
            );
        }
        assert_eq!(
            (stats["pending"].as_u64(), stats["dead"].as_u64()),
            (Some(0), Some(0)),
            "{stats}"
        );
        if extra.iter().any(|a| a == "--outbox-retention-secs") {
            // Each event recorded once in the published table, none missing.
            let pool = t.db.as_postgres().expect("postgres");
            let ids: Vec<String> =
                sqlx::query_scalar("SELECT message_id FROM oncely_outbox_published")
                    .fetch_all(pool)
                    .await
                    .unwrap();
            let recorded: std::collections::HashSet<&String> = ids.iter().collect();
            assert_eq!(ids.len(), recorded.len());
            let not_recorded: Vec<&String> =
                sent.keys().filter(|id| !recorded.contains(id)).collect();
            assert!(
                not_recorded.is_empty() && ids.len() == sent.len(),
                "{} published rows for {} events; not recorded: {not_recorded:?}",
                ids.len(),
                sent.len()
            );
        }
        drop(js.delete_stream(&stream).await);
        drop(std::fs::remove_dir_all(&logs));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn postgres_relay_processes_sigkilled_at_random_lose_no_event_and_keep_each_partitions_order(
    ) {
        killed_relays(&[], None).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn postgres_relay_processes_sigkilled_at_random_while_vacuuming_and_keeping_published_rows(
    ) {
        // A 100 ms duplicate window (JetStream's minimum): copies republished after a kill reach the stream, and their
        // first arrivals still have to be in order.
        killed_relays(
            &[
                "--outbox-vacuum-after-rows",
                "100",
                "--outbox-retention-secs",
                "3600",
            ],
            Some(Duration::from_millis(100)),
        )
        .await;
    }
}
