//! `GET /openapi.json`: the document parses as OpenAPI 3.1 (into the specification's object
//! model, strictly: [`oas`]), every `$ref` resolves, and it lists exactly the routes and
//! methods the router serves — the routes read from the router itself, so a route added
//! without its annotation fails here. It names every problem type, the `Idempotency-Key`
//! and `Idempotent-Replayed` headers and the API key scheme.

use std::collections::{BTreeMap, BTreeSet};

use oncely_testkit::TestDb;
use serde_json::Value;

use super::{config, start, KEY_A};

oncely_testkit::matrix! {
    tests: [
        openapi_document_is_openapi_3_1_and_lists_every_route_the_router_serves,
        readyz_names_the_database_broker_and_providers_and_is_503_when_one_is_down,
    ],
}

/// The methods a route may serve; each served path is probed with every one.
const METHODS: [&str; 5] = ["GET", "POST", "PUT", "PATCH", "DELETE"];

/// The paths `router` serves, read from its `Debug` form (axum prints each path of its
/// route table); axum's own catch-all paths of the fallback are left out.
fn served_paths(router: &axum::Router) -> BTreeSet<String> {
    let debug = format!("{router:?}");
    debug
        .split('"')
        .skip(1)
        .step_by(2)
        .filter(|s| s.starts_with('/') && s.len() > 1 && !s.contains("__private__axum"))
        .map(str::to_owned)
        .collect()
}

/// `path` with each `{param}` filled in (a fresh UUID: a well-formed id of nothing).
fn concrete(path: &str) -> String {
    let mut out = String::new();
    let mut rest = path;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let close = rest[open..].find('}').map_or(rest.len(), |c| open + c + 1);
        out.push_str(&uuid::Uuid::new_v4().to_string());
        rest = &rest[close..];
    }
    out.push_str(rest);
    out
}

async fn openapi_document_is_openapi_3_1_and_lists_every_route_the_router_serves(t: TestDb) {
    let server = start(&t.db, config()).await;
    // No credential: the document is public.
    let res = server
        .client
        .get(format!("{}/openapi.json", server.base))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(res.headers()["content-type"], "application/json");
    let text = res.text().await.unwrap();

    // Strictly typed by the OpenAPI 3.1 object model below (written from the specification,
    // not by the generator): unknown or misspelt fields and missing required ones fail.
    let spec: oas::OpenApi = serde_json::from_str(&text).expect("the document is OpenAPI 3.1");
    assert!(spec.openapi.starts_with("3.1."), "{}", spec.openapi);
    let mut documented = BTreeMap::<String, BTreeSet<String>>::new();
    for (path, item) in &spec.paths {
        for (method, op) in item.operations() {
            documented
                .entry(path.clone())
                .or_default()
                .insert(method.to_owned());
            assert!(!op.responses.is_empty(), "{method} {path} has no responses");
        }
    }
    let doc: Value = serde_json::from_str(&text).unwrap();
    assert_refs_resolve(&doc, &doc);

    // Every path the router serves is documented, and nothing else.
    let router = orders::router(t.db.clone(), &config());
    let route_table = served_paths(&router);
    assert!(route_table.contains("/v1/orders/{id}"), "{route_table:?}");
    let documented_paths: BTreeSet<String> = documented.keys().cloned().collect();
    assert_eq!(
        route_table, documented_paths,
        "served paths vs documented paths"
    );

    // On each, every method the router answers is documented, and each documented one is
    // answered (the router's 405 is `method-not-allowed`; HEAD and OPTIONS follow GET).
    for path in &route_table {
        let url = format!("{}{}", server.base, concrete(path));
        let mut answered = BTreeSet::new();
        for method in METHODS {
            let res = server
                .client
                .request(method.parse().unwrap(), &url)
                .bearer_auth(KEY_A)
                .send()
                .await
                .unwrap();
            let status = res.status();
            let body: Value = res.json().await.unwrap_or(Value::Null);
            let not_allowed =
                status == 405 && body["type"] == "urn:oncely:problem:method-not-allowed";
            if !not_allowed {
                answered.insert(method.to_lowercase());
            }
        }
        assert_eq!(answered, documented[path], "methods of {path}");
    }

    assert_doc_describes_problems_headers_and_auth(&doc);
}

