//! The `oncely` binary as a process: S8 (a second process against the same database obeys
//! the same keys), migrations, graceful shutdown on SIGTERM, the in-process billing consumer,
//! and `oncely verify` against `oncely serve`.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use oncely_testkit::{on_every_backend, TestDb};
use serde_json::{json, Value};

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

/// Starts `oncely serve` on an ephemeral port and reads the bound address from its JSON log.
fn serve(url: &str) -> Proc {
    serve_with(url, &[])
}

/// [`serve`] with extra arguments.
fn serve_with(url: &str, extra: &[&str]) -> Proc {
    let mut child = Command::new(env!("CARGO_BIN_EXE_oncely"))
        .args(["serve", "--listen", "127.0.0.1:0"])
        .args(extra)
        .env("ONCELY_DATABASE_URL", url)
        .env(
            "ONCELY_API_KEYS",
            format!("{API_KEY}=cli,{API_KEY_B}=cli-b"),
        )
        .env("ONCELY_LOG_FORMAT", "json")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn oncely");
    let stderr = child.stderr.take().unwrap();
    let mut lines = BufReader::new(stderr).lines();
    let listen = loop {
        let line = lines
            .next()
            .expect("oncely exited before listening")
            .unwrap();
        let v: Value = serde_json::from_str(&line).unwrap_or(Value::Null);
        if let Some(addr) = v["fields"]["listen"].as_str() {
            break addr.to_owned();
        }
    };
    // Keep draining stderr so the child never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    Proc {
        child,
        base: format!("http://{listen}"),
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

on_every_backend!(
    s8_second_process_on_the_same_database_obeys_the_same_keys,
    migrate_command_applies_migrations_and_sigterm_drains,
    serve_bills_each_order_once_in_process_and_get_shows_the_invoice,
    serve_bills_each_order_once_through_nats_jetstream,
    serve_bills_each_order_once_through_rabbitmq,
    serve_bills_each_order_once_through_kafka,
    serve_bills_200_orders_created_with_retries_over_dropped_connections_once_each,
    inbox_dead_list_and_requeue_commands_show_and_revive_a_dead_delivery,
    outbox_stats_dead_list_and_requeue_commands_show_and_revive_a_dead_event,
    relay_process_aborted_after_confirm_is_republished_with_the_same_ids_and_jetstream_drops_the_copies,
    serve_starts_with_the_broker_down_and_relays_the_events_once_it_is_up,
    verify_command_against_serve_finds_every_check_holding,
);

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
    let status = Command::new(env!("CARGO_BIN_EXE_oncely"))
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
        let out = Command::new(env!("CARGO_BIN_EXE_oncely"))
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

/// The whole chain through a real broker, as `oncely serve --broker nats` runs it: order and
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

/// Creates 5 orders through `oncely serve` (with `extra` arguments), each retried with its
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
        Command::new(env!("CARGO_BIN_EXE_oncely"))
            .args(["inbox", "--database-url", &t.url, "dead"])
            .args(args)
            .stderr(Stdio::null())
            .output()
            .unwrap()
    };
    let list = run(&["list"]);
    assert!(list.status.success());
    let out = String::from_utf8(list.stdout).unwrap();
    assert!(out.contains(&format!("{id}\t1\tboom in billing")), "{out}");
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
    orders::migrate(&t.db).await.unwrap();
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
        Command::new(env!("CARGO_BIN_EXE_oncely"))
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
    orders::migrate(&t.db).await.unwrap();
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    let topic = format!("kill.{suffix}");
    let stream = format!("KILL{suffix}");
    // 4 aggregates × 5 events: the first batch holds the 4 partition heads.
    let events: Vec<_> = (0..20)
        .map(|n| outbox_event(&topic, &format!("agg-{}", n % 4), n))
        .collect();
    let ids = enqueue(&t, &events).await;
    let relay = |fault: bool| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_oncely"));
        c.args(["relay", "--database-url", &t.url, "--broker", "nats"])
            .args(["--nats-url", &nats_url, "--nats-stream", &stream])
            .args(["--nats-subjects", &topic, "--relay-lease-secs", "2"])
            .args(["--relay-poll-ms", "50"])
            // Keep the published rows, so the test can read their state.
            .args(["--outbox-retention-secs", "3600"])
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if fault {
            c.env("ONCELY_FAULT", "relay-abort-after-confirm");
        }
        c.spawn().expect("spawn oncely relay")
    };
    let mut first = relay(true);
    let status = wait_exit(&mut first).await;
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
    let second = Proc {
        child: second,
        base: String::new(),
    };
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

/// The broker is down when `oncely serve` starts: the service still takes orders, their
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
    let (auth_a, auth_b) = (
        format!("Authorization: Bearer {API_KEY}"),
        format!("Authorization: Bearer {API_KEY_B}"),
    );
    let out = tokio::task::spawn_blocking({
        let (body, report) = (body_path.clone(), report_path.clone());
        move || {
            Command::new(env!("CARGO_BIN_EXE_oncely"))
                .args(["verify", "--url", &url, "--body"])
                .arg(&body)
                .args(["--header", &auth_a, "--header-b", &auth_b])
                .args(["--mutate", "/amount_minor=2999", "--object-id", "/id"])
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
    let out = Command::new(env!("CARGO_BIN_EXE_oncely"))
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
    // Exit status 2 when the checks cannot run.
    let out = Command::new(env!("CARGO_BIN_EXE_oncely"))
        .args(["verify", "--url", "ftp://x", "--body", "{}"])
        .stderr(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}
