//! `oncely inbox dead list|requeue` on the brokers (the SQL transport's is
//! `inbox_dead_list_and_requeue_commands_show_and_revive_a_dead_delivery`, on every
//! backend): a delivery the test's consumer group dead-letters is listed by the command —
//! as a table and as JSON — requeued by it, comes again to the group with its attempts
//! reset, and is listed no more. Each test has a namespace of its own (RabbitMQ queue
//! prefix and exchange, JetStream stream and group, Kafka topic and group).

use std::collections::BTreeMap;
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use oncely_broker::{Message, Publisher, Subscriber};
use oncely_core::MessageId;
use oncely_testkit::broker_conformance::receive_n;
use serde_json::Value;

fn ns() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

fn inbox(args: &[String]) -> Output {
    oncely_testkit::process::command(super::oncely_bin())
        .args(["inbox", "dead"])
        .args(args)
        .stderr(Stdio::piped())
        .output()
        .expect("run oncely")
}

/// `oncely inbox dead list --json` for `group` with `broker` arguments, one object per
/// line.
fn list_json(broker: &[String], group: &str) -> Vec<Value> {
    let mut args = vec!["list".to_owned()];
    args.extend_from_slice(broker);
    args.extend([
        "--consumer".to_owned(),
        group.to_owned(),
        "--json".to_owned(),
    ]);
    let out = inbox(&args);
    assert!(
        out.status.success(),
        "list failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

fn message(topic: &str) -> Message {
    Message {
        id: MessageId::new_random(),
        topic: topic.to_owned(),
        partition_key: "o-1".to_owned(),
        event_type: "order.created".to_owned(),
        payload: br#"{"order":"o-1"}"#.to_vec(),
        headers: BTreeMap::new(),
    }
}

/// The round trip on one broker: `sub` (group `group`, already configured on `topic`)
/// dead-letters a message `publisher` sends; the command, given `broker`, lists and
/// requeues it; `sub` gets it again with attempts 0.
async fn list_and_requeue_through_the_command<S: Subscriber>(
    sub: &S,
    publisher: &dyn Publisher,
    topic: &str,
    group: &str,
    broker: &[String],
) {
    sub.subscribe().await.expect("subscribe");
    let m = message(topic);
    for r in publisher.publish(std::slice::from_ref(&m)).await {
        r.expect("published");
    }
    let got = receive_n(sub, 1, Duration::from_secs(20)).await;
    assert_eq!(got.len(), 1, "delivered");
    sub.dead(&got[0], "refused by the test")
        .await
        .expect("dead");

    let deadline = Instant::now() + Duration::from_secs(20);
    let listed = loop {
        let l = list_json(broker, group);
        if !l.is_empty() || Instant::now() > deadline {
            break l;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    assert_eq!(listed.len(), 1, "{listed:?}");
    let l = &listed[0];
    assert_eq!(l["message_id"], m.id.to_string());
    assert_eq!(l["attempts"], 1);
    assert_eq!(l["last_error"], "refused by the test");
    assert_eq!(l["topic"], topic);
    assert_eq!(l["group"], group);
    assert_eq!(l["payload_bytes"], m.payload.len());
    assert_eq!(l["payload_preview"], r#"{"order":"o-1"}"#);

    let mut table = vec!["list".to_owned()];
    table.extend_from_slice(broker);
    table.extend(["--consumer".to_owned(), group.to_owned()]);
    let out = inbox(&table);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains(&format!("{}\t1\trefused by the test\t{topic}\t", m.id)),
        "{text}"
    );

    let mut requeue = vec!["requeue".to_owned()];
    requeue.extend_from_slice(broker);
    requeue.extend(["--consumer".to_owned(), group.to_owned(), m.id.to_string()]);
    let out = inbox(&requeue);
    assert!(
        out.status.success(),
        "requeue failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8(out.stdout)
        .unwrap()
        .contains("requeued 1"));
    let again = receive_n(sub, 1, Duration::from_secs(20)).await;
    assert_eq!(again.len(), 1, "the requeued message comes again");
    let r = again[0].message.as_ref().expect("decodable");
    assert_eq!(r.id, m.id);
    assert_eq!(r.payload, m.payload);
    assert_eq!(again[0].attempts, 0, "attempts reset");
    sub.ack(&again[0]).await.expect("ack");
    assert!(list_json(broker, group).is_empty(), "listed no more");
    assert!(
        !inbox(&requeue).status.success(),
        "a second requeue finds nothing"
    );
    sub.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_dead_commands_list_and_requeue_on_rabbitmq() {
    use oncely_broker::{
        RabbitMqConfig, RabbitMqPublisher, RabbitMqSubscriber, RabbitMqSubscriberConfig,
    };
    let url = oncely_testkit::amqp_url();
    if !oncely_testkit::service_reachable("RabbitMQ", &url).await {
        return;
    }
    let ns = ns();
    let mut pc = RabbitMqConfig::new(&url);
    pc.exchange = format!("t.{ns}");
    let publisher = RabbitMqPublisher::connect(pc).await.expect("RabbitMQ");
    let mut sc = RabbitMqSubscriberConfig::new(&url, "billing", "orders")
        .with_queue_prefix(&format!("t.{ns}"));
    sc.exchange = format!("t.{ns}");
    let sub = RabbitMqSubscriber::new(sc.clone());
    let broker = [
        "--broker",
        "rabbitmq",
        "--amqp-url",
        &url,
        "--amqp-queue-prefix",
        &format!("t.{ns}"),
    ]
    .map(str::to_owned);
    list_and_requeue_through_the_command(&sub, &publisher, "orders", "billing", &broker).await;
    RabbitMqSubscriber::new(sc).delete_queues().await.unwrap();
    publisher.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_dead_commands_list_and_requeue_on_nats() {
    use oncely_broker::{NatsConfig, NatsPublisher, NatsSubscriber, NatsSubscriberConfig};
    let url = oncely_testkit::nats_url();
    if !oncely_testkit::service_reachable("NATS", &url).await {
        return;
    }
    let ns = ns();
    let (stream, topic, group) = (format!("T{ns}"), format!("t{ns}.orders"), format!("g{ns}"));
    let publisher = NatsPublisher::connect(NatsConfig::new(&url))
        .await
        .expect("NATS");
    publisher
        .ensure_stream(&stream, std::slice::from_ref(&topic))
        .await
        .expect("stream");
    // The command's defaults: DLQ stream ONCELY_DLQ, subjects oncely.dlq.<group>.<subject>.
    let sub = NatsSubscriber::new(NatsSubscriberConfig::new(&url, &stream, &group, &topic));
    let broker = ["--broker", "nats", "--nats-url", &url].map(str::to_owned);
    list_and_requeue_through_the_command(&sub, &publisher, &topic, &group, &broker).await;
    drop(publisher.jetstream().delete_stream(&stream).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_dead_commands_list_and_requeue_on_kafka() {
    use oncely_broker::{KafkaConfig, KafkaPublisher, KafkaSubscriber, KafkaSubscriberConfig};
    if !oncely_testkit::service_reachable("Kafka", &oncely_testkit::kafka_url()).await {
        return;
    }
    let brokers = oncely_testkit::kafka_brokers();
    let ns = ns();
    let topic = format!("t{ns}.orders");
    let publisher = KafkaPublisher::new(KafkaConfig::new(&brokers)).expect("producer");
    publisher.ensure_topic(&topic, 3).await.expect("topic");
    let mut c = KafkaSubscriberConfig::new(&brokers, "billing", &topic);
    c.group_id = format!("t{ns}.billing");
    c.session_timeout = Duration::from_secs(6);
    let sub = KafkaSubscriber::new(c);
    let broker = [
        "--broker",
        "kafka",
        "--kafka-brokers",
        &brokers,
        "--kafka-topics",
        &topic,
    ]
    .map(str::to_owned);
    list_and_requeue_through_the_command(&sub, &publisher, &topic, "billing", &broker).await;
}

/// The operator console of `orders serve --broker rabbitmq` (`--no-consumer`, so nothing
/// but the test takes the group's messages) lists a dead letter of the broker's
/// `billing` group — counted on the overview, a row on the dead-letter page — and its
/// requeue form sends it back to that group with attempts reset, after which the page lists
/// nothing. Plain HTTP with the session cookie and the page's CSRF token (the browser test
/// is `console_in_headless_chromium_…`, on the SQL transport).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[allow(
    clippy::too_many_lines,
    reason = "one scenario: seed at the broker, sign in, list, requeue, receive"
)]
async fn console_lists_and_requeues_a_dead_letter_of_the_rabbitmq_broker() {
    use oncely_broker::{
        RabbitMqConfig, RabbitMqPublisher, RabbitMqSubscriber, RabbitMqSubscriberConfig,
    };
    const ADMIN: &str = "console-admin-token-rabbitmq-0123";
    let url = oncely_testkit::amqp_url();
    if !oncely_testkit::service_reachable("RabbitMQ", &url).await {
        return;
    }
    let ns = ns();
    let prefix = format!("t.{ns}");
    let mut pc = RabbitMqConfig::new(&url);
    pc.exchange.clone_from(&prefix);
    let publisher = RabbitMqPublisher::connect(pc).await.expect("RabbitMQ");
    let mut sc =
        RabbitMqSubscriberConfig::new(&url, "billing", "orders").with_queue_prefix(&prefix);
    sc.exchange.clone_from(&prefix);
    let sub = RabbitMqSubscriber::new(sc.clone());
    sub.subscribe().await.expect("subscribe");
    let m = message("orders");
    for r in publisher.publish(std::slice::from_ref(&m)).await {
        r.expect("published");
    }
    let got = receive_n(&sub, 1, Duration::from_secs(20)).await;
    assert_eq!(got.len(), 1, "delivered");
    sub.dead(&got[0], "invoice service down")
        .await
        .expect("dead");

    let t = oncely_testkit::TestDb::new(oncely_testkit::TestBackend::Sqlite)
        .await
        .expect("SQLite");
    let serve = super::serve_with_env(
        &t.url,
        &[
            "--no-consumer",
            "--no-relay",
            "--broker",
            "rabbitmq",
            "--amqp-url",
            &url,
            "--amqp-queue-prefix",
            &prefix,
        ],
        &[("ONCELY_ADMIN_TOKEN", ADMIN)],
    );
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let res = http
        .post(format!("{}/console/login", serve.base))
        .form(&[("token", ADMIN), ("name", "ops-rabbit")])
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 303, "signed in");
    let cookie = res.headers()["set-cookie"]
        .to_str()
        .unwrap()
        .split(';')
        .next()
        .unwrap()
        .to_owned();
    let page = |path: &str| {
        let req = http
            .get(format!("{}{path}", serve.base))
            .header("cookie", &cookie);
        async move {
            let res = req.send().await.unwrap();
            assert_eq!(res.status(), 200);
            res.text().await.unwrap()
        }
    };
    let overview = page("/console").await;
    assert!(
        overview.contains(r#"id="count-dead-billing">1<"#),
        "{overview}"
    );
    let letters = page("/console/dead-letters").await;
    let row = format!(r#"id="dead-billing-{}""#, m.id);
    assert!(letters.contains(&row), "{letters}");
    assert!(letters.contains("invoice service down"), "{letters}");
    assert!(letters.contains("Dead letters on rabbitmq."), "{letters}");
    let csrf = letters
        .split(r#"name="csrf" value=""#)
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .expect("a CSRF token on the page")
        .to_owned();
    let res = http
        .post(format!("{}/console/dead-letters/requeue", serve.base))
        .header("cookie", &cookie)
        .form(&[
            ("csrf", csrf.as_str()),
            ("consumer", "billing"),
            ("message_id", &m.id.to_string()),
        ])
        .send()
        .await
        .unwrap();
    let status = res.status();
    let body = res.text().await.unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains(&format!("Requeued message {}", m.id)),
        "{body}"
    );
    let again = receive_n(&sub, 1, Duration::from_secs(20)).await;
    assert_eq!(
        again.len(),
        1,
        "the requeued message comes again to billing"
    );
    assert_eq!(again[0].message.as_ref().expect("decodable").id, m.id);
    assert_eq!(again[0].attempts, 0, "attempts reset");
    sub.ack(&again[0]).await.expect("ack");
    assert!(page("/console/dead-letters")
        .await
        .contains(r#"id="no-dead-letters""#));
    drop(serve);
    sub.close().await;
    RabbitMqSubscriber::new(sc).delete_queues().await.unwrap();
    publisher.close().await;
}
