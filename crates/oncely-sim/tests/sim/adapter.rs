//! The payment adapter's request sequence reduced to JSON shapes, to compare the payments
//! simulator with localstripe.

use serde_json::{json, Value};

use super::support::client;

/// The JSON type of `v`, and the value itself for the fields whose values must agree.
pub(crate) fn shape(v: &Value, fields: &[&str], values: &[&str]) -> Value {
    let kind = |v: &Value| match v {
        Value::Null => "null",
        Value::Bool(_) => "bool",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    };
    let mut out = serde_json::Map::new();
    for f in fields {
        out.insert((*f).into(), kind(&v[*f]).into());
    }
    for f in values {
        out.insert(format!("{f}="), v[*f].clone());
    }
    if let Some(id) = v["id"].as_str() {
        out.insert(
            "id_prefix".into(),
            id.split('_').next().unwrap_or_default().into(),
        );
    }
    Value::Object(out)
}

/// The small request sequence the payment adapter relies on, reduced to shapes.
#[allow(
    clippy::too_many_lines,
    reason = "one fixed request sequence, compared step by step between two servers"
)]
pub(crate) async fn stripe_sequence(base: &str, sk: &str) -> Vec<(&'static str, u16, Value)> {
    let c = client();
    let mut out = Vec::new();
    let res = c
        .get(format!("{base}/v1/payment_intents"))
        .send()
        .await
        .unwrap();
    let status = res.status().as_u16();
    let body: Value = res.json().await.unwrap();
    out.push((
        "unauthenticated",
        status,
        json!(body["error"]["type"].is_string()),
    ));

    let form = [
        ("amount", "1000"),
        ("currency", "eur"),
        ("confirm", "true"),
        ("payment_method", "pm_card_visa"),
        ("metadata[invoice_id]", "inv-compat"),
        ("metadata[order_id]", "ord-compat"),
    ];
    let res = c
        .post(format!("{base}/v1/payment_intents"))
        .basic_auth(sk, Some(""))
        .form(&form)
        .send()
        .await
        .unwrap();
    let status = res.status().as_u16();
    let pi: Value = res.json().await.unwrap();
    let pi_fields = ["id", "amount", "currency", "status", "metadata", "created"];
    let pi_values = [
        "object", "amount", "currency", "status", "metadata", "livemode",
    ];
    out.push(("create intent", status, shape(&pi, &pi_fields, &pi_values)));
    let id = pi["id"].as_str().unwrap().to_owned();

    let res = c
        .get(format!("{base}/v1/payment_intents/{id}"))
        .bearer_auth(sk)
        .send()
        .await
        .unwrap();
    let status = res.status().as_u16();
    let got: Value = res.json().await.unwrap();
    assert_eq!(got["id"], pi["id"]);
    out.push((
        "retrieve intent",
        status,
        shape(&got, &pi_fields, &pi_values),
    ));

    let res = c
        .get(format!("{base}/v1/payment_intents?limit=1"))
        .bearer_auth(sk)
        .send()
        .await
        .unwrap();
    let status = res.status().as_u16();
    let list: Value = res.json().await.unwrap();
    assert_eq!(list["data"][0]["id"], pi["id"]);
    out.push((
        "list intents",
        status,
        shape(&list, &["data", "has_more"], &["object", "has_more", "url"]),
    ));

    let res = c
        .get(format!("{base}/v1/payment_intents/pi_missing"))
        .bearer_auth(sk)
        .send()
        .await
        .unwrap();
    let status = res.status().as_u16();
    let body: Value = res.json().await.unwrap();
    out.push(("retrieve missing", status, json!(body["error"]["type"])));

    let res = c
        .post(format!("{base}/v1/refunds"))
        .bearer_auth(sk)
        .form(&[("payment_intent", id.as_str()), ("amount", "300")])
        .send()
        .await
        .unwrap();
    let status = res.status().as_u16();
    let refund: Value = res.json().await.unwrap();
    assert_eq!(refund["payment_intent"], pi["id"]);
    out.push((
        "refund",
        status,
        shape(
            &refund,
            &["id", "charge", "created", "metadata"],
            &["object", "amount", "currency", "status"],
        ),
    ));

    let res = c
        .get(format!("{base}/v1/refunds?payment_intent={id}"))
        .bearer_auth(sk)
        .send()
        .await
        .unwrap();
    let status = res.status().as_u16();
    let refunds: Value = res.json().await.unwrap();
    assert_eq!(refunds["data"][0]["id"], refund["id"]);
    out.push((
        "list refunds",
        status,
        shape(
            &refunds,
            &["data", "has_more"],
            &["object", "has_more", "url"],
        ),
    ));
    out
}
