//! The TOML configuration file and the command-line routes: parsed, checked, and a route
//! option taking effect through a real gateway.

use oncely_core::{FingerprintParts, JsonPointer};
use oncely_gateway::{ConfigError, GatewayConfig, KeyPolicy, On5xx, RouteConfig};
use oncely_http::KeySource;
use oncely_testkit::TestBackend;
use serde_json::json;

use crate::support::{gateway_with, post, test_db, Upstream, KEY_A};

const FILE: &str = r#"
upstream = "http://127.0.0.1:9000"
connect_timeout_ms = 500

[[route]]
method = "POST"
path = "/orders"
timeout_ms = 5000
retention_secs = 3600
on_5xx = "unknown"
probe = { url = "/orders?external_ref={/external_ref}", select = "/0", found_status = 201 }

[[route]]
method = "patch"
path = "/orders/{id}"
key = "optional"
"#;

#[test]
fn a_configuration_file_gives_each_route_its_options() {
    let config = GatewayConfig::from_toml(FILE).unwrap();
    assert_eq!(config.connect_timeout_ms, 500);
    let [orders, patch] = &config.routes[..] else {
        panic!("two routes")
    };
    assert_eq!(orders.timeout_ms, 5000);
    assert_eq!(orders.retention_secs, 3600);
    assert_eq!(orders.on_5xx, On5xx::Unknown);
    let probe = orders.probe.as_ref().unwrap();
    assert_eq!(probe.found_status, Some(201));
    assert_eq!(probe.settle_ms, 5000, "the default settle time");
    assert_eq!(patch.key, KeyPolicy::Optional);
    assert_eq!(patch.method().unwrap(), http::Method::PATCH);
    assert_eq!(patch.on_5xx, On5xx::Release, "the default");
}

#[test]
fn bad_configurations_are_refused_with_what_is_wrong() {
    assert!(matches!(
        RouteConfig::parse("GET /orders"),
        Err(ConfigError::Route(..))
    ));
    assert!(matches!(
        RouteConfig::parse("POST"),
        Err(ConfigError::Route(..))
    ));
    assert!(matches!(
        RouteConfig::parse("POST orders"),
        Err(ConfigError::Route(..))
    ));
    let mut twice = GatewayConfig::new("http://127.0.0.1:1");
    twice.routes = vec![
        RouteConfig::parse("POST /a").unwrap(),
        RouteConfig::parse("post /a").unwrap(),
    ];
    assert!(matches!(
        twice.validate(),
        Err(ConfigError::DuplicateRoute(_))
    ));
    assert!(matches!(
        GatewayConfig::new("ftp://x").validate(),
        Err(ConfigError::Upstream(_))
    ));
    let bad_probe = FILE.replace("{/external_ref}", "{external_ref}");
    assert!(matches!(
        GatewayConfig::from_toml(&bad_probe),
        Err(ConfigError::Probe(..))
    ));
    assert!(matches!(
        GatewayConfig::from_toml("upstream = \"http://x\"\nunknown_field = 1"),
        Err(ConfigError::File(_))
    ));
}

#[test]
fn fingerprint_parts_and_a_business_key_are_route_options() {
    let text = r#"
upstream = "http://127.0.0.1:9000"

[[route]]
method = "POST"
path = "/payments"
fingerprint_body = ["/amount", "/currency"]
fingerprint_headers = ["Stripe-Version"]
business_key = "/external_ref"
"#;
    let config = GatewayConfig::from_toml(text).unwrap();
    let route = &config.routes[0];
    let parts = route.fingerprint_parts().unwrap();
    let pointers: Vec<&str> = parts
        .pointers()
        .unwrap()
        .iter()
        .map(JsonPointer::as_str)
        .collect();
    assert_eq!(pointers, ["/amount", "/currency"]);
    assert_eq!(parts.header_names(), ["stripe-version"]);
    assert_eq!(
        route.key_source().unwrap(),
        KeySource::Body(JsonPointer::parse("/external_ref").unwrap())
    );
    // Unset, they are today's defaults.
    let plain = RouteConfig::parse("POST /orders").unwrap();
    assert_eq!(
        plain.fingerprint_parts().unwrap(),
        FingerprintParts::default()
    );
    assert_eq!(plain.key_source().unwrap(), KeySource::Header);

    for (from, to) in [
        ("\"/amount\", ", "\"amount\", "),
        ("\"Stripe-Version\"", "\"Stripe Version\""),
        ("\"/external_ref\"", "\"/a~2\""),
    ] {
        let bad = text.replace(from, to);
        assert!(
            matches!(
                GatewayConfig::from_toml(&bad),
                Err(ConfigError::RouteOption(..))
            ),
            "{to}"
        );
    }
    let optional = format!("{text}key = \"optional\"\n");
    assert!(matches!(
        GatewayConfig::from_toml(&optional),
        Err(ConfigError::Route(..))
    ));
    let misspelt = text.replace("business_key", "business_keys");
    assert!(matches!(
        GatewayConfig::from_toml(&misspelt),
        Err(ConfigError::File(_))
    ));
}

#[tokio::test]
async fn an_optional_key_route_forwards_a_keyless_request_once_unprotected() {
    let up = Upstream::start();
    let db = test_db(TestBackend::Sqlite, 4).await.unwrap();
    let text = format!(
        "upstream = \"{}\"\n[[route]]\nmethod = \"POST\"\npath = \"/orders\"\nkey = \"optional\"\n",
        up.base
    );
    let gw = gateway_with(&db.db, &GatewayConfig::from_toml(&text).unwrap()).await;
    let body = json!({"external_ref": "o-1"});
    assert_eq!(
        post(&gw.base, "/orders", KEY_A, None, &body).await.status(),
        201
    );
    assert_eq!(
        post(&gw.base, "/orders", "wrong-key-0123456789", None, &body)
            .await
            .status(),
        401,
        "still authenticated"
    );
    let keyed = post(&gw.base, "/orders", KEY_A, Some("o-1"), &body).await;
    assert_eq!(keyed.status(), 201);
    let replay = post(&gw.base, "/orders", KEY_A, Some("o-1"), &body).await;
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(up.count().await, 2);
}
