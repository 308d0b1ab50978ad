//! The request log (issue 29 §4): `orders serve` writes one `INFO` line per request with the
//! method, route template, status, tenant, replayed or not, key hash, duration and request
//! id, in JSON mode as the line's `fields`; the request id is the client's `X-Request-Id`
//! or a fresh one, echoed on the answer.

use std::io::{BufRead as _, BufReader};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use oncely_testkit::process::SpawnTied as _;
use serde_json::Value;

use super::{order, Proc, API_KEY, ORDERS};

/// Starts `orders serve` on a fresh SQLite file with JSON logs; every stderr line is kept.
fn serve_logged(dir: &std::path::Path) -> (Proc, Arc<Mutex<Vec<Value>>>) {
    let url = format!("sqlite://{}?mode=rwc", dir.join("orders.db").display());
    // Held from the start: a serve that never logs its address is killed with the test.
    let mut proc = Proc {
        child: oncely_testkit::process::command(ORDERS)
            .args(["serve", "--listen", "127.0.0.1:0", "--no-relay"])
            .env("ONCELY_DATABASE_URL", &url)
            .env("ONCELY_API_KEYS", format!("{API_KEY}=cli"))
            .env("ONCELY_LOG", "info")
            .env("ONCELY_LOG_FORMAT", "json")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn_tied()
            .expect("spawn orders"),
        base: String::new(),
    };
    let mut lines = BufReader::new(proc.child.stderr.take().unwrap()).lines();
    let listen = super::listen_of(&mut lines);
    let logs = Arc::new(Mutex::new(Vec::new()));
    let sink = logs.clone();
    std::thread::spawn(move || {
        for line in lines.map_while(Result::ok) {
            let v: Value = serde_json::from_str(&line)
                .unwrap_or_else(|_| panic!("a log line that is not JSON: {line}"));
            sink.lock().unwrap().push(v);
        }
    });
    proc.base = format!("http://{listen}");
    (proc, logs)
}

/// The request lines logged so far for `request_id`, waiting up to 5 s for the first.
async fn lines_of(logs: &Mutex<Vec<Value>>, request_id: &str) -> Vec<Value> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let found: Vec<Value> = logs
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l["target"] == "oncely::request" && l["fields"]["request_id"] == request_id)
            .cloned()
            .collect();
        if !found.is_empty() || Instant::now() > deadline {
            return found;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn serve_logs_one_line_per_request_with_route_tenant_replay_key_hash_and_request_id() {
    let dir = tempfile::tempdir().unwrap();
    let (p, logs) = serve_logged(dir.path());
    let client = reqwest::Client::new();
    let post = |request_id: &'static str| {
        client
            .post(format!("{}/v1/orders", p.base))
            .bearer_auth(API_KEY)
            .header("Idempotency-Key", "log-key-1")
            .header("X-Request-Id", request_id)
            .json(&order("log-1"))
            .send()
    };
    let first = post("req-first").await.unwrap();
    assert_eq!(first.status(), 201);
    assert_eq!(first.headers()["x-request-id"], "req-first", "echoed");
    let again = post("req-again").await.unwrap();
    assert_eq!(again.headers()["idempotent-replayed"], "true");

    let first = lines_of(&logs, "req-first").await;
    assert_eq!(first.len(), 1, "one line per request: {first:?}");
    let f = &first[0]["fields"];
    assert_eq!(first[0]["level"], "INFO", "{f}");
    assert_eq!(
        (
            &f["method"],
            &f["route"],
            &f["status"],
            &f["tenant"],
            &f["replayed"]
        ),
        (
            &"POST".into(),
            &"/v1/orders".into(),
            &201.into(),
            &"cli".into(),
            &false.into()
        ),
        "{f}"
    );
    let hash = f["key_hash"].as_str().unwrap();
    assert!(
        hash.len() == 16 && hash.bytes().all(|b| b.is_ascii_hexdigit()),
        "{f}"
    );
    assert!(
        !first[0].to_string().contains("log-key-1"),
        "the key itself is not logged"
    );
    assert!(f["duration_ms"].as_f64().is_some_and(|d| d >= 0.0), "{f}");

    let again = lines_of(&logs, "req-again").await;
    assert_eq!(again.len(), 1, "{again:?}");
    let a = &again[0]["fields"];
    assert_eq!(
        (&a["replayed"], &a["key_hash"]),
        (&true.into(), &f["key_hash"]),
        "{a}"
    );

    // A read by id logs the template, not the id; an unauthenticated request logs its 401
    // with no tenant; without a client id, a fresh one is made and echoed.
    let created: Value = post("req-body").await.unwrap().json().await.unwrap();
    let id = created["id"].as_str().unwrap();
    let read = client
        .get(format!("{}/v1/orders/{id}", p.base))
        .send()
        .await
        .unwrap();
    assert_eq!(read.status(), 401);
    let fresh = read.headers()["x-request-id"].to_str().unwrap().to_owned();
    assert!(uuid::Uuid::parse_str(&fresh).is_ok(), "{fresh}");
    let read = lines_of(&logs, &fresh).await;
    assert_eq!(read.len(), 1, "{read:?}");
    let r = &read[0]["fields"];
    assert_eq!(
        (&r["route"], &r["status"], &r["tenant"], &r["key_hash"]),
        (
            &"/v1/orders/{id}".into(),
            &401.into(),
            &"-".into(),
            &"-".into()
        ),
        "{r}"
    );
    assert!(
        !read[0].to_string().contains(id),
        "the concrete path is not logged"
    );
}
