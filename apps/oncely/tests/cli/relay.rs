//! `oncely relay` as a process on every backend: it applies oncely's schema only and drains
//! at SIGTERM; aborted after the broker confirmed a batch, its rows are republished with
//! the same ids and JetStream drops the copies.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use oncely_testkit::process::ProcessGuard;
use oncely_testkit::TestDb;

use super::{enqueue, outbox_event, table_names, wait_exit};

/// Only the commands that use the orders schema (`serve`, `migrate`, `consume billing`) run
/// the order service's migrations: `oncely relay` on an empty database creates oncely's
/// tables (outbox, queue), not `orders` or `invoices`, and drains at SIGTERM.
pub(crate) async fn relay_command_applies_oncely_schema_and_not_the_order_services(t: TestDb) {
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
pub(crate) async fn relay_process_aborted_after_confirm_is_republished_with_the_same_ids_and_jetstream_drops_the_copies(
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
