//! `GET /v1/orders` on every backend: paging through more than one page sees each of the
//! tenant's orders once, newest first; no tenant sees another's; a bad cursor, limit or
//! parameter is a 400 problem.

use std::collections::HashSet;

use base64::Engine as _;
use oncely_testkit::TestDb;
use serde_json::Value;

use super::{config, order, start, unique, Server, KEY_A, KEY_B};

impl Server {
    pub(crate) async fn get_list(
        &self,
        api_key: &str,
        query: &str,
    ) -> (reqwest::StatusCode, Value) {
        let res = self
            .client
            .get(format!("{}/v1/orders{query}", self.base))
            .bearer_auth(api_key)
            .send()
            .await
            .expect("request");
        let status = res.status();
        (status, res.json().await.unwrap_or(Value::Null))
    }

    /// Every order of the tenant of `api_key` matching `filter` (`&source=…`), paging
    /// with `limit`; the pages seen.
    pub(crate) async fn list_all(
        &self,
        api_key: &str,
        limit: u32,
        filter: &str,
    ) -> (Vec<Value>, usize) {
        let (mut orders, mut pages, mut cursor) = (Vec::new(), 0, None::<String>);
        loop {
            let mut q = format!("?limit={limit}{filter}");
            if let Some(c) = &cursor {
                q.push_str("&cursor=");
                q.push_str(c);
            }
            let (status, page) = self.get_list(api_key, &q).await;
            assert_eq!(status, 200, "{page}");
            pages += 1;
            orders.extend(page["orders"].as_array().unwrap().iter().cloned());
            match page["next_cursor"].as_str() {
                Some(c) => cursor = Some(c.to_owned()),
                None => return (orders, pages),
            }
            assert!(pages < 1000, "paging does not end");
        }
    }
}

oncely_testkit::matrix! {
    tests: [
        listing_pages_through_the_tenants_orders_newest_first,
        a_bad_cursor_limit_or_parameter_is_a_400_problem,
        a_forged_foreign_or_edited_cursor_and_a_signed_limit_are_a_400_problem,
    ],
}

async fn listing_pages_through_the_tenants_orders_newest_first(t: TestDb) {
    let s = start(&t.db, config()).await;
    let mut ids_a = Vec::new();
    for i in 0..7 {
        let a = s
            .post(KEY_A, &unique("k"), &order(&format!("a-{i}"), 100 + i))
            .await;
        assert_eq!(a.status, 201);
        ids_a.push(a.id());
    }
    let b = s.post(KEY_B, &unique("k"), &order("b-0", 100)).await;
    assert_eq!(b.status, 201);

    let (orders, pages) = s.list_all(KEY_A, 3, "").await;
    assert_eq!(pages, 3, "7 orders in pages of 3");
    let seen: Vec<String> = orders
        .iter()
        .map(|o| o["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        seen.iter().collect::<HashSet<_>>().len(),
        7,
        "no order twice"
    );
    ids_a.reverse();
    assert_eq!(seen, ids_a, "newest first");
    assert!(
        !seen.contains(&b.id()),
        "tenant a never sees tenant b's order"
    );
    let (status, first) = s.get_list(KEY_A, "?limit=3").await;
    assert_eq!(status, 200);
    assert_eq!(first["total"], 7);
    assert_eq!(first["orders"][0]["external_ref"], "a-6");

    let (orders_b, _) = s.list_all(KEY_B, 100, "").await;
    assert_eq!(orders_b.len(), 1);
    assert_eq!(orders_b[0]["id"], b.id());
    // Tenant b's cursor names tenant b's order, and used by tenant a it shows a's orders
    // only.
    let (filtered, _) = s.list_all(KEY_A, 100, "&external_ref=a-3").await;
    assert_eq!(filtered.len(), 1);
    assert_eq!(filtered[0]["external_ref"], "a-3");
    let (none, _) = s.list_all(KEY_A, 100, "&external_ref=b-0").await;
    assert!(
        none.is_empty(),
        "a filter on another tenant's order finds nothing"
    );
    let (by_source, _) = s.list_all(KEY_A, 2, "&source=shop").await;
    assert_eq!(by_source.len(), 7);
}

/// Asserts that `q` is answered 400 `invalid-query` problem for tenant a.
async fn assert_invalid_query(s: &Server, q: &str) {
    let res = s
        .client
        .get(format!("{}/v1/orders{q}", s.base))
        .bearer_auth(KEY_A)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 400, "{q}");
    assert_eq!(
        res.headers()["content-type"],
        "application/problem+json",
        "{q}"
    );
    let body: Value = res.json().await.unwrap();
    assert_eq!(body["type"], "urn:oncely:problem:invalid-query", "{q}");
}

fn cursor(text: &str) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(text)
}

async fn a_forged_foreign_or_edited_cursor_and_a_signed_limit_are_a_400_problem(t: TestDb) {
    let s = start(&t.db, config()).await;
    for (key, i) in [(KEY_A, 0), (KEY_A, 1), (KEY_B, 0), (KEY_B, 1)] {
        let made = s
            .post(key, &unique("k"), &order(&format!("c-{i}"), 100))
            .await;
        assert_eq!(made.status, 201);
    }
    let (_, page_a) = s.get_list(KEY_A, "?limit=1").await;
    let issued = page_a["next_cursor"].as_str().unwrap().to_owned();
    let (status, _) = s
        .get_list(KEY_A, &format!("?limit=1&cursor={issued}"))
        .await;
    assert_eq!(status, 200, "the cursor the service issued is taken");
    let (_, page_b) = s.get_list(KEY_B, "?limit=1").await;
    let foreign = page_b["next_cursor"].as_str().unwrap().to_owned();

    let text = String::from_utf8(
        base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(&issued)
            .unwrap(),
    )
    .unwrap();
    let (time, id) = text
        .strip_prefix("o1:")
        .and_then(|rest| rest.split_once(':'))
        .unwrap();
    let time: i64 = time.parse().unwrap();
    let edited = cursor(&format!("o1:{}:{id}", time + 1));
    let signed = cursor(&format!("o1:+{time}:{id}"));
    let forged = cursor(&format!("o1:{time}:{}", uuid::Uuid::now_v7()));
    for q in [
        format!("?cursor={forged}"),
        format!("?cursor={edited}"),
        format!("?cursor={signed}"),
        format!("?cursor={foreign}"),
        // Issued for all of a's orders, used with a filter that does not select its order.
        format!("?cursor={issued}&external_ref=c-0"),
        "?limit=%2B5".to_owned(),
        "?limit=+5".to_owned(),
        "?limit=-0".to_owned(),
        "?limit=05.0".to_owned(),
    ] {
        assert_invalid_query(&s, &q).await;
    }
}

async fn a_bad_cursor_limit_or_parameter_is_a_400_problem(t: TestDb) {
    let s = start(&t.db, config()).await;
    for q in [
        "?cursor=garbage",
        "?cursor=bzE6MTIzOng",
        "?limit=0",
        "?limit=101",
        "?limit=ten",
        "?tenant=tenant-b",
    ] {
        assert_invalid_query(&s, q).await;
    }
    let res = s
        .client
        .get(format!("{}/v1/orders", s.base))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 401, "listing needs a credential");
}
