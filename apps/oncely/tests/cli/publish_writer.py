# The test's Python writer (apps/oncely/tests/cli/publish.rs): appended to the snippets the
# test extracts from docs/publish-from-any-language.md, which define `message_id`,
# `BUSINESS_TABLE`, `write_order` and `place_order` for one backend.
#
# Environment: PUBLISH_BACKEND (postgres, mariadb, sqlite), PUBLISH_DSN (a libpq URL, a
# JSON object of pymysql.connect arguments, a file path), PUBLISH_TENANT, PUBLISH_WRITER (a
# name, prefix of its order and customer ids), PUBLISH_TXNS (transactions), PUBLISH_CUSTOMERS,
# PUBLISH_ROLLBACK_EVERY (every n-th transaction is rolled back after both inserts),
# PUBLISH_PAUSE_MS (up to this long between transactions), PUBLISH_SEED, PUBLISH_TOPIC (the event topic); argv[1] `setup`
# creates the business table and exits.
#
# Prints one line per transaction, flushed, after its outcome is final:
# `committed <order_id> <message_id> <customer_id>` or `rolled-back <order_id> <message_id>`.
import os
import random
import sys


def connect():
    backend, dsn = os.environ["PUBLISH_BACKEND"], os.environ["PUBLISH_DSN"]
    if backend == "postgres":
        return psycopg.connect(dsn)
    if backend == "mariadb":
        return pymysql.connect(**json.loads(dsn))
    return sqlite3.connect(dsn, timeout=30)


class _Rollback(Exception):
    pass


def rolled_back_order(conn, tenant, order_id, customer_id, amount_cents):
    """Both inserts of the doc's `write_order`, then a rollback: the event must never leave."""
    backend = os.environ["PUBLISH_BACKEND"]
    if backend == "postgres":
        mid = None
        try:
            with conn.transaction():
                mid = write_order(conn, tenant, order_id, customer_id, amount_cents)
                raise _Rollback()
        except _Rollback:
            return mid
    if backend == "mariadb":
        conn.begin()
    mid = write_order(conn, tenant, order_id, customer_id, amount_cents)
    conn.rollback()
    return mid


def setup(conn):
    if os.environ["PUBLISH_BACKEND"] == "mariadb":
        with conn.cursor() as cur:
            cur.execute(BUSINESS_TABLE)
        conn.commit()
    elif os.environ["PUBLISH_BACKEND"] == "postgres":
        with conn.transaction():
            conn.execute(BUSINESS_TABLE)
    else:
        with conn:
            conn.execute(BUSINESS_TABLE)


def main():
    global TOPIC
    TOPIC = os.environ.get("PUBLISH_TOPIC", TOPIC)
    conn = connect()
    if sys.argv[1:] == ["setup"]:
        setup(conn)
        return
    tenant = os.environ["PUBLISH_TENANT"]
    writer = os.environ["PUBLISH_WRITER"]
    txns = int(os.environ["PUBLISH_TXNS"])
    customers = int(os.environ["PUBLISH_CUSTOMERS"])
    every = int(os.environ["PUBLISH_ROLLBACK_EVERY"])
    pause_ms = int(os.environ["PUBLISH_PAUSE_MS"])
    rng = random.Random(int(os.environ["PUBLISH_SEED"]))
    for n in range(1, txns + 1):
        order_id = f"{writer}-order-{n:06d}"
        customer_id = f"{writer}-customer-{rng.randrange(customers):03d}"
        amount = 100 + rng.randrange(10_000)
        if every and n % every == 0:
            mid = rolled_back_order(conn, tenant, order_id, customer_id, amount)
            print(f"rolled-back {order_id} {mid}", flush=True)
        else:
            mid = place_order(conn, tenant, order_id, customer_id, amount)
            print(f"committed {order_id} {mid} {customer_id}", flush=True)
        if pause_ms:
            time.sleep(rng.randrange(pause_ms + 1) / 1000)


main()