/// `GET /readyz`: 200 naming each dependency `ok`; with a provider's port closed, 503
/// `not-ready` naming that provider `unavailable` and the others `ok`. `/healthz` stays 200.
async fn readyz_names_the_database_broker_and_providers_and_is_503_when_one_is_down(t: TestDb) {
    let payments = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let shipping = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let shipping_addr = shipping.local_addr().unwrap();
    let mut cfg = config();
    cfg.dependencies = vec![
        orders::Dependency::broker("sql", ""),
        orders::Dependency::Provider {
            name: "payments".to_owned(),
            url: format!("http://{}/v1", payments.local_addr().unwrap()),
        },
        orders::Dependency::Provider {
            name: "shipping".to_owned(),
            url: format!("http://{shipping_addr}"),
        },
    ];
    let server = start(&t.db, cfg).await;
    let get = |path: &'static str| {
        let (client, base) = (server.client.clone(), server.base.clone());
        async move {
            let res = client.get(format!("{base}{path}")).send().await.unwrap();
            let status = res.status().as_u16();
            (status, res.json::<Value>().await.unwrap_or(Value::Null))
        }
    };
    let (status, body) = get("/readyz").await;
    assert_eq!(status, 200, "{body}");
    let backend = t.db.backend().as_str();
    assert_eq!(
        body,
        serde_json::json!({"status": "ready", "checks": {
            "database": {"status": "ok", "backend": backend},
            "broker": {"status": "ok", "backend": "sql"},
            "providers": {"payments": {"status": "ok"}, "shipping": {"status": "ok"}}}})
    );
    drop(shipping);
    let (status, body) = get("/readyz").await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["type"], "urn:oncely:problem:not-ready");
    assert_eq!(
        body["checks"]["providers"]["shipping"]["status"],
        "unavailable"
    );
    assert_eq!(body["checks"]["providers"]["payments"]["status"], "ok");
    assert_eq!(body["checks"]["database"]["status"], "ok");
    assert_eq!(body["checks"]["broker"]["status"], "ok");
    assert_eq!(
        get("/healthz").await.0,
        200,
        "liveness does not depend on providers"
    );
    drop(payments);
}

/// Every `"$ref": "#/…"` in `v` points at something in `root`.
fn assert_refs_resolve(root: &Value, v: &Value) {
    match v {
        Value::Object(o) => {
            if let Some(r) = o.get("$ref").and_then(Value::as_str) {
                let pointer = r.strip_prefix('#').expect("local reference");
                assert!(root.pointer(pointer).is_some(), "dangling $ref {r}");
            }
            o.values().for_each(|c| assert_refs_resolve(root, c));
        }
        Value::Array(a) => a.iter().for_each(|c| assert_refs_resolve(root, c)),
        _ => {}
    }
}

fn assert_doc_describes_problems_headers_and_auth(doc: &Value) {
    // Every problem type URI, of the service and of the idempotency layer.
    let types: BTreeSet<&str> = doc["components"]["schemas"]["Problem"]["properties"]["type"]
        ["enum"]
        .as_array()
        .expect("Problem.type lists the type URIs")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    for kind in orders::problem::ALL.iter().chain(oncely_http::kind::ALL) {
        let uri = format!("urn:oncely:problem:{kind}");
        assert!(types.contains(uri.as_str()), "{uri} missing");
    }
    // Every 4xx/5xx of a /v1 operation is a problem+json answer.
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            for (status, res) in op["responses"].as_object().unwrap() {
                if status.starts_with('4') || status.starts_with('5') {
                    let schema = &res["content"]["application/problem+json"]["schema"]["$ref"];
                    assert_eq!(
                        schema, "#/components/schemas/Problem",
                        "{method} {path} {status}"
                    );
                }
            }
        }
    }
    let create = &doc["paths"]["/v1/orders"]["post"];
    let key = create["parameters"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "Idempotency-Key")
        .expect("POST /v1/orders takes Idempotency-Key");
    assert_eq!(
        (&key["in"], &key["required"]),
        (&"header".into(), &true.into())
    );
    for status in ["200", "201", "409"] {
        assert!(
            create["responses"][status]["headers"]["Idempotent-Replayed"].is_object(),
            "Idempotent-Replayed on {status}"
        );
    }
    let scheme = &doc["components"]["securitySchemes"]["api_key"];
    assert_eq!(
        (&scheme["type"], &scheme["scheme"]),
        (&"http".into(), &"bearer".into())
    );
    assert_eq!(create["security"][0]["api_key"], Value::Array(vec![]));
    // The operational route_table need no credential.
    assert_eq!(
        doc["paths"]["/healthz"]["get"]["security"][0],
        Value::Object(serde_json::Map::default())
    );
}

