//! `oncely consume --deliver-to`: messages POSTed to a receiver in another language — the
//! Python receiver of docs/consume-in-any-language.md, extracted from the page and run as
//! is — through answers of 500, dropped connections and the receiver stopped for longer
//! than the retry schedule's cap (every message applied exactly once, none dead), and a
//! refusal (dead with the answer, delivered after `oncely inbox dead requeue`).
//!
//! Knobs (environment): `ONCELY_DELIVERY_MESSAGES` (300), `ONCELY_DELIVERY_SEED` (the
//! receiver's PRNG seed, printed).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use oncely_testkit::process::ProcessGuard;
use oncely_testkit::{TestBackend, TestBroker, TestDb};
use serde_json::Value;

use super::{enqueue, env_u64, outbox_event};

/// The Standard Webhooks spec's example secret.
const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
/// The retry schedule's cap the consumer runs with (`--consumer-backoff-cap-secs`).
const CAP: Duration = Duration::from_secs(1);
/// The page whose Python receiver the tests run.
const PAGE: &str = include_str!("../../../../docs/consume-in-any-language.md");

/// The first ```` ```python ```` block of the page.
fn receiver_source() -> &'static str {
    let start = PAGE.find("```python\n").expect("a python block") + "```python\n".len();
    let len = PAGE[start..].find("```").expect("the block ends");
    &PAGE[start..start + len]
}

/// One test's world: database, broker names, a temporary directory for the receiver.
struct World {
    t: TestDb,
    broker: TestBroker,
    dir: tempfile::TempDir,
    suffix: String,
    group: String,
    topic: String,
}

impl World {
    async fn new(backend: TestBackend, broker: TestBroker) -> Option<Self> {
        if broker == TestBroker::RabbitMq
            && !oncely_testkit::service_reachable("RabbitMQ", &oncely_testkit::amqp_url()).await
        {
            return None;
        }
        let t = TestDb::new(backend).await?;
        t.db.migrate().await.unwrap();
        let suffix = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
        Some(Self {
            t,
            broker,
            dir: tempfile::tempdir().unwrap(),
            group: format!("deliver-{suffix}"),
            topic: format!("deliver.{suffix}"),
            suffix,
        })
    }

    /// The database and broker flags every `oncely` command of the test takes, with a
    /// pool of `pool` connections (PostgreSQL's are shared by the whole suite).
    fn common_args(&self, pool: u32) -> Vec<String> {
        let mut a = vec![
            "--database-url".to_owned(),
            self.t.url.clone(),
            "--db-max-connections".to_owned(),
            pool.to_string(),
        ];
        match self.broker {
            TestBroker::Sql => a.extend(["--broker".to_owned(), "sql".to_owned()]),
            TestBroker::RabbitMq => a.extend([
                "--broker".to_owned(),
                "rabbitmq".to_owned(),
                "--amqp-url".to_owned(),
                oncely_testkit::amqp_url(),
                "--amqp-exchange".to_owned(),
                format!("deliver.{}", self.suffix),
                "--amqp-queue-prefix".to_owned(),
                format!("deliver-{}", self.suffix),
            ]),
            other => panic!("no delivery test on {other:?}"),
        }
        a
    }

    fn applied_file(&self) -> PathBuf {
        self.dir.path().join("applied.jsonl")
    }

