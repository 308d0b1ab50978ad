//! The operator console in a real browser: headless Chromium driven through chromedriver
//! (W3C WebDriver over HTTP) against a running `orders serve`. A person's path through it —
//! sign in, find a dead letter, requeue it and see the order's invoice appear, resolve an
//! effect in review — plus the refusals: a tenant API key, a form without its CSRF token,
//! the console off without an admin token.

use oncely_testkit::process::ProcessGuard;
use std::io::{BufRead as _, BufReader};
use std::process::Stdio;
use std::time::{Duration, Instant};

use oncely_testkit::TestDb;
use serde_json::{json, Value};

use super::{order, serve_with, serve_with_env, API_KEY};

const ADMIN_TOKEN: &str = "console-admin-token-0123456789";
/// The W3C WebDriver element reference key.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// chromedriver on a port it picks itself (`--port=0`), killed on drop.
struct Driver {
    _proc: ProcessGuard,
    url: String,
}

/// Starts chromedriver; `None` (after printing SKIPPED) when it is not installed, a panic
/// instead under `ONCELY_TEST_REQUIRE_SERVICES=1`. A chromedriver that exits before it
/// listens (seen once in CI with three of these tests starting at once) is started again, up
/// to three times; the panic then carries what it printed on stderr.
fn chromedriver() -> Option<Driver> {
    let mut why = String::new();
    for attempt in 1..=3 {
        match start_chromedriver() {
            Ok(driver) => return driver,
            Err(exited) => {
                eprintln!("chromedriver exited before listening (attempt {attempt}): {exited}");
                why = exited;
            }
        }
    }
    panic!("chromedriver exited before listening, three times: {why}");
}

/// One start: `Ok(None)` when it is not installed, `Err` with its exit status and stderr
/// when it exits before listening.
fn start_chromedriver() -> Result<Option<Driver>, String> {
    let mut cmd = oncely_testkit::process::command("chromedriver");
    cmd.arg("--port=0")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut proc = match ProcessGuard::spawn(cmd) {
        Ok(p) => p,
        Err(e) => {
            assert!(
                !oncely_testkit::require_services(),
                "chromedriver is not installed (apt-get install chromium chromium-driver): {e}"
            );
            eprintln!("SKIPPED: chromedriver is not installed: {e}");
            return Ok(None);
        }
    };
    let mut stderr = proc.child.stderr.take().unwrap();
    let mut lines = BufReader::new(proc.child.stdout.take().unwrap()).lines();
    let port = loop {
        let Some(line) = lines.next().and_then(Result::ok) else {
            let status = proc.child.wait().map(|s| s.to_string()).unwrap_or_default();
            let mut printed = String::new();
            drop(std::io::Read::read_to_string(&mut stderr, &mut printed));
            return Err(format!("{status}: {}", printed.trim()));
        };
        if let Some(rest) = line.split("started successfully on port ").nth(1) {
            break rest.trim_end_matches('.').trim().to_owned();
        }
    };
    std::thread::spawn(move || for _ in lines {});
    std::thread::spawn(move || std::io::copy(&mut stderr, &mut std::io::sink()));
    Ok(Some(Driver {
        _proc: proc,
        url: format!("http://127.0.0.1:{port}"),
    }))
}

/// One WebDriver session (W3C WebDriver, the commands this test needs) in headless
/// Chromium.
struct Browser {
    http: reqwest::Client,
    session: String,
}

