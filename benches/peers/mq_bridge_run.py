"""The peer relay of `outroute-bench --only peers`: mq-bridge (PyPI), the
fastest other relay measured on this machine, draining the same outbox
table into the same Kafka topic, so every outroute figure has its peer's
beside it (issue 47).

    mq_bridge_run.py cdc     URL PUBLICATION SLOT BROKERS TOPIC
    mq_bridge_run.py polling URL TABLE            BROKERS TOPIC

`cdc` reads the table's inserts from an existing publication and logical
slot (pgoutput); `polling` reads the table and deletes what it published
(`delete_after_read`, its outbox mode). Both publish with `acks=all` and
the same producer limits outroute runs with here (max.in.flight 5,
linger.ms 5). Runs until SIGTERM; prints nothing unless something fails.
"""

import signal
import sys

from mq_bridge import Route


def producer_options():
    return [
        ["acks", "all"],
        ["linger.ms", "5"],
        ["max.in.flight.requests.per.connection", "5"],
    ]


def main(argv):
    if len(argv) < 2 or argv[1] not in ("cdc", "polling"):
        sys.exit(__doc__)
    mode = argv[1]
    if mode == "cdc":
        if len(argv) != 7:
            sys.exit(__doc__)
        url, publication, slot, brokers, topic = argv[2:7]
        source = {
            "postgres_cdc": {
                "url": url,
                "publication": publication,
                "slot_name": slot,
                "create_slot": False,
                "create_publication": False,
                "consume": "capture_new",
            }
        }
    else:
        if len(argv) != 6:
            sys.exit(__doc__)
        url, table, brokers, topic = argv[2:6]
        source = {
            "sqlx": {
                "url": url,
                "table": table,
                "delete_after_read": True,
                "polling_interval_ms": 10,
                "max_polling_interval_ms": 100,
            }
        }
    route = Route.from_config(
        {
            "input": source,
            "output": {
                "kafka": {
                    "url": brokers,
                    "topic": topic,
                    "create_topic": False,
                    "producer_options": producer_options(),
                }
            },
            "batch_size": 1000,
        }
    )
    signal.signal(signal.SIGTERM, lambda *_: route.stop())
    route.start()
    route.join()


if __name__ == "__main__":
    main(sys.argv)