/// The OpenAPI 3.1.1 object model (spec.openapis.org/oas/v3.1.1 §4.8), strictly: every
/// object refuses fields the specification does not define (`x-` extensions aside) and
/// requires the ones it requires. Schema objects are JSON Schema 2020-12 and stay JSON.
#[allow(dead_code, reason = "fields exist to be parsed and checked, not read")]
mod oas {
    use std::collections::BTreeMap;

    use serde::Deserialize;
    use serde_json::Value;

    type Map<T> = BTreeMap<String, T>;

    /// An object or a Reference Object (§4.8.23).
    #[derive(Deserialize)]
    #[serde(untagged)]
    pub(super) enum Or<T> {
        Ref(Reference),
        Item(T),
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub(super) struct Reference {
        #[serde(rename = "$ref")]
        _ref: String,
        #[serde(rename = "summary")]
        _summary: Option<String>,
        #[serde(rename = "description")]
        _description: Option<String>,
    }

    /// §4.8.1.
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields, rename_all = "camelCase")]
    pub(super) struct OpenApi {
        pub(super) openapi: String,
        pub(super) info: Info,
        pub(super) json_schema_dialect: Option<String>,
        pub(super) servers: Option<Vec<Value>>,
        #[serde(default)]
        pub(super) paths: Map<PathItem>,
        pub(super) webhooks: Option<Map<Value>>,
        pub(super) components: Option<Components>,
        pub(super) security: Option<Vec<Map<Vec<String>>>>,
        pub(super) tags: Option<Vec<Tag>>,
        pub(super) external_docs: Option<Value>,
    }

    /// §4.8.2.
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields, rename_all = "camelCase")]
    pub(super) struct Info {
        pub(super) title: String,
        pub(super) summary: Option<String>,
        pub(super) description: Option<String>,
        pub(super) terms_of_service: Option<String>,
        pub(super) contact: Option<Value>,
        pub(super) license: Option<Value>,
        pub(super) version: String,
    }

    /// §4.8.9.
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub(super) struct PathItem {
        #[serde(rename = "$ref")]
        pub(super) reference: Option<String>,
        pub(super) summary: Option<String>,
        pub(super) description: Option<String>,
        pub(super) get: Option<Operation>,
        pub(super) put: Option<Operation>,
        pub(super) post: Option<Operation>,
        pub(super) delete: Option<Operation>,
        pub(super) options: Option<Operation>,
        pub(super) head: Option<Operation>,
        pub(super) patch: Option<Operation>,
        pub(super) trace: Option<Operation>,
        pub(super) servers: Option<Vec<Value>>,
        pub(super) parameters: Option<Vec<Or<Parameter>>>,
    }

    impl PathItem {
        pub(super) fn operations(&self) -> Vec<(&'static str, &Operation)> {
            [
                ("get", &self.get),
                ("put", &self.put),
                ("post", &self.post),
                ("delete", &self.delete),
                ("options", &self.options),
                ("head", &self.head),
                ("patch", &self.patch),
                ("trace", &self.trace),
            ]
            .into_iter()
            .filter_map(|(m, op)| op.as_ref().map(|op| (m, op)))
            .collect()
        }
    }

    /// §4.8.10.
    #[derive(Deserialize)]
    #[allow(clippy::struct_field_names, reason = "the specification's field names")]
    #[serde(deny_unknown_fields, rename_all = "camelCase")]
    pub(super) struct Operation {
        pub(super) tags: Option<Vec<String>>,
        pub(super) summary: Option<String>,
        pub(super) description: Option<String>,
        pub(super) external_docs: Option<Value>,
        pub(super) operation_id: Option<String>,
        pub(super) parameters: Option<Vec<Or<Parameter>>>,
        pub(super) request_body: Option<Or<RequestBody>>,
        #[serde(default)]
        pub(super) responses: Map<Or<Response>>,
        pub(super) callbacks: Option<Map<Value>>,
        pub(super) deprecated: Option<bool>,
        pub(super) security: Option<Vec<Map<Vec<String>>>>,
        pub(super) servers: Option<Vec<Value>>,
    }

    /// §4.8.12 `in`.
    #[derive(Deserialize)]
    #[serde(rename_all = "lowercase")]
    pub(super) enum In {
        Query,
        Header,
        Path,
        Cookie,
    }

    /// §4.8.12.
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields, rename_all = "camelCase")]
    pub(super) struct Parameter {
        pub(super) name: String,
        #[serde(rename = "in")]
        pub(super) location: In,
        pub(super) description: Option<String>,
        pub(super) required: Option<bool>,
        pub(super) deprecated: Option<bool>,
        pub(super) allow_empty_value: Option<bool>,
        pub(super) style: Option<String>,
        pub(super) explode: Option<bool>,
        pub(super) allow_reserved: Option<bool>,
        pub(super) schema: Option<Value>,
        pub(super) example: Option<Value>,
        pub(super) examples: Option<Map<Value>>,
        pub(super) content: Option<Map<MediaType>>,
    }

    /// §4.8.13.
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub(super) struct RequestBody {
        pub(super) description: Option<String>,
        pub(super) content: Map<MediaType>,
        pub(super) required: Option<bool>,
    }

    /// §4.8.14.
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub(super) struct MediaType {
        pub(super) schema: Option<Value>,
        pub(super) example: Option<Value>,
        pub(super) examples: Option<Map<Value>>,
        pub(super) encoding: Option<Map<Value>>,
    }

    /// §4.8.17.
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub(super) struct Response {
        pub(super) description: String,
        pub(super) headers: Option<Map<Or<Header>>>,
        pub(super) content: Option<Map<MediaType>>,
        pub(super) links: Option<Map<Value>>,
    }

    /// §4.8.21.
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub(super) struct Header {
        pub(super) description: Option<String>,
        pub(super) required: Option<bool>,
        pub(super) deprecated: Option<bool>,
        pub(super) style: Option<String>,
        pub(super) explode: Option<bool>,
        pub(super) schema: Option<Value>,
        pub(super) example: Option<Value>,
        pub(super) examples: Option<Map<Value>>,
        pub(super) content: Option<Map<MediaType>>,
    }

    /// §4.8.7.
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields, rename_all = "camelCase")]
    pub(super) struct Components {
        pub(super) schemas: Option<Map<Value>>,
        pub(super) responses: Option<Map<Or<Response>>>,
        pub(super) parameters: Option<Map<Or<Parameter>>>,
        pub(super) examples: Option<Map<Value>>,
        pub(super) request_bodies: Option<Map<Or<RequestBody>>>,
        pub(super) headers: Option<Map<Or<Header>>>,
        pub(super) security_schemes: Option<Map<Or<SecurityScheme>>>,
        pub(super) links: Option<Map<Value>>,
        pub(super) callbacks: Option<Map<Value>>,
        pub(super) path_items: Option<Map<Value>>,
    }

    /// §4.8.27 `type`.
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    pub(super) enum SchemeType {
        ApiKey,
        Http,
        MutualTLS,
        Oauth2,
        OpenIdConnect,
    }

    /// §4.8.27.
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields, rename_all = "camelCase")]
    pub(super) struct SecurityScheme {
        #[serde(rename = "type")]
        pub(super) kind: SchemeType,
        pub(super) description: Option<String>,
        pub(super) name: Option<String>,
        #[serde(rename = "in")]
        pub(super) location: Option<String>,
        pub(super) scheme: Option<String>,
        pub(super) bearer_format: Option<String>,
        pub(super) flows: Option<Value>,
        pub(super) open_id_connect_url: Option<String>,
    }

    /// §4.8.22.
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields, rename_all = "camelCase")]
    pub(super) struct Tag {
        pub(super) name: String,
        pub(super) description: Option<String>,
        pub(super) external_docs: Option<Value>,
    }
}
