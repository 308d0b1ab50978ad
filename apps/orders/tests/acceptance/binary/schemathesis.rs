//! schemathesis (PyPI) against a running `orders serve` on SQLite, with the payments and
//! shipping simulators as its providers: it reads the service's
//! own `/openapi.json`, generates requests for every operation (valid and invalid ones) and
//! fails on any 5xx or any response outside the document's schema.

use std::process::Stdio;
use std::time::{Duration, Instant};

use oncely_testkit::{TestBackend, TestDb};

use super::{serve_with, sim, API_KEY};

/// Test cases per operation and phase: enough to reach every documented status, few enough
/// that the run stays well under two minutes on a loaded 2-core machine.
const MAX_EXAMPLES: &str = "40";

/// The schemathesis CLI, `st`, when it is installed.
fn schemathesis() -> Option<&'static str> {
    let found = oncely_testkit::process::command("st")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    found.then_some("st")
}

#[tokio::test]
async fn schemathesis_finds_no_server_error_and_no_response_outside_the_openapi_document() {
    let Some(st) = schemathesis() else {
        assert!(
            !oncely_testkit::require_services(),
            "schemathesis is not installed (pip install schemathesis)"
        );
        eprintln!("skipped: schemathesis is not installed (pip install schemathesis)");
        return;
    };
    let t = TestDb::new(TestBackend::Sqlite).await.expect("SQLite");
    // With both providers (our simulators), so the payments endpoint runs for real: a
    // service without one answers 503 payments-not-configured, which is a 5xx by design.
    let (_payments_sim, payments) = sim("payments", &["--secret-key", "sk_test_x"]);
    let (_shipping_sim, shipping) = sim("shipping", &[]);
    let flags = [
        "--payments-url",
        &payments,
        "--payments-secret-key",
        "sk_test_x",
        "--shipping-url",
        &shipping,
    ];
    let p = serve_with(&t.url, &flags);
    let report = tempfile::tempdir().unwrap();
    let started = Instant::now();
    let out = tokio::task::spawn_blocking({
        let schema = format!("{}/openapi.json", p.base);
        let report = report.path().to_owned();
        move || {
            oncely_testkit::process::command(st)
                .arg("run")
                .arg(&schema)
                .args(["--header", &format!("Authorization: Bearer {API_KEY}")])
                .args(["--checks", "not_a_server_error,response_schema_conformance"])
                .args(["--max-examples", MAX_EXAMPLES])
                .args(["--workers", "2", "--request-timeout", "10"])
                .arg("--report-dir")
                .arg(&report)
                // Its cache (.schemathesis/) goes there too, not into the source tree.
                .current_dir(&report)
                .env("NO_COLOR", "1")
                .env("SCHEMATHESIS_TELEMETRY", "false")
                .output()
                .expect("run schemathesis")
        }
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stdout}\n{stderr}");
    assert!(
        out.status.success(),
        "schemathesis found problems (exit {:?}); see its output above",
        out.status.code()
    );
    // It tested every operation (a run that tested nothing exits 0 too), and every case
    // passed: "Test cases: N generated, N passed" (warnings, such as operations that mostly
    // answered 404 for random ids, are not failures).
    assert!(
        stdout.contains("Tested: 12") && !stdout.contains("Failures:"),
        "schemathesis did not test the 12 operations:\n{stdout}"
    );
    let cases = stdout
        .lines()
        .find_map(|l| l.trim().split_once(" generated, "))
        .unwrap_or_else(|| panic!("no test case count in:\n{stdout}"));
    assert_eq!(
        cases.1,
        format!("{} passed", cases.0),
        "not every generated case passed:\n{stdout}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(120),
        "schemathesis took {:?}",
        started.elapsed()
    );
}
