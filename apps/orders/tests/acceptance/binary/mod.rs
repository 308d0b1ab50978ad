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
#[path = "consumers.rs"]
mod consumers;
#[path = "operator.rs"]
mod operator;
use console::console_in_headless_chromium_requeues_a_dead_letter_and_resolves_an_effect;
use consumers::{
    serve_bills_each_order_once_in_process_and_get_shows_the_invoice,
    serve_bills_each_order_once_through_kafka, serve_bills_each_order_once_through_nats_jetstream,
    serve_bills_each_order_once_through_rabbitmq,
    serve_starts_with_the_broker_down_and_relays_the_events_once_it_is_up,
};
use operator::{
    effects_commands_retry_and_resolve_a_parked_effect_and_show_its_audit_trail,
    inbox_dead_list_and_requeue_commands_show_and_revive_a_dead_delivery,
    verify_command_against_serve_finds_every_check_holding,
};

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

#[path = "slow_clients.rs"]
mod slow_clients;

#[path = "flow.rs"]
mod flow;
