#!/bin/bash
# LocalStack ready hook (/etc/localstack/init/ready.d) for docker-compose.yml:
# the FIFO topic the relay publishes to (deploy/compose/relay.toml) and a FIFO
# queue subscribed to it with raw delivery, so what the relay published can be
# read back:
#
#   docker compose exec localstack awslocal sqs receive-message \
#       --queue-url http://localhost:4566/000000000000/outbox-events.fifo \
#       --attribute-names All --message-attribute-names All
#
# Content-based deduplication stays off: the relay sets MessageDeduplicationId
# (the event id) and MessageGroupId (the ordering group) on every message.
set -euo pipefail

topic_arn=$(awslocal sns create-topic --name outbox-events.fifo \
    --attributes FifoTopic=true,ContentBasedDeduplication=false \
    --query TopicArn --output text)
queue_url=$(awslocal sqs create-queue --queue-name outbox-events.fifo \
    --attributes FifoQueue=true,ContentBasedDeduplication=false \
    --query QueueUrl --output text)
queue_arn=$(awslocal sqs get-queue-attributes --queue-url "$queue_url" \
    --attribute-names QueueArn --query Attributes.QueueArn --output text)
awslocal sns subscribe --topic-arn "$topic_arn" --protocol sqs \
    --notification-endpoint "$queue_arn" \
    --attributes RawMessageDelivery=true >/dev/null
echo "outbox-relay demo: $topic_arn -> $queue_arn (raw delivery)"
