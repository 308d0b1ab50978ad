//! Publish from any language (docs/publish-from-any-language.md): a Python process writes
//! orders and their outbox rows with the page's own snippets (extracted from the markdown,
//! so the page cannot drift from what works), one transaction each, and rolls every 7th
//! back after both inserts; meanwhile two `oncely relay` processes are SIGKILLed at random
//! and restarted. Afterwards the broker must hold every committed order's event (distinct
//! message ids = committed transactions, each id the one `MessageId::derive_from_parts`
//! gives for the order), none of a rolled-back one, copies only under the same id and with
//! the same content, each customer's (partition key's) events first arriving in commit
//! order; the outbox must be drained and the business table must hold the committed orders.
//!
//! Knobs (environment): `ONCELY_PUBLISH_SEED` (the kill schedule's and the writers' seed,
//! printed), `ONCELY_PUBLISH_TXNS` (transactions in all, 500), `ONCELY_PUBLISH_KILLS` (at
//! least this many SIGKILLs, 10). Relay logs and the writers' stderr go to
//! `$TMPDIR/oncely-publish-<suffix>/`, kept when the test fails.

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead as _, BufReader};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use oncely_core::MessageId;
use oncely_testkit::process::{command, ProcessGuard};
use oncely_testkit::{Delivered, TestBackend, TestBroker, TestDb, TestTopic, TEST_EXCHANGE};

use super::{env_u64, Rng};

/// The page whose Python snippets the writer runs.
const DOC: &str = include_str!("../../../../docs/publish-from-any-language.md");
/// The test's driver, appended to the snippets.
const DRIVER: &str = include_str!("publish_writer.py");
/// The tenant of every order (the `tenant` header, the first part of the message id).
const TENANT: &str = "acme";
/// Every `ROLLBACK_EVERY`-th transaction of a writer is rolled back.
const ROLLBACK_EVERY: u64 = 7;
/// Concurrent writer processes (disjoint customers, so each partition has one writer).
const WRITERS: u64 = 2;
/// Relay processes.
const RELAYS: usize = 2;

/// The fenced ```python block of [`DOC`] whose first line is `# publish-from-python: <tag>`.
fn doc_snippet(tag: &str) -> &'static str {
    let marker = format!("```python\n# publish-from-python: {tag}\n");
    let start = DOC
        .find(&marker)
        .unwrap_or_else(|| panic!("docs/publish-from-any-language.md lost its {tag} snippet"))
        + "```python\n".len();
    let len = DOC[start..].find("```").expect("an unterminated snippet");
    &DOC[start..start + len]
}

/// The writer program for `backend`: the page's message-id and backend snippets, then
/// [`DRIVER`].
fn writer_program(backend: &str) -> String {
    format!(
        "{}\n{}\n{DRIVER}",
        doc_snippet("message-id"),
        doc_snippet(backend)
    )
}

/// `PUBLISH_BACKEND` and `PUBLISH_DSN` for the test database `url` (see the driver).
fn python_dsn(url: &str) -> (&'static str, String) {
    if let Some(path) = url.strip_prefix("sqlite://") {
        return ("sqlite", path.to_owned());
    }
    if let Some(rest) = url.strip_prefix("mysql://") {
        let (auth, rest) = rest.split_once('@').expect("mysql URL with a user");
        let (user, password) = auth.split_once(':').unwrap_or((auth, ""));
        let (host_port, database) = rest.split_once('/').expect("mysql URL with a database");
        let database = database.split('?').next().unwrap_or_default();
        let (host, port) = host_port.split_once(':').unwrap_or((host_port, "3306"));
        let args = serde_json::json!({
            "host": host, "port": port.parse::<u16>().expect("port"), "user": user,
            "password": password, "database": database,
        });
        return ("mariadb", args.to_string());
    }
    let (base, query) = url
        .split_once('?')
        .expect("postgres URL with a search path");
    let schema = query
        .split('&')
        .find_map(|kv| kv.strip_prefix("options[search_path]="))
        .expect("options[search_path]");
    (
        "postgres",
        format!("{base}?options=-csearch_path%3D{schema}"),
    )
}

