//! The `orders` binary as a process: S8 (a second process against the same database obeys
//! the same keys), migrations, graceful shutdown on SIGTERM, the in-process consumers on
//! every broker, `orders import`, the payments endpoint and the flows through processes
//! (with chaos), slow clients, the console in a browser, schemathesis, `/metrics`, `orders
//! dev` with its banner's commands, the start-up refusals; and the operator's `oncely`
//! binary against it (`oncely verify`, `oncely sim`, `oncely inbox`, `oncely effects
//! resolve` continued by the service's runner).
//!
//! The `oncely` binary is the one beside `orders` in the target directory (`cargo test
//! --workspace` builds both; alone, `cargo build -p oncely` first).

use oncely_testkit::process::SpawnTied as _;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use oncely_testkit::TestDb;
use serde_json::{json, Value};

/// The `orders` binary.
const ORDERS: &str = env!("CARGO_BIN_EXE_orders");

/// The `oncely` binary beside [`ORDERS`].
fn oncely_bin() -> PathBuf {
    let path = std::path::Path::new(ORDERS)
        .with_file_name(format!("oncely{}", std::env::consts::EXE_SUFFIX));
    assert!(
        path.exists(),
        "{} is missing: `cargo test --workspace` builds it, or run `cargo build -p oncely`",
        path.display()
    );
    path
}

/// The binary that runs `args`: the order service's commands are `orders`', the rest
/// (`relay`, the operator commands) `oncely`'s.
fn binary_for<S: AsRef<str>>(args: &[S]) -> PathBuf {
    let words: Vec<&str> = args.iter().take(2).map(AsRef::as_ref).collect();
    match words.as_slice() {
        ["serve" | "migrate" | "consume" | "import" | "reconcile", ..] | ["effects", "run"] => {
            PathBuf::from(ORDERS)
        }
        _ => oncely_bin(),
    }
}

#[path = "dead_letters.rs"]
mod dead_letters;

/// Held by each test that runs a fleet of processes on PostgreSQL (the chaos and fleet
/// runs), so two never run at once: each opens up to ~40 of the server's 100 connections
/// (two together were measured at 84).
static POSTGRES_FLEET: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const API_KEY: &str = "cli-key-0123456789abcdef";
/// A second tenant's credential, for `oncely verify`'s scope check.
const API_KEY_B: &str = "cli-key-b-0123456789abcdef";

struct Proc {
    child: Child,
    base: String,
}

impl Drop for Proc {
    fn drop(&mut self) {
        drop(self.child.kill());
        drop(self.child.wait());
    }
}

/// Starts `orders serve` on an ephemeral port and reads the bound address from its JSON log.
fn serve(url: &str) -> Proc {
    serve_with(url, &[])
}

/// [`serve`] with extra arguments.
fn serve_with(url: &str, extra: &[&str]) -> Proc {
    serve_with_env(url, extra, &[])
}

/// [`serve_with`] with extra environment variables (settings given the way a deployment
/// gives them; a binary without the setting ignores it rather than refusing to start).
fn serve_with_env(url: &str, extra: &[&str], env: &[(&str, &str)]) -> Proc {
    // Held from the start: a serve that never logs its address is killed with the test.
    let mut p = Proc {
        child: oncely_testkit::process::command(ORDERS)
            .args(["serve", "--listen", "127.0.0.1:0"])
            .args(extra)
            // `listen_of` waits for the info line naming the address: a caller's ONCELY_LOG
            // (`warn`, say) would leave it waiting forever.
            .env("ONCELY_LOG", "info")
            .envs(env.iter().copied())
            .env("ONCELY_DATABASE_URL", url)
            .env(
                "ONCELY_API_KEYS",
                format!("{API_KEY}=cli,{API_KEY_B}=cli-b"),
            )
            .env("ONCELY_LOG_FORMAT", "json")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn_tied()
            .expect("spawn orders"),
        base: String::new(),
    };
    let stderr = p.child.stderr.take().unwrap();
    let mut lines = BufReader::new(stderr).lines();
    let listen = listen_of(&mut lines);
    // Keep draining stderr so the child never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    p.base = format!("http://{listen}");
    p
}

/// Reads a serve process's JSON log `lines` up to the one naming its bound address.
fn listen_of(lines: &mut impl Iterator<Item = std::io::Result<String>>) -> String {
    loop {
        let line = lines
            .next()
            .expect("orders exited before listening")
            .unwrap();
        let v: Value = serde_json::from_str(&line).unwrap_or(Value::Null);
        if let Some(addr) = v["fields"]["listen"].as_str() {
            return addr.to_owned();
        }
    }
}

async fn post(client: &reqwest::Client, base: &str, key: &str, body: &Value) -> (u16, bool, Value) {
    let res = client
        .post(format!("{base}/v1/orders"))
        .bearer_auth(API_KEY)
        .header("idempotency-key", key)
        .json(body)
        .send()
        .await
        .unwrap();
    let replayed = res.headers().get("idempotent-replayed").is_some();
    (
        res.status().as_u16(),
        replayed,
        res.json().await.unwrap_or(Value::Null),
    )
}

fn order(ext: &str) -> Value {
    json!({"source": "cli", "external_ref": ext, "customer_id": "c", "items": [{"sku": "s", "quantity": 1}],
           "amount_minor": 100, "currency": "EUR"})
}

async fn count_orders(t: &TestDb, ext: &str) -> i64 {
    oncely_sql::on_pool!(&t.db, |p| sqlx::query_scalar::<_, i64>(
        &oncely_sql::sql_text(p, "SELECT COUNT(*) FROM orders WHERE external_ref = $1")
    )
    .bind(ext)
    .fetch_one(p)
    .await)
    .unwrap()
}

#[path = "import.rs"]
mod import;

#[path = "schemathesis.rs"]
mod schemathesis;

#[path = "metrics.rs"]
mod metrics;

#[path = "console.rs"]
mod console;
use console::console_in_headless_chromium_requeues_a_dead_letter_and_resolves_an_effect;

oncely_testkit::matrix! {
    tests: [
        s8_second_process_on_the_same_database_obeys_the_same_keys,
        migrate_command_applies_migrations_and_sigterm_drains,
        serve_bills_each_order_once_in_process_and_get_shows_the_invoice,
        serve_bills_each_order_once_through_nats_jetstream,
        serve_bills_each_order_once_through_rabbitmq,
        serve_bills_each_order_once_through_kafka,
        serve_bills_200_orders_created_with_retries_over_dropped_connections_once_each,
        inbox_dead_list_and_requeue_commands_show_and_revive_a_dead_delivery,
        effects_commands_retry_and_resolve_a_parked_effect_and_show_its_audit_trail,
        serve_starts_with_the_broker_down_and_relays_the_events_once_it_is_up,
        verify_command_against_serve_finds_every_check_holding,
        console_in_headless_chromium_requeues_a_dead_letter_and_resolves_an_effect,
        keys_of_a_server_killed_behind_a_frozen_database_path_complete_on_another_within_the_bound,
    ],
    cannot_apply: [
        // PostgreSQL and MariaDB only: an embedded SQLite database dies with its process, so a
        // partition cannot leave its sessions behind.
        keys_of_a_server_killed_behind_a_frozen_database_path_complete_on_another_within_the_bound on sqlite,
    ],
}

