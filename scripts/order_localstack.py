"""The AWS side of scripts/order-localstack.sh, against LocalStack (LS_URL):

    order_localstack.py setup DEST TAG      create DEST's resources (names with TAG); print
                                            the relay's [sink] and destination sections
    order_localstack.py sql TABLE N G T P   the SQL inserting N events over G groups into
                                            TABLE, T events a transaction, in commit order,
                                            groups in pattern P (below)
    order_localstack.py read DEST TAG N OUT read what DEST's consumer receives until N
                                            distinct events arrived and nothing more comes
                                            (or a deadline); write the figures to OUT (JSON)
    order_localstack.py table FILE...       print the table of those figures

DEST: sns-standard (standard topic -> standard queue, raw delivery), sns-fifo (FIFO topic
-> FIFO queue, raw delivery), sqs-standard, sqs-fifo, eventbridge (bus -> rule ->
standard queue), kinesis (stream of 2 shards, every shard read from TRIM_HORIZON).

Patterns: round-robin puts event k (0 <= k < N) in group k % G, so no two events of a
group are within G of each other in commit order (nor in one transaction or one batch
of up to G); runs puts runs of 5 consecutive events in one group ((k // 5) % G), so
a transaction of 10 holds two groups and a batch carries several events of a group.
Event k's payload is {"order_probe": {"k": k, "group": ..., "n": ...}} (n: its place
in its group), found again in whatever the consumer gets (an SQS body, an EventBridge
event's detail, a Kinesis record's data).
A group is out of order when the order in which its events were first seen differs
from commit order.
"""
import json
import os
import sys
import time

import boto3
from botocore.config import Config

KW = dict(
    endpoint_url=os.environ.get("LS_URL", "http://127.0.0.1:4566"),
    region_name="us-east-1",
    aws_access_key_id="test",
    aws_secret_access_key="test",
    config=Config(retries={"max_attempts": 3, "mode": "standard"}),
)
QUIET_S = 3.0  # nothing new for this long once everything arrived: done
DEADLINE_S = float(os.environ.get("ORDER_DEADLINE_S", "90"))


RUN = 5  # events of a group in a row, pattern runs


def name(dest, tag):
    base = f"order-{tag}-{dest}"
    return base + ".fifo" if dest.endswith("fifo") else base


