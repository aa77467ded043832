"""The AWS side of scripts/demo.sh, against moto (MOTO_URL):

    demo_aws.py setup SINK   create the destination; print the relay's [SINK] section
    demo_aws.py show SINK N  print the N events the destination got (fails if fewer arrive)

SINK: sns (FIFO topic -> FIFO queue), sqs (FIFO queue), eventbridge (bus ->
rule -> queue), kinesis (stream of 2 shards, read back shard by shard).
"""
import base64
import json
import os
import sys
import time

import boto3

KW = dict(endpoint_url=os.environ["MOTO_URL"], region_name="us-east-1")
ACCOUNT = "123456789012"


def queue(sqs, name, fifo):
    attributes = {"FifoQueue": "true", "ContentBasedDeduplication": "true"} if fifo else {}
    url = sqs.create_queue(QueueName=name, Attributes=attributes)["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    return url, arn


def setup(sink):
    endpoint = os.environ["MOTO_URL"]
    sqs = boto3.client("sqs", **KW)
    if sink == "sns":
        sns = boto3.client("sns", **KW)
        topic = sns.create_topic(Name="orders.fifo", Attributes={"FifoTopic": "true"})["TopicArn"]
        _, arn = queue(sqs, "orders.fifo", True)
        sns.subscribe(TopicArn=topic, Protocol="sqs", Endpoint=arn, Attributes={"RawMessageDelivery": "true"})
        print(f'[sns]\nendpoint_url = "{endpoint}"\ntopic_arn = "{topic}"')
    elif sink == "sqs":
        url, _ = queue(sqs, "orders.fifo", True)
        print(f'[sqs]\nendpoint_url = "{endpoint}"\nqueue_url = "{url}"')
    elif sink == "eventbridge":
        events = boto3.client("events", **KW)
        events.create_event_bus(Name="orders")
        _, arn = queue(sqs, "orders-events", False)
        events.put_rule(Name="all-orders", EventBusName="orders",
                        EventPattern=json.dumps({"source": ["com.example.orders"]}), State="ENABLED")
        events.put_targets(Rule="all-orders", EventBusName="orders", Targets=[{"Id": "queue", "Arn": arn}])
        print(f'[eventbridge]\nendpoint_url = "{endpoint}"\nbus = "orders"\nsource = "com.example.orders"')
    elif sink == "kinesis":
        boto3.client("kinesis", **KW).create_stream(StreamName="orders", ShardCount=2)
        print(f'[kinesis]\nendpoint_url = "{endpoint}"\nstream = "orders"')
    else:
        raise SystemExit(f"unknown sink {sink}")


def receive(name, want):
    sqs = boto3.client("sqs", **KW)
    url = sqs.get_queue_url(QueueName=name)["QueueUrl"]
    got, deadline = [], time.time() + 15
    while len(got) < want and time.time() < deadline:
        for m in sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10, WaitTimeSeconds=1,
                                     AttributeNames=["All"], MessageAttributeNames=["All"]).get("Messages", []):
            got.append(m)
            sqs.delete_message(QueueUrl=url, ReceiptHandle=m["ReceiptHandle"])
    return got


def show(sink, want):
    if sink in ("sns", "sqs"):
        got = receive("orders.fifo", want)
        for m in got:
            attrs = {k: v["StringValue"] for k, v in sorted(m.get("MessageAttributes", {}).items())}
            print(f"-- group {m['Attributes']['MessageGroupId']}  dedup {m['Attributes'].get('MessageDeduplicationId')}  attributes {attrs}")
            print(json.dumps(json.loads(m["Body"])))
    elif sink == "eventbridge":
        got = receive("orders-events", want)
        for m in got:
            event = json.loads(m["Body"])
            print(f"-- source {event['source']}  detail-type {event['detail-type']}  detail:")
            print(json.dumps(event["detail"]))
    else:
        kinesis = boto3.client("kinesis", **KW)
        got, deadline = [], time.time() + 15
        while len(got) < want and time.time() < deadline:
            got = []
            for shard in kinesis.list_shards(StreamName="orders")["Shards"]:
                it = kinesis.get_shard_iterator(StreamName="orders", ShardId=shard["ShardId"],
                                                ShardIteratorType="TRIM_HORIZON")["ShardIterator"]
                for r in kinesis.get_records(ShardIterator=it, Limit=1000)["Records"]:
                    got.append((shard["ShardId"], r))
            time.sleep(0.2)
        for shard, r in got:
            print(f"-- {shard}  sequence {r['SequenceNumber']}  partition key {r['PartitionKey']}")
            print(json.dumps(json.loads(r["Data"])))
    if len(got) < want:
        raise SystemExit(f"only {len(got)} of {want} events arrived; see the relay log below")


if __name__ == "__main__":
    if sys.argv[1] == "setup":
        setup(sys.argv[2])
    else:
        show(sys.argv[2], int(sys.argv[3]))