/// Whether `python3` can import `module`; `false` (after printing why) when it cannot and
/// services are not required.
fn python_has(module: &str) -> bool {
    let ok = std::process::Command::new("python3")
        .args(["-c", &format!("import {module}")])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok || !oncely_testkit::require_services(),
        "python3 with {module} is required (.ci/run installs it)"
    );
    if !ok {
        eprintln!("SKIPPED: python3 cannot import {module}");
    }
    ok
}

/// One writer's outcome, from its stdout lines.
#[derive(Debug, Default)]
struct Written {
    /// (order id, message id, customer id), in commit order.
    committed: Vec<(String, String, String)>,
    /// (order id, message id).
    rolled_back: Vec<(String, String)>,
}

/// A writer process and what it printed so far.
struct Writer {
    proc: ProcessGuard,
    lines: Arc<Mutex<Vec<String>>>,
    name: String,
}

/// The environment every run of the writer program shares.
struct WriterEnv {
    program: std::path::PathBuf,
    backend: &'static str,
    dsn: String,
    topic: String,
    logs: std::path::PathBuf,
}

impl WriterEnv {
    fn command(&self, name: &str) -> std::process::Command {
        let mut c = command("python3");
        c.arg(&self.program)
            .env("PUBLISH_BACKEND", self.backend)
            .env("PUBLISH_DSN", &self.dsn)
            .env("PUBLISH_TENANT", TENANT)
            .env("PUBLISH_TOPIC", &self.topic)
            .env("PUBLISH_WRITER", name)
            .stderr(Stdio::from(
                std::fs::File::create(self.logs.join(format!("{name}.stderr"))).unwrap(),
            ));
        c
    }

    /// Creates the business table (the snippet's `BUSINESS_TABLE`).
    fn setup(&self) {
        let status = self.command("setup").arg("setup").status().unwrap();
        assert!(
            status.success(),
            "writer setup failed: see {}",
            self.logs.display()
        );
    }

    fn start(&self, name: &str, txns: u64, seed: u64) -> Writer {
        let mut cmd = self.command(name);
        cmd.env("PUBLISH_TXNS", txns.to_string())
            .env("PUBLISH_CUSTOMERS", "10")
            .env("PUBLISH_ROLLBACK_EVERY", ROLLBACK_EVERY.to_string())
            .env("PUBLISH_PAUSE_MS", "20")
            .env("PUBLISH_SEED", seed.to_string())
            .stdout(Stdio::piped());
        let mut proc = ProcessGuard::spawn(cmd).expect("spawn python3");
        let lines: Arc<Mutex<Vec<String>>> = Arc::default();
        let out = BufReader::new(proc.child.stdout.take().unwrap());
        let sink = lines.clone();
        std::thread::spawn(move || {
            for line in out.lines().map_while(Result::ok) {
                sink.lock().unwrap().push(line);
            }
        });
        Writer {
            proc,
            lines,
            name: name.to_owned(),
        }
    }
}

impl Writer {
    /// `true` once the writer exited successfully; a failed writer fails the test.
    fn done(&mut self) -> bool {
        match self.proc.child.try_wait().unwrap() {
            None => false,
            Some(s) => {
                assert!(s.success(), "writer {} failed: {s:?}", self.name);
                true
            }
        }
    }

    fn written(&self) -> Written {
        let mut written = Written::default();
        for line in self.lines.lock().unwrap().iter() {
            let fields: Vec<String> = line.split(' ').map(str::to_owned).collect();
            match <[String; 4]>::try_from(fields.clone()) {
                Ok([outcome, order, id, customer]) if outcome == "committed" => {
                    written.committed.push((order, id, customer));
                    continue;
                }
                _ => {}
            }
            match <[String; 3]>::try_from(fields) {
                Ok([outcome, order, id]) if outcome == "rolled-back" => {
                    written.rolled_back.push((order, id));
                }
                _ => panic!("writer {}: unexpected line {line:?}", self.name),
            }
        }
        written
    }
}

/// The relays: `RELAYS` slots, each running an `oncely relay` process or none.
struct Relays {
    args: Vec<String>,
    slots: Vec<Option<ProcessGuard>>,
    started: u64,
    kills: u64,
    logs: std::path::PathBuf,
}

