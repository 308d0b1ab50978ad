//! The SQL transport fixture: a queue table in the test database itself.

use std::time::Duration;

use oncely_broker::{
    DeadLetters, Message, Publisher, SqlDeadLetters, SqlSubscriber, SqlTransport, Subscriber,
};
use oncely_inbox::{Consumer, Processed};
use oncely_sql::Database;
use oncely_testkit::{TestBackend, TestDb};

use super::{ns, test_db, DeadLetter, Fixture};

pub(crate) struct SqlFixture {
    t: TestDb,
    transport: SqlTransport,
    topic: String,
}

impl SqlFixture {
    pub(super) async fn new(backend: TestBackend) -> Option<Self> {
        let t = test_db(backend).await?;
        let transport = SqlTransport::new(t.db.clone(), 1 << 20);
        Some(Self {
            t,
            transport,
            topic: format!("t{}.orders", ns()),
        })
    }
}

impl Fixture for SqlFixture {
    type S = SqlSubscriber;
    fn db(&self) -> &Database {
        &self.t.db
    }
    fn topic(&self) -> String {
        self.topic.clone()
    }
    fn subscriber(&self, group: &str, settle: Duration) -> SqlSubscriber {
        SqlSubscriber::new(self.transport.clone(), group, self.topic.clone(), settle)
    }
    fn url(&self) -> &str {
        &self.t.url
    }
    fn subscriber_via(&self, db: &Database, group: &str, settle: Duration) -> SqlSubscriber {
        let transport = SqlTransport::new(db.clone(), 1 << 20);
        SqlSubscriber::new(transport, group, self.topic.clone(), settle)
    }
    async fn publish(&self, batch: &[Message]) {
        for r in self.transport.publish(batch).await {
            r.expect("queued");
        }
    }
    async fn publish_copy(&self, _m: &Message) -> bool {
        false
    }
    async fn process_on_both(
        &self,
        a: &Consumer<SqlSubscriber>,
        b: &Consumer<SqlSubscriber>,
    ) -> usize {
        let deliveries = a.subscriber().receive(100, Duration::ZERO).await.unwrap();
        let count = deliveries.len();
        let runs = deliveries.into_iter().map(|delivery| async move {
            let (first, second) = tokio::join!(a.process(delivery.clone()), b.process(delivery));
            let mut pair = [first, second];
            pair.sort_by_key(|p| format!("{p:?}"));
            assert_eq!(pair, [Processed::Consumed, Processed::Duplicate]);
        });
        futures_util::future::join_all(runs).await;
        count
    }
    async fn publish_undecodable(&self) -> bool {
        false
    }
    async fn dead_letters(&self, group: &str) -> Vec<DeadLetter> {
        self.transport
            .dead_deliveries(group, 100)
            .await
            .unwrap()
            .into_iter()
            .map(|d| DeadLetter {
                id: Some(d.id),
                attempts: d.attempts,
                error: d.last_error.unwrap_or_default(),
            })
            .collect()
    }
    fn dead_letter_admin(&self) -> Box<dyn DeadLetters> {
        Box::new(SqlDeadLetters::new(self.t.db.clone()))
    }
    async fn cleanup(&self) {}
}
