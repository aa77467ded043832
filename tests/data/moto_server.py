"""moto's server as the tests run it: Kinesis's PutRecords and GetRecords made
safe for concurrent calls, and EventBridge rules fast enough for thousands of
events.

moto 5.2's `Shard.put_record` says of itself "this function is not safe for
concurrency": it takes the shard's highest sequence number plus one, so two
PutRecords calls at once on one shard can give two records the same number,
and the later replaces the earlier. The relay sends batches concurrently, and
a test then missed one record of 2,000 that moto had acknowledged. Kinesis
loses nothing so; a lock around it makes moto behave as Kinesis does.

moto 5.2.1 builds a new JSONPath parser (a yacc table) for each of the 8 paths
of an event template, for every event a rule sends to a target: ~130 ms an
event, so 2,000 events would keep a server busy for over four minutes. The
parse of a path is pure; caching it changes nothing but the time (~4 ms).

moto 5.2.1 deduplicates a FIFO queue's message only against the messages
still in the queue: once a consumer has deleted a message, a repeat with its
deduplication id is delivered again. SQS drops a repeat for five minutes after
the first was accepted, deleted or not ("any messages sent with the same
message deduplication ID are accepted successfully but aren't delivered during
the 5-minute deduplication interval"), and the conformance suite's consumers
delete what they read: each queue remembers when it accepted each id.

Arguments are moto.server's (`-H 127.0.0.1 -p PORT`).
"""

import sys
import threading

import functools

import jsonpath_ng.ext

jsonpath_ng.ext.parse = functools.lru_cache(maxsize=1024)(jsonpath_ng.ext.parse)

import moto.kinesis.models as kinesis  # noqa: E402 (after the patch above)
from moto.server import main  # noqa: E402

_put_record = kinesis.Shard.put_record
_lock = threading.Lock()


def put_record(self, *args, **kwargs):
    with _lock:
        return _put_record(self, *args, **kwargs)


kinesis.Shard.put_record = put_record

# GetRecords iterates the shard's records (an OrderedDict) while a
# concurrent PutRecords appends to it: "mutated during iteration", an HTTP
# 500 Kinesis never answers. The same lock makes a read see whole writes.
_get_records = kinesis.Shard.get_records


def get_records(self, *args, **kwargs):
    with _lock:
        return _get_records(self, *args, **kwargs)


kinesis.Shard.get_records = get_records

import moto.sqs.models as sqs  # noqa: E402

_add_message = sqs.Queue.add_message
_dedup_lock = threading.Lock()


def add_message(self, message):
    deduplicated = self.fifo_queue and (
        self.attributes.get("ContentBasedDeduplication") == "true"
        or message.deduplication_id
    )
    if deduplicated:
        with _dedup_lock:
            accepted = self.__dict__.setdefault("_accepted_dedup_ids", {})
            now = message.sent_timestamp / 1000
            first = accepted.get(message.deduplication_id)
            if first is not None and now - first < sqs.DEDUPLICATION_TIME_IN_SECONDS:
                return None
            accepted[message.deduplication_id] = now
    return _add_message(self, message)


sqs.Queue.add_message = add_message

if __name__ == "__main__":
    sys.exit(main())