impl Relays {
    fn start(&mut self, slot: usize) {
        self.started += 1;
        let log = std::fs::File::create(self.logs.join(format!("relay-{:04}.log", self.started)))
            .unwrap();
        let mut cmd = command(env!("CARGO_BIN_EXE_oncely"));
        cmd.arg("relay")
            .args(&self.args)
            .args(["--relay-batch", "16", "--relay-poll-ms", "50"])
            // Pools of 6 (LISTEN, four batches in flight, the loops), not the default 16.
            .args(["--db-max-connections", "6"])
            .args([
                "--relay-backoff-base-ms",
                "50",
                "--relay-backoff-cap-secs",
                "1",
            ])
            .env("ONCELY_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::from(log));
        self.slots[slot] = Some(ProcessGuard::spawn(cmd).expect("spawn oncely relay"));
    }

    /// SIGKILLs the slot's relay, if one runs. A relay that exited by itself fails the test.
    fn kill(&mut self, slot: usize) {
        if let Some(mut p) = self.slots[slot].take() {
            if let Some(status) = p.child.try_wait().unwrap() {
                panic!(
                    "a relay exited by itself: {status:?}, logs in {}",
                    self.logs.display()
                );
            }
            drop(p); // SIGKILL and reap
            self.kills += 1;
        }
    }
}

/// The `oncely relay` arguments that publish the database `url`'s outbox to `topic` on
/// `broker` (where the [`TestTopic`]'s collector reads it).
fn relay_args(broker: TestBroker, url: &str, topic: &str) -> Vec<String> {
    let kind = match broker {
        TestBroker::Sql => "sql",
        TestBroker::RabbitMq => "rabbitmq",
        TestBroker::Nats => "nats",
        TestBroker::Kafka => "kafka",
    };
    let mut args = vec!["--database-url", url, "--broker", kind];
    let (amqp, kafka) = (oncely_testkit::amqp_url(), oncely_testkit::kafka_brokers());
    match broker {
        TestBroker::RabbitMq => {
            args.extend(["--amqp-url", &amqp, "--amqp-exchange", TEST_EXCHANGE]);
        }
        TestBroker::Kafka => args.extend(["--kafka-brokers", &kafka, "--kafka-topics", topic]),
        TestBroker::Sql | TestBroker::Nats => {}
    }
    if !url.starts_with("postgres") {
        // Claimed rows are leased on SQLite and MariaDB: a SIGKILLed relay's rows wait this
        // long (PostgreSQL's row locks go with the connection).
        args.extend(["--relay-lease-secs", "3"]);
    }
    args.into_iter().map(str::to_owned).collect()
}

/// The scenario of the module's first comment on `backend` + `broker`.
async fn python_writer_with_relays_sigkilled(backend: TestBackend, broker: TestBroker) {
    let module = match backend {
        TestBackend::Postgres => "psycopg",
        TestBackend::MySql => "pymysql",
        TestBackend::Sqlite => "sqlite3",
    };
    if !python_has(module) {
        return;
    }
    let Some(t) = TestDb::new(backend).await else {
        return;
    };
    t.db.migrate().await.unwrap();
    let Some(topic) = TestTopic::new(broker, &t.db).await else {
        return;
    };
    let (_, topic, _, mut collector, _) = topic.into_parts();
    let args = relay_args(broker, &t.url, &topic);
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    let seed = env_u64("ONCELY_PUBLISH_SEED", oncely_core::now_ms() as u64) | 1;
    let txns = env_u64("ONCELY_PUBLISH_TXNS", 500);
    let min_kills = env_u64("ONCELY_PUBLISH_KILLS", 10);
    let logs = std::env::temp_dir().join(format!("oncely-publish-{suffix}"));
    std::fs::create_dir_all(&logs).unwrap();
    eprintln!(
        "publish test: seed {seed}, {txns} transactions, at least {min_kills} kills, \
         {backend:?} + {broker:?}, url {}, topic {topic}, logs {}",
        t.url,
        logs.display()
    );
    let (py_backend, dsn) = python_dsn(&t.url);
    let program = logs.join("writer.py");
    std::fs::write(&program, writer_program(py_backend)).unwrap();
    let env = WriterEnv {
        program,
        backend: py_backend,
        dsn,
        topic: topic.clone(),
        logs: logs.clone(),
    };
    env.setup();
    let mut relays = Relays {
        args,
        slots: (0..RELAYS).map(|_| None).collect(),
        started: 0,
        kills: 0,
        logs: logs.clone(),
    };
    for slot in 0..RELAYS {
        relays.start(slot);
    }
    let mut writers: Vec<Writer> = (0..WRITERS)
        .map(|w| {
            env.start(
                &format!("w{w}"),
                txns / WRITERS,
                seed.rotate_left(w as u32 + 1),
            )
        })
        .collect();
    kill_until_written(&mut relays, &mut writers, Rng(seed), min_kills).await;
    drain(&t).await;
    let kills = relays.kills;
    for slot in 0..RELAYS {
        relays.kill(slot);
    }
    let written: Vec<Written> = writers.iter().map(Writer::written).collect();
    let committed: usize = written.iter().map(|w| w.committed.len()).sum();
    eprintln!(
        "publish test: {committed} committed, {} rolled back, {kills} kills while running, \
         {} relay processes",
        written.iter().map(|w| w.rolled_back.len()).sum::<usize>(),
        relays.started
    );
    let delivered = collector
        .collect(committed, Duration::from_secs(120), Duration::from_secs(3))
        .await;
    check(&written, &delivered);
    assert_eq!(
        business_rows(&t).await,
        committed as i64,
        "shop_orders rows"
    );
    drop(std::fs::remove_dir_all(&logs));
}

/// SIGKILLs a random relay every 100–600 ms and restarts it after 0–300 ms, until every
/// writer is done and at least `min_kills` kills happened.
async fn kill_until_written(
    relays: &mut Relays,
    writers: &mut [Writer],
    mut rng: Rng,
    min_kills: u64,
) {
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        assert!(
            Instant::now() < deadline,
            "the writers did not finish within 10 minutes"
        );
        tokio::time::sleep(Duration::from_millis(100 + rng.below(500))).await;
        let slot = rng.below(RELAYS as u64) as usize;
        relays.kill(slot);
        tokio::time::sleep(Duration::from_millis(rng.below(300))).await;
        relays.start(slot);
        let mut all_done = true;
        for w in writers.iter_mut() {
            all_done &= w.done();
        }
        if all_done && relays.kills >= min_kills {
            return;
        }
    }
}

