//! `localstripe` (PyPI), a fake Stripe server written by others: the second opinion every
//! payments test runs against beside our own simulator. It ignores `Idempotency-Key`, so a
//! test that stays at one charge there proves the status check did it, not the key.

use crate::process::SpawnTied as _;
use std::time::Duration;

use crate::require_services;

/// A running `localstripe --port N --from-scratch`, killed on drop.
#[derive(Debug)]
pub struct LocalStripe {
    child: std::process::Child,
    base: String,
}

impl LocalStripe {
    /// Starts one on a free port below 32768 (the ephemeral range is left to the kernel's
    /// own picks) and waits up to 10 s for it to listen. `None` (after printing `SKIPPED`)
    /// when `localstripe` is not installed.
    ///
    /// # Panics
    /// When it is not installed under `ONCELY_TEST_REQUIRE_SERVICES=1`, or does not listen
    /// within 10 s.
    pub async fn start() -> Option<Self> {
        let port = free_low_port();
        let spawned = crate::process::command("localstripe")
            .args(["--port", &port.to_string(), "--from-scratch"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn_tied();
        let child = match spawned {
            Ok(c) => c,
            Err(e) => {
                assert!(
                    !require_services(),
                    "localstripe is not installed (pip install localstripe): {e}"
                );
                eprintln!("SKIPPED: localstripe is not installed (pip install localstripe): {e}");
                return None;
            }
        };
        let ls = Self {
            child,
            base: format!("http://127.0.0.1:{port}"),
        };
        for _ in 0..100 {
            if tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
            {
                return Some(ls);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("localstripe did not listen on {port} within 10 s");
    }

    /// Its base URL, `http://127.0.0.1:N` (no trailing slash).
    pub fn base_url(&self) -> &str {
        &self.base
    }
}

/// Every PaymentIntent localstripe at `base` holds, in its list order (newest first): the
/// list paged with `starting_after` until `has_more` is false. What the payments tests
/// count charges by (localstripe has no search).
///
/// # Panics
/// When localstripe cannot be reached or answers something that is not a list.
pub async fn localstripe_payment_intents(base: &str, secret_key: &str) -> Vec<serde_json::Value> {
    let client = reqwest::Client::new();
    let mut all = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let mut query = vec![("limit", "100".to_owned())];
        if let Some(a) = &after {
            query.push(("starting_after", a.clone()));
        }
        let page: serde_json::Value = client
            .get(format!("{base}/v1/payment_intents"))
            .bearer_auth(secret_key)
            .query(&query)
            .send()
            .await
            .expect("localstripe answers")
            .json()
            .await
            .expect("a JSON list");
        let data = page["data"].as_array().expect("a list's data").clone();
        let more = page["has_more"] == true && !data.is_empty();
        after = data
            .last()
            .and_then(|pi| pi["id"].as_str())
            .map(str::to_owned);
        all.extend(data);
        if !more {
            return all;
        }
    }
}

impl Drop for LocalStripe {
    fn drop(&mut self) {
        drop(self.child.kill());
        drop(self.child.wait());
    }
}

/// A port below 32768 that is free now, starting from one derived from the process id so
/// parallel test processes rarely race for the same one, and never the same one twice in
/// a process (two tests of one binary start their servers at the same moment, before
/// either listens).
fn free_low_port() -> u16 {
    static HANDED_OUT: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(0);
    let offset = HANDED_OUT.fetch_add(7, std::sync::atomic::Ordering::Relaxed) % 1_000;
    let start = 20_000 + (std::process::id() % 10_000) as u16 + offset;
    (start..32_000)
        .find(|p| std::net::TcpListener::bind(("127.0.0.1", *p)).is_ok())
        .expect("a free port below 32768")
}
