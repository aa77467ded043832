"""The consumer side of the claim check, with the official SQS Extended Client
for Python (amazon-sqs-extended-client), against a local endpoint (moto).

    extended_client.py ENDPOINT create-bucket BUCKET
    extended_client.py ENDPOINT receive QUEUE_URL COUNT OUT_FILE

`receive` reads COUNT messages as a consumer using the library does (it
fetches the payloads the messages point at from S3), deletes them, and writes
them to OUT_FILE as a JSON list of {"body", "attributes"}.
"""

import json
import sys
import time

import boto3
import sqs_extended_client  # noqa: F401  (makes boto3's sessions extended ones)


def session(endpoint):
    return boto3.Session(
        region_name="us-east-1",
        aws_access_key_id="test",
        aws_secret_access_key="test",
    )


def main(endpoint, command, *args):
    s = session(endpoint)
    if command == "create-bucket":
        s.client("s3", endpoint_url=endpoint).create_bucket(Bucket=args[0])
        return
    queue_url, count, out = args[0], int(args[1]), args[2]
    sqs = s.client("sqs", endpoint_url=endpoint)
    sqs.s3_client = s.client("s3", endpoint_url=endpoint)
    got = []
    deadline = time.monotonic() + 30
    while len(got) < count and time.monotonic() < deadline:
        answer = sqs.receive_message(
            QueueUrl=queue_url,
            MessageAttributeNames=["All"],
            MaxNumberOfMessages=10,
            WaitTimeSeconds=1,
        )
        for message in answer.get("Messages", []):
            attributes = {
                name: value.get("StringValue")
                for name, value in message.get("MessageAttributes", {}).items()
            }
            got.append({"body": message["Body"], "attributes": attributes})
            sqs.delete_message(QueueUrl=queue_url, ReceiptHandle=message["ReceiptHandle"])
    with open(out, "w", encoding="utf-8") as f:
        json.dump(got, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