/// Waits until the outbox holds no pending row (2 minutes at most), then for settles in
/// flight; a dead row fails the test.
async fn drain(t: &TestDb) {
    let store = oncely_sql::OutboxStore::new(t.db.clone());
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let s = store.stats().await.unwrap();
        assert_eq!(s.dead, 0, "dead rows: {s:?}");
        if s.pending == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the relays did not drain the outbox: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
}

/// Rows in the writers' business table.
async fn business_rows(t: &TestDb) -> i64 {
    let sql = "SELECT COUNT(*) FROM shop_orders";
    if let Some(pool) = t.db.as_mysql() {
        return sqlx::query_scalar(sql).fetch_one(pool).await.unwrap();
    }
    if let Some((_, reader)) = t.db.as_sqlite() {
        return sqlx::query_scalar(sql).fetch_one(reader).await.unwrap();
    }
    let pool = t.db.as_postgres().expect("postgres");
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

/// The broker's messages against what the writers committed and rolled back.
fn check(written: &[Written], delivered: &[Delivered]) {
    // message id -> (order id, customer id)
    let mut sent: HashMap<&str, (&str, &str)> = HashMap::new();
    for w in written {
        for (order, mid, customer) in &w.committed {
            assert_eq!(*mid, derived_id(order), "Python's message id for {order}");
            sent.insert(mid, (order, customer));
        }
        for (order, mid) in &w.rolled_back {
            assert_eq!(*mid, derived_id(order), "Python's message id for {order}");
        }
    }
    let mut first: BTreeMap<&str, usize> = BTreeMap::new();
    let (mut copies, mut unknown) = (0usize, Vec::new());
    for (i, d) in delivered.iter().enumerate() {
        let Some((order, customer)) = sent.get(d.id.as_str()) else {
            unknown.push(d.id.clone());
            continue;
        };
        assert_eq!(d.partition_key, *customer, "partition key of {}", d.id);
        assert_eq!(d.event_type, "order.placed");
        assert_eq!(d.headers.get("tenant").map(String::as_str), Some(TENANT));
        let body: serde_json::Value = serde_json::from_slice(&d.payload).unwrap();
        assert_eq!(body["order_id"], *order, "payload of {}", d.id);
        // A copy (a relay killed between the broker's confirmation and its settle) counts
        // only with its id's first arrival.
        match first.entry(&d.id) {
            std::collections::btree_map::Entry::Vacant(e) => {
                e.insert(i);
            }
            std::collections::btree_map::Entry::Occupied(_) => copies += 1,
        }
    }
    let rolled_back: Vec<&String> = written
        .iter()
        .flat_map(|w| &w.rolled_back)
        .map(|(_, m)| m)
        .filter(|m| unknown.contains(m))
        .collect();
    let violations = order_violations(written, &first);
    eprintln!(
        "publish test: {} messages, {} distinct ids, {copies} copies (same id), {} unknown \
         ({} of them rolled back), {} order violations",
        delivered.len(),
        first.len(),
        unknown.len(),
        rolled_back.len(),
        violations.len()
    );
    assert!(
        rolled_back.is_empty(),
        "rolled-back events published: {rolled_back:?}"
    );
    assert!(unknown.is_empty(), "messages nobody committed: {unknown:?}");
    let missing: Vec<&&str> = sent.keys().filter(|m| !first.contains_key(**m)).collect();
    assert!(
        missing.is_empty(),
        "committed events never published: {missing:?}"
    );
    assert_eq!(
        first.len(),
        sent.len(),
        "distinct message ids = committed transactions"
    );
    assert!(violations.is_empty(), "order violations: {violations:#?}");
}

/// oncely's id for the order (the snippet's `message_id(tenant, "order.placed", order)`).
fn derived_id(order: &str) -> String {
    MessageId::derive_from_parts(&[TENANT, "order.placed", order]).to_string()
}

/// Per customer, consecutive committed events whose first arrivals are out of commit order.
fn order_violations(written: &[Written], first: &BTreeMap<&str, usize>) -> Vec<String> {
    let mut last: HashMap<&str, (&str, usize)> = HashMap::new();
    let mut out = Vec::new();
    for w in written {
        for (order, mid, customer) in &w.committed {
            let Some(&at) = first.get(mid.as_str()) else {
                continue;
            };
            if let Some((prev, prev_at)) = last.insert(customer, (order, at)) {
                if prev_at > at {
                    out.push(format!(
                        "{customer}: {order} (arrival {at}) before {prev} (arrival {prev_at})"
                    ));
                }
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn python_writer_on_postgres_with_relays_sigkilled_publishes_each_committed_order_once_per_id_in_order_to_rabbitmq(
) {
    python_writer_with_relays_sigkilled(TestBackend::Postgres, TestBroker::RabbitMq).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn python_writer_on_mariadb_with_relays_sigkilled_publishes_each_committed_order_once_per_id_in_order_to_kafka(
) {
    python_writer_with_relays_sigkilled(TestBackend::MySql, TestBroker::Kafka).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn python_writer_on_sqlite_with_relays_sigkilled_publishes_each_committed_order_once_per_id_in_order_to_the_sql_queue(
) {
    python_writer_with_relays_sigkilled(TestBackend::Sqlite, TestBroker::Sql).await;
}

/// Rows a foreign writer could get wrong, each with what is wrong with it: (message id,
/// headers). Before migration 0035 each went in, and the relays' claims failed on it for
/// good (`a stored record is corrupt`), stopping every partition.
const BROKEN_ROWS: [(&str, &str, &str); 6] = [
    ("not-a-uuid", "{}", "a message id that is not a UUID"),
    (
        "8f0c3c1e-5b1a-8c2d-9e3f-4a5b6c7d8e9f0",
        "{}",
        "a message id one digit too long",
    ),
    (
        "8f0c3c1e-5b1a-8c2d-9e3f-4a5b6c7d8e9f",
        "not json",
        "headers that are not JSON",
    ),
    (
        "8f0c3c1e-5b1a-8c2d-9e3f-4a5b6c7d8e9f",
        "[\"tenant\"]",
        "headers that are an array",
    ),
    (
        "8f0c3c1e-5b1a-8c2d-9e3f-4a5b6c7d8e9f",
        "{\"tenant\": \"acme\", \"n\": 1}",
        "a header value that is a number",
    ),
    (
        "8f0c3c1e-5b1a-8c2d-9e3f-4a5b6c7d8e9f",
        "{\"tenant\": {\"id\": \"acme\"}}",
        "a header value that is an object",
    ),
];

/// Inserts an outbox row as a foreign writer would (the page's column list) with the given
/// message id and headers, in a transaction of its own.
async fn insert_foreign_row(t: &TestDb, message_id: &str, headers: &str) -> Result<(), String> {
    let sql = format!(
        "INSERT INTO oncely_outbox (message_id, topic, partition_key, event_type, payload, \
         headers, created_at, available_at) VALUES ('{message_id}', 'orders', 'c-1', \
         'order.placed', '{{}}', '{headers}', {now}, {now})",
        now = oncely_core::now_ms()
    );
    let r = if let Some(pool) = t.db.as_mysql() {
        sqlx::query(&sql).execute(pool).await.map(drop)
    } else if let Some((writer, _)) = t.db.as_sqlite() {
        sqlx::query(&sql).execute(writer).await.map(drop)
    } else {
        let pool = t.db.as_postgres().expect("postgres");
        sqlx::query(&sql).execute(pool).await.map(drop)
    };
    r.map_err(|e| e.to_string())
}

/// The schema refuses a row the relay could not publish (migration 0035), so the writer's
/// transaction fails instead of the relays, and a row by the contract goes in and out.
async fn outbox_refuses_rows_that_break_the_contract_so_a_foreign_writer_cannot_stop_the_relay(
    backend: TestBackend,
) {
    let Some(t) = TestDb::new(backend).await else {
        return;
    };
    t.db.migrate().await.unwrap();
    for (id, headers, what) in BROKEN_ROWS {
        let r = insert_foreign_row(&t, id, headers).await;
        assert!(r.is_err(), "{backend:?} took a row with {what}");
    }
    let good = derived_id("order-1");
    insert_foreign_row(&t, &good, "{\"tenant\": \"acme\"}")
        .await
        .unwrap();
    insert_foreign_row(&t, &derived_id("order-2"), "{}")
        .await
        .unwrap();
    let store = oncely_sql::OutboxStore::new(t.db.clone());
    let rows = store
        .claim("test", 10, Duration::from_secs(30), oncely_core::now_ms())
        .await
        .expect("the relay's claim reads the foreign rows");
    assert_eq!(rows.len(), 1, "one head of partition c-1");
    assert_eq!(rows[0].event.message_id.to_string(), good);
    assert_eq!(
        rows[0].event.headers.get("tenant").map(String::as_str),
        Some("acme")
    );
}

#[tokio::test]
async fn postgres_outbox_refuses_rows_that_break_the_contract_so_a_foreign_writer_cannot_stop_the_relay(
) {
    outbox_refuses_rows_that_break_the_contract_so_a_foreign_writer_cannot_stop_the_relay(
        TestBackend::Postgres,
    )
    .await;
}

#[tokio::test]
async fn mariadb_outbox_refuses_rows_that_break_the_contract_so_a_foreign_writer_cannot_stop_the_relay(
) {
    outbox_refuses_rows_that_break_the_contract_so_a_foreign_writer_cannot_stop_the_relay(
        TestBackend::MySql,
    )
    .await;
}

#[tokio::test]
async fn sqlite_outbox_refuses_rows_that_break_the_contract_so_a_foreign_writer_cannot_stop_the_relay(
) {
    outbox_refuses_rows_that_break_the_contract_so_a_foreign_writer_cannot_stop_the_relay(
        TestBackend::Sqlite,
    )
    .await;
}