impl Browser {
    async fn start(driver: &Driver, profile: &std::path::Path) -> Self {
        let http = reqwest::Client::new();
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": "/usr/bin/chromium",
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                         "--disable-dev-shm-usage", "--no-first-run",
                         format!("--user-data-dir={}", profile.display())],
            },
        }}});
        let res: Value = http
            .post(format!("{}/session", driver.url))
            .json(&caps)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let id = res["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no Chromium session: {res}"));
        Self {
            http,
            session: format!("{}/session/{id}", driver.url),
        }
    }

    /// A command; `Err(value)` when the driver answers with an error.
    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<Value, Value> {
        let mut req = self.http.request(method, format!("{}{path}", self.session));
        if let Some(b) = body {
            req = req.json(&b);
        }
        let res = req.send().await.unwrap();
        let ok = res.status().is_success();
        let v: Value = res.json().await.unwrap();
        if ok {
            Ok(v["value"].clone())
        } else {
            Err(v["value"].clone())
        }
    }

    async fn goto(&self, url: &str) {
        self.call(reqwest::Method::POST, "/url", Some(json!({"url": url})))
            .await
            .unwrap();
    }

    async fn path(&self) -> String {
        let url = self.call(reqwest::Method::GET, "/url", None).await.unwrap();
        let url = url.as_str().unwrap();
        let after_host = url.splitn(4, '/').nth(3).unwrap_or("");
        format!("/{}", after_host.split(['?', '#']).next().unwrap_or(""))
    }

    /// Waits (at most 20 s) until the browser is at `path`: a click that submits a form
    /// returns before the next page has loaded.
    async fn until_path(&self, path: &str) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        let mut now_at = self.path().await;
        while now_at != path && std::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            now_at = self.path().await;
        }
        assert_eq!(now_at, path);
    }

    async fn find_all(&self, css: &str) -> Vec<String> {
        let found = self
            .call(
                reqwest::Method::POST,
                "/elements",
                Some(json!({"using": "css selector", "value": css})),
            )
            .await
            .unwrap();
        found
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e[ELEMENT].as_str().unwrap().to_owned())
            .collect()
    }

    async fn find(&self, css: &str) -> String {
        // A click that submits a form returns before the next page has loaded: wait for it.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        let mut found = self.find_all(css).await;
        while found.is_empty() && std::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            found = self.find_all(css).await;
        }
        if found.is_empty() {
            let source = self.call(reqwest::Method::GET, "/source", None).await;
            panic!("no {css} on {}; the page: {source:?}", self.path().await);
        }
        found[0].clone()
    }

    async fn text(&self, css: &str) -> String {
        // The element may go stale if the page it was found on is still being replaced.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        loop {
            let e = self.find(css).await;
            match self
                .call(reqwest::Method::GET, &format!("/element/{e}/text"), None)
                .await
            {
                Ok(t) => return t.as_str().unwrap().to_owned(),
                Err(err) if std::time::Instant::now() < deadline => {
                    eprintln!("console: text of {css} again after {err}");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
                Err(err) => panic!("no text of {css}: {err}"),
            }
        }
    }

    async fn type_in(&self, css: &str, text: &str) {
        let e = self.find(css).await;
        self.call(
            reqwest::Method::POST,
            &format!("/element/{e}/value"),
            Some(json!({"text": text})),
        )
        .await
        .unwrap();
    }

    async fn click(&self, css: &str) {
        let e = self.find(css).await;
        self.call(
            reqwest::Method::POST,
            &format!("/element/{e}/click"),
            Some(json!({})),
        )
        .await
        .unwrap();
    }

    async fn cookie(&self, name: &str) -> Value {
        self.call(reqwest::Method::GET, &format!("/cookie/{name}"), None)
            .await
            .unwrap()
    }

    async fn close(self) {
        drop(self.call(reqwest::Method::DELETE, "", None).await);
    }
}

async fn sign_in(c: &Browser, base: &str, token: &str, name: &str) {
    c.goto(&format!("{base}/console")).await;
    assert_eq!(
        c.path().await,
        "/console/login",
        "without a session the console sends the browser to the sign-in form"
    );
    c.type_in("#token", token).await;
    c.type_in("#name", name).await;
    c.click("#sign-in").await;
}

