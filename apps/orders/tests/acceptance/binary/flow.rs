//! The payment + shipping flow through processes: `oncely sim payments`, `oncely sim
//! shipping`, `orders serve` with the provider flags (and, for the second case,
//! `--no-runner` beside a separate `orders effects run`) on a SQLite file.

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