/// Slack on top of the idle-transaction timeout for a second server to complete every key
/// of a vanished one: the second server's start-up, a retry interval and request time.
/// README states the bound: idle-transaction timeout + 5 s (65 s with the defaults).
const PARTITION_SLACK: Duration = Duration::from_secs(5);

/// A silent partition: twelve requests are mid-transaction (each key claimed, the order
/// insert on its way) when the path to the database freezes without closing either side,
/// and the server is SIGKILLed. The database still holds the dead sessions — and their
/// key claims — until the idle-transaction timeout ends them; a second server, connected
/// directly, then completes every key (201, one order each) within that timeout + slack.
async fn keys_of_a_server_killed_behind_a_frozen_database_path_complete_on_another_within_the_bound(
    t: TestDb,
) {
    const KEYS: usize = 12;
    let idle = Duration::from_secs(8);
    let (proxy, url) = oncely_testkit::FaultProxy::in_front_of(&t.url).await;
    let idle_secs = idle.as_secs().to_string();
    let mut a = serve_with(
        &oncely_testkit::without_statement_cache(&url),
        &[
            "--no-relay",
            "--no-consumer",
            "--db-idle-transaction-timeout-secs",
            &idle_secs,
        ],
    );
    proxy.fault_when_sent("INSERT INTO orders", oncely_testkit::Fault::Freeze);
    let run = uuid::Uuid::now_v7().simple().to_string();
    let work: Vec<(String, String)> = (0..KEYS)
        .map(|i| (format!("part-{run}-{i}"), format!("ext-{run}-{i}")))
        .collect();
    let client = reqwest::Client::new();
    let in_flight: Vec<_> = work
        .iter()
        .map(|(key, ext)| {
            let req = client
                .post(format!("{}/v1/orders", a.base))
                .bearer_auth(API_KEY)
                .header("idempotency-key", key)
                .json(&order(ext));
            tokio::spawn(async move { drop(req.send().await) })
        })
        .collect();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while proxy.faults_applied() < KEYS {
        assert!(
            std::time::Instant::now() < deadline,
            "only {} of {KEYS} requests reached the order insert",
            proxy.faults_applied()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    a.child.kill().unwrap(); // SIGKILL
    a.child.wait().unwrap();
    let killed = std::time::Instant::now();
    for task in in_flight {
        task.abort();
    }
    let b = serve_with(&t.url, &["--no-relay", "--no-consumer"]);
    let bound = idle + PARTITION_SLACK;
    let mut held = 0;
    for (key, ext) in &work {
        let answer = loop {
            let answer = post(&client, &b.base, key, &order(ext)).await;
            if answer.0 != 409 || killed.elapsed() > bound {
                break answer;
            }
            held += 1;
            tokio::time::sleep(Duration::from_millis(250)).await;
        };
        assert_eq!(answer.0, 201, "{key}: {}", answer.2);
        assert!(
            !answer.1,
            "{key}: the retry ran (nothing was committed before)"
        );
        assert_eq!(count_orders(&t, ext).await, 1, "{key}: exactly one order");
    }
    let took = killed.elapsed();
    eprintln!(
        "every key completed {took:?} after the kill (idle-transaction timeout {idle:?}; \
         {held} answers of 409 while the dead sessions held keys)"
    );
    assert!(
        held > 0,
        "the dead server's sessions held its keys for a while"
    );
    assert!(took <= bound, "{took:?} > {bound:?}");
}

async fn s8_second_process_on_the_same_database_obeys_the_same_keys(t: TestDb) {
    let a = serve(&t.url);
    let b = serve(&t.url);
    let client = reqwest::Client::new();

    // A retry that lands on another process is the replay.
    let ext = format!("ext-{}", uuid::Uuid::now_v7());
    let first = post(&client, &a.base, "s8-key-1", &order(&ext)).await;
    assert_eq!(first.0, 201);
    let on_b = post(&client, &b.base, "s8-key-1", &order(&ext)).await;
    assert_eq!(on_b.0, 201);
    assert!(on_b.1, "process B replays what process A stored");
    assert_eq!(on_b.2["id"], first.2["id"]);
    // B with a new key for the same business order: the same order (business key).
    let new_key = post(&client, &b.base, "s8-key-2", &order(&ext)).await;
    assert_eq!(new_key.0, 200);
    assert_eq!(new_key.2["id"], first.2["id"]);

    // Concurrent retries spread over both processes: one execution.
    let ext2 = format!("ext-{}", uuid::Uuid::now_v7());
    let bases = Arc::new([a.base.clone(), b.base.clone()]);
    let mut tasks = Vec::new();
    for i in 0..32 {
        let (client, bases, body) = (client.clone(), bases.clone(), order(&ext2));
        tasks.push(tokio::spawn(async move {
            post(&client, &bases[i % 2], "s8-key-3", &body).await
        }));
    }
    let mut executed = 0;
    for task in tasks {
        let (status, replayed, _) = task.await.unwrap();
        assert!(status == 201 || status == 409, "unexpected {status}");
        if status == 201 && !replayed {
            executed += 1;
        }
    }
    assert_eq!(executed, 1);
    assert_eq!(count_orders(&t, &ext).await, 1);
    assert_eq!(count_orders(&t, &ext2).await, 1);
}

async fn migrate_command_applies_migrations_and_sigterm_drains(t: TestDb) {
    let status = oncely_testkit::process::command(ORDERS)
        .args(["migrate", "--database-url", &t.url])
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    assert_eq!(count_orders(&t, "none").await, 0, "the orders table exists");

    let mut p = serve(&t.url);
    let health = reqwest::get(format!("{}/healthz", p.base)).await.unwrap();
    assert_eq!(health.status(), 200);
    let pid = p.child.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let mut exited = None;
    for _ in 0..100 {
        if let Some(s) = p.child.try_wait().unwrap() {
            exited = Some(s);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let exited = exited.expect("oncely stops within 5 s of SIGTERM");
    assert!(exited.success(), "graceful shutdown exits 0, got {exited}");
}

async fn serve_bills_each_order_once_in_process_and_get_shows_the_invoice(t: TestDb) {
    let p = bills_each_order_once(&t, &[]).await;
    // `/metrics`: counters of events that did not happen are there at 0 (so `rate()` and
    // alerts see them), handler run times are a histogram.
    let expected = [
        "oncely_outbox_dead_total 0",
        "oncely_outbox_publish_failures_total{broker=\"sql\"} 0",
        "oncely_outbox_published_total{broker=\"sql\"} 5",
        "oncely_idempotency_store_unavailable_total 0",
        "oncely_inbox_dead_lettered_total{consumer=\"billing\",broker=\"sql\"} 0",
        "oncely_inbox_consumed_total{consumer=\"billing\",broker=\"sql\"} 5",
        "# TYPE oncely_inbox_handler_seconds histogram",
        "# TYPE oncely_outbox_publish_latency_seconds histogram",
    ];
    // The relay counts a batch after its commit, which the consumer may beat.
    let mut missing = Vec::new();
    for _ in 0..50 {
        let m = reqwest::get(format!("{}/metrics", p.base))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        missing = expected
            .iter()
            .filter(|line| !m.lines().any(|l| l == **line))
            .map(|line| (*line).to_owned())
            .collect();
        if missing.is_empty() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("lines missing from /metrics after 5 s: {missing:?}");
}

/// A key given twice in `--api-keys` would authenticate whichever tenant came last: start-up
/// stops with a message naming the entries, never the key.
#[tokio::test]
async fn serve_refuses_a_duplicate_api_key_without_printing_it() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("dup.db").display());
    let key = "dup-key-0123456789abcdef";
    let (status, stderr) = run_to_exit(
        oncely_testkit::process::command(ORDERS)
            .args(["serve", "--listen", "127.0.0.1:0"])
            .env("ONCELY_DATABASE_URL", &url)
            .env(
                "ONCELY_API_KEYS",
                format!("{API_KEY}=a,{key}=tenant-a, {key}=tenant-b"),
            ),
    )
    .await;
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains("API key entry 3 repeats the API key of entry 2"),
        "{stderr}"
    );
    assert!(!stderr.contains(key), "the key itself is printed: {stderr}");
}

/// The whole chain through a real broker, as `orders serve --broker nats` runs it: order and
/// `order.created` in one transaction, the relay publishing to JetStream, the in-process
/// billing consumer reading its durable consumer and billing through the inbox — each order
/// billed once, retries and duplicate orders included.
async fn serve_bills_each_order_once_through_nats_jetstream(t: TestDb) {
    let nats_url = oncely_testkit::nats_url();
    if !oncely_testkit::service_reachable("NATS", &nats_url).await {
        return;
    }
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    let topic = format!("bill.{suffix}");
    let stream = format!("BILL{suffix}");
    bills_each_order_once(
        &t,
        &[
            "--broker",
            "nats",
            "--nats-url",
            &nats_url,
            "--nats-stream",
            &stream,
            "--nats-subjects",
            &topic,
            "--events-topic",
            &topic,
            "--relay-poll-ms",
            "50",
        ],
    )
    .await;
    let js = async_nats::jetstream::new(async_nats::connect(&nats_url).await.unwrap());
    let messages = js
        .get_stream(&stream)
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .state
        .messages;
    assert_eq!(messages, 5, "one order.created per order in the stream");
    drop(js.delete_stream(&stream).await);
}

/// As [`serve_bills_each_order_once_through_nats_jetstream`], through RabbitMQ: the relay
/// publishes persistent messages with confirms to a topic exchange of this run, the billing
/// consumer reads its group's queue (this run's `--amqp-queue-prefix`, so runs on other
/// backends sharing the broker never take each other's deliveries). Publishes that find no
/// queue bound yet come back unroutable and are retried, so nothing is lost to start-up order.
async fn serve_bills_each_order_once_through_rabbitmq(t: TestDb) {
    let amqp_url = oncely_testkit::amqp_url();
    if !oncely_testkit::service_reachable("RabbitMQ", &amqp_url).await {
        return;
    }
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    let exchange = format!("bill.{suffix}");
    let prefix = format!("bill-{suffix}");
    bills_each_order_once(
        &t,
        &[
            "--broker",
            "rabbitmq",
            "--amqp-url",
            &amqp_url,
            "--amqp-exchange",
            &exchange,
            "--amqp-queue-prefix",
            &prefix,
            "--relay-poll-ms",
            "50",
            "--relay-backoff-base-ms",
            "50",
        ],
    )
    .await;
    // Nothing left behind in the group's queues: every delivery acknowledged, none dead.
    let conn = lapin::Connection::connect(&amqp_url, oncely_broker::amqp_connection_properties())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    for (queue, dead) in [
        (format!("{prefix}.billing"), false),
        (format!("{prefix}.billing.retry"), false),
        (format!("{prefix}.billing.dead"), true),
    ] {
        let q = ch
            .queue_declare(
                queue.as_str(),
                lapin::options::QueueDeclareOptions {
                    passive: true,
                    ..lapin::options::QueueDeclareOptions::default()
                },
                lapin::types::FieldTable::default(),
            )
            .await
            .unwrap_or_else(|e| panic!("queue {queue} declared by the consumer: {e}"));
        if dead {
            assert_eq!(q.message_count(), 0, "nothing dead-lettered");
        }
        drop(
            ch.queue_delete(
                queue.as_str(),
                lapin::options::QueueDeleteOptions::default(),
            )
            .await,
        );
    }
    drop(
        ch.exchange_delete(
            exchange.as_str(),
            lapin::options::ExchangeDeleteOptions::default(),
        )
        .await,
    );
    drop(conn.close(200, "test done").await);
}

/// As [`serve_bills_each_order_once_through_nats_jetstream`], through Kafka (tansu): the relay
/// produces with the idempotent producer to a topic of this run, the billing consumer reads
/// it in a consumer group of this run (`--kafka-group-prefix`).
async fn serve_bills_each_order_once_through_kafka(t: TestDb) {
    if !oncely_testkit::service_reachable("Kafka", &oncely_testkit::kafka_url()).await {
        return;
    }
    let brokers = oncely_testkit::kafka_brokers();
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    let topic = format!("bill.{suffix}");
    bills_each_order_once(
        &t,
        &[
            "--broker",
            "kafka",
            "--kafka-brokers",
            &brokers,
            "--kafka-topics",
            &topic,
            "--kafka-group-prefix",
            &format!("bill-{suffix}"),
            "--events-topic",
            &topic,
            "--relay-poll-ms",
            "50",
        ],
    )
    .await;
    // The billing consumer read in this run's group.
    let group = format!("bill-{suffix}.billing");
    let groups = tokio::task::spawn_blocking(move || {
        use rdkafka::consumer::Consumer as _;
        let c: rdkafka::consumer::BaseConsumer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .create()
            .unwrap();
        c.fetch_group_list(Some(&group), Duration::from_secs(10))
            .unwrap()
            .groups()
            .iter()
            .map(|g| g.name().to_owned())
            .collect::<Vec<_>>()
    })
    .await
    .unwrap();
    assert_eq!(groups, [format!("bill-{suffix}.billing")]);
}

/// Creates 5 orders through `orders serve` (with `extra` arguments), each retried with its
/// key and repeated under a new key, and checks that each is billed exactly once.
/// Returns the still-running service.
async fn bills_each_order_once(t: &TestDb, extra: &[&str]) -> Proc {
    let p = serve_with(&t.url, extra);
    let client = reqwest::Client::new();
    let mut ids = Vec::new();
    for i in 0..5 {
        let ext = format!("bill-{i}");
        let first = post(&client, &p.base, &format!("bill-key-{i}"), &order(&ext)).await;
        assert_eq!(first.0, 201);
        // A retry and a new key for the same order add nothing.
        assert_eq!(
            post(&client, &p.base, &format!("bill-key-{i}"), &order(&ext))
                .await
                .0,
            201
        );
        assert_eq!(
            post(&client, &p.base, &format!("bill-other-{i}"), &order(&ext))
                .await
                .0,
            200
        );
        ids.push(first.2["id"].as_str().unwrap().to_owned());
    }
    for id in &ids {
        let mut invoice = Value::Null;
        for _ in 0..200 {
            let got: Value = client
                .get(format!("{}/v1/orders/{id}", p.base))
                .bearer_auth(API_KEY)
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            if !got["invoice"].is_null() {
                invoice = got["invoice"].clone();
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(invoice["kind"], "order", "order {id} billed within 10 s");
        assert_eq!(invoice["amount_minor"], 100);
    }
    let invoices: i64 = oncely_sql::on_pool!(&t.db, |p| sqlx::query_scalar(
        "SELECT COUNT(*) FROM invoices"
    )
    .fetch_one(p)
    .await)
    .unwrap();
    assert_eq!(invoices, 5);
    p
}

async fn serve_bills_200_orders_created_with_retries_over_dropped_connections_once_each(t: TestDb) {
    let p = serve(&t.url);
    let target: std::net::SocketAddr = p.base.trim_start_matches("http://").parse().unwrap();
    let proxy = Arc::new(oncely_testkit::FaultProxy::start(target).await);
    let base = format!("http://{}", proxy.addr());
    // Cut every connection every 40 ms: requests and answers are lost mid-flight.
    let stop = tokio_util::sync::CancellationToken::new();
    let cutter = {
        let (proxy, stop) = (proxy.clone(), stop.clone());
        tokio::spawn(async move {
            while !stop.is_cancelled() {
                tokio::time::sleep(Duration::from_millis(40)).await;
                proxy.cut();
                tokio::time::sleep(Duration::from_millis(3)).await;
                proxy.restore();
            }
        })
    };
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let sends = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let tasks: Vec<_> = (0..16)
        .map(|worker| {
            let (client, base, sends) = (client.clone(), base.clone(), sends.clone());
            tokio::spawn(async move {
                for i in (worker..200).step_by(16) {
                    let body = order(&format!("drop-{i}"));
                    let mut done = false;
                    for _ in 0..400 {
                        sends.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let res = client
                            .post(format!("{base}/v1/orders"))
                            .bearer_auth(API_KEY)
                            .header("idempotency-key", format!("drop-key-{i}"))
                            .json(&body)
                            .send()
                            .await;
                        if let Ok(r) = res {
                            if matches!(r.status().as_u16(), 200 | 201) && r.bytes().await.is_ok() {
                                done = true;
                                break;
                            }
                        }
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    assert!(done, "order {i} created within 400 attempts");
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    stop.cancel();
    cutter.await.unwrap();
    eprintln!(
        "200 orders took {} POSTs",
        sends.load(std::sync::atomic::Ordering::Relaxed)
    );
    assert!(
        sends.load(std::sync::atomic::Ordering::Relaxed) > 200,
        "connections were dropped and requests retried"
    );
    let count = |sql: &'static str| {
        let db = t.db.clone();
        async move {
            oncely_sql::on_pool!(&db, |p| sqlx::query_scalar::<_, i64>(sql)
                .fetch_one(p)
                .await)
            .unwrap()
        }
    };
    let mut invoices = 0;
    for _ in 0..600 {
        invoices = count("SELECT COUNT(*) FROM invoices").await;
        if invoices >= 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Let stray redeliveries arrive before the final count.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        count("SELECT COUNT(*) FROM orders WHERE external_ref LIKE 'drop-%'").await,
        200
    );
    assert_eq!(
        invoices.max(count("SELECT COUNT(*) FROM invoices").await),
        200
    );
    assert_eq!(
        count("SELECT COUNT(DISTINCT order_id) FROM invoices").await,
        200
    );
}

async fn inbox_dead_list_and_requeue_commands_show_and_revive_a_dead_delivery(t: TestDb) {
    use oncely_broker::Publisher as _;
    orders::migrate(&t.db).await.unwrap();
    let transport = oncely_broker::SqlTransport::new(t.db.clone(), 1 << 20);
    transport.subscribe("billing", "orders").await.unwrap();
    let id = oncely_core::MessageId::new_random();
    let message = oncely_broker::Message {
        id,
        topic: "orders".to_owned(),
        partition_key: "o-1".to_owned(),
        event_type: "order.created".to_owned(),
        payload: b"{}".to_vec(),
        headers: std::collections::BTreeMap::new(),
    };
    for r in transport.publish(&[message]).await {
        r.unwrap();
    }
    let d = transport
        .claim("billing", 1, Duration::from_secs(30))
        .await
        .unwrap();
    assert!(transport.dead(&d[0], "boom\tin billing").await.unwrap());
    let run = |args: &[&str]| {
        oncely_testkit::process::command(oncely_bin())
            .args(["inbox", "--database-url", &t.url, "dead"])
            .args(args)
            .stderr(Stdio::null())
            .output()
            .unwrap()
    };
    let list = run(&["list"]);
    assert!(list.status.success());
    let out = String::from_utf8(list.stdout).unwrap();
    assert!(
        out.contains(&format!("{id}\t1\tboom in billing\torders\t")),
        "{out}"
    );
    let json = run(&["list", "--json", "--consumer", "billing"]);
    assert!(json.status.success());
    let rows: Vec<Value> = String::from_utf8(json.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0]["message_id"], id.to_string());
    assert_eq!(rows[0]["attempts"], 1);
    assert_eq!(rows[0]["last_error"], "boom\tin billing");
    assert_eq!(rows[0]["payload_preview"], "{}");
    let position = rows[0]["position"].as_str().unwrap().to_owned();
    assert!(position.starts_with("sql:"), "{position}");
    let after = run(&["list", "--json", "--after", &position]);
    assert!(after.status.success());
    assert!(after.stdout.is_empty(), "nothing after the last letter");
    let requeue = run(&["requeue", &id.to_string()]);
    assert!(requeue.status.success());
    assert!(String::from_utf8(requeue.stdout)
        .unwrap()
        .contains("requeued 1"));
    assert!(
        !run(&["requeue", &id.to_string()]).status.success(),
        "nothing dead any more"
    );
    let again = transport
        .claim("billing", 1, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(again.len(), 1, "pending again");
}

/// `oncely effects`: a parked (`needs_review`) effect is listed, retried — back to
/// `unknown`, never a blind call — resolved as succeeded with the provider's id, and shown
/// with its evidence and both audit rows; a second resolution is refused. The `oncely`
/// binary only records the resolution (its continuation marked in the store, the invoice
/// untouched): a running `orders effects run` continues it with the service's handler —
/// its invoice paid and one `invoice.paid` written.
#[allow(
    clippy::too_many_lines,
    reason = "one effect through every operator command, read top to bottom"
)]
async fn effects_commands_retry_and_resolve_a_parked_effect_and_show_its_audit_trail(t: TestDb) {
    orders::migrate(&t.db).await.unwrap();
    // The invoice the parked charge pays: resolving the charge as succeeded marks it paid
    // and writes invoice.paid, as the runner's settle would have.
    t.db.execute(oncely_sql::query(
        "INSERT INTO invoices (id, tenant, order_id, kind, amount_minor, currency, \
             message_id, created_at) VALUES ('inv-ops', 'acme', 'ord-ops', 'order', 100, \
             'eur', 'm-ops', 1000)",
    ))
    .await
    .unwrap();
    let id = oncely_testkit::park_effect(&t.db, "acme", "inv-ops").await;
    let run = |args: &[&str]| {
        oncely_testkit::process::command(oncely_bin())
            .args(["effects", "--database-url", &t.url])
            .args(args)
            .stderr(Stdio::null())
            .output()
            .unwrap()
    };
    let list = run(&["list", "--state", "needs-review"]);
    let out = String::from_utf8(list.stdout).unwrap();
    assert!(
        list.status.success()
            && out.contains(&format!("{id}\tpayments\tcharge\tinv-ops\tneeds_review")),
        "{out}"
    );
    let retry = run(&["retry", &id, "--actor", "ops@acme"]);
    let retried: Value = serde_json::from_slice(&retry.stdout).unwrap();
    assert_eq!(
        retried["state"], "unknown",
        "a retry checks the status first"
    );
    let resolve = run(&[
        "resolve",
        &id,
        "--as",
        "succeeded",
        "--provider-id",
        "pi_seen",
        "--actor",
        "ops@acme",
    ]);
    let resolved: Value = serde_json::from_slice(&resolve.stdout).unwrap();
    assert_eq!(
        (resolved["state"].as_str(), resolved["provider_id"].as_str()),
        (Some("succeeded"), Some("pi_seen"))
    );
    let invoice = || async {
        let row: (Option<i64>, Option<String>) =
            t.db.fetch_optional(oncely_sql::query(format!(
                "SELECT paid_at, {} FROM invoices WHERE id = 'inv-ops'",
                t.db.backend().text_column("payment_id")
            )))
            .await
            .unwrap()
            .expect("the invoice");
        row
    };
    assert_eq!(
        invoice().await.0,
        None,
        "the CLI runs no handler of the service"
    );
    let (pending,): (i64,) =
        t.db.fetch_optional(oncely_sql::query(
            "SELECT COUNT(*) FROM oncely_effects WHERE continuation_at IS NOT NULL",
        ))
        .await
        .unwrap()
        .expect("a count");
    assert_eq!(pending, 1, "the resolution's continuation is recorded");
    // The service's runner (no provider is ever called: a shipping provider nobody books
    // with) continues it.
    let runner = Proc {
        child: oncely_testkit::process::command(ORDERS)
            .args(["effects", "run", "--database-url", &t.url])
            .args([
                "--shipping-url",
                "http://127.0.0.1:9",
                "--runner-poll-ms",
                "50",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn_tied()
            .expect("spawn orders effects run"),
        base: String::new(),
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let (paid_at, payment_id) = loop {
        let row = invoice().await;
        if row.0.is_some() || std::time::Instant::now() > deadline {
            break row;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    drop(runner);
    assert!(paid_at.is_some(), "the service's runner paid the invoice");
    assert_eq!(payment_id.as_deref(), Some("pi_seen"));
    let (paid_events,): (i64,) =
        t.db.fetch_optional(oncely_sql::query(
            "SELECT COUNT(*) FROM oncely_outbox WHERE event_type = 'invoice.paid'",
        ))
        .await
        .unwrap()
        .expect("a count");
    assert_eq!(paid_events, 1, "one invoice.paid from the continuation");
    assert!(
        !run(&["resolve", &id, "--as", "failed"]).status.success(),
        "settled: refused"
    );
    assert!(
        !run(&["resolve", &id, "--as", "succeeded"]).status.success(),
        "no provider id"
    );
    let show: Value = serde_json::from_slice(&run(&["show", &id]).stdout).unwrap();
    assert_eq!(show["evidence"][0]["outcome"], "unavailable");
    let audit: Vec<_> = show["audit"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            (
                a["action"].as_str().unwrap(),
                a["actor"].as_str().unwrap(),
                a["to"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        audit,
        [
            ("retry", "ops@acme", "unknown"),
            ("resolve", "ops@acme", "succeeded")
        ]
    );
}

/// Waits for `child` to exit (30 s at most) and returns its status.
/// Spawns `cmd` (stderr piped, tied to the test) and waits for its exit: its status and
/// stderr. A [`Proc`] holds it meanwhile, so a binary that keeps running is killed when the
/// test fails.
async fn run_to_exit(cmd: &mut std::process::Command) -> (std::process::ExitStatus, String) {
    let child = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn_tied()
        .unwrap();
    let mut p = Proc {
        child,
        base: String::new(),
    };
    let status = wait_exit(&mut p.child).await;
    let mut stderr = String::new();
    std::io::Read::read_to_string(p.child.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    (status, stderr)
}

async fn wait_exit(child: &mut Child) -> std::process::ExitStatus {
    for _ in 0..300 {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("process did not exit within 30 s");
}

/// The broker is down when `orders serve` starts: the service still takes orders, their
/// events wait in the outbox, and once the broker is reachable the relay connects and
/// publishes every one of them exactly once.
async fn serve_starts_with_the_broker_down_and_relays_the_events_once_it_is_up(t: TestDb) {
    let nats_url = oncely_testkit::nats_url();
    if !oncely_testkit::service_reachable("NATS", &nats_url).await {
        return;
    }
    let target: std::net::SocketAddr = oncely_testkit::url_authority(&nats_url)
        .unwrap()
        .parse()
        .unwrap();
    let proxy = oncely_testkit::FaultProxy::start(target).await;
    proxy.cut();
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    let topic = format!("down.{suffix}");
    let stream = format!("DOWN{suffix}");
    let proxied = format!("nats://{}", proxy.addr());
    let p = serve_with(
        &t.url,
        &[
            "--broker",
            "nats",
            "--nats-url",
            &proxied,
            "--nats-stream",
            &stream,
            "--nats-subjects",
            &topic,
            "--events-topic",
            &topic,
            "--relay-poll-ms",
            "50",
        ],
    );
    let client = reqwest::Client::new();
    let mut ids = Vec::new();
    for i in 0..5 {
        let ext = format!("down-{suffix}-{i}");
        let (status, _, body) = post(
            &client,
            &p.base,
            &format!("down-{suffix}-{i}"),
            &order(&ext),
        )
        .await;
        assert_eq!(
            status, 201,
            "orders are taken while the broker is down: {body}"
        );
        ids.push(body["id"].as_str().unwrap().to_owned());
    }
    let store = oncely_sql::OutboxStore::new(t.db.clone());
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        store.stats().await.unwrap().pending,
        5,
        "the events wait in the outbox"
    );

    proxy.restore();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while store.stats().await.unwrap().pending > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the relay never caught up"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let js = async_nats::jetstream::new(async_nats::connect(&nats_url).await.unwrap());
    let mut s = js.get_stream(&stream).await.unwrap();
    let state = s.info().await.unwrap().state.clone();
    assert_eq!(state.messages, 5, "each order's event once");
    let mut partitions = std::collections::HashSet::new();
    for seq in state.first_sequence..=state.last_sequence {
        let m = s.get_raw_message(seq).await.unwrap();
        partitions.insert(
            m.headers
                .get("partition-key")
                .map(|v| v.as_str().to_owned())
                .unwrap(),
        );
    }
    assert_eq!(partitions, ids.into_iter().collect());
    drop(p);
    drop(js.delete_stream(&stream).await);
}

async fn verify_command_against_serve_finds_every_check_holding(t: TestDb) {
    let p = serve(&t.url);
    let dir = tempfile::tempdir().unwrap();
    let report_path = dir.path().join("report.json");
    let body_path = dir.path().join("order.json");
    std::fs::write(
        &body_path,
        r#"{"source":"verify","external_ref":"{{uuid}}","customer_id":"c-42",
            "items":[{"sku":"sku-1","quantity":2}],"amount_minor":1999,"currency":"EUR"}"#,
    )
    .unwrap();
    let url = format!("{}/v1/orders", p.base);
    // The service's own list counts the first credential's orders (`total`).
    let count_url = format!("{}/v1/orders?limit=1", p.base);
    let (auth_a, auth_b) = (
        format!("Authorization: Bearer {API_KEY}"),
        format!("Authorization: Bearer {API_KEY_B}"),
    );
    let out = tokio::task::spawn_blocking({
        let (body, report) = (body_path.clone(), report_path.clone());
        move || {
            oncely_testkit::process::command(oncely_bin())
                .args(["verify", "--url", &url, "--body"])
                .arg(&body)
                .args(["--header", &auth_a, "--header-b", &auth_b])
                .args(["--mutate", "/amount_minor=2999", "--object-id", "/id"])
                .args(["--count-url", &count_url])
                .args(["--concurrency", "16", "--json"])
                .arg(&report)
                .stderr(Stdio::inherit())
                .output()
                .unwrap()
        }
    })
    .await
    .unwrap();
    let table = String::from_utf8(out.stdout).unwrap();
    println!("{table}");
    assert!(out.status.success(), "oncely verify exits 0: {table}");
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(&report_path).unwrap()).unwrap();
    let checks = report["checks"].as_array().unwrap();
    assert_eq!(checks.len(), 9);
    for c in checks {
        assert_eq!(c["outcome"], "holds", "{c}");
    }
    assert_eq!(report["all_applicable_hold"], true);
    let s2 = checks.iter().find(|c| c["id"] == "s2-concurrent").unwrap();
    assert_eq!(
        s2["count_after"].as_u64().unwrap() - s2["count_before"].as_u64().unwrap(),
        1,
        "{s2}"
    );
    assert!(table.contains("9 checks: 9 hold, 0 fail, 0 not applicable"));
    // One object per logical operation: key-max-length, S1, S2, S3 (twice), S4, scope (2).
    let orders: i64 = oncely_sql::on_pool!(&t.db, |p| sqlx::query_scalar(
        "SELECT COUNT(*) FROM orders WHERE source = 'verify'"
    )
    .fetch_one(p)
    .await)
    .unwrap();
    assert_eq!(orders, 8);

    // Exit status 1 when a check fails: told to look for a replay marker the service does
    // not send, S1 cannot find it.
    let out = oncely_testkit::process::command(oncely_bin())
        .args([
            "verify",
            "--url",
            &format!("{}/v1/orders", p.base),
            "--body",
        ])
        .arg(&body_path)
        .args(["--header", &format!("Authorization: Bearer {API_KEY}")])
        .args(["--replay-header", "x-no-such-marker"])
        .stderr(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    // Exit status 2 when the endpoint refuses the sample request: the checks could not
    // judge idempotency (a body without the order's fields is a 4xx of the service).
    let out = oncely_testkit::process::command(oncely_bin())
        .args([
            "verify",
            "--url",
            &format!("{}/v1/orders", p.base),
            "--body",
            r#"{"source":"verify"}"#,
        ])
        .args(["--header", &format!("Authorization: Bearer {API_KEY}")])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("refused the sample request"), "{stderr}");
    // Exit status 2 when the checks cannot run.
    let out = oncely_testkit::process::command(oncely_bin())
        .args(["verify", "--url", "ftp://x", "--body", "{}"])
        .stderr(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
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

/// An `oncely sim <api>` process and its base URL (read from its first stdout line).
fn sim(api: &str, extra: &[&str]) -> (Proc, String) {
    // Held from the start: a simulator that prints no address is killed with the test.
    let mut p = Proc {
        child: oncely_testkit::process::command(oncely_bin())
            .args(["sim", api, "--listen", "127.0.0.1:0"])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn_tied()
            .expect("spawn oncely sim"),
        base: String::new(),
    };
    let stdout = p.child.stdout.take().unwrap();
    let line = BufReader::new(stdout)
        .lines()
        .next()
        .expect("oncely sim exited before listening")
        .unwrap();
    let addr = line
        .rsplit(' ')
        .next()
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_owned();
    p.base = format!("http://{addr}");
    let base = p.base.clone();
    (p, base)
}

async fn stats(base: &str) -> Value {
    reqwest::get(format!("{base}/_sim/stats"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

#[path = "chaos.rs"]
mod chaos;
#[path = "crash/mod.rs"]
mod crash;
#[path = "fleet/mod.rs"]
mod fleet;
#[path = "saga_chaos.rs"]
mod saga_chaos;

#[path = "payments.rs"]
mod payments;

#[path = "dev.rs"]
mod dev;

#[path = "refusals.rs"]
mod refusals;

#[path = "request_log.rs"]
mod request_log;

#[path = "webhooks.rs"]
mod webhooks;

/// Slow clients (issue 14 §4), against the real `orders serve` process: bodies that stall or
/// trickle are cut by the body deadline, and the memory stalled uploads can pin is bounded
/// by the body budget. Settings go in as environment variables, so an older binary runs the
/// same test (and fails it) instead of refusing an unknown flag.
mod slow_clients {
    use std::net::SocketAddr;
    use std::time::{Duration, Instant};

    use oncely_testkit::{TestBackend, TestDb};
    use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWriteExt as _};
    use tokio::net::TcpStream;

    use super::{order, post, serve_with_env, API_KEY};

    const BODY_TIMEOUT_SECS: u64 = 5;
    const BODY_TIMEOUT: &str = "5";
    const MIB: usize = 1024 * 1024;
    /// The stated bound on the server's peak RSS with the default limits (README).
    const PEAK_RSS_BOUND_KIB: u64 = 400 * 1024;
    /// Every connection's body bytes come from this one buffer: the test process must not
    /// hold 800 MiB itself.
    static CHUNK: [u8; 64 * 1024] = [b' '; 64 * 1024];

    fn head(content_length: usize, key: &str) -> String {
        format!(
            "POST /v1/orders HTTP/1.1\r\nhost: oncely\r\nauthorization: Bearer {API_KEY}\r\n\
             idempotency-key: {key}\r\ncontent-type: application/json\r\n\
             content-length: {content_length}\r\n\r\n"
        )
    }

    /// Everything the server sends until it closes the connection (a reset ends it too,
    /// possibly before its answer was read).
    async fn until_closed(mut r: impl AsyncRead + Unpin) -> Vec<u8> {
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        while let Ok(n @ 1..) = r.read(&mut buf).await {
            got.extend_from_slice(&buf[..n]);
        }
        got
    }

    /// The status code of an HTTP/1.1 answer (`HTTP/1.1 408 …`).
    fn status(answer: &[u8]) -> Option<u16> {
        std::str::from_utf8(answer.get(9..12)?).ok()?.parse().ok()
    }

    /// A `proc(5)` status field in KiB (`VmHWM`, `VmRSS`).
    fn proc_kib(pid: u32, field: &str) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
    }

    /// Sends the head and 1 MiB − 1 byte of a 1 MiB body, then goes silent; returns the
    /// server's answer, once it closes the connection.
    async fn stalled_upload(addr: SocketAddr, n: usize) -> Vec<u8> {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(head(MIB, &format!("stalled-{n}")).as_bytes())
            .await
            .unwrap();
        let mut left = MIB - 1;
        while left > 0 {
            let len = left.min(CHUNK.len());
            if s.write_all(&CHUNK[..len]).await.is_err() {
                break; // the server answered early and closed
            }
            left -= len;
        }
        until_closed(s).await
    }

    fn addr(base: &str) -> SocketAddr {
        base.strip_prefix("http://").unwrap().parse().unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn eight_hundred_stalled_uploads_are_cut_by_the_body_deadline_within_bounded_memory() {
        let t = TestDb::new(TestBackend::Sqlite).await.unwrap();
        let p = serve_with_env(
            &t.url,
            &["--no-relay", "--no-consumer"],
            &[("ONCELY_BODY_READ_TIMEOUT_SECS", BODY_TIMEOUT)],
        );
        let pid = p.child.id();
        let before_kib = proc_kib(pid, "VmRSS");
        let slack = Duration::from_secs(15);
        let started = Instant::now();
        let uploads: Vec<_> = (0..800)
            .map(|n| {
                let addr = addr(&p.base);
                tokio::spawn(tokio::time::timeout(
                    Duration::from_secs(BODY_TIMEOUT_SECS) + slack,
                    stalled_upload(addr, n),
                ))
            })
            .collect();
        let (mut timed_out, mut busy, mut reset) = (0, 0, 0);
        for upload in uploads {
            let answer = upload
                .await
                .unwrap()
                .expect("every stalled upload is cut within the body deadline + 15 s");
            match status(&answer) {
                Some(408) => timed_out += 1,
                Some(503) => busy += 1,
                None => reset += 1,
                Some(other) => panic!("unexpected {other}: {}", String::from_utf8_lossy(&answer)),
            }
        }
        let elapsed = started.elapsed();
        let peak_kib = proc_kib(pid, "VmHWM");
        tokio::time::sleep(Duration::from_secs(2)).await;
        let after_kib = proc_kib(pid, "VmRSS");
        eprintln!(
            "800 stalled uploads: {timed_out} × 408, {busy} × 503, {reset} reset, all closed \
             after {elapsed:?}; server RSS before {before_kib} KiB, peak (VmHWM) {peak_kib} \
             KiB, 2 s after the last close {after_kib} KiB"
        );
        assert!(
            peak_kib < PEAK_RSS_BOUND_KIB,
            "peak RSS {peak_kib} KiB over the bound"
        );
        // The default budget (64 MiB) holds 64 reservations of 1 MiB at once: those run into
        // the deadline, the others are turned away without being read. (More than 64 × 408
        // in all only if some heads arrived after the first 64 were cut — a slow machine.)
        assert!(timed_out > 0, "no body ran into the deadline");
        assert!(busy > 0, "the body budget turned nobody away");
        // And the service still serves.
        let created = post(
            &reqwest::Client::new(),
            &p.base,
            "after-the-storm",
            &order("after-the-storm"),
        )
        .await;
        assert_eq!(created.0, 201);
    }

    /// Opens a connection with a 1 KiB receive buffer and pipelines `GET /metrics` on it
    /// until the server stops taking requests (its answers are never read, so its writes
    /// stall and it stops reading); returns the stream, still open and unread.
    async fn never_reading(addr: SocketAddr) -> TcpStream {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(1024).unwrap();
        let mut s = socket.connect(addr).await.unwrap();
        let request = b"GET /metrics HTTP/1.1\r\nhost: oncely\r\n\r\n";
        while let Ok(Ok(())) =
            tokio::time::timeout(Duration::from_secs(1), s.write_all(request)).await
        {}
        s
    }

    /// Clients that send requests and never read the answers (issue 14's tester: 520 of them
    /// locked every other client out for 70+ s, past every read deadline): with the
    /// connection cap at 8, eight such clients fill it, and a ninth client is still served
    /// once the server's stalled writes pass the write timeout and their connections close.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn clients_that_never_read_their_answers_lose_their_connections_after_the_write_timeout()
    {
        const WRITE_TIMEOUT_SECS: u64 = 3;
        let t = TestDb::new(TestBackend::Sqlite).await.unwrap();
        let p = serve_with_env(
            &t.url,
            &["--no-relay", "--no-consumer"],
            &[
                ("ONCELY_MAX_CONNECTIONS", "8"),
                ("ONCELY_WRITE_TIMEOUT_SECS", "3"),
            ],
        );
        let held =
            futures_util::future::join_all((0..8).map(|_| never_reading(addr(&p.base)))).await;
        let started = Instant::now();
        let client = reqwest::Client::new();
        let probe = tokio::time::timeout(Duration::from_secs(WRITE_TIMEOUT_SECS + 15), async {
            loop {
                let answer = client
                    .get(format!("{}/healthz", p.base))
                    .timeout(Duration::from_secs(2))
                    .send()
                    .await;
                if let Ok(r) = answer {
                    return r.status();
                }
            }
        })
        .await
        .expect("a new client is served within the write timeout + 15 s");
        assert_eq!(probe, 200);
        eprintln!(
            "8 never-reading clients held the cap; a new client served after {:?}",
            started.elapsed()
        );
        drop(held);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_body_trickled_a_byte_per_quarter_second_is_cut_at_the_body_deadline() {
        let t = TestDb::new(TestBackend::Sqlite).await.unwrap();
        let p = serve_with_env(
            &t.url,
            &["--no-relay", "--no-consumer"],
            &[("ONCELY_BODY_READ_TIMEOUT_SECS", BODY_TIMEOUT)],
        );
        let s = TcpStream::connect(addr(&p.base)).await.unwrap();
        let (rd, mut wr) = s.into_split();
        wr.write_all(head(1000, "trickled").as_bytes())
            .await
            .unwrap();
        let started = Instant::now();
        // 1000 bytes at 4 a second would take 250 s; every byte arrives well within any
        // idle timeout.
        let trickle = tokio::spawn(async move {
            for _ in 0..1000 {
                if wr.write_all(b" ").await.is_err() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        });
        let answer = tokio::time::timeout(
            Duration::from_secs(BODY_TIMEOUT_SECS + 10),
            until_closed(rd),
        )
        .await
        .expect("the trickled body is cut within the body deadline + 10 s");
        let elapsed = started.elapsed();
        trickle.abort();
        let text = String::from_utf8_lossy(&answer);
        assert_eq!(status(&answer), Some(408), "{text}");
        assert!(
            text.contains("urn:oncely:problem:request-timeout"),
            "{text}"
        );
        assert!(
            elapsed >= Duration::from_secs(BODY_TIMEOUT_SECS - 1),
            "cut after {elapsed:?}, before the deadline"
        );
        eprintln!("trickled body cut after {elapsed:?}");
    }
}

/// The payment + shipping flow through processes: `oncely sim payments`, `oncely sim
/// shipping`, `orders serve` with the provider flags (and, for the second case,
/// `--no-runner` beside a separate `orders effects run`) on a SQLite file.
mod flow {
    use super::*;
    use oncely_testkit::process::ProcessGuard;

    fn sqlite_url() -> (std::path::PathBuf, String) {
        let dir = std::env::temp_dir().join(format!("oncely-flow-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let url = format!("sqlite://{}", dir.join("flow.db").display());
        (dir, url)
    }

    /// The provider flags for the two simulators.
    fn provider_flags<'a>(payments: &'a str, shipping: &'a str) -> Vec<&'a str> {
        vec![
            "--payments-url",
            payments,
            "--payments-secret-key",
            "sk_test_x",
            "--shipping-url",
            shipping,
            "--runner-poll-ms",
            "20",
            "--runner-check-delay-ms",
            "200",
        ]
    }

    /// Posts `n` orders to `serve` and waits until `GET` shows each one's invoice paid, its
    /// payment and its shipment succeeded; then counts at both simulators: one charge per
    /// invoice, one shipment per order (`before`: orders that flowed besides these).
    async fn orders_flow_to_shipment(
        serve: &Proc,
        (n, before): (usize, usize),
        payments: &str,
        shipping: &str,
    ) {
        let client = reqwest::Client::new();
        let mut ids = Vec::new();
        for i in 0..n {
            let ext = format!("flow-{i}");
            let created = post(&client, &serve.base, &format!("flow-key-{i}"), &order(&ext)).await;
            assert_eq!(created.0, 201, "{created:?}");
            ids.push(created.2["id"].as_str().unwrap().to_owned());
        }
        let mut invoices = Vec::new();
        for id in &ids {
            let mut got = Value::Null;
            for _ in 0..600 {
                got = client
                    .get(format!("{}/v1/orders/{id}", serve.base))
                    .bearer_auth(API_KEY)
                    .send()
                    .await
                    .unwrap()
                    .json()
                    .await
                    .unwrap();
                if got["shipment"]["state"] == "succeeded" {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            assert_eq!(
                got["shipment"]["state"], "succeeded",
                "shipped within 30 s: {got}"
            );
            assert!(got["shipment"]["provider_id"].is_string(), "{got}");
            assert_eq!(got["payment"]["state"], "succeeded", "{got}");
            assert!(
                got["payment"]["provider_id"]
                    .as_str()
                    .is_some_and(|p| p.starts_with("pi_")),
                "{got}"
            );
            assert_eq!(got["invoice"]["status"], "paid", "{got}");
            invoices.push(got["invoice"]["id"].as_str().unwrap().to_owned());
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (pay, ship) = (stats(payments).await, stats(shipping).await);
        assert_eq!(pay["payment_intents"], n + before, "{pay}");
        assert_eq!(ship["shipments"], n + before, "{ship}");
        for (id, invoice) in ids.iter().zip(&invoices) {
            assert_eq!(
                pay["payment_intents_by_metadata"]["invoice_id"][invoice]["succeeded"], 1,
                "{pay}"
            );
            assert_eq!(ship["by_merchant_reference"][id]["total"], 1, "{ship}");
        }
    }

    #[tokio::test]
    async fn serve_with_provider_flags_charges_and_ships_each_order_once_in_process() {
        let (_pay_proc, payments) = sim("payments", &["--secret-key", "sk_test_x"]);
        let (_ship_proc, shipping) = sim("shipping", &[]);
        let (dir, url) = sqlite_url();
        let serve = serve_with(&url, &provider_flags(&payments, &shipping));
        orders_flow_to_shipment(&serve, (5, 0), &payments, &shipping).await;
        drop(serve);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn serve_without_runner_leaves_the_effects_to_a_separate_effects_run_process() {
        let (_pay_proc, payments) = sim("payments", &["--secret-key", "sk_test_x"]);
        let (_ship_proc, shipping) = sim("shipping", &[]);
        let (dir, url) = sqlite_url();
        let mut flags = provider_flags(&payments, &shipping);
        flags.push("--no-runner");
        let serve = serve_with(&url, &flags);
        let client = reqwest::Client::new();
        // Without a runner the charge waits, pending, with the invoice open.
        let created = post(&client, &serve.base, "flow-wait", &order("flow-wait")).await;
        let id = created.2["id"].as_str().unwrap().to_owned();
        let mut got = Value::Null;
        for _ in 0..200 {
            got = client
                .get(format!("{}/v1/orders/{id}", serve.base))
                .bearer_auth(API_KEY)
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            if got["payment"]["state"] == "pending" {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(got["payment"]["state"], "pending", "{got}");
        assert_eq!(got["invoice"]["status"], "open", "{got}");
        assert!(got["shipment"].is_null(), "{got}");
        assert_eq!(stats(&payments).await["payment_intents"], 0);
        let mut cmd = oncely_testkit::process::command(super::ORDERS);
        cmd.args(["effects", "run", "--database-url", &url])
            .args(provider_flags(&payments, &shipping))
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let mut runner = ProcessGuard::spawn(cmd).expect("spawn orders effects run");
        orders_flow_to_shipment(&serve, (4, 1), &payments, &shipping).await;
        // The first order too, now.
        let got: Value = client
            .get(format!("{}/v1/orders/{id}", serve.base))
            .bearer_auth(API_KEY)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(got["shipment"]["state"], "succeeded", "{got}");
        // SIGTERM: the runner drains and exits 0.
        let pid = runner.id().to_string();
        assert!(Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success());
        let status = wait_exit(&mut runner.child).await;
        assert!(
            status.success(),
            "effects run exits 0 at SIGTERM, got {status}"
        );
        drop(serve);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
