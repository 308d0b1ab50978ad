//! Bad configuration refused at start, in words (issue 29 §6): a pool too small for what a
//! command runs is a usage error (exit status 2) naming `--db-max-connections`, the part
//! that needs more and the minimum — not a start that reports the database unavailable
//! forever after.

use super::{run_to_exit, API_KEY, ORDERS};

/// A PostgreSQL URL nothing listens on: a command that passes its checks fails to connect
/// (exit status 1) instead of running.
const NOWHERE: &str = "postgres://postgres@127.0.0.1:1/none";

/// Runs `orders args…` against [`NOWHERE`] to its exit; its exit code and stderr.
async fn orders(args: &[&str]) -> (Option<i32>, String) {
    let (status, stderr) = run_to_exit(
        oncely_testkit::process::command(ORDERS)
            .args(args)
            .env("ONCELY_DATABASE_URL", NOWHERE)
            .env("ONCELY_API_KEYS", format!("{API_KEY}=cli")),
    )
    .await;
    (status.code(), stderr)
}

#[tokio::test]
async fn serve_consume_and_effects_run_refuse_a_pool_too_small_for_what_they_run() {
    let (code, err) = orders(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--db-max-connections",
        "2",
    ])
    .await;
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains(
            "--db-max-connections 2 is too small: the relay holds up to 3 connections at \
             once; give it at least 3"
        ),
        "{err}"
    );
    let (code, err) = orders(&["consume", "billing", "--db-max-connections", "0"]).await;
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains(
            "--db-max-connections 0 is too small: a consumer holds up to 1 connection at \
             once; give it at least 1"
        ),
        "{err}"
    );
    let runner = ["effects", "run", "--payments-url", "http://127.0.0.1:1"];
    let (code, err) = orders(&[&runner[..], &["--db-max-connections", "0"]].concat()).await;
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("--db-max-connections 0 is too small: the effect runner holds up to 1"),
        "{err}"
    );
    // Without the relay one connection is enough: the check passes and `serve` goes on to
    // connect (and fails to, nothing listens).
    let no_relay = ["serve", "--listen", "127.0.0.1:0", "--no-relay"];
    let (code, err) = orders(&[&no_relay[..], &["--db-max-connections", "1"]].concat()).await;
    assert_eq!(code, Some(1), "{err}");
    assert!(!err.contains("too small"), "{err}");
}

/// A flag `serve` would ignore is refused, naming the flag that decides instead: its
/// in-process consumers read `--events-topic`, so another `--consumer-topic` is a usage
/// error (status 2); the same topic is accepted (and `serve` goes on to connect).
#[tokio::test]
async fn serve_refuses_a_consumer_topic_it_would_ignore() {
    let serve = ["serve", "--listen", "127.0.0.1:0", "--events-topic", "shop"];
    let (code, err) = orders(&[&serve[..], &["--consumer-topic", "orders"]].concat()).await;
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains(
            "--consumer-topic orders (or ONCELY_CONSUMER_TOPIC) is not used here: this \
             command's consumers read the topic it publishes to, --events-topic shop"
        ),
        "{err}"
    );
    let (code, err) = orders(&[&serve[..], &["--consumer-topic", "shop"]].concat()).await;
    assert_eq!(code, Some(1), "{err}");
    assert!(!err.contains("not used here"), "{err}");
}