    /// Starts the page's receiver on `port` (0: any) with the fault knobs `env`.
    fn receiver(&self, port: u16, env: &[(&str, String)]) -> Receiver {
        let script = self.dir.path().join("receiver.py");
        std::fs::write(&script, receiver_source()).unwrap();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("receiver.log"))
            .unwrap();
        let mut cmd = oncely_testkit::process::command("python3");
        cmd.arg(&script)
            .env("WEBHOOK_SECRET", SECRET)
            .env("APPLIED_FILE", self.applied_file())
            .env("PORT", port.to_string())
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdout(Stdio::piped())
            .stderr(log);
        let mut guard = ProcessGuard::spawn(cmd).unwrap();
        let mut line = String::new();
        BufReader::new(guard.child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        println!("receiver: {}", line.trim());
        let port = line
            .split_whitespace()
            .nth(2)
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("the receiver did not start: {line:?}"));
        Receiver {
            _guard: guard,
            port,
        }
    }

    /// Starts `oncely consume --deliver-to` at `port`.
    fn consume(&self, port: u16) -> Oncely {
        let url = format!("http://127.0.0.1:{port}/webhooks");
        let cap = CAP.as_secs().to_string();
        let mut args: Vec<String> = [
            "consume",
            "--deliver-to",
            url.as_str(),
            "--signing-secret",
            SECRET,
            "--consumer",
            self.group.as_str(),
            "--consumer-topic",
            self.topic.as_str(),
            "--consumer-concurrency",
            "4",
            "--consumer-poll-ms",
            "50",
            "--consumer-backoff-base-ms",
            "50",
            "--consumer-backoff-cap-secs",
            cap.as_str(),
            "--delivery-timeout-secs",
            "5",
            // Does not apply to delivery: were it applied, the first 500 would kill.
            "--consumer-max-attempts",
            "1",
        ]
        .map(str::to_owned)
        .into();
        args.extend(self.common_args(5));
        Oncely::spawn(&args)
    }

    /// Starts `oncely relay`, which publishes what the test enqueues.
    fn relay(&self) -> Oncely {
        let mut args = vec![
            "relay".to_owned(),
            "--relay-poll-ms".to_owned(),
            "50".to_owned(),
        ];
        args.extend(self.common_args(3));
        Oncely::spawn(&args)
    }

    /// Runs `oncely inbox dead ARGS… --consumer GROUP`, returning its stdout.
    fn dead(&self, args: &[&str]) -> String {
        let out = oncely_testkit::process::command(env!("CARGO_BIN_EXE_oncely"))
            .args(["inbox", "dead"])
            .args(args)
            .args(["--consumer", &self.group])
            .args(self.common_args(1))
            .stderr(Stdio::inherit())
            .output()
            .unwrap();
        assert!(out.status.success(), "inbox dead {args:?} failed");
        String::from_utf8(out.stdout).unwrap()
    }

    /// The dead letters of the group, as `inbox dead list --json` prints them.
    fn dead_letters(&self) -> Vec<Value> {
        self.dead(&["list", "--json"])
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    /// What the receiver applied: one JSON object per application, in order.
    fn applied(&self) -> Vec<Value> {
        std::fs::read_to_string(self.applied_file())
            .unwrap_or_default()
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    /// Waits until the receiver applied `n` messages (`within` at most), failing at once
    /// when the consumer dead-letters more than `dead` messages.
    async fn wait_applied(&self, n: usize, dead: usize, within: Duration, oncely: &Oncely) {
        let started = Instant::now();
        while self.applied().len() < n {
            assert!(
                oncely.count("dead-lettered") <= dead,
                "dead-lettered: {:#?}",
                oncely.tail(20)
            );
            assert!(
                started.elapsed() < within,
                "{} of {n} applied after {within:?}; consumer log tail: {:#?}",
                self.applied().len(),
                oncely.tail(20)
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Deletes the group's RabbitMQ queues and the test's exchange.
    async fn clean_up(&self) {
        if self.broker != TestBroker::RabbitMq {
            return;
        }
        let config = oncely_broker::RabbitMqSubscriberConfig::new(
            oncely_testkit::amqp_url(),
            &self.group,
            &self.topic,
        )
        .with_queue_prefix(&format!("deliver-{}", self.suffix));
        drop(
            oncely_broker::RabbitMqSubscriber::new(config)
                .delete_queues()
                .await,
        );
        if let Ok(conn) = lapin::Connection::connect(
            &oncely_testkit::amqp_url(),
            oncely_broker::amqp_connection_properties(),
        )
        .await
        {
            if let Ok(ch) = conn.create_channel().await {
                drop(
                    ch.exchange_delete(
                        &format!("deliver.{}", self.suffix),
                        lapin::options::ExchangeDeleteOptions::default(),
                    )
                    .await,
                );
            }
            drop(conn.close(200, "bye").await);
        }
    }
}

/// The receiver process (killed when dropped) and its port.
struct Receiver {
    _guard: ProcessGuard,
    port: u16,
}

/// An `oncely` process (killed when dropped) and its log lines.
struct Oncely {
    guard: ProcessGuard,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Oncely {
    fn spawn(args: &[String]) -> Self {
        let mut cmd = oncely_testkit::process::command(env!("CARGO_BIN_EXE_oncely"));
        cmd.args(args)
            .env_remove("ONCELY_LOG")
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let mut guard = ProcessGuard::spawn(cmd).unwrap();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let stderr = guard.child.stderr.take().unwrap();
        let sink = lines.clone();
        std::thread::spawn(move || {
            for l in BufReader::new(stderr).lines().map_while(Result::ok) {
                sink.lock().unwrap().push(l);
            }
        });
        Self { guard, lines }
    }

    fn count(&self, needle: &str) -> usize {
        self.lines
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains(needle))
            .count()
    }

    fn tail(&self, n: usize) -> Vec<String> {
        let lines = self.lines.lock().unwrap();
        lines[lines.len().saturating_sub(n)..].to_vec()
    }

    async fn wait_for(&self, needle: &str) {
        let started = Instant::now();
        while self.count(needle) == 0 {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "no {needle:?} within 30 s: {:#?}",
                self.tail(20)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGTERM, and the exit status (30 s at most).
    async fn stop(mut self) -> std::process::ExitStatus {
        let pid = self.guard.id().to_string();
        assert!(std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success());
        super::wait_exit(&mut self.guard.child).await
    }
}

/// `n` events of the test's topic, each with a tenant header.
fn events(w: &World, n: usize) -> Vec<oncely_sql::OutboxEvent> {
    (0..n)
        .map(|i| outbox_event(&w.topic, &format!("k{}", i % 7), i).with_header("tenant", "t-1"))
        .collect()
}

/// Each of `events` applied exactly once, with its event type, tenant and body, and
/// nothing else applied.
fn assert_applied_once(applied: &[Value], events: &[oncely_sql::OutboxEvent]) {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    for a in applied {
        *seen
            .entry(a["id"].as_str().unwrap().to_owned())
            .or_default() += 1;
    }
    for (i, e) in events.iter().enumerate() {
        let id = e.message_id.to_string();
        assert_eq!(seen.remove(&id), Some(1), "message {i} ({id}) applied once");
    }
    assert!(seen.is_empty(), "applied but never published: {seen:?}");
    for a in applied {
        assert_eq!(a["event_type"], "order.created", "{a}");
        assert_eq!(a["tenant"], "t-1", "{a}");
        assert!(a["body"].as_str().unwrap().starts_with("{\"n\":"), "{a}");
    }
}

/// The group's inbox rows: the messages the consumer recorded as delivered.
async fn inbox_rows(w: &World) -> i64 {
    // The group name is the test's own `deliver-<hex>`: safe as a literal.
    let sql = format!(
        "SELECT COUNT(*) FROM oncely_inbox WHERE consumer = '{}'",
        w.group
    );
    oncely_sql::on_pool!(&w.t.db, |p| sqlx::query_scalar::<_, i64>(&sql)
        .fetch_one(p)
        .await)
    .unwrap()
}

/// Item 1 of issue 31 part 2: with 20 % of the deliveries answered 500, 5 % of the
/// connections dropped after the receiver applied the message, and the receiver stopped
/// for three times the retry schedule's cap, every message is delivered (applied exactly
/// once, recorded in the inbox) and none is dead.
async fn every_message_is_applied_once_through_500s_drops_and_a_receiver_outage(
    backend: TestBackend,
    broker: TestBroker,
) {
    let Some(w) = World::new(backend, broker).await else {
        return;
    };
    let n = usize::try_from(env_u64("ONCELY_DELIVERY_MESSAGES", 300)).unwrap();
    let seed = env_u64("ONCELY_DELIVERY_SEED", u64::from(rand_seed()));
    println!("ONCELY_DELIVERY_SEED={seed} ONCELY_DELIVERY_MESSAGES={n}");
    let faults = |seed: u64| {
        vec![
            ("FAIL_RATE", "0.2".to_owned()),
            ("DROP_RATE", "0.05".to_owned()),
            ("SEED", seed.to_string()),
        ]
    };
    let receiver = w.receiver(0, &faults(seed));
    let port = receiver.port;
    let consume = w.consume(port);
    consume.wait_for("inbox consumer starting").await;
    let events = events(&w, n);
    enqueue(&w.t, &events).await;
    let relay = w.relay();
    w.wait_applied(n / 3, 0, Duration::from_secs(120), &consume)
        .await;
    drop(receiver);
    println!("receiver stopped after {} applied", w.applied().len());
    tokio::time::sleep(CAP * 3).await;
    let _receiver = w.receiver(port, &faults(seed + 1));
    w.wait_applied(n, 0, Duration::from_secs(300), &consume)
        .await;
    // Acknowledged means recorded: the consumer's inbox holds every message.
    let started = Instant::now();
    while inbox_rows(&w).await < i64::try_from(n).unwrap() {
        assert!(started.elapsed() < Duration::from_secs(30), "inbox rows");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_applied_once(&w.applied(), &events);
    assert_eq!(w.dead_letters(), Vec::<Value>::new(), "none is dead");
    let retried = consume.count("handler failed; retrying");
    println!("{retried} retried deliveries");
    assert!(retried > 0, "the faults caused retries");
    assert!(consume.stop().await.success());
    assert!(relay.stop().await.success());
    w.clean_up().await;
}

/// Item 2: a message the receiver answers 400 is dead at once with the answer as its
/// reason, the others are delivered; once requeued (and accepted) it is delivered.
async fn a_refused_message_is_dead_with_the_answer_and_delivered_after_requeue(
    backend: TestBackend,
    broker: TestBroker,
) {
    let Some(w) = World::new(backend, broker).await else {
        return;
    };
    let events = events(&w, 5);
    let refused = events[2].message_id.to_string();
    let receiver = w.receiver(0, &[("REFUSE_ID", refused.clone())]);
    let port = receiver.port;
    let consume = w.consume(port);
    consume.wait_for("inbox consumer starting").await;
    enqueue(&w.t, &events).await;
    let relay = w.relay();
    w.wait_applied(4, 1, Duration::from_secs(60), &consume)
        .await;
    let started = Instant::now();
    let dead = loop {
        let dead = w.dead_letters();
        if !dead.is_empty() || started.elapsed() > Duration::from_secs(30) {
            break dead;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(dead.len(), 1, "{dead:#?}");
    assert_eq!(dead[0]["message_id"], refused.as_str());
    let reason = dead[0]["last_error"].as_str().unwrap();
    assert!(
        reason.contains("HTTP 400")
            && reason.contains(&format!("message {refused} cannot be applied")),
        "{reason}"
    );
    assert!(
        dead[0]["attempts"].as_u64() <= Some(1),
        "dead at the first answer: {dead:#?}"
    );
    assert!(!w.applied().iter().any(|a| a["id"] == refused.as_str()));
    // The receiver is fixed; the operator requeues.
    drop(receiver);
    let _receiver = w.receiver(port, &[]);
    assert!(w.dead(&["requeue", &refused]).contains("requeued 1"));
    w.wait_applied(5, 1, Duration::from_secs(60), &consume)
        .await;
    assert_applied_once(&w.applied(), &events);
    assert_eq!(w.dead_letters(), Vec::<Value>::new());
    assert!(consume.stop().await.success());
    assert!(relay.stop().await.success());
    w.clean_up().await;
}

/// A seed from the clock (the test prints it).
fn rand_seed() -> u32 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos()
        | 1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_rabbitmq_every_message_is_applied_once_through_500s_drops_and_a_receiver_outage()
{
    every_message_is_applied_once_through_500s_drops_and_a_receiver_outage(
        TestBackend::Postgres,
        TestBroker::RabbitMq,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_sql_queue_every_message_is_applied_once_through_500s_drops_and_a_receiver_outage() {
    every_message_is_applied_once_through_500s_drops_and_a_receiver_outage(
        TestBackend::Sqlite,
        TestBroker::Sql,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_rabbitmq_a_refused_message_is_dead_with_the_answer_and_delivered_after_requeue() {
    a_refused_message_is_dead_with_the_answer_and_delivered_after_requeue(
        TestBackend::Postgres,
        TestBroker::RabbitMq,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_sql_queue_a_refused_message_is_dead_with_the_answer_and_delivered_after_requeue() {
    a_refused_message_is_dead_with_the_answer_and_delivered_after_requeue(
        TestBackend::Sqlite,
        TestBroker::Sql,
    )
    .await;
}

/// The page's Python receiver accepts what oncely signs: Python's `hmac` computes the
/// Standard Webhooks test vector the Rust signer is tested against (oncely-delivery's unit
/// test), so both sides agree on the scheme.
#[test]
fn python_hmac_computes_the_standard_webhooks_test_vector() {
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            "import base64,hashlib,hmac\n\
             k=base64.b64decode('MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw')\n\
             m=b'msg_p5jXN8AQM9LWM0D4loKWxJek.1614265330.{\"test\": 2432232314}'\n\
             print('v1,'+base64.b64encode(hmac.new(k,m,hashlib.sha256).digest()).decode())",
        ])
        .output()
        .unwrap();
    assert!(out.status.success());
    let python = String::from_utf8(out.stdout).unwrap();
    let secret = oncely_delivery::SigningSecret::parse(SECRET).unwrap();
    let rust = secret.sign(
        "msg_p5jXN8AQM9LWM0D4loKWxJek",
        1_614_265_330,
        br#"{"test": 2432232314}"#,
    );
    assert_eq!(python.trim(), rust);
    assert_eq!(rust, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
}
