"""moto's server as the tests run it, with Kinesis's PutRecords made safe for
concurrent calls.

moto 5.2's `Shard.put_record` says of itself "this function is not safe for
concurrency": it takes the shard's highest sequence number plus one, so two
PutRecords calls at once on one shard can give two records the same number,
and the later replaces the earlier. The relay sends batches concurrently, and
a test then missed one record of 2,000 that moto had acknowledged. Kinesis
loses nothing so; a lock around it makes moto behave as Kinesis does.
Arguments are moto.server's (`-H 127.0.0.1 -p PORT`).
"""

import sys
import threading

import moto.kinesis.models as kinesis
from moto.server import main

_put_record = kinesis.Shard.put_record
_lock = threading.Lock()


def put_record(self, *args, **kwargs):
    with _lock:
        return _put_record(self, *args, **kwargs)


kinesis.Shard.put_record = put_record

if __name__ == "__main__":
    sys.exit(main())