/// An order whose `order.created` reached the billing consumer's queue and was dead-lettered
/// there (its handler "failed" while no consumer ran: the test plays the failing consumer),
/// created through a server without the console, which answers `/console` with 404.
/// Returns the order id and the dead message id.
async fn dead_lettered_order(t: &TestDb) -> (String, String) {
    let transport = oncely_broker::SqlTransport::new(t.db.clone(), 1 << 20);
    transport.subscribe("billing", "orders").await.unwrap();
    let a = serve_with(&t.url, &["--no-consumer"]);
    let client = reqwest::Client::new();
    let off = client
        .get(format!("{}/console", a.base))
        .send()
        .await
        .unwrap();
    assert_eq!(
        off.status(),
        404,
        "without an admin token the console is off"
    );
    let res = client
        .post(format!("{}/v1/orders", a.base))
        .bearer_auth(API_KEY)
        .header("idempotency-key", "console-order-1")
        .json(&order("console-1"))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    let order_id = res.json::<Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let deadline = Instant::now() + Duration::from_secs(60);
    let delivery = loop {
        let mut d = transport
            .claim("billing", 1, Duration::from_secs(60))
            .await
            .unwrap();
        if let Some(d) = d.pop() {
            break d;
        }
        assert!(
            Instant::now() < deadline,
            "the relay never published the order's event"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(transport
        .dead(&delivery, "billing handler failed: invoice service down")
        .await
        .unwrap());
    (order_id, delivery.message.id.to_string())
}

/// Headless Chromium against `orders serve --admin-token`: a tenant key is refused at sign-in
/// and on the console's URLs (403 problem), the admin token signs in (HttpOnly, SameSite=Strict
/// cookie); the overview counts the dead letter; it is requeued from the dead-letter page and
/// the billing consumer delivers it — the invoice appears on the order's lineage page; an
/// effect in review is resolved as succeeded. Both actions are audited under the name signed
/// in with, and a form without its CSRF token is refused (403) and changes nothing.
pub(crate) async fn console_in_headless_chromium_requeues_a_dead_letter_and_resolves_an_effect(
    t: TestDb,
) {
    orders::migrate(&t.db).await.unwrap();
    let Some(driver) = chromedriver() else {
        return;
    };
    let (order_id, message_id) = dead_lettered_order(&t).await;
    let effect_id = oncely_testkit::park_effect(&t.db, "cli", "inv-console").await;
    let b = serve_with_env(&t.url, &[], &[("ONCELY_ADMIN_TOKEN", ADMIN_TOKEN)]);
    let profile = tempfile::tempdir().unwrap();
    let c = Browser::start(&driver, profile.path()).await;

    sign_in(&c, &b.base, API_KEY, "mallory").await;
    assert_eq!(
        c.text("#error").await,
        "A tenant API key cannot open the console."
    );
    sign_in(&c, &b.base, ADMIN_TOKEN, "ops-e2e").await;
    c.until_path("/console").await;
    assert_eq!(c.text("#count-dead-billing").await, "1");
    let cookie = c.cookie("oncely_console").await;
    assert_eq!(cookie["httpOnly"], true, "{cookie}");
    assert_eq!(cookie["sameSite"], "Strict", "{cookie}");
    refusals(&b.base, cookie["value"].as_str().unwrap(), &effect_id).await;
    c.goto(&format!("{}/console/stuck", b.base)).await;
    assert!(c
        .text(&format!("#stuck-{effect_id}"))
        .await
        .contains("needs_review"));
    c.goto(&format!("{}/console/reconciliation", b.base)).await;
    c.find("#no-discrepancies").await;

    c.goto(&format!("{}/console/dead-letters", b.base)).await;
    let row = format!("#dead-billing-{message_id}");
    assert!(c.text(&row).await.contains("invoice service down"));
    c.click(&format!("{row} button.requeue")).await;
    assert!(c
        .text("#message")
        .await
        .contains(&format!("Requeued message {message_id}")));
    see_invoice(&c, &b.base, &order_id).await;

    c.goto(&format!("{}/console/review", b.base)).await;
    let row = format!("#effect-{effect_id}");
    c.click(&format!("{row} option[value=succeeded]")).await;
    c.type_in(&format!("{row} input[name=provider_id]"), "pi_console_e2e")
        .await;
    c.type_in(
        &format!("{row} input[name=reason]"),
        "seen in the dashboard",
    )
    .await;
    c.click(&format!("{row} button.resolve")).await;
    assert_eq!(
        c.text("#message").await,
        format!("Effect {effect_id} is succeeded now.")
    );
    c.close().await;
    audited(&t, &effect_id, &message_id).await;
}

/// Polls the order's chain page until the invoice the requeued `order.created` produced is
/// on it.
async fn see_invoice(c: &Browser, base: &str, order_id: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        c.goto(&format!("{base}/console/orders/{order_id}")).await;
        if !c.find_all("li[data-kind=invoice]").await.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the requeued dead letter was never delivered"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        c.find_all("li[data-kind=invoice]").await.len(),
        1,
        "one invoice for the order"
    );
    assert!(c.text("li[data-kind=invoice]").await.contains("100 EUR"));
}

/// What the console refuses, over plain HTTP: a tenant key (403 problem), no credential on
/// an action (401), the session's cookie on an action without or with a forged CSRF token
/// (403, the effect untouched).
async fn refusals(base: &str, cookie: &str, effect_id: &str) {
    let client = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let tenant = client
        .get(format!("{base}/console"))
        .bearer_auth(API_KEY)
        .send()
        .await
        .unwrap();
    assert_eq!(tenant.status(), 403);
    assert_eq!(tenant.headers()["content-type"], "application/problem+json");
    let body: Value = tenant.json().await.unwrap();
    assert_eq!(body["type"], "urn:oncely:problem:forbidden");
    let resolve = format!("{base}/console/effects/{effect_id}/resolve");
    let form = [("outcome", "failed"), ("reason", "forged")];
    let anonymous = client.post(&resolve).form(&form).send().await.unwrap();
    assert_eq!(anonymous.status(), 401);
    let session = format!("oncely_console={cookie}");
    for csrf in [None, Some("Zm9yZ2Vk")] {
        let mut fields = form.to_vec();
        fields.extend(csrf.map(|t| ("csrf", t)));
        let res = client
            .post(&resolve)
            .header("cookie", &session)
            .form(&fields)
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 403, "csrf {csrf:?}");
        let body: Value = res.json().await.unwrap();
        assert_eq!(body["type"], "urn:oncely:problem:csrf-rejected");
    }
}

/// The effect is succeeded with the provider id given, and both actions carry the name the
/// operator signed in with in their audit tables.
async fn audited(t: &TestDb, effect_id: &str, message_id: &str) {
    let store = oncely_sql::EffectStore::new(t.db.clone());
    let effect = store.get(effect_id).await.unwrap().unwrap();
    assert_eq!(effect.state_word, "succeeded");
    assert_eq!(effect.provider_id.as_deref(), Some("pi_console_e2e"));
    let trail = store.audit_trail(effect_id).await.unwrap();
    assert!(
        trail.iter().any(
            |(_, actor, action, from, to, detail)| actor == "console:ops-e2e"
                && action == "resolve"
                && from == "needs_review"
                && to == "succeeded"
                && detail.contains("seen in the dashboard")
        ),
        "{trail:?}"
    );
    let requeues = oncely_sql::OperatorAudit::new(t.db.clone())
        .recent(Some(&format!("inbox:billing:{message_id}")), 10)
        .await
        .unwrap();
    assert_eq!(requeues.len(), 1, "{requeues:?}");
    assert_eq!(requeues[0].actor, "console:ops-e2e");
    assert_eq!(requeues[0].action, "requeue-dead-letter");
}