def queue(sqs, qname):
    attributes = {"FifoQueue": "true"} if qname.endswith(".fifo") else {}
    url = sqs.create_queue(QueueName=qname, Attributes=attributes)["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    return url, arn


def setup(dest, tag):
    endpoint = KW["endpoint_url"]
    sqs = boto3.client("sqs", **KW)
    if dest in ("sns-standard", "sns-fifo"):
        sns = boto3.client("sns", **KW)
        attributes = {"FifoTopic": "true"} if dest == "sns-fifo" else {}
        topic = sns.create_topic(Name=name(dest, tag), Attributes=attributes)["TopicArn"]
        _, arn = queue(sqs, name(dest, tag))
        sns.subscribe(TopicArn=topic, Protocol="sqs", Endpoint=arn,
                      Attributes={"RawMessageDelivery": "true"})
        print(f'[sink]\nkind = "sns"\n\n[sns]\nendpoint_url = "{endpoint}"\ntopic_arn = "{topic}"')
    elif dest in ("sqs-standard", "sqs-fifo"):
        url, _ = queue(sqs, name(dest, tag))
        print(f'[sink]\nkind = "sqs"\n\n[sqs]\nendpoint_url = "{endpoint}"\nqueue_url = "{url}"')
    elif dest == "eventbridge":
        events = boto3.client("events", **KW)
        events.create_event_bus(Name=name(dest, tag))
        _, arn = queue(sqs, name(dest, tag))
        events.put_rule(Name="order-all", EventBusName=name(dest, tag),
                        EventPattern=json.dumps({"source": ["order-probe"]}), State="ENABLED")
        events.put_targets(Rule="order-all", EventBusName=name(dest, tag), Targets=[{"Id": "queue", "Arn": arn}])
        print(f'[sink]\nkind = "eventbridge"\n\n[eventbridge]\nendpoint_url = "{endpoint}"\n'
              f'bus = "{name(dest, tag)}"\nsource = "order-probe"')
    elif dest == "kinesis":
        kinesis = boto3.client("kinesis", **KW)
        kinesis.create_stream(StreamName=name(dest, tag), ShardCount=2)
        deadline = time.time() + 60
        while True:
            status = kinesis.describe_stream_summary(StreamName=name(dest, tag))["StreamDescriptionSummary"]["StreamStatus"]
            if status == "ACTIVE":
                break
            if time.time() > deadline:
                raise SystemExit(f"stream {name(dest, tag)} still {status} after 60 s")
            time.sleep(0.5)
        print(f'[sink]\nkind = "kinesis"\n\n[kinesis]\nendpoint_url = "{endpoint}"\nstream = "{name(dest, tag)}"')
    else:
        raise SystemExit(f"unknown destination {dest}")


def sql(table, n, groups, per_tx, pattern):
    if pattern not in ("round-robin", "runs"):
        raise SystemExit(f"unknown pattern {pattern}")
    placed = {}
    for start in range(0, n, per_tx):
        rows = []
        for k in range(start, min(n, start + per_tx)):
            group = f"agg-{(k if pattern == 'round-robin' else k // RUN) % groups:02d}"
            placed[group] = placed.get(group, -1) + 1
            probe = json.dumps({"order_probe": {"k": k, "group": group, "n": placed[group]}})
            rows.append(f"('order', '{group}', 'Step', '{probe}')")
        print("BEGIN;")
        print(f"INSERT INTO {table} (aggregate_type, aggregate_id, event_type, payload) VALUES")
        print(",\n".join(rows) + ";")
        print("COMMIT;")


def probe(value):
    """The order_probe object anywhere in a decoded message (JSON strings are opened)."""
    if isinstance(value, str):
        try:
            return probe(json.loads(value))
        except ValueError:
            return None
    if isinstance(value, dict):
        if "order_probe" in value:
            return value["order_probe"]
        value = list(value.values())
    if isinstance(value, list):
        for v in value:
            found = probe(v)
            if found is not None:
                return found
    return None


def read_queue(dest, tag, want):
    """Receive (10 at a time, one consumer) and delete, as an application would."""
    sqs = boto3.client("sqs", **KW)
    url = sqs.get_queue_url(QueueName=name(dest, tag))["QueueUrl"]
    seen, distinct = [], set()
    start = last_new = time.time()
    while time.time() - start < DEADLINE_S:
        messages = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10, WaitTimeSeconds=1,
                                       AttributeNames=["All"]).get("Messages", [])
        for m in messages:
            seen.append(m["Body"])
        if messages:
            last_new = time.time()
            sqs.delete_message_batch(QueueUrl=url, Entries=[
                {"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]} for i, m in enumerate(messages)])
            distinct.update(json.dumps(probe(b)) for b in seen[-len(messages):])
        elif len(distinct) >= want and time.time() - last_new >= QUIET_S:
            break
    return seen


def read_stream(dest, tag, want):
    """Every shard from TRIM_HORIZON, GetRecords until nothing more comes."""
    kinesis = boto3.client("kinesis", **KW)
    stream = name(dest, tag)
    iterators = {}
    for shard in kinesis.list_shards(StreamName=stream)["Shards"]:
        iterators[shard["ShardId"]] = kinesis.get_shard_iterator(
            StreamName=stream, ShardId=shard["ShardId"], ShardIteratorType="TRIM_HORIZON")["ShardIterator"]
    per_shard = {shard: [] for shard in iterators}
    start = last_new = time.time()
    while time.time() - start < DEADLINE_S:
        new = 0
        for shard, it in list(iterators.items()):
            if it is None:
                continue
            out = kinesis.get_records(ShardIterator=it, Limit=1000)
            iterators[shard] = out.get("NextShardIterator")
            for r in out["Records"]:
                per_shard[shard].append(r["Data"].decode())
            new += len(out["Records"])
        total = sum(len(v) for v in per_shard.values())
        if new:
            last_new = time.time()
        elif total >= want and time.time() - last_new >= QUIET_S:
            break
        else:
            time.sleep(0.2)
    # A group lives in one shard: per-group order is per-shard order.
    return [data for shard in sorted(per_shard) for data in per_shard[shard]]


def figures(dest, want, messages):
    probes = [probe(m) for m in messages]
    unknown = sum(1 for p in probes if p is None)
    first_seen, seen = {}, set()
    for p in probes:
        if p is None or p["k"] in seen:
            continue
        seen.add(p["k"])
        first_seen.setdefault(p["group"], []).append(p["n"])
    out_of_order = sorted(g for g, ns in first_seen.items() if ns != sorted(ns))
    # How far events moved: adjacent pairs of a group seen later-first.
    inversions = sum(sum(1 for a, b in zip(ns, ns[1:]) if a > b) for ns in first_seen.values())
    return {
        "destination": dest,
        "committed": want,
        "received": len(messages),
        "distinct": len(seen),
        "repeats": len(messages) - unknown - len(seen),
        "missing": want - len(seen),
        "unrecognised": unknown,
        "groups": len(first_seen),
        "groups_out_of_order": len(out_of_order),
        "adjacent_inversions": inversions,
        "out_of_order": out_of_order,
    }


def read(dest, tag, want, out):
    messages = read_stream(dest, tag, want) if dest == "kinesis" else read_queue(dest, tag, want)
    result = figures(dest, want, messages)
    result["pattern"] = tag
    with open(out, "w") as f:
        json.dump(result, f)
    print(json.dumps(result))


COLUMNS = [("destination", "destination"), ("pattern", "pattern"), ("committed", "committed"), ("received", "received"),
           ("distinct", "distinct"), ("repeats", "repeats"), ("missing", "missing"),
           ("groups out of order", "groups_out_of_order"), ("adjacent inversions", "adjacent_inversions"),
           ("rows PUBLISHED", "published")]


def table(files):
    rows = []
    for path in files:
        with open(path) as f:
            r = json.load(f)
        if "skipped" in r:
            rows.append([r["destination"], r.get("pattern", "-")] + ["-"] * (len(COLUMNS) - 3)
                        + [f"not run: {r['skipped']}"])
            continue
        r["groups_out_of_order"] = f"{r['groups_out_of_order']} of {r['groups']}"
        rows.append([str(r.get(key, "-")) for _, key in COLUMNS])
    header = [title for title, _ in COLUMNS]
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("-" * (len(h) + 2) for h in header) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    if command == "setup":
        setup(sys.argv[2], sys.argv[3])
    elif command == "sql":
        sql(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
    elif command == "read":
        read(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
    elif command == "table":
        table(sys.argv[2:])
    else:
        raise SystemExit(__doc__)
