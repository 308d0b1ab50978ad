//! The proxy against a tiny upstream.

use std::convert::Infallible;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::net::TcpListener;

use super::*;

/// A tiny upstream: `POST /v1/things` creates `{id, status, metadata{order_id}}`,
/// `GET /v1/things` lists them; counts the creates.
async fn upstream() -> (String, Arc<Mutex<Vec<Value>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let things = Arc::new(Mutex::new(Vec::<Value>::new()));
    let store = things.clone();
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let store = store.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(
                    move |req: http::Request<hyper::body::Incoming>| {
                        let store = store.clone();
                        async move {
                            let post = req.method() == http::Method::POST;
                            let body = req.into_body().collect().await.unwrap().to_bytes();
                            let mut all = store.lock().unwrap();
                            let answer = if post {
                                let order = order_of_request(&RequestView {
                                    method: "POST",
                                    target: "/",
                                    body: &body,
                                })
                                .unwrap();
                                let thing = serde_json::json!({"id": format!("th_{}", all.len()), "status": "succeeded", "metadata": {"order_id": order}});
                                all.push(thing.clone());
                                thing
                            } else {
                                serde_json::json!({"data": *all})
                            };
                            Ok::<_, Infallible>(http::Response::new(Full::new(Bytes::from(
                                answer.to_string(),
                            ))))
                        }
                    },
                );
                drop(
                    hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await,
                );
            });
        }
    });
    (base, things)
}

async fn create(
    client: &reqwest::Client,
    proxy: &HttpFaultProxy,
    order: &str,
) -> Result<(u16, String), reqwest::Error> {
    let res = client
        .post(format!("{}/v1/things", proxy.base_url()))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(format!("metadata[order_id]={order}"))
        .send()
        .await?;
    Ok((res.status().as_u16(), res.text().await?))
}

#[tokio::test]
async fn each_order_meets_its_own_schedule_and_the_commit_lands_after_the_fault() {
    let (base, things) = upstream().await;
    let proxy = HttpFaultProxy::start(&base, ProxyOptions::default()).await;
    let client = reqwest::Client::builder()
        .timeout(Duration::from_millis(500))
        .build()
        .unwrap();
    proxy.plan(
        "order-aaaaaaaa",
        Schedule {
            effects: vec![
                Fault::Before(Answer::Status {
                    status: 503,
                    body: BodyFault::Empty,
                }),
                Fault::After(Answer::Status {
                    status: 524,
                    body: BodyFault::Garbled,
                }),
                Fault::After(Answer::Reset),
                Fault::SlowCommit(800),
            ],
            ..Schedule::default()
        },
    );
    proxy.plan("order-bbbbbbbb", Schedule::default());
    assert_eq!(
        create(&client, &proxy, "order-aaaaaaaa").await.unwrap().0,
        503
    );
    assert_eq!(things.lock().unwrap().len(), 0, "not forwarded");
    let (status, body) = create(&client, &proxy, "order-aaaaaaaa").await.unwrap();
    assert_eq!(status, 524);
    assert!(
        serde_json::from_str::<Value>(&body).is_err(),
        "garbled: {body}"
    );
    assert_eq!(things.lock().unwrap().len(), 1, "committed");
    assert!(
        create(&client, &proxy, "order-aaaaaaaa").await.is_err(),
        "reset"
    );
    assert_eq!(things.lock().unwrap().len(), 2);
    assert!(
        create(&client, &proxy, "order-aaaaaaaa").await.is_err(),
        "timed out"
    );
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(things.lock().unwrap().len(), 3, "the slow commit landed");
    assert_eq!(
        create(&client, &proxy, "order-aaaaaaaa").await.unwrap().0,
        200,
        "past the list"
    );
    assert_eq!(
        create(&client, &proxy, "order-bbbbbbbb").await.unwrap().0,
        200
    );
    assert_eq!(
        proxy.log("order-aaaaaaaa").len(),
        5,
        "{:?}",
        proxy.log("order-aaaaaaaa")
    );
}

#[tokio::test]
async fn lookups_lag_empty_and_rewrite_only_their_orders_objects() {
    let (base, _things) = upstream().await;
    let options = ProxyOptions {
        hide_window: Duration::from_millis(400),
        ..ProxyOptions::default()
    };
    let proxy = HttpFaultProxy::start(&base, options).await;
    let client = reqwest::Client::new();
    proxy.plan(
        "order-lagging1",
        Schedule {
            lag_ms: 300,
            ..Schedule::default()
        },
    );
    proxy.plan(
        "order-worded11",
        Schedule {
            lookups: vec![Fault::StatusWord("processing".into()), Fault::EmptyPage],
            ..Schedule::default()
        },
    );
    create(&client, &proxy, "order-lagging1").await.unwrap();
    create(&client, &proxy, "order-worded11").await.unwrap();
    let list = |q: &'static str| {
        let (client, url) = (
            client.clone(),
            format!("{}/v1/things?{q}", proxy.base_url()),
        );
        async move {
            client
                .get(url)
                .send()
                .await
                .unwrap()
                .json::<Value>()
                .await
                .unwrap()
        }
    };
    let page = list("merchant_reference=order-worded11:ship").await;
    let data = page["data"].as_array().unwrap();
    assert_eq!(
        data.len(),
        1,
        "the lagging order's object is hidden: {page}"
    );
    assert_eq!(data[0]["status"], "processing");
    let page = list("merchant_reference=order-worded11").await;
    assert_eq!(
        page["data"].as_array().unwrap().len(),
        0,
        "empty page: {page}"
    );
    // A list no order is named in takes each listed order's next rewrite.
    proxy.plan(
        "order-listed11",
        Schedule {
            lookups: vec![Fault::StatusWord("pending".into())],
            ..Schedule::default()
        },
    );
    create(&client, &proxy, "order-listed11").await.unwrap();
    let page = list("limit=100").await;
    let listed: Vec<&Value> = page["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i["metadata"]["order_id"] == "order-listed11")
        .collect();
    assert_eq!(listed[0]["status"], "pending", "{page}");
    tokio::time::sleep(Duration::from_millis(450)).await;
    let page = list("merchant_reference=order-lagging1").await;
    assert_eq!(
        page["data"].as_array().unwrap().len(),
        3,
        "past the lag: {page}"
    );
}

#[test]
fn a_seed_draws_the_same_numbers() {
    let (mut a, mut b) = (SeededRng::new(7), SeededRng::new(7));
    let xs: Vec<u64> = (0..5).map(|_| a.below(600)).collect();
    let ys: Vec<u64> = (0..5).map(|_| b.below(600)).collect();
    assert_eq!(xs, ys);
    assert_ne!(SeededRng::new(8).next_u64(), SeededRng::new(7).next_u64());
}
